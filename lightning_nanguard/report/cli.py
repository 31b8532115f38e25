"""The ``nanguard`` command: ``nanguard report PATH [--json]`` and ``nanguard validate CONFIG.yaml``.

``report`` reads ``events.jsonl`` files (PATH is one file, or a folder searched recursively) and prints one
row per incident plus totals, and where they happened: per host and rank, the incidents of each cause, hosts
with repeated faults that did not come back (a cause that counts against the hardware) first, each named with its rank, device and
steps. A truncated or garbled *last* line (a run killed while writing) is reported on stderr and skipped; a
missing path, a file without a single valid event or a malformed line in the middle of a file ends with exit
status 2 and one line on stderr, never a traceback.

``validate`` resolves a NaNGuard YAML file (sections at the top, under ``nanguard:``, or the
``init_args`` of ``lightning_nanguard.NaNGuard`` in a LightningCLI config) and prints the complete
configuration as YAML, or the :class:`~lightning_nanguard.ConfigError` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TextIO

from ..causes import CAUSES
from ..config import SECTIONS, ConfigError, NaNGuardConfig, load_yaml

__all__ = ["main", "read_events", "find_event_files", "InputError"]

EVENTS_FILE = "events.jsonl"
COLUMNS = ("step", "kind", "actions", "cause", "culprit")
REQUIRED = ("step", "kind")


class InputError(Exception):
    """Bad input to the command line: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------------ reading


def find_event_files(path: Path) -> list[Path]:
    """``path`` itself if it is a file, else every ``events.jsonl`` below it (sorted)."""
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_file():
        return [path]
    try:
        return sorted(p for p in path.rglob(EVENTS_FILE) if p.is_file())
    except OSError as err:
        raise InputError(f"{path}: cannot search folder ({err.strerror or err})") from None


