"""`nanguard report` and `nanguard validate`: on a real run's output, and on bad input (exit 2, no traceback)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_nanguard import NaNGuard
from lightning_nanguard.report.cli import main
from lightning_nanguard.config import SECTIONS
from .models import Regression, loader, regression_data, trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*")

ROOT = Path(__file__).resolve().parents[1]
BAD_BATCHES = (2, 5, 9)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real guarded run (TensorBoard logger) with input incidents at known steps."""
    root = tmp_path_factory.mktemp("run")
    data = regression_data(512)
    for b in BAD_BATCHES:
        data.tensors[0][b * 32, 0] = float("inf") if b == 5 else float("nan")
    guard = NaNGuard(logging={"verbose": False})
    t = trainer(root, callbacks=[guard], logger=TensorBoardLogger(str(root), name="tb"), log_every_n_steps=50)
    t.fit(Regression(lr=0.05), loader(data, batch_size=32))
    assert [e.step for e in guard.events] == list(BAD_BATCHES)
    return root, guard


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_on_a_run_folder_lists_every_incident(capsys, run_dir):
    root, guard = run_dir
    code, out, err = cli(capsys, "report", str(root))
    assert code == 0, err
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:5] == ["step", "kind", "actions", "cause",
                                                                            "culprit"])
    rows = [line.split() for line in lines[header + 2: header + 2 + len(BAD_BATCHES)]]
    assert [(int(r[0]), r[1]) for r in rows] == [(e.step, e.kind) for e in guard.events]
    for row, event in zip(rows, guard.events):
        assert row[2] == ",".join(event.actions) and row[3] == (event.cause or "-")
    assert f"total: {len(BAD_BATCHES)} incident(s) in 1 file(s)" in out
    assert f"kinds:   input={len(BAD_BATCHES)}" in out
    assert "events.jsonl" in out and err == ""


def test_report_json_round_trips_the_events(capsys, run_dir):
    root, guard = run_dir
    events_file = next(root.rglob("events.jsonl"))
    code, out, _ = cli(capsys, "report", str(events_file), "--json")
    assert code == 0
    data = json.loads(out)
    assert [{k: e[k] for k in ("step", "kind", "actions", "cause", "culprit", "op")} for e in data["events"]] == [
        {k: e.to_dict()[k] for k in ("step", "kind", "actions", "cause", "culprit", "op")} for e in guard.events]
    assert data["totals"]["incidents"] == len(BAD_BATCHES)
    assert data["totals"]["actions"]["skip_step"] == len(BAD_BATCHES)
    assert all(e["source"] == str(events_file) for e in data["events"])


def test_report_json_over_three_files_is_one_json_document(capsys, run_dir, tmp_path):
    """docs/events.md: ``--json`` over a folder prints ``{"events": [...], "totals": {...}}``, streamed, one event at
    a time: over three ``events.jsonl`` files the whole of stdout is still one valid JSON document, every event of
    every file in it, in file order, each naming its ``source``."""
    root, guard = run_dir
    text = next(root.rglob("events.jsonl")).read_text()
    files = [tmp_path / run / "nanguard" / "events.jsonl" for run in ("a", "b", "c")]
    for f in files:
        f.parent.mkdir(parents=True)
        f.write_text(text)
    code, out, err = cli(capsys, "report", str(tmp_path), "--json")
    assert code == 0, err
    data = json.loads(out)  # one document: no comma missing, none doubled, between the files' events
    assert [e["source"] for e in data["events"]] == [str(f) for f in files for _ in BAD_BATCHES]
    assert [e["step"] for e in data["events"]] == list(BAD_BATCHES) * 3
    assert data["totals"]["incidents"] == 3 * len(BAD_BATCHES) and data["totals"]["files"] == 3


def test_report_skips_a_truncated_last_line_with_a_warning(capsys, run_dir, tmp_path):
    root, guard = run_dir
    text = next(root.rglob("events.jsonl")).read_text()
    killed = tmp_path / "events.jsonl"
    killed.write_text(text + text.splitlines()[-1][:40])  # a run killed while writing a 4th event
    code, out, err = cli(capsys, "report", str(killed))
    assert code == 0
    assert "truncated or garbled last line" in err and f"{killed}:{len(BAD_BATCHES) + 1}" in err
    assert f"total: {len(BAD_BATCHES)} incident(s)" in out


