#!/usr/bin/env python
"""Mutation testing with curated mutants: how many realistic single-behaviour bugs does the suite catch?

Each mutant of scripts/mutants.py (one exact find/replace in one file) is applied to a fresh copy of the
repository (tracked and untracked-but-not-ignored files), and the test suite runs on that copy
(``python -m pytest -x -q -p no:cacheprovider``, OMP_NUM_THREADS=1, PYTHONPATH=the copy) in two passes: the
tests not marked slow first, then, if they all passed, the slow ones (the same tests as one full run; most
mutants fall to a quick test, so the pass saves most of the slow tests' time). The real tree is only read.
A mutant is

- killed:   a test failed (the first failing test is reported);
- survived: the whole suite passed with the bug in place;
- timeout:  the suite ran past --timeout (a hang): killed by timeout, counted as killed, listed apart;
- stale:    its ``find`` is missing or occurs more than once (the code moved or changed: fix the mutant).

Kill rate = (killed + timeout) / (killed + timeout + survived). See docs/mutation.md.

    python scripts/mutation.py --list                 # check every mutant applies, and where (no tests run)
    python scripts/mutation.py --jobs 2 --json out.json
    python scripts/mutation.py --area ladder --only snap-rollback-to-oldest
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from mutants import AREAS, MUTANTS, Mutant  # noqa: E402

ROOT = HERE.parent
PACKAGE = "lightning_nanguard"
PYTEST = ["-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider"]


@dataclass
class Result:
    id: str
    area: str
    status: str  # killed | survived | timeout | stale | error
    seconds: float = 0.0
    killed_by: Optional[str] = None
    detail: str = ""
    breaks: str = ""
    harmless: str = ""


# ------------------------------------------------------------------------------------------ mutants


def check_mutant(m: Mutant, root: Path = ROOT) -> tuple[Optional[str], str]:
    """(mutated source, "") when ``m`` applies cleanly to ``root``, else (None, why it is stale)."""
    path = root / m.file
    if not path.is_file():
        return None, f"{m.file}: no such file" + _elsewhere(m, root)
    text = path.read_text(encoding="utf-8")
    count = text.count(m.find)
    if count != 1:
        why = "not found" if count == 0 else f"found {count} times (ambiguous)"
        return None, f"{m.file}: find {why}" + (_elsewhere(m, root) if count == 0 else "")
    if m.find == m.replace:
        return None, "find == replace"
    mutated = text.replace(m.find, m.replace)
    try:
        compile(mutated, str(path), "exec")
    except SyntaxError as err:
        return None, f"mutated {m.file} does not compile: {err.msg} (line {err.lineno})"
    return mutated, ""


def _elsewhere(m: Mutant, root: Path) -> str:
    """Where the snippet lives now, if it moved to another file of the package (a refactor)."""
    counts = {str(p.relative_to(root)): p.read_text(encoding="utf-8").count(m.find)
              for p in sorted((root / PACKAGE).rglob("*.py"))}
    hits = [f"{f}" + (f" ({n} times)" if n > 1 else "") for f, n in counts.items() if n]
    if not hits:
        return ""
    return f"; the snippet is now in {', '.join(hits)}" if len(hits) <= 3 else f"; found in {len(hits)} files"


def select(args: argparse.Namespace) -> list[Mutant]:
    ids = [m.id for m in MUTANTS]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        sys.exit(f"mutation.py: duplicate mutant ids: {', '.join(dupes)}")
    bad_area = sorted({m.area for m in MUTANTS} - set(AREAS))
    if bad_area:
        sys.exit(f"mutation.py: mutants with unknown area(s): {', '.join(bad_area)}")
    chosen = list(MUTANTS)
    if args.area:
        unknown = [a for a in args.area if a not in AREAS]
        if unknown:
            sys.exit(f"mutation.py: unknown area(s) {', '.join(unknown)}; known: {', '.join(AREAS)}")
        chosen = [m for m in chosen if m.area in args.area]
    if args.only:
        unknown = [i for i in args.only if i not in ids]
        if unknown:
            sys.exit(f"mutation.py: unknown mutant id(s): {', '.join(unknown)}")
        chosen = [m for m in chosen if m.id in args.only]
    return chosen


# ------------------------------------------------------------------------------------------- copies


def repo_files(root: Path) -> list[str]:
    """Tracked files plus untracked files that git does not ignore (what a fresh checkout would test)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def make_copy(root: Path, files: list[str], dest: Path) -> Path:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)
    return dest


