"""Known-good training state: what a snapshot holds, and the stores that keep a ring of them.

:func:`training_state` says what a snapshot takes from a fit (the module, every optimizer, every LR scheduler
and the GradScaler); :func:`load_training_state` puts it back. A :class:`SnapshotStore` keeps the newest
``keep`` of them and owns both directions: :meth:`~SnapshotStore.capture` takes the state of a fit,
:meth:`~SnapshotStore.restore` loads one back into it. Where the tensors live is the implementation's:

- :class:`MemoryStore`: preallocated CPU memory (``copy_``, no allocation in steady state);
- :class:`DiskStore`: one atomically written file per snapshot (``torch.save``, ``fsync``, rename).

A new store (e.g. one that shards the state of a replicated strategy across ranks) implements ``_keep``,
``load`` and ``_forget``.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from ..detect.amp import grad_scaler
from ..layouts import copy_to_cpu, is_strided, load_module_state, nbytes
from ..tree import flatten, unflatten

__all__ = ["Snapshot", "SnapshotStore", "MemoryStore", "DiskStore", "make_store", "training_state",
           "load_training_state", "restorable_scaler_state"]


def training_state(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The live state a snapshot keeps: module, optimizers, LR schedulers and grad scaler (tensors not copied)."""
    scaler = grad_scaler(trainer)
    return {
        "module": pl_module.state_dict(),
        "optimizers": [o.state_dict() for o in trainer.optimizers],
        "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "scaler": scaler.state_dict() if scaler is not None else None,
    }


def restorable_scaler_state(snapshot: dict[str, Any], current_scale: float, overflows: int) -> dict[str, Any]:
    """The scaler state a rollback restores: the snapshot's, except while the scaler is overflowing.

    A rollback during a streak of overflows must not raise the scale back to the snapshot's value (that
    scale is what overflows): the scale is capped at the current one. After any other incident (a NaN
    loss, bad inputs) the snapshot's scale is restored as it was.
    """
    state = dict(snapshot)
    if overflows > 0 and "scale" in state:
        state["scale"] = min(float(state["scale"]), float(current_scale))
    return state


def load_training_state(trainer: Any, pl_module: Any, state: dict[str, Any], scaler_overflows: int = 0) -> None:
    """Put :func:`training_state` ``state`` (fresh tensors, see :meth:`SnapshotStore.load`) back into the fit."""
    load_module_state(pl_module, state["module"])
    for opt, opt_state in zip(trainer.optimizers, state["optimizers"]):
        opt.load_state_dict(opt_state)
    for sched_cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        sched_cfg.scheduler.load_state_dict(sched_state)
    scaler = grad_scaler(trainer)
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(restorable_scaler_state(state["scaler"], scaler.get_scale(), scaler_overflows))


@dataclass
class Snapshot:
    """Known-good training state at ``step``: where its tensors are (the store's business) and the guard's meta
    (the LR scale of its time, the running statistics that belong to it)."""

    step: int
    skeleton: Any = None
    tensors: list[Tensor] = field(default_factory=list)
    path: Optional[Path] = None
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0


class SnapshotStore:
    """A ring of the newest ``keep`` known-good states of a fit (module docstring)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.ring: deque[Snapshot] = deque()
        self._spare: list[Snapshot] = []  # evicted snapshots, reused by the next capture

    def __len__(self) -> int:
        return len(self.ring)

    @property
    def newest(self) -> Optional[Snapshot]:
        return self.ring[-1] if self.ring else None

    def newest_before(self, step: int) -> Optional[Snapshot]:
        """The newest snapshot taken at or before ``step``, or None."""
        return next((snap for snap in reversed(self.ring) if snap.step <= step), None)

    def capture(self, trainer: Any, pl_module: Any, step: int, meta: dict[str, Any]) -> Snapshot:
        """Keep the fit's state now (:func:`training_state`) as the newest snapshot, evicting the oldest."""
        return self.take(step, training_state(trainer, pl_module), meta)

    def take(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Snapshot:
        """Keep ``state`` (live tensors, copied here) as the newest snapshot, evicting the oldest."""
        while len(self.ring) >= self.keep:  # evict first, so that at most `keep` copies ever exist
            old = self.ring.popleft()
            self._forget(old)
            self._spare.append(old)
        snap = self._spare.pop() if self._spare else Snapshot(step=step)
        snap.step, snap.meta = step, dict(meta)
        self._keep(snap, state)
        self.ring.append(snap)
        return snap

    def restore(self, snap: Snapshot, trainer: Any, pl_module: Any, scaler_overflows: int = 0) -> None:
        """Load ``snap`` back into the fit (module, optimizers, schedulers, scaler: :func:`load_training_state`)."""
        load_training_state(trainer, pl_module, self.load(snap), scaler_overflows)

    def drop_newest(self) -> None:
        """Forget the newest snapshot (it did not lead to recovery); keeps at least one."""
        if len(self.ring) > 1:
            snap = self.ring.pop()
            self._forget(snap)
            self._spare.append(snap)

    # ------------------------------------------------------------------------- what an implementation does

    def _keep(self, snap: Snapshot, state: dict[str, Any]) -> None:
        """Copy ``state`` into ``snap`` (set ``snap.nbytes``)."""
        raise NotImplementedError

    def load(self, snap: Snapshot) -> dict[str, Any]:
        """The snapshot's state as fresh tensors (never aliasing the snapshot)."""
        raise NotImplementedError

    def _forget(self, snap: Snapshot) -> None:
        """``snap`` leaves the ring (its buffers may be reused by the next :meth:`_keep`)."""


class MemoryStore(SnapshotStore):
    """Snapshots in preallocated CPU memory.

    Taking a snapshot copies into buffers allocated on first use (``copy_``, no allocation in steady
    state); restoring clones again, so neither the live objects nor the snapshot alias each other. Sparse
    tensors (a graph's adjacency buffer) are copied in their own layout.
    """

    mode = "memory"

    def _keep(self, snap: Snapshot, state: dict[str, Any]) -> None:
        snap.skeleton, live = flatten(state)
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

    def load(self, snap: Snapshot) -> dict[str, Any]:
        return unflatten(snap.skeleton, snap.tensors, clone=True)


class DiskStore(SnapshotStore):
    """Snapshots as files in ``directory``: written to a temporary name, fsynced, then renamed."""

    mode = "disk"

    def __init__(self, keep: int = 2, directory: Optional[Path] = None) -> None:
        super().__init__(keep)
        if directory is None:
            raise ValueError("disk snapshots need a directory")
        self.directory = Path(directory)

    def _keep(self, snap: Snapshot, state: dict[str, Any]) -> None:
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
        assert snap.path is not None
        return torch.load(snap.path, map_location="cpu", weights_only=False)

    def _forget(self, snap: Snapshot) -> None:
        if snap.path is not None:
            snap.path.unlink(missing_ok=True)
            snap.path = None


def make_store(mode: str, keep: int, directory: Optional[Path] = None) -> SnapshotStore:
    """The store for ``recovery.snapshot`` (``memory`` or ``disk``)."""
    if mode == "memory":
        return MemoryStore(keep)
    if mode == "disk":
        return DiskStore(keep, directory)
    raise ValueError(f"snapshot mode must be 'memory' or 'disk', got {mode!r}")
