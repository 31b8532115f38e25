"""``nanguard report``: start-up cost and peak memory against the size of the events file.

Writes an events.jsonl of ``--mb`` megabytes (copies of real events, renumbered), then runs ``python -m
lightning_nanguard report FILE`` (and ``--json``) in a child per measurement and reads the child's CPU time and peak
RSS (``ru_maxrss``) from ``getrusage(RUSAGE_CHILDREN)``, plus the same on a one-event file (the start-up cost).
``--code`` points PYTHONPATH at another checkout to compare (e.g. the main branch)::

    python benchmarks/report_cli.py --mb 200                       # this checkout
    python benchmarks/report_cli.py --mb 200 --code /path/to/main  # another one

CPU seconds, not wall time: the machine's other load does not count. Imports nothing heavy itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EVENT = {"actions": ["skip_step"], "batch_idx": 2, "cause": "input", "culprit": None,
         "details": {"grad_norm": "nan", "inputs": [{"features": [0], "field": "batch[0]", "inf": 0, "micro_batch": 0,
                                                     "nan": 1, "samples": [0], "shape": [32, 8]}], "lr": [0.05],
                     "reasons": ["no LR cut: the cause (input) is not the learning rate"]},
         "device": "cpu", "epoch": 0, "host": "vm", "index": 1, "kind": "input", "local_rank": 0, "op": None,
         "rank": 0, "step": 2,
         "suggestion": "batch[0] holds NaN/Inf at samples [0] features [0]. Bad input data: fix or drop these samples "
                       "(check the data pipeline, normalisation and division by zero in feature engineering), or "
                       "filter non-finite batches in the dataset."}


def write_events(path: Path, megabytes: float) -> int:
    """An events.jsonl of about ``megabytes`` MB; returns the number of events."""
    target, size, n = int(megabytes * 1e6), 0, 0
    with open(path, "w") as fh:
        while size < target:
            n += 1
            line = json.dumps(dict(EVENT, step=n, index=n)) + "\n"
            fh.write(line)
            size += len(line)
    return n


_WRAPPER = """
import json, resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": proc.returncode, "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
                  "maxrss_mib": round(ru.ru_maxrss / 1024, 1), "stderr": proc.stderr[-200:]}))
"""


def measure(code: Path, path: Path, *extra: str) -> dict[str, float]:
    """One ``nanguard report`` in a child of its own (so that ``ru_maxrss`` of RUSAGE_CHILDREN is its alone): its
    exit status, CPU seconds and peak RSS (MiB)."""
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lightning_nanguard", "report", str(path), *extra]
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="size of the events file (MB)")
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout to measure (PYTHONPATH)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp) / "small.jsonl", Path(tmp) / "events.jsonl"
        write_events(small, 0.0001)
        events = write_events(big, args.mb)
        results = {"code": str(args.code), "events": events, "file_mb": round(big.stat().st_size / 1e6, 1),
                   "start_one_event": measure(args.code, small),
                   "report": measure(args.code, big),
                   "report_json": measure(args.code, big, "--json")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