def env_for(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_import(copy: Path) -> None:
    """Abort unless the copy's package (not the installed one) is what the tests import."""
    code = f"import {PACKAGE}, os; print(os.path.realpath({PACKAGE}.__file__))"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env_for(copy), capture_output=True,
                         text=True)
    where = out.stdout.strip()
    if out.returncode != 0 or not where.startswith(os.path.realpath(copy) + os.sep):
        sys.exit(f"mutation.py: the copy imports {PACKAGE} from {where or out.stderr.strip()!r}, not from "
                 f"{copy}; check PYTHONPATH and the installed package")


_procs: dict[int, subprocess.Popen] = {}
_procs_lock = threading.Lock()


def run_suite(copy: Path, timeout: float, pytest_args: list[str], allow_empty: bool = False) -> tuple[str, float, str]:
    """Run the suite in ``copy``: (outcome, seconds, output); outcome is passed, failed or timeout.
    ``allow_empty``: a selection with no test in it (pytest's exit status 5) passes."""
    cmd = [sys.executable, *PYTEST, f"--basetemp={copy / '.pytest-tmp'}", *pytest_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    with _procs_lock:
        _procs[proc.pid] = proc
    try:
        output, _ = proc.communicate(timeout=timeout)
        outcome = "passed" if proc.returncode == 0 or (allow_empty and proc.returncode == 5) else "failed"
    except subprocess.TimeoutExpired:
        _kill(proc)
        output, _ = proc.communicate()
        outcome = "timeout"
    finally:
        with _procs_lock:
            _procs.pop(proc.pid, None)
    if outcome == "failed" and proc.returncode not in (1, 2):  # 3 internal error, 4 usage, 5 no tests
        output += f"\n[pytest exit status {proc.returncode}]"
    return outcome, time.monotonic() - start, output


def count_tests(copy: Path, pytest_args: list[str]) -> Optional[int]:
    """How many tests the suite in ``copy`` holds (``pytest --collect-only``), or None if pytest does not say."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args]
    out = subprocess.run(cmd, cwd=copy, env=env_for(copy), capture_output=True, text=True, timeout=600)
    m = re.search(r"^(\d+)(?:/\d+)? tests? collected", out.stdout, re.M)
    return int(m.group(1)) if m else None


def provenance(copy: Path, args: argparse.Namespace, pytest_args: list[str]) -> dict:
    """What a results file needs to be read later (docs/mutation.md is generated from it): when, on which commit
    (``+dirty`` with uncommitted edits, which the copy holds), the suite's size, and how the run was made."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short=7", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "tests": count_tests(copy, pytest_args), "jobs": args.jobs,
            "selection": {"only": args.only, "area": args.area, "pytest_args": args.pytest_args,
                          "one_pass": args.one_pass}}


def _kill_all() -> None:
    with _procs_lock:
        for proc in list(_procs.values()):
            _kill(proc)


