"""What the DDP scripts here share: telling the guard's calls from the others, and leaving a rank cleanly.

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


def save_and_exit(payload: Any, path: Path) -> NoReturn:
    """Save this rank's results, wait until every rank has saved its own, then leave without the interpreter's
    teardown, where gloo's threads can abort a process ("terminate called without an active exception") after a
    run that itself went fine."""
    torch.save(payload, path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
