"""What the DDP scripts here share: telling the guard's calls from the others, counting its collectives and host
reads, and leaving a rank cleanly.

Imported by its sibling scripts (each runs as ``python SCRIPT``, so this folder is on ``sys.path``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import lightning_nanguard

GUARD_DIR = os.path.dirname(lightning_nanguard.__file__)


def from_guard() -> bool:
    """Whether the caller of the wrapper that calls this (a wrapped collective or tensor read) was reached from
    code in ``lightning_nanguard``, at any depth."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(GUARD_DIR):
            return True
        frame = frame.f_back
    return False


CALLS: list[tuple[str, int]] = []  # the guard's collectives: (name, numel), while COUNTING[0]
READS: list[str] = []  # the guard's host reads of a tensor, while COUNTING[0]
COUNTING = [False]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter", "all_to_all")
HOST_READS = ("tolist", "item", "__bool__", "__float__", "__int__")


def _count_collective(name: str) -> None:
    original = getattr(dist.distributed_c10d, name)

    def counted(*args, **kwargs):
        if COUNTING[0] and from_guard():
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            CALLS.append((name, tensor.numel() if tensor is not None else -1))
        return original(*args, **kwargs)

    setattr(dist.distributed_c10d, name, counted)
    setattr(dist, name, counted)


def _count_read(name: str) -> None:
    original = getattr(torch.Tensor, name)

    def read(t, *args, **kwargs):
        if COUNTING[0] and sys._getframe(1).f_code.co_filename.startswith(GUARD_DIR):
            READS.append(name)
        return original(t, *args, **kwargs)

    setattr(torch.Tensor, name, read)


def install_counters() -> None:
    """Wrap every collective and host read of a tensor, so that those the guard makes while ``COUNTING[0]`` are
    recorded in ``CALLS`` and ``READS`` (call once, at import of the script)."""
    for name in COLLECTIVES:
        if hasattr(dist.distributed_c10d, name):
            _count_collective(name)
    for name in HOST_READS:
        _count_read(name)


def save_and_exit(payload: Any, path: Path) -> NoReturn:
    """Save this rank's results, wait until every rank has saved its own, then leave without the interpreter's
    teardown, where gloo's threads can abort a process ("terminate called without an active exception") after a
    run that itself went fine."""
    torch.save(payload, path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
