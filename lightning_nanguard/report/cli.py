"""The ``nanguard`` command: ``nanguard report PATH [--json] [--plot DIR]`` and ``nanguard validate CONFIG.yaml``.

``report`` reads ``events.jsonl`` files (PATH is one file, or a folder searched recursively) and prints one
row per incident plus totals, and where they happened: per host and rank, the incidents of each cause, hosts
with repeated faults that did not come back (a cause that counts against the hardware) first, each named with its
rank, device and steps. A truncated or garbled *last* line (a run killed while writing) is reported on stderr and
skipped; a missing path, a file without a single valid event or a malformed line in the middle of a file ends with exit
status 2 and one line on stderr, never a traceback, whatever the bytes (binary data, invalid UTF-8, JSON nested
100,000 deep, a line of gigabytes). The files are read as streams, one line in memory at a time, twice (check and
add up, then print), so memory does not grow with their size; and the command imports neither torch nor
Lightning (``lightning_nanguard`` imports the callback only when ``NaNGuard`` is first used).

``report --plot DIR`` also draws the pictures of every event that kept its gradient-flow window
(:mod:`.pictures`, with matplotlib) as PNG files in DIR: the same pictures the guard drew during the fit.

``validate`` resolves a NaNGuard YAML file (sections at the top, under ``nanguard:``, or the
``init_args`` of ``lightning_nanguard.NaNGuard`` in a LightningCLI config) and prints the complete
configuration as YAML, or the :class:`~lightning_nanguard.ConfigError` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping, Optional, Sequence, TextIO, Union

from ..config import SECTIONS, ConfigError, NaNGuardConfig, load_yaml
from ..core.causes import CAUSES
from ..core.jsonvalue import JSONDict, JSONValue

__all__ = ["main", "read_events", "scan_events", "find_event_files", "InputError", "Totals", "Place"]

EVENTS_FILE = "events.jsonl"
COLUMNS = ("step", "kind", "actions", "cause", "culprit")
REQUIRED = ("step", "kind")


class InputError(Exception):
    """Bad input to the command line: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------------ reading

MAX_LINE = 16 * 2**20  # bytes: an event line of the guard is a few kB; a longer line is not one (nor read whole)
MAX_DEPTH = 64  # nesting of an event's JSON: the guard's are 5 deep; deeper is not an event (nor safe to recurse)


def find_event_files(path: Path) -> list[Path]:
    """The events files to read.

    Args:
        path: a file, or a folder to search.

    Returns:
        ``path`` itself if it is a file, else every ``events.jsonl`` below it (sorted).

    Raises:
        InputError: ``path`` does not exist or cannot be searched.
    """
    try:
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if path.is_file():
            return [path]
        return sorted(p for p in path.rglob(EVENTS_FILE) if p.is_file())
    except (OSError, ValueError) as err:  # a name too long, a NUL in it, a folder that cannot be listed
        raise InputError(f"{path}: cannot search ({getattr(err, 'strerror', None) or err})") from None


class _NotText(ValueError):
    """A line that is not text (invalid UTF-8, NUL bytes): a binary file, when it is the first one."""

    def __init__(self, message: str, binary: bool = False) -> None:
        super().__init__(message)
        self.binary = binary


def _records(fh: BinaryIO, end: Optional[int] = None) -> Iterator[tuple[int, int, Union[JSONDict, ValueError]]]:
    """``(line number, offset after the line, event or ValueError)`` for every non-blank line, up to byte ``end``.

    One line in memory at a time, and at most :data:`MAX_LINE` bytes of it (the rest of a longer line is read in
    pieces and dropped)."""
    lineno = offset = 0
    while end is None or offset < end:
        raw = fh.readline(MAX_LINE + 1)
        if not raw:
            return
        lineno += 1
        offset += len(raw)
        if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = fh.readline(MAX_LINE)
                offset += len(raw)
            yield lineno, offset, ValueError(f"a line longer than {MAX_LINE // 2**20} MiB")
            continue
        if raw.strip():
            try:
                yield lineno, offset, _parse_line(raw)
            except ValueError as err:
                yield lineno, offset, err


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None


