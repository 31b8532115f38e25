"""Known-good training state: a ring of snapshots in preallocated CPU memory or in atomically written files."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from ..layouts import copy_to_cpu, is_strided, nbytes
from ..tree import flatten, unflatten

__all__ = ["Snapshot", "SnapshotStore"]


@dataclass
class Snapshot:
    """Known-good training state at ``step``: module, optimizers, schedulers, grad scaler, guard meta."""

    step: int
    skeleton: Any = None
    tensors: list[Tensor] = field(default_factory=list)
    path: Optional[Path] = None
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0


class SnapshotStore:
    """A ring of known-good states, in preallocated CPU memory or in atomically written files.

    Taking a snapshot copies into buffers allocated on first use (``copy_``, no allocation in steady
    state); restoring clones again, so neither the live objects nor the snapshot alias each other. Sparse
    tensors (a graph's adjacency buffer) are copied in their own layout.
    """

    def __init__(self, keep: int = 2, mode: str = "memory", directory: Optional[Path] = None) -> None:
        if mode not in ("memory", "disk"):
            raise ValueError(f"snapshot mode must be 'memory' or 'disk', got {mode!r}")
        self.keep = keep
        self.mode = mode
        self.directory = Path(directory) if directory is not None else None
        self.ring: deque[Snapshot] = deque()
        self._spare: list[Snapshot] = []  # evicted snapshots whose buffers are reused

    def __len__(self) -> int:
        return len(self.ring)

    @property
    def newest(self) -> Optional[Snapshot]:
        return self.ring[-1] if self.ring else None

    def take(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Snapshot:
        skeleton, live = flatten(state)
        while len(self.ring) >= self.keep:  # evict first, so that at most `keep` copies ever exist
            self._retire(self.ring.popleft())
        snap = self._spare.pop() if self._spare else Snapshot(step=step)
        snap.step, snap.skeleton, snap.meta = step, skeleton, dict(meta)
        if self.mode == "memory":
            self._copy_into(snap, live)
        else:
            self._write(snap, state)
        self.ring.append(snap)
        return snap

    def _retire(self, snap: Snapshot) -> None:
        if snap.path is not None:
            snap.path.unlink(missing_ok=True)
            snap.path = None
        self._spare.append(snap)

    def _copy_into(self, snap: Snapshot, live: list[Tensor]) -> None:
        same = len(snap.tensors) == len(live) and all(
            (a.shape == b.shape and a.dtype == b.dtype) if is_strided(b) else not is_strided(a)
            for a, b in zip(snap.tensors, live))
        if not same:
            pin = any(t.is_cuda for t in live) and torch.cuda.is_available()
            snap.tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) if is_strided(t)
                            else t for t in live]  # sparse tensors are copied below, in their own layout
        non_blocking = any(t.is_cuda for t in live)
        for i, (dst, src) in enumerate(zip(snap.tensors, live)):
            if is_strided(src):
                dst.copy_(src, non_blocking=non_blocking)
            else:  # a sparse buffer: a fresh copy (its number of stored elements may change)
                snap.tensors[i] = copy_to_cpu(src)
        if non_blocking:
            torch.cuda.synchronize()
        snap.nbytes = sum(nbytes(t) for t in snap.tensors)

    def _write(self, snap: Snapshot, state: dict[str, Any]) -> None:
        assert self.directory is not None, "disk snapshots need a directory"
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"snapshot-step{snap.step}.pt"
        tmp = path.with_suffix(".pt.tmp")
        torch.save(state, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        snap.path = path
        snap.nbytes = path.stat().st_size

    def load(self, snap: Snapshot) -> dict[str, Any]:
        """The snapshot's state as fresh tensors (never aliasing the snapshot)."""
        if self.mode == "disk":
            assert snap.path is not None
            return torch.load(snap.path, map_location="cpu", weights_only=False)
        return unflatten(snap.skeleton, snap.tensors, clone=True)

    def drop_newest(self) -> None:
        """Forget the newest snapshot (it did not lead to recovery); keeps at least one."""
        if len(self.ring) > 1:
            self._retire(self.ring.pop())