@pytest.mark.parametrize("content, expected", [
    ('{"step": 1, "kind": "loss"}\n{"step": 2, "kind"\n{"step": 3, "kind": "loss"}\n', ":2: malformed event line"),
    ('{"step": 1, "kind": "loss"}\n[1, 2]\n{"step": 3, "kind": "loss"}\n', "expected a JSON object"),
    ('{"step": 1}\n{"step": 2, "kind": "loss"}\n', "missing key(s) kind"),
    ("\n\n", "no valid event lines"),
    ('{"step": 1, "kin', "no valid event lines"),
])
def test_report_malformed_jsonl_exits_2(capsys, tmp_path, content, expected):
    path = tmp_path / "events.jsonl"
    path.write_text(content)
    code, out, err = cli(capsys, "report", str(path))
    assert code == 2 and out == ""
    assert expected in err and str(path) in err
    assert len(err.strip().splitlines()) <= 2  # the error (and at most the truncation warning)


def test_report_binary_file_and_empty_folder_exit_2(capsys, tmp_path):
    binary = tmp_path / "events.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    code, out, err = cli(capsys, "report", str(binary))
    assert code == 2 and out == ""
    assert err == f"nanguard report: error: {binary}: not a UTF-8 text file (expected JSON lines)\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(capsys, "report", str(empty))
    assert code == 2 and "no events.jsonl found" in err


