"""Recovery mechanics: learning-rate cuts that schedulers keep, buffer undo, known-good snapshots.

Each piece is independent of Lightning: it takes modules, optimizers, schedulers and a grad scaler.
"""

from __future__ import annotations

import copy
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

__all__ = ["scale_lr", "current_lrs", "BufferUndo", "SnapshotStore", "Snapshot", "reset_grads"]

# param-group keys that hold absolute learning rates (OneCycleLR, CyclicLR and the chainable schedulers)
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lr")
# scheduler attributes that hold absolute learning rates, per-group lists or scalars
_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min", "end_lr")


def _scaled(value: Any, factor: float) -> Any:
    if isinstance(value, Tensor):
        return value.mul_(factor) if value.is_floating_point() else value
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * factor
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    return value


def _iter_schedulers(scheduler: Any) -> Iterable[Any]:
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or []:  # SequentialLR, ChainedScheduler
        yield from _iter_schedulers(inner)


def scale_lr(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], factor: float) -> None:
    """Multiply every learning rate by ``factor`` so that no torch LR scheduler undoes it.

    Scaling only ``param_groups[i]["lr"]`` is overwritten by schedulers that recompute the LR from stored
    absolutes (OneCycleLR from ``max_lr``/``initial_lr``/``min_lr``, LambdaLR from ``base_lrs``, cosine from
    ``base_lrs`` and ``eta_min``). All of them are affine in those absolutes, so scaling every one of them
    scales the whole future schedule.
    """
    for opt in optimizers:
        for group in opt.param_groups:
            for key in _GROUP_LR_KEYS:
                if key in group:
                    group[key] = _scaled(group[key], factor)
    seen: set[int] = set()
    for top in schedulers:
        for sched in _iter_schedulers(top):
            if id(sched) in seen:
                continue
            seen.add(id(sched))
            for attr in _SCHED_LR_ATTRS:
                if hasattr(sched, attr):
                    setattr(sched, attr, _scaled(getattr(sched, attr), factor))


def current_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> list[float]:
    return [float(g["lr"]) for opt in optimizers for g in opt.param_groups]


def reset_grads(params: Iterable[Tensor]) -> None:
    """Skip the coming optimizer step for ``params``: torch optimizers skip params whose grad is None,
    leaving the parameter and its optimizer state (moments, step count) untouched. Zeroing would not:
    weight decay and momentum would still move the weights."""
    for p in params:
        p.grad = None


class BufferUndo:
    """Undo what one forward pass wrote into module buffers (BatchNorm running statistics).

    ``arm()`` before the forward copies the buffers that forward passes write into preallocated device
    memory; ``undo()`` copies them back. Which buffers are written: those of normalisation layers that
    track running statistics (their kernels update in place without bumping the version counter), plus
    any buffer whose version counter was seen to move during a forward. Constant buffers (masks,
    positional tables) are never copied.
    """

    def __init__(self, module: nn.Module) -> None:
        self.named = [(n, b) for n, b in module.named_buffers() if b is not None]
        self._mutable: set[str] = set()
        for prefix, sub in module.named_modules():
            if getattr(sub, "track_running_stats", False):
                self._mutable.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_buffers(recurse=False))
        self._backup: dict[str, Tensor] = {}
        self._versions: dict[str, int] = {}

    def arm(self) -> None:
        self._learn()
        src, dst = [], []
        for n, b in self.named:
            self._versions[n] = b._version
            if n in self._mutable:
                if n not in self._backup or self._backup[n].shape != b.shape:
                    self._backup[n] = torch.empty_like(b)
                src.append(b.detach())
                dst.append(self._backup[n])
        if src:
            torch._foreach_copy_(dst, src)

    def _learn(self) -> None:
        for n, b in self.named:
            if n in self._versions and b._version != self._versions[n]:
                self._mutable.add(n)

    def undo(self) -> list[str]:
        """Restore the buffers backed up by ``arm()``; returns their names."""
        restored = []
        with torch.no_grad():
            for n, b in self.named:
                if n in self._backup:
                    b.copy_(self._backup[n])
                    restored.append(n)
        self._learn()  # a buffer written for the first time is backed up from the next arm() on
        for n, b in self.named:
            self._versions[n] = b._version
        return restored

    def disarm(self) -> None:
        """After a healthy step: learn which buffers the forward pass changed."""
        self._learn()


# --------------------------------------------------------------------------------------------- snapshots


class _Leaf:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _flatten(obj: Any, out: list[Tensor]) -> Any:
    if isinstance(obj, Tensor):
        out.append(obj.detach())
        return _Leaf(len(out) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, out) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, out) for v in obj)
    return copy.deepcopy(obj)


def _unflatten(skel: Any, tensors: Sequence[Tensor], clone: bool) -> Any:
    if isinstance(skel, _Leaf):
        t = tensors[skel.i]
        return t.clone() if clone else t
    if isinstance(skel, dict):
        return {k: _unflatten(v, tensors, clone) for k, v in skel.items()}
    if isinstance(skel, list):
        return [_unflatten(v, tensors, clone) for v in skel]
    if isinstance(skel, tuple):
        return tuple(_unflatten(v, tensors, clone) for v in skel)
    return copy.deepcopy(skel)


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
    state); restoring clones again, so neither the live objects nor the snapshot alias each other.
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
        live: list[Tensor] = []
        skeleton = _flatten(state, live)
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
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(snap.tensors, live))
        if not same:
            pin = any(t.is_cuda for t in live) and torch.cuda.is_available()
            snap.tensors = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in live]
            snap.nbytes = sum(t.numel() * t.element_size() for t in snap.tensors)
        non_blocking = any(t.is_cuda for t in live)
        for dst, src in zip(snap.tensors, live):
            dst.copy_(src, non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()

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
        return _unflatten(snap.skeleton, snap.tensors, clone=True)

    def drop_newest(self) -> None:
        """Forget the newest snapshot (it did not lead to recovery); keeps at least one."""
        if len(self.ring) > 1:
            self._retire(self.ring.pop())

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [s.step for s in self.ring]}
