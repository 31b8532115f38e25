"""Regenerate ``configs/default.yaml`` and the reference table of ``docs/configuration.md`` from the code.

Run after adding, removing or changing the default, range or help of a configuration key
(``tests/test_config.py`` fails until both files are in sync with ``lightning_nanguard.config``):

    python scripts/gen_config_docs.py          # rewrite both files
    python scripts/gen_config_docs.py --check  # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Union

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_nanguard.config import SECTIONS, iter_keys  # noqa: E402

DOCS = ROOT / "docs" / "configuration.md"
DEFAULT_YAML = ROOT / "configs" / "default.yaml"
REFERENCE_HEADING = "## Reference"
TABLE_HEADER = "| key | default | allowed | meaning |"
# checked across fields (``CheckConfig._validate``), so not visible in the field's range metadata
CROSS_FIELD = {"check.activations": "`off`, `on_incident`, `always`, int N >= 1"}


def yaml_value(value: object) -> str:
    """A default as YAML writes it inline (``null``, ``true``, ``on_incident``, ``0.0001``)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def default_yaml() -> str:
    keys = iter_keys()
    width = max(len(f"  {k.split('.')[1]}: {yaml_value(d)}") for k, d, _ in keys) + 2
    out = ["# NaNGuard: every configuration key with its default (equal to the code defaults; a test keeps",
           "# them equal: regenerate with `python scripts/gen_config_docs.py`). Copy it and change what you",
           "# need, or start from a preset next to it.",
           "#   NaNGuard.from_yaml(\"configs/default.yaml\")   |   nanguard validate configs/default.yaml",
           "# The same sections may also be nested under one top-level key `nanguard:`.", ""]
    for name, cls in SECTIONS.items():
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        out.append(f"{name + ':':<{width}}# {doc}")
        out += [f"{'  ' + k.split('.')[1] + ': ' + yaml_value(d):<{width}}# {h}"
                for k, d, h in keys if k.split(".")[0] == name]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _range(kind: str, meta: Mapping[str, Any]) -> str:
    """``int >= 1``, ``float in (0, 1)``, ``float > 0`` from a field's range metadata."""
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and hi is not None:
        left, right = "(" if meta.get("lo_open") else "[", ")" if meta.get("hi_open") else "]"
        text = f"{kind} in {left}{_number(lo)}, {_number(hi)}{right}"
    elif lo is not None:
        text = f"{kind} {'>' if meta.get('lo_open') else '>='} {_number(lo)}"
    elif hi is not None:
        text = f"{kind} {'<' if meta.get('hi_open') else '<='} {_number(hi)}"
    else:
        text = kind
    return text + (", or .inf" if meta.get("inf_ok") and (hi is None or math.isinf(hi)) else "")


def allowed(tp: Any, meta: Mapping[str, Any]) -> str:
    """What a key accepts, from its type hint and range metadata."""
    arms = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    parts: list[str] = []
    for arm in arms:
        if arm is type(None):
            parts.append("null")
        elif typing.get_origin(arm) is Literal:
            parts += [f"`{a}`" for a in typing.get_args(arm)]
        elif arm is bool:
            parts.append("`true`, `false`")
        elif arm in (int, float):
            parts.append(_range(arm.__name__, meta))
        else:
            parts.append(getattr(arm, "__name__", str(arm)))
    return ", ".join(parts)


def reference_table() -> list[str]:
    helps = {k: h for k, _, h in iter_keys()}
    rows = [TABLE_HEADER, "|---|---|---|---|"]
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            accepts = CROSS_FIELD.get(key) or allowed(hints[f.name], f.metadata)
            meaning = helps[key].replace("|", "/").replace("<", "&lt;")  # <log_dir> is not an HTML tag
            rows.append(f"| `{key}` | `{yaml_value(f.default)}` | {accepts} | {meaning} |")
    return rows


def docs_with_table(text: str) -> str:
    lines = text.splitlines()
    section = next(i for i, line in enumerate(lines) if line.strip() == REFERENCE_HEADING)
    start = next(i for i in range(section, len(lines)) if lines[i].startswith("| key |"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + reference_table() + lines[end:]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file is out of date")
    args = parser.parse_args()
    targets = {DEFAULT_YAML: default_yaml(), DOCS: docs_with_table(DOCS.read_text(encoding="utf-8"))}
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if stale else 0
    for p in stale:
        p.write_text(targets[p], encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