def scan_events(path: Path, warn: TextIO, each: Callable[[JSONDict], None]) -> tuple[int, int]:
    """Read one events.jsonl as a stream, one line in memory at a time.

    Args:
        path: the file.
        warn: where a bad last line is reported (a run killed while writing it: skipped).
        each: called on every event.

    Returns:
        ``(events, end)``: how many events, and the byte offset after the last valid one (:func:`read_events`
        stops there).

    Raises:
        InputError: a bad line that is not the last, a file that is not text, or one without a valid event.
    """
    events = end = 0
    pending: Optional[tuple[int, ValueError]] = None  # a bad line: fatal unless it is the last
    with _open(path) as fh:
        try:
            for lineno, after, item in _records(fh):
                if pending is not None:
                    raise _bad_line(path, *pending, events)
                if isinstance(item, ValueError):
                    pending = (lineno, item)
                    continue
                each(item)
                events, end = events + 1, after
        except OSError as err:
            raise InputError(f"{path}: cannot read ({err.strerror or err})") from None
    if not events:
        if pending is not None and isinstance(pending[1], _NotText):
            raise _bad_line(path, *pending, events)
        reason = f"; line {pending[0]}: {pending[1]}" if pending is not None else ""
        raise InputError(f"{path}: no valid event lines (expected one JSON object per line{reason})")
    if pending is not None:
        warn.write(f"nanguard: warning: {path}:{pending[0]}: skipped a truncated or garbled last line "
                   f"({pending[1]}); the run was probably killed while writing it\n")
    return events, end


def _bad_line(path: Path, lineno: int, err: ValueError, events_before: int) -> InputError:
    if isinstance(err, _NotText) and not events_before:  # the first line already: not a text file at all
        what = "binary data (NUL bytes), not a text file" if err.binary else "not a UTF-8 text file"
        return InputError(f"{path}: {what} (expected JSON lines)")
    return InputError(f"{path}:{lineno}: malformed event line: {err}")


def read_events(path: Path, end: Optional[int] = None) -> Iterator[JSONDict]:
    """The events of one events.jsonl, read as a stream; bad lines are skipped.

    Args:
        path: the file.
        end: the byte to stop at (what :func:`scan_events` checked); None: the whole file.

    Returns:
        The events, in file order.
    """
    with _open(path) as fh:
        for _, _, item in _records(fh, end):
            if not isinstance(item, ValueError):
                yield item


