"""Launching a script as torchrun would: one process per rank on this host (gloo, CPU), each with its ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``, and reading back what each rank saved (``rank<r>.pt`` in the output folder,
as ``tests/ddp_scripts/common.py``'s ``save_and_exit`` writes it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, out: Path, size: int, *args: str, timeout: float = 300) -> list[Any]:
    """Run ``script out *args`` on ``size`` ranks in ``out`` and return each rank's saved payload, in rank order.
    Every rank must finish within ``timeout`` seconds (a hang, ranks waiting on each other's collectives, fails
    here) and exit 0 (else the assertion shows the end of each rank's output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(size), NODE_RANK="0")
    procs = [subprocess.Popen([sys.executable, str(script), str(out), *args],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=str(out), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    import torch

    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(size)]


def per_step(fit: dict) -> list[tuple[int, list, list, bool]]:
    """``(step, the guard's collectives, its host reads, took a snapshot)`` of every step but the first (which also
    holds fit setup), from a fit's ``steps`` rows and the ``calls``/``reads`` that ``ddp_scripts/common.py``'s
    counters recorded."""
    rows, calls, reads, snaps = [], 0, 0, 0
    for rec in fit["steps"]:
        rows.append((rec["step"], fit["calls"][calls:rec["calls"]], fit["reads"][reads:rec["reads"]],
                     rec["snapshots"] > snaps))
        calls, reads, snaps = rec["calls"], rec["reads"], rec["snapshots"]
    return rows[1:]
