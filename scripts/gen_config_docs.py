"""Regenerate ``configs/default.yaml`` and the README's configuration-reference table from the code.

Run after adding, removing or changing the default of a configuration key (``tests/test_config.py``
fails until both are in sync with ``lightning_nanguard.config.iter_keys()``):

    python scripts/gen_config_docs.py          # rewrite both files
    python scripts/gen_config_docs.py --check  # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_nanguard.config import SECTIONS, iter_keys  # noqa: E402

TABLE_HEADER = "| key | default | meaning |"


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


def readme_table() -> list[str]:
    rows = [TABLE_HEADER, "|---|---|---|"]
    rows += [f"| `{k}` | `{yaml_value(d)}` | {h.replace('|', '/')} |" for k, d, h in iter_keys()]
    return rows


def readme_with_table(text: str) -> str:
    lines = text.splitlines()
    section = next(i for i, line in enumerate(lines) if line.strip() == "## Configuration reference")
    start = next(i for i in range(section, len(lines)) if lines[i].strip() == TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + readme_table() + lines[end:]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file is out of date")
    args = parser.parse_args()
    targets = {ROOT / "configs" / "default.yaml": default_yaml(),
               ROOT / "README.md": readme_with_table((ROOT / "README.md").read_text(encoding="utf-8"))}
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