def _parse_line(raw: bytes) -> JSONDict:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _NotText(f"not UTF-8 text (byte {err.start + 1})") from None
    if "\x00" in line:
        raise _NotText("binary data (NUL bytes), not JSON", binary=True)
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON at column {err.colno}: {err.msg}") from None
    except RecursionError:
        raise ValueError(f"JSON nested more than {MAX_DEPTH} deep") from None
    except ValueError as err:  # an integer of more than 4300 digits
        raise ValueError(f"invalid JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if line.count("[") + line.count("{") > MAX_DEPTH and _depth(obj) > MAX_DEPTH:
        raise ValueError(f"JSON nested more than {MAX_DEPTH} deep")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    return obj


def _depth(obj: object) -> int:
    """How deep lists and objects nest in ``obj`` (without recursion)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


# ------------------------------------------------------------------------------------------------- report

MAX_CELL = 100  # characters of a table cell (a culprit name is ~40; a longer value is cut)
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value) or "-"
    else:
        text = str(value)
    if not text.isprintable():  # a newline or a tab in a name would break the table
        text = text.translate(_CONTROL)
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


class _Table:
    """A table printed row by row, its column widths known before the first row (:meth:`fit` on every row)."""

    def __init__(self, header: Sequence[str]) -> None:
        self.header = list(header)
        self.widths = [len(h) for h in header]

    def fit(self, cells: Sequence[str]) -> None:
        self.widths = [max(w, len(c)) for w, c in zip(self.widths, cells)]

    def line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths)).rstrip()

    def head(self) -> str:
        return self.line(self.header) + "\n" + self.line(["-" * w for w in self.widths])


def _table(rows: list[list[str]], header: Sequence[str]) -> str:
    table = _Table(header)
    for r in rows:
        table.fit(r)
    return "\n".join([table.head(), *(table.line(r) for r in rows)])


UNKNOWN_RANK = "?"  # several ranks, none with evidence of its own (details.ranks empty)
REPEATED = 2  # faults that did not come back, on one rank, that make its row come first
# the cause of a fault that did not come back on replay: it counts against the rank's hardware (its own column)
FAULTS = next(c.name for c in CAUSES.values() if c.hardware_fault)


@dataclass
class Place:
    """The incidents of one host and rank (:meth:`Totals.places`)."""

    host: str
    rank: str
    device: JSONValue
    local_rank: JSONValue
    incidents: int = 0
    causes: Counter[str] = field(default_factory=Counter)
    faults: int = 0  # of the cause FAULTS: faults that did not come back
    fault_steps: list[JSONValue] = field(default_factory=list)

    def as_dict(self) -> JSONDict:
        """The place as ``--json`` writes it (its causes most frequent first)."""
        return {"host": self.host, "rank": self.rank, "device": self.device, "local_rank": self.local_rank,
                "incidents": self.incidents, "causes": dict(self.causes.most_common()), FAULTS: self.faults,
                FAULTS + "_steps": list(self.fault_steps)}


class Totals:
    """Totals over the events, added one at a time: counts by kind, action and cause, and per host and rank."""

    def __init__(self) -> None:
        self.incidents = 0
        self.counts: dict[str, Counter[str]] = {"kinds": Counter(), "actions": Counter(), "causes": Counter()}
        self.rows: dict[tuple[str, str], Place] = {}

    def add(self, e: JSONDict) -> None:
        """Count one event.

        Args:
            e: the event, as its ``events.jsonl`` line holds it.
        """
        self.incidents += 1
        for name, key in (("kinds", "kind"), ("actions", "actions"), ("causes", "cause")):
            vals = e.get(key)
            for v in (vals if isinstance(vals, list) else [vals]):
                self.counts[name][str(v) if v is not None else "none"] += 1
        self._place(e)

    def _place(self, e: JSONDict) -> None:
        """Per host and rank: its incidents, their causes, its faults that did not come back (their steps). An
        event of several ranks that names none (``details.ranks: []``) counts on host and rank ``?``."""
        details = e.get("details")
        if not isinstance(details, dict):
            details = {}
        known = details.get("ranks") != []
        host = str(e.get("host") or "-") if known else UNKNOWN_RANK
        rank = str(e.get("rank", 0)) if known else UNKNOWN_RANK
        row = self.rows.get((host, rank))
        if row is None:
            row = self.rows[(host, rank)] = Place(host, rank, (e.get("device") or "-") if known else "-",
                                                  e.get("local_rank"))
        row.incidents += 1
        row.causes[str(e.get("cause") or "none")] += 1
        if e.get("cause") == FAULTS:
            row.faults += 1
            row.fault_steps.append(e.get("step"))

    def places(self) -> list[Place]:
        """The places of :meth:`_place`, hosts with repeated faults that did not come back first, ``?`` last.

        Returns:
            One :class:`Place` per host and rank.
        """
        host_transients: Counter[str] = Counter()
        for row in self.rows.values():
            host_transients[row.host] += row.faults
        return sorted(self.rows.values(), key=lambda r: (
            r.host == UNKNOWN_RANK, -(host_transients[r.host] >= REPEATED), -host_transients[r.host],
            r.host, -r.faults, -r.incidents, r.rank))

    def as_dict(self, files: int) -> JSONDict:
        """The totals as ``--json`` writes them.

        Args:
            files: how many events files were read.

        Returns:
            ``incidents``, ``files``, the counts by ``kinds``, ``actions`` and ``causes``, and the ``places``.
        """
        counts: dict[str, JSONValue] = {name: dict(c.most_common()) for name, c in self.counts.items()}
        return {"incidents": self.incidents, "files": files, **counts,
                "places": [p.as_dict() for p in self.places()]}


def _fmt_counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items()) or "-"


def cmd_report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Two passes over the files, one line in memory at a time: the first checks every line and adds up the
    totals and the table's widths (nothing is printed if any file is bad), the second prints."""
    root = Path(args.path)
    files = find_event_files(root)
    if not files:
        raise InputError(f"{root}: no {EVENTS_FILE} found in this folder or below it")
    totals, tables, scanned = Totals(), [], []
    for f in files:
        table = _Table(COLUMNS)

        def each(e: JSONDict, table: _Table = table) -> None:
            totals.add(e)
            if not args.json:
                table.fit([_cell(e.get(c)) for c in COLUMNS])

        scanned.append((f, *scan_events(f, err, each)))
        tables.append(table)
    summary = totals.as_dict(len(files))
    if args.json:
        _write_json(scanned, summary, out)
        if args.plot is not None:  # (what it wrote goes to stderr: stdout is the JSON)
            _write_pictures(root, scanned, Path(args.plot), err, err)
        return 0
    headed = len(files) > 1 or root.is_dir()
    for (f, count, end), table in zip(scanned, tables):
        if headed:
            out.write(f"{f}  ({count} incident{'s' if count != 1 else ''})\n")
        out.write(table.head() + "\n")
        for e in read_events(f, end):
            out.write(table.line([_cell(e.get(c)) for c in COLUMNS]) + "\n")
        out.write("\n")
    out.write(f"total: {totals.incidents} incident(s) in {len(files)} file(s)\n")
    out.write(f"  kinds:   {_fmt_counts(dict(totals.counts['kinds'].most_common()))}\n")
    out.write(f"  actions: {_fmt_counts(dict(totals.counts['actions'].most_common()))}\n")
    out.write(f"  causes:  {_fmt_counts(dict(totals.counts['causes'].most_common()))}\n")
    _write_places(totals.places(), out)
    if args.plot is not None:
        _write_pictures(root, scanned, Path(args.plot), out, err)
    return 0


def _write_pictures(root: Path, scanned: list[tuple[Path, int, int]], folder: Path, out: TextIO, err: TextIO) -> None:
    """``--plot DIR``: the pictures of every event that kept its gradient-flow window, as PNG files in ``DIR`` (below
    it, the folders of the events files under a searched PATH), the same ones the guard drew during the fit."""
    from .pictures import figures, plots_available, png_bytes

    if not plots_available():
        raise InputError("--plot needs matplotlib: pip install 'lightning-nanguard[plots]'")
    written = 0
    for f, _, end in scanned:
        where = folder
        if root.is_dir():
            rel = f.parent.relative_to(root) if f.parent.is_relative_to(root) else Path(f.parent.name)
            where = folder / rel
        for e in read_events(f, end):
            if e.get("flow") is None:
                continue
            try:
                pictures = figures(e)
            except ValueError as exc:  # a window that is not one (edited by hand, another version)
                err.write(f"nanguard: warning: {f}: event {e.get('index', '?')} (step {e.get('step')}): {exc}\n")
                continue
            try:
                where.mkdir(parents=True, exist_ok=True)
                for name, fig in pictures.items():
                    path = where / f"incident-{_cell(e.get('index', 0)).zfill(4)}-step{_cell(e.get('step'))}-{name}.png"
                    path.write_bytes(png_bytes(fig))
                    out.write(f"wrote {path}\n")
                    written += 1
            except OSError as exc:
                raise InputError(f"{where}: cannot write ({exc.strerror or exc})") from None
    out.write(f"{written} picture(s) in {folder}" + ("" if written else
              " (no event kept a gradient-flow window: logging.flow_window 0, or none was recorded)") + "\n")


def _write_json(scanned: list[tuple[Path, int, int]], summary: JSONDict, out: TextIO) -> None:
    """``{"events": [...], "totals": {...}}`` as ``json.dump(..., indent=2, sort_keys=True)`` writes it, one event
    at a time."""
    out.write('{\n  "events": [')
    first = True
    for f, _, end in scanned:
        for e in read_events(f, end):
            text = json.dumps(dict(e, source=str(f)), indent=2, sort_keys=True).replace("\n", "\n    ")
            out.write(("\n    " if first else ",\n    ") + text)
            first = False
    out.write("\n  ],\n  \"totals\": " + json.dumps(summary, indent=2, sort_keys=True).replace("\n", "\n  ") + "\n}\n")


def _write_places(places: list[Place], out: TextIO) -> None:
    """Where the incidents happened, hosts with repeated faults that did not come back first."""
    header = ("host", "rank", "device", "incidents", FAULTS, "causes")
    rows = [[_cell(p.host), _cell(p.rank), _cell(p.device), str(p.incidents), str(p.faults),
             _fmt_counts(dict(p.causes.most_common()))] for p in places]
    out.write("\nby host and rank (hosts with repeated faults that did not come back first):\n")
    out.write(_table(rows, header) + "\n")
    for p in places:
        if p.faults >= REPEATED:
            rank = "an unknown rank" if p.rank == UNKNOWN_RANK else f"rank {_cell(p.rank)}"
            steps = ", ".join(_cell(s) for s in p.fault_steps)
            out.write(f"suspect: {rank} on host {_cell(p.host)} ({_cell(p.device)}) had {p.faults} faults "
                      f"that did not come back (steps {steps}): test that device or exclude the host\n")


# ----------------------------------------------------------------------------------------------- validate


def resolve_config(data: object, where: str) -> NaNGuardConfig:
    """Sections (optionally under ``nanguard:``), or the NaNGuard ``init_args`` of a LightningCLI config."""
    if isinstance(data, Mapping) and "trainer" in data and not set(data) & set(SECTIONS):
        return _from_lightning_cli(data, where)
    return NaNGuardConfig.from_mapping(data, where=where)


def _from_lightning_cli(data: Mapping[str, object], where: str) -> NaNGuardConfig:
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
    report.add_argument("--plot", metavar="DIR", default=None,
                        help="also write each incident's pictures (gradient flow, where it broke) as PNG files to DIR "
                             "(needs matplotlib: the plots extra)")
    report.set_defaults(func=cmd_report)
    validate = sub.add_parser("validate", help="check a NaNGuard YAML config and print it resolved",
                              description="Print the resolved configuration as YAML, or the error.")
    validate.add_argument("config", metavar="CONFIG.yaml",
                          help="sections, sections under 'nanguard:', or a LightningCLI config")
    validate.set_defaults(func=cmd_validate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``nanguard`` command: ``report`` (summarise events.jsonl files) and ``validate`` (check a config).

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 2 for bad input (printed as one line on stderr), 130 when interrupted.
    """
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    for stream in (out, err):  # a name or an event string that the terminal cannot encode: escaped, not a traceback
        reconfigure = getattr(stream, "reconfigure", None)  # TextIOWrapper's; not every TextIO has one
        try:
            if reconfigure is not None:
                reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass
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