@pytest.mark.slow  # three real processes
def test_python_m_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path):
    """The real command: a missing path, and the two YAML files that once escaped as ValueError (an escape
    beyond U+10FFFF) and RecursionError (5,000 nested lists) with a traceback and exit status 1."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    missing = tmp_path / "missing"
    escape = tmp_path / "escape.yaml"
    escape.write_text('recovery:\n  lr_factor: "\\U100010000"\n')
    deep = tmp_path / "deep.yaml"
    deep.write_text("recovery: " + "[" * 5000 + "]" * 5000 + "\n")
    runs = {
        ("report", missing): f"nanguard report: error: {missing}: no such file or directory",
        ("validate", escape): f"nanguard validate: error: {escape}: malformed YAML",
        ("validate", deep): f"nanguard validate: error: {deep}: malformed YAML",
    }
    procs = {argv: subprocess.Popen([sys.executable, "-m", "lightning_nanguard", argv[0], str(argv[1])], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv in runs}  # concurrently
    for argv, expected in runs.items():
        out, err = procs[argv].communicate(timeout=120)
        assert procs[argv].returncode == 2 and "Traceback" not in err and out == "", (argv, err[-2000:])
        (line,) = err.strip().splitlines()
        assert line.startswith(expected), (argv, line)


def test_malformed_inputs_exit_2_without_raising(capsys, tmp_path):
    """The same paths as the console script: main() returns 2 with one line, it never raises."""
    bad = tmp_path / "events.jsonl"
    bad.write_text('{"step": 1, "kind": "loss"}\nnot json\n{"step": 2, "kind": "loss"}\n')
    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text("recovery:\n  lr_factor: [0.5\n")
    for argv, expected in ((["report", str(bad)], "events.jsonl:2: malformed event line: invalid JSON"),
                           (["validate", str(broken_yaml)], "broken.yaml: malformed YAML at line 3"),
                           (["validate", str(tmp_path)], "not a file"),
                           (["validate", str(tmp_path / "missing.yaml")], "missing.yaml: no such file")):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == "" and expected in err and len(err.strip().splitlines()) == 1, err


def test_validate_prints_the_resolved_config(capsys, tmp_path):
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text("nanguard:\n  recovery:\n    lr_factor: 0.25\n")
    code, out, err = cli(capsys, "validate", str(path))
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["recovery"]["lr_factor"] == 0.25
    assert resolved == NaNGuard(recovery={"lr_factor": 0.25}).config.to_dict()


def test_validate_reads_the_nanguard_entry_of_a_lightning_cli_config(capsys):
    import yaml

    path = ROOT / "configs" / "lightning_cli.yaml"
    code, out, err = cli(capsys, "validate", str(path))
    assert code == 0, err
    (entry,) = [c for c in yaml.safe_load(path.read_text())["trainer"]["callbacks"]
                if c["class_path"] == "lightning_nanguard.NaNGuard"]
    expected = NaNGuard(**entry["init_args"]).config.to_dict()
    assert yaml.safe_load(out) == expected and expected != NaNGuard().config.to_dict()


@pytest.mark.parametrize("text, named", [
    ("recovery:\n  lr_factor: 2\n", "recovery.lr_factor: got 2"),
    ("recovery:\n  lr_factor: 1.0\n", "recovery.lr_factor: got 1.0"),  # exactly at the open bound
    ("recovery:\n  lr_factor: .inf\n", "recovery.lr_factor: got inf"),
    ("clip:\n  max_norm: .inf\n", "clip.max_norm: got inf"),
    ("clip:\n  ema_alpha: 0.0\n", "clip.ema_alpha: got 0.0"),
    ("recovery:\n  max_skips: true\n", "recovery.max_skips: got True"),
    ("check:\n  activations: 0\n", "check.activations: got 0"),
    ("anomaly:\n  mode: off\n", "anomaly.mode: got False"),  # YAML 1.1: unquoted off is false
    ("nanguard:\n  recovery:\n    min_lr_scale: 0\n", "recovery.min_lr_scale: got 0"),
    ("recovery:\n  lr_factr: 0.3\n", "did you mean 'recovery.lr_factor'"),
    ("recovery: [1]\n", "recovery: expected a mapping"),
    ('"rec\\novery": {}\n', "'rec\\novery': unknown key"),  # a key with a newline: still one line
    ("recovery: {\"lr\\n\\nfactor\": 0.5}\n", "recovery.'lr\\n\\nfactor': unknown key"),
    ("trainer:\n  callbacks:\n    - class_path: lightning_nanguard.NaNGuard\n      init_args:\n"
     "        recovery: {max_rollbacks: -1}\n", "recovery.max_rollbacks: got -1"),
])
def test_validate_bad_config_exits_2_naming_the_key(capsys, tmp_path, text, named):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = cli(capsys, "validate", str(path))
    assert code == 2 and out == ""
    assert err.startswith("nanguard validate: error: ") and named in err and len(err.strip().splitlines()) == 1, err


def _out_of_range() -> list:
    """For every key with a declared range: the nearest refused value at each bound."""
    cases = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
            is_int = hints[f.name] is int
            if lo is not None:
                below = lo if f.metadata["lo_open"] else lo - 1 if is_int else lo - 0.5
                cases.append((f"{section}.{f.name}", below))
            if hi is not None:
                cases.append((f"{section}.{f.name}", hi if f.metadata["hi_open"] else hi + 1))
    return cases


@pytest.mark.parametrize("key, value", _out_of_range(), ids=lambda v: str(v))
def test_validate_refuses_every_key_just_out_of_range(capsys, tmp_path, key, value):
    section, name = key.split(".")
    path = tmp_path / "bad.yaml"
    path.write_text(f"{section}:\n  {name}: {value!r}\n")
    code, out, err = cli(capsys, "validate", str(path))
    assert code == 2 and out == "" and err.startswith(f"nanguard validate: error: {key}: got "), err
    assert len(err.strip().splitlines()) == 1


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["report"])
    assert info.value.code == 2


def test_report_summarises_incidents_per_host_and_rank_repeated_transients_first(capsys, tmp_path):
    """Where the incidents happened: one row per host and rank with the incidents of each cause, the host with
    repeated faults that did not come back first and named; an event whose rank is unknown counts apart."""
    def event(step, cause, rank, host, device, **details):
        return {"step": step, "kind": "loss", "actions": ["skip_step"], "cause": cause, "culprit": None, "rank": rank,
                "host": host, "device": device, "local_rank": rank % 4, "details": details}

    events = [event(40, "input", 0, "node0", "cuda:0"), event(10, "transient", 5, "node3", "cuda:1"),
              event(50, "unknown", 0, "node0", "cuda:0"), event(200, "transient", 5, "node3", "cuda:1"),
              event(60, "transient", 1, "node0", "cuda:1"), event(70, "transient", 0, "node0", "cuda:0", ranks=[]),
              event(310, "transient", 5, "node3", "cuda:1")]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = cli(capsys, "report", str(path))
    assert code == 0, err
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.split() == ["host", "rank", "device", "incidents",
                                                                          "transient", "causes"]))
    rows = [line.split(None, 5) for line in lines[header + 2: header + 6]]
    assert rows == [["node3", "5", "cuda:1", "3", "3", "transient=3"],
                    ["node0", "1", "cuda:1", "1", "1", "transient=1"],
                    ["node0", "0", "cuda:0", "2", "0", "input=1, unknown=1"],
                    ["?", "?", "-", "1", "1", "transient=1"]]
    suspects = [line for line in lines if line.startswith("suspect:")]
    assert suspects == ["suspect: rank 5 on host node3 (cuda:1) had 3 faults that did not come back (steps 10, 200, "
                        "310): test that device or exclude the host"]
    code, out, _ = cli(capsys, "report", str(path), "--json")
    places = json.loads(out)["totals"]["places"]
    assert [(p["host"], p["rank"], p["causes"], p["transient_steps"]) for p in places][0] == (
        "node3", "5", {"transient": 3}, [10, 200, 310])


# ------------------------------------------------------------------------- any bytes, streamed, without torch


def _lines(*events: str) -> bytes:
    return "".join(e + "\n" for e in events).encode()


GOOD = '{"step": 1, "kind": "loss"}'
DEEP = b'{"step": 2, "kind": "loss", "details": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
LONG = b'{"step": 2, "kind": "loss", "culprit": "' + b"x" * (17 * 2**20) + b'"}'


@pytest.mark.parametrize("content, code, said", [
    (b"[" * 100_000, 2, "no valid event lines (expected one JSON object per line; line 1: JSON nested more than"),
    (_lines(GOOD) + DEEP + b"\n" + _lines(GOOD), 2, "events.jsonl:2: malformed event line: JSON nested more than 64"),
    (_lines(GOOD) + DEEP, 0, "events.jsonl:2: skipped a truncated or garbled last line (JSON nested more than 64"),
    (b"\x00" * 100_000, 2, "events.jsonl: binary data (NUL bytes), not a text file (expected JSON lines)"),
    (b"\x00" * 50 + b"\n" + _lines(GOOD), 2, "events.jsonl: binary data (NUL bytes), not a text file"),
    (_lines(GOOD) + b'{"step": 2, "kind": "lo\xffss"}\n' + _lines(GOOD), 2,
     "events.jsonl:2: malformed event line: not UTF-8 text (byte 24)"),
    (_lines(GOOD) + LONG + b"\n" + _lines(GOOD), 2, "events.jsonl:2: malformed event line: a line longer than 16 MiB"),
    (_lines(GOOD) + LONG, 0, "events.jsonl:2: skipped a truncated or garbled last line (a line longer than 16 MiB)"),
    (_lines('{"step": ' + "9" * 5000 + ', "kind": "loss"}', GOOD), 2, "events.jsonl:1: malformed event line: invalid "
                                                                      "JSON: Exceeds the limit (4300 digits)"),
], ids=["deep-only", "deep-middle", "deep-last", "nul-bytes", "nul-line-first", "invalid-utf8-middle", "huge-middle",
        "huge-last", "huge-integer"])
def test_report_never_tracebacks_on_bad_bytes(capsys, tmp_path, content, code, said):
    """Each once gave a traceback (RecursionError, ValueError) or two contradictory lines; now exit 2 with one line
    naming the file and line, or, for a bad last line, exit 0 with one warning."""
    path = tmp_path / "events.jsonl"
    path.write_bytes(content)
    got, out, err = cli(capsys, "report", str(path))
    assert got == code and said in err and len(err.strip().splitlines()) == 1, err[-500:]
    assert (out == "") is (code == 2) and "Traceback" not in err
    if code == 0:
        assert "total: 1 incident(s)" in out


def test_report_escapes_what_a_terminal_cannot_show(capsys, tmp_path):
    """A lone surrogate and a newline in a culprit, an undecodable byte in a folder's name: escaped, one row."""
    folder = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/run\xff"))
    folder.mkdir()
    (folder / "events.jsonl").write_text('{"step": 7, "kind": "loss", "culprit": "enc\\udcff\\nder"}\n')
    code, out, err = cli(capsys, "report", str(tmp_path))
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if line.startswith("7 ")]
    assert row.split() == ["7", "loss", "-", "-", "enc\\udcff\\x0ader"]
    assert "run\\udcff" in out


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs /proc/self/mem (Linux)")
def test_report_on_a_folder_with_an_unreadable_file_and_a_link_loop_exits_2_naming_it(capsys, run_dir, tmp_path):
    """An events.jsonl that cannot be read (a link to /proc/self/mem reads EIO, even as root) next to good ones, and
    a folder link back up: one line naming the file, no traceback, no endless walk."""
    good = next(run_dir[0].rglob("events.jsonl")).read_text()
    for name in ("a", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events.jsonl").write_text(good)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "events.jsonl").symlink_to("/proc/self/mem")
    (tmp_path / "a" / "up").symlink_to(tmp_path)
    code, out, err = cli(capsys, "report", str(tmp_path))
    assert code == 2 and out == ""
    assert err == f"nanguard report: error: {tmp_path / 'b' / 'events.jsonl'}: cannot read (Input/output error)\n"


def test_report_survives_random_damage_to_a_real_events_file(capsys, run_dir, tmp_path):
    """100 random byte flips, cuts, insertions and duplications of a real run's events.jsonl: exit 0 or 2 every
    time, never an exception; on 2 nothing on stdout and one line on stderr."""
    import random

    text = next(run_dir[0].rglob("events.jsonl")).read_bytes()
    rng = random.Random(0)
    path = tmp_path / "events.jsonl"
    codes = set()
    for _ in range(100):
        data = bytearray(text)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            op = rng.choice(("flip", "cut", "insert", "duplicate"))
            if op == "flip":
                data[at] = rng.randrange(256)
            elif op == "cut":
                del data[at:at + rng.randint(1, 200)]
            elif op == "insert":
                data[at:at] = bytes(rng.choice(b'{}[]",:\n\x00\xff\\0123456789e-') for _ in range(rng.randint(1, 20)))
            else:
                data[at:at] = data[max(0, at - 300):at]
        path.write_bytes(bytes(data))
        for args in (("report", str(path)), ("report", str(path), "--json")):
            code, out, err = cli(capsys, *args)
            codes.add(code)
            assert code in (0, 2), err
            if code == 2:
                assert out == "" and len(err.strip().splitlines()) == 1, err
            elif "--json" in args:
                assert isinstance(json.loads(out)["events"], list)
    assert codes == {0, 2}


@pytest.mark.slow  # ~1.5 s: tracemalloc slows every allocation
def test_report_streams_its_input_memory_does_not_grow_with_the_file(tmp_path, run_dir):
    """Every line is read, checked and added up, then read again to print: the largest allocation while reporting a
    file is far below the file's size (holding its events took about 8x it), in both output formats (written to a
    file here: a captured stdout would hold the output itself)."""
    import contextlib
    import tracemalloc

    events = [json.loads(x) for x in next(run_dir[0].rglob("events.jsonl")).read_text().splitlines()]
    path = tmp_path / "events.jsonl"
    with open(path, "w") as fh:
        for i in range(1500):
            fh.write(json.dumps(dict(events[i % len(events)], step=i)) + "\n")
    size = path.stat().st_size
    for extra in ((), ("--json",)):
        printed = tmp_path / "out.txt"
        with open(printed, "w") as out, contextlib.redirect_stdout(out):  # first calls allocate once (imports)
            main(["report", str(path), *extra])
        with open(printed, "w") as out, contextlib.redirect_stdout(out):
            tracemalloc.start()
            try:
                code = main(["report", str(path), *extra])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        text = printed.read_text()
        assert code == 0 and ("total: 1500 incident(s)" in text or json.loads(text)["totals"]["incidents"] == 1500)
        assert peak < size / 4, (extra, peak, size)


def test_report_starts_without_importing_torch_or_lightning(tmp_path):
    """`nanguard report` on a small file in a fresh interpreter: neither torch nor Lightning is imported (they cost
    seconds of CPU at every call and the report needs neither)."""
    path = tmp_path / "events.jsonl"
    path.write_text(GOOD + "\n")
    code = ("import sys\nfrom lightning_nanguard.report.cli import main\nrc = main(['report', sys.argv[1]])\n"
            "heavy = [m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules]\n"
            "print('RESULT', rc, heavy)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "RESULT 0 []"