def _kill(proc: subprocess.Popen) -> None:
    """Kill the suite's process group (pytest and the subprocesses it spawned: DDP ranks, CLI runs)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_FAILED = re.compile(r"^(FAILED|ERROR) (.+?)(?: - .*)?$", re.M)  # pytest's short summary (-rfE)


def first_failure(output: str) -> str:
    # only in pytest's short summary: a captured log line can start with "ERROR" too
    summary = output.rfind("short test summary info")
    m = _FAILED.search(output, summary if summary >= 0 else 0)
    if m:
        name = m.group(2) if len(m.group(2)) <= 150 else m.group(2)[:147] + "..."
        return name + (" (error)" if m.group(1) == "ERROR" else "")
    if "error" in output.lower() and "collect" in output.lower():
        return "(collection error)"
    tail = [line for line in output.strip().splitlines() if line.strip()]
    return tail[-1][:120] if tail else "(no output)"


# the two passes of a mutant's run: together, the whole suite once
PASSES = (["-m", "not slow"], ["-m", "slow"])


def run_mutant(m: Mutant, files: list[str], work: Path, timeout: float, pytest_args: list[str],
               keep: bool, passes: tuple[list[str], ...] = PASSES) -> Result:
    mutated, why = check_mutant(m)
    if mutated is None:
        return Result(m.id, m.area, "stale", detail=why, breaks=m.breaks)
    copy = make_copy(ROOT, files, work / m.id)
    try:
        (copy / m.file).write_text(mutated, encoding="utf-8")
        seconds = 0.0
        for selection in passes:
            outcome, took, output = run_suite(copy, timeout, [*selection, *pytest_args], allow_empty=bool(selection))
            seconds += took
            if outcome != "passed":
                break
        if outcome == "passed":
            return Result(m.id, m.area, "survived", seconds, breaks=m.breaks, harmless=m.harmless)
        if outcome == "timeout":
            return Result(m.id, m.area, "timeout", seconds, detail=f"ran past {timeout:.0f} s", breaks=m.breaks)
        return Result(m.id, m.area, "killed", seconds, killed_by=first_failure(output), breaks=m.breaks)
    finally:
        if not keep:
            shutil.rmtree(copy, ignore_errors=True)


# --------------------------------------------------------------------------------------------- main


def where(m: Mutant, root: Path = ROOT) -> str:
    """``file:function`` of the mutant's ``find`` (the nearest ``def`` above it): a refactor can leave a ``find``
    that still occurs once, but in another function than the one the mutant means to break."""
    text = (root / m.file).read_text(encoding="utf-8")
    defs = re.findall(r"^\s*def (\w+)", text[: max(text.find(m.find), 0)], re.M)
    return f"{m.file.removeprefix(PACKAGE + '/')}:{defs[-1] if defs else '(module)'}"


def list_mutants(chosen: list[Mutant]) -> int:
    stale = 0
    for m in chosen:
        mutated, why = check_mutant(m)
        stale += mutated is None
        mark = "ok   " if mutated is not None else "STALE"
        at = f"  [{where(m)}]" if mutated is not None else ""
        print(f"{mark} {m.area:<10} {m.id:<40} {m.breaks}{at}" + (f"\n      -> {why}" if why else ""))
    areas = {a: sum(m.area == a for m in chosen) for a in AREAS}
    print(f"\n{len(chosen)} mutant(s), {stale} stale; per area: "
          + ", ".join(f"{a}={n}" for a, n in areas.items() if n))
    return 1 if stale else 0


def summarise(results: list[Result], wall: float, baseline: float) -> dict:
    by = {s: [r for r in results if r.status == s] for s in ("killed", "survived", "timeout", "stale")}
    killed = len(by["killed"]) + len(by["timeout"])  # a hang is a failing suite: killed by timeout
    survived = len(by["survived"])
    harmless = [r for r in by["survived"] if r.harmless]
    rate = killed / (killed + survived) if killed + survived else float("nan")
    print(f"\n{len(results)} mutant(s): killed {len(by['killed'])} (+{len(by['timeout'])} by timeout), "
          f"survived {survived}, stale {len(by['stale'])}")
    suite = f"unmutated suite {baseline:.0f} s" if baseline else "unmutated suite skipped"
    print(f"kill rate: {killed}/{killed + survived} = {rate:.1%}  (wall {wall / 60:.1f} min; {suite})")
    rate_judged = rate
    if harmless:
        judged = killed + survived - len(harmless)
        rate_judged = killed / judged if judged else float("nan")
        print(f"kill rate without the {len(harmless)} survivor(s) judged harmless: {killed}/{judged} = "
              f"{rate_judged:.1%}")
    for status in ("survived", "timeout", "stale"):
        if by[status]:
            print(f"\n{status}:")
            for r in sorted(by[status], key=lambda r: (bool(r.harmless), AREAS.index(r.area), r.id)):
                print(f"  {r.id:<40} {r.breaks}" + (f"\n    -> {r.detail}" if r.detail else "")
                      + (f"\n    -> judged harmless: {r.harmless}" if r.harmless and status == "survived" else ""))
    per_area = {}
    for a in AREAS:
        k = sum(r.area == a and r.status in ("killed", "timeout") for r in results)
        s = sum(r.area == a and r.status == "survived" for r in results)
        if k + s:
            per_area[a] = {"killed": k, "survived": s}
    print("\nper area (killed/judged): " + ", ".join(f"{a} {v['killed']}/{v['killed'] + v['survived']}"
                                                    for a, v in per_area.items()))
    return {"kill_rate": rate, "kill_rate_without_harmless": rate_judged, "killed": killed, "survived": survived,
            "survived_harmless": len(harmless), "timeout": len(by["timeout"]), "stale": len(by["stale"]),
            "wall_s": round(wall, 1), "baseline_suite_s": round(baseline, 1), "per_area": per_area,
            "python": sys.executable, "results": [asdict(r) for r in results]}


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="mutants run in parallel (default 2)")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutant ids")
    parser.add_argument("--area", nargs="+", metavar="NAME", help=f"run only these areas ({', '.join(AREAS)})")
    parser.add_argument("--list", action="store_true", help="list the mutants and check they apply; run nothing")
    parser.add_argument("--json", metavar="OUT", help="write every result (and the summary) as JSON")
    parser.add_argument("--timeout", type=float,
                        help="seconds per mutant's suite run, past which it is killed by timeout "
                             "(default: 3 x the unmutated run + 60)")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the unmutated suite first (only when it is known to pass; needs --timeout)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies (under the temp folder)")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string, e.g. '-k \"not ddp\"'")
    parser.add_argument("--one-pass", action="store_true",
                        help="run each mutant's suite in one pass instead of quick tests first, then slow ones "
                             "(implied when --pytest-args selects with -m)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a background run ignores SIGINT: kill -TERM stops it cleanly

    chosen = select(args)
    if args.list:
        return list_mutants(chosen)
    if not chosen:
        sys.exit("mutation.py: no mutant selected")
    if args.skip_baseline and args.timeout is None:
        sys.exit("mutation.py: --skip-baseline needs --timeout")
    pytest_args = __import__("shlex").split(args.pytest_args)
    passes = ([],) if args.one_pass or "-m" in pytest_args else PASSES

    files = repo_files(ROOT)
    work = Path(tempfile.mkdtemp(prefix="nanguard-mutation-"))
    print(f"{len(chosen)} mutant(s), {len(files)} files copied per run, --jobs {args.jobs}, work dir {work}",
          flush=True)
    start = time.monotonic()
    try:
        base = make_copy(ROOT, files, work / "_unmutated")
        check_import(base)
        run = provenance(base, args, pytest_args)
        baseline = 0.0
        if not args.skip_baseline:
            outcome, baseline, output = run_suite(base, args.timeout or 1800, pytest_args)
            if outcome != "passed":
                print(output[-4000:])
                print(f"mutation.py: the unmutated suite {outcome} in the copy ({first_failure(output)}); "
                      "fix it before measuring mutants", file=sys.stderr)
                return 2
            print(f"unmutated suite passed in {baseline:.0f} s", flush=True)
        shutil.rmtree(base, ignore_errors=True)
        timeout = args.timeout or 3 * baseline + 60

        results: list[Result] = []
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_mutant, m, files, work, timeout, pytest_args, args.keep, passes): m
                       for m in chosen}
            try:
                for n, fut in enumerate(as_completed(futures), start=1):
                    r = fut.result()
                    results.append(r)
                    extra = f"by {r.killed_by}" if r.killed_by else r.detail
                    print(f"[{n:>3}/{len(chosen)}] {r.status:<8} {r.id:<40} {r.seconds:5.0f} s  {extra}", flush=True)
            except KeyboardInterrupt:  # before the pool waits for the running suites: stop them first
                for fut in futures:
                    fut.cancel()
                _kill_all()
                raise
        order = {m.id: i for i, m in enumerate(MUTANTS)}
        results.sort(key=lambda r: order[r.id])
        summary = {"run": run, **summarise(results, time.monotonic() - start, baseline)}
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
            print(f"\nwrote {args.json}")
        unexplained = summary["survived"] - summary["survived_harmless"]
        return 0 if unexplained == summary["stale"] == 0 else 1
    except KeyboardInterrupt:
        _kill_all()
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