def read_events(path: Path, warn: TextIO) -> list[dict[str, Any]]:
    """Parse one events.jsonl; a bad last line is reported on ``warn`` and skipped, any other is fatal."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file (expected JSON lines)") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    events = []
    for i, (lineno, line) in enumerate(lines):
        try:
            event = _parse_line(line)
        except ValueError as err:
            if i == len(lines) - 1:
                warn.write(f"nanguard: warning: {path}:{lineno}: skipped a truncated or garbled last line "
                           f"({err}); the run was probably killed while writing it\n")
                continue
            raise InputError(f"{path}:{lineno}: malformed event line: {err}") from None
        events.append(event)
    if not events:
        raise InputError(f"{path}: no valid event lines (expected one JSON object per line)")
    return events


def _parse_line(line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON at column {err.colno}: {err.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    return obj


# ------------------------------------------------------------------------------------------------- report


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def _table(rows: list[list[str]], header: Sequence[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in out)


def _totals(events: list[dict[str, Any]], files: int) -> dict[str, Any]:
    def count(key: str) -> dict[str, int]:
        c: Counter = Counter()
        for e in events:
            vals = e.get(key)
            for v in (vals if isinstance(vals, list) else [vals]):
                c[str(v) if v is not None else "none"] += 1
        return dict(c.most_common())

    return {"incidents": len(events), "files": files, "kinds": count("kind"), "actions": count("actions"),
            "causes": count("cause"), "places": _places(events)}


UNKNOWN_RANK = "?"  # several ranks, none with evidence of its own (details.ranks empty)
REPEATED = 2  # faults that did not come back, on one rank, that make its row come first
# the cause of a fault that did not come back on replay: it counts against the rank's hardware (its own column)
FAULTS = next(c.name for c in CAUSES.values() if c.hardware_fault)


def _places(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host and rank: its incidents, their causes, its faults that did not come back (their steps); hosts with
    repeated ones first. An event of several ranks that names none (``details.ranks: []``) counts on host and rank
    ``?``, last."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for e in events:
        details = e.get("details") if isinstance(e.get("details"), dict) else {}
        known = details.get("ranks") != []
        host = str(e.get("host") or "-") if known else UNKNOWN_RANK
        rank = str(e.get("rank", 0)) if known else UNKNOWN_RANK
        row = rows.setdefault((host, rank), {"host": host, "rank": rank,
                                             "device": (e.get("device") or "-") if known else "-",
                                             "local_rank": e.get("local_rank"), "incidents": 0, "causes": Counter(),
                                             FAULTS: 0, FAULTS + "_steps": []})
        row["incidents"] += 1
        row["causes"][str(e.get("cause") or "none")] += 1
        if e.get("cause") == FAULTS:
            row[FAULTS] += 1
            row[FAULTS + "_steps"].append(e.get("step"))
    host_transients = Counter()
    for row in rows.values():
        host_transients[row["host"]] += row[FAULTS]
    ordered = sorted(rows.values(), key=lambda r: (r["host"] == UNKNOWN_RANK, -(host_transients[r["host"]] >= REPEATED),
                                                  -host_transients[r["host"]], r["host"], -r[FAULTS],
                                                  -r["incidents"], r["rank"]))
    return [dict(r, causes=dict(r["causes"].most_common())) for r in ordered]


def _fmt_counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items()) or "-"


def cmd_report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    root = Path(args.path)
    files = find_event_files(root)
    if not files:
        raise InputError(f"{root}: no {EVENTS_FILE} found in this folder or below it")
    per_file = [(f, read_events(f, err)) for f in files]
    everything = [dict(e, source=str(f)) for f, events in per_file for e in events]
    totals = _totals(everything, len(files))
    if args.json:
        json.dump({"events": everything, "totals": totals}, out, indent=2, sort_keys=True)
        out.write("\n")
        return 0
    for f, events in per_file:
        if len(files) > 1 or root.is_dir():
            out.write(f"{f}  ({len(events)} incident{'s' if len(events) != 1 else ''})\n")
        rows = [[_cell(e.get(c)) for c in COLUMNS] for e in events]
        out.write(_table(rows, COLUMNS) + "\n\n")
    out.write(f"total: {totals['incidents']} incident(s) in {totals['files']} file(s)\n")
    out.write(f"  kinds:   {_fmt_counts(totals['kinds'])}\n")
    out.write(f"  actions: {_fmt_counts(totals['actions'])}\n")
    out.write(f"  causes:  {_fmt_counts(totals['causes'])}\n")
    _write_places(totals["places"], out)
    return 0


def _write_places(places: list[dict[str, Any]], out: TextIO) -> None:
    """Where the incidents happened, hosts with repeated faults that did not come back first."""
    header = ("host", "rank", "device", "incidents", FAULTS, "causes")
    rows = [[p["host"], p["rank"], str(p["device"]), str(p["incidents"]), str(p[FAULTS]), _fmt_counts(p["causes"])]
            for p in places]
    out.write("\nby host and rank (hosts with repeated faults that did not come back first):\n")
    out.write(_table(rows, header) + "\n")
    for p in places:
        if p[FAULTS] >= REPEATED:
            rank = "an unknown rank" if p["rank"] == UNKNOWN_RANK else f"rank {p['rank']}"
            steps = ", ".join(str(s) for s in p[FAULTS + "_steps"])
            out.write(f"suspect: {rank} on host {p['host']} ({p['device']}) had {p[FAULTS]} faults that did not "
                      f"come back (steps {steps}): test that device or exclude the host\n")


# ----------------------------------------------------------------------------------------------- validate


def resolve_config(data: Any, where: str) -> NaNGuardConfig:
    """Sections (optionally under ``nanguard:``), or the NaNGuard ``init_args`` of a LightningCLI config."""
    if isinstance(data, Mapping) and "trainer" in data and not set(data) & set(SECTIONS):
        return _from_lightning_cli(data, where)
    return NaNGuardConfig.from_mapping(data, where=where)


def _from_lightning_cli(data: Mapping[str, Any], where: str) -> NaNGuardConfig:
    trainer = data.get("trainer") or {}
    callbacks = trainer.get("callbacks") if isinstance(trainer, Mapping) else None
    if isinstance(callbacks, Mapping):
        callbacks = [callbacks]
    for i, cb in enumerate(callbacks or []):
        if isinstance(cb, Mapping) and str(cb.get("class_path", "")).split(".")[-1] == "NaNGuard":
            init = cb.get("init_args") or {}
            prefix = f"trainer.callbacks[{i}].init_args"
            if not isinstance(init, Mapping):
                raise ConfigError(f"{prefix}: expected a mapping of sections, got {type(init).__name__}")
            init = dict(init)
            init.pop("name", None)  # NaNGuard's own argument, not a configuration section
            base = NaNGuardConfig.from_mapping(init.pop("config", None), where=f"{prefix}.config")
            given = NaNGuardConfig.from_mapping(init, where=prefix)  # validates names and values
            sections = {name: getattr(given if init.get(name) is not None else base, name) for name in SECTIONS}
            return NaNGuardConfig(**sections)
    raise ConfigError(f"{where}: a LightningCLI config without a lightning_nanguard.NaNGuard entry in "
                      "trainer.callbacks")


def cmd_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import yaml

    path = Path(args.config)
    if not path.is_file():
        raise InputError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    config = resolve_config(load_yaml(path), str(path))
    out.write(f"# {path}: valid; the resolved NaNGuard configuration (defaults filled in)\n")
    out.write(yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False))
    return 0


# ------------------------------------------------------------------------------------------------- entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanguard", description="Inspect NaNGuard incidents and configs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = sub.add_parser("report", help="summarise events.jsonl files (one file or a folder, recursively)",
                            description="Print one row per incident (step, kind, actions, cause, culprit) "
                                        "and totals.")
    report.add_argument("path", metavar="PATH", help="an events.jsonl file, or a folder searched recursively")
    report.add_argument("--json", action="store_true", help="print the events and totals as JSON instead")
    report.set_defaults(func=cmd_report)
    validate = sub.add_parser("validate", help="check a NaNGuard YAML config and print it resolved",
                              description="Print the resolved configuration as YAML, or the error.")
    validate.add_argument("config", metavar="CONFIG.yaml",
                          help="sections, sections under 'nanguard:', or a LightningCLI config")
    validate.set_defaults(func=cmd_validate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    try:
        return args.func(args, out, err)
    except (InputError, ConfigError) as exc:
        err.write(f"nanguard {args.command}: error: {exc}\n")
        return 2
    except BrokenPipeError:  # `nanguard report ... | head`
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
