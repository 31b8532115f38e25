"""Known-good training state: what a snapshot holds, and the stores that keep a ring of them.

:func:`training_state` says what a snapshot takes from a fit (the module, every optimizer, every LR scheduler
and the GradScaler); :func:`load_training_state` puts it back. A :class:`SnapshotStore` keeps the newest
``keep`` of them and owns both directions: :meth:`~SnapshotStore.capture` takes the state of a fit,
:meth:`~SnapshotStore.restore` loads one back into it. Where the tensors live is the implementation's:

- :class:`MemoryStore`: preallocated CPU memory (``copy_``, no allocation in steady state; from CUDA, pinned
  memory filled on a side stream that the host never waits for on a healthy step: :mod:`.device_copy`);
- :class:`DiskStore`: one atomically written file per snapshot (``torch.save``, ``fsync``, rename), written by a
  background thread (:mod:`.writer`) from a host copy taken on the step like the memory store's; when the disk
  cannot hold a snapshot, the newest such one stays in host memory (a rollback target of last resort);
- :class:`~.sharded.ShardedStore`: under a replicated strategy (DDP), each rank keeps only its share of every
  snapshot, in a memory or disk store, and a rollback puts every rank's share back into the live tensors in place.

Every snapshot is sealed when it is kept (:mod:`.verify`: a SHA-256 digest of its tensors, taken on the snapshot
thread, held in the run's memory) and checked against its seal at every read, before a byte of it reaches the
model: a snapshot that fails (missing, truncated, another file, other bytes, refused by torch's restricted loader)
is refused (:meth:`SnapshotStore.refuse`: warned once, never a target again), and a rollback
(:meth:`SnapshotStore.restore_newest`) restores the next older one that verifies.

A new store implements ``_keep``, ``_read`` and ``_forget``.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, TypedDict, TypeVar

import torch
from torch import Tensor

from ..core.dtensors import is_dtensor, like, local
from ..core.layouts import copy_to_cpu, is_strided, load_module_state, nbytes
from ..core.tree import flatten, slot, unflatten
from ..detect.amp import grad_scaler
from ..errors import SnapshotReadWarning, SnapshotWriteWarning
from .device_copy import CudaBackend, DeviceCopy
from .verify import REASONS, Refused, Seal, check, packed, seal, unpack
from .writer import SnapshotWriter, Write, why_not_written, write_atomic

__all__ = ["Snapshot", "SnapshotStore", "MemoryStore", "DiskStore", "make_store", "training_state", "as_live",
           "load_training_state", "restorable_scaler_state", "written_by_forward", "Norms", "Refusal", "Restored",
           "TrainingState", "Failure"]

if TYPE_CHECKING:
    import pytorch_lightning as pl

_T = TypeVar("_T")


class TrainingState(TypedDict):
    """The state of a fit that a snapshot keeps (:func:`training_state`): state dicts, tensors not copied."""

    module: dict[str, object]
    optimizers: list[dict[str, object]]
    schedulers: list[dict[str, object]]
    scaler: Optional[dict[str, object]]


class Failure(TypedDict):
    """A snapshot that could not be written (:attr:`SnapshotStore.failures`)."""

    step: int
    path: Optional[str]
    error: str
    in_memory: bool  # kept in host memory instead: still a rollback target of last resort


def training_state(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> TrainingState:
    """The live state a snapshot keeps: module, optimizers, LR schedulers and grad scaler (tensors not copied).

    A store flattens it (:func:`~..tree.flatten`): the tensors are copied and sealed, the rest (the skeleton: plain
    containers, numbers and strings, plus whatever object a user's ``get_extra_state`` returns) stays in the run's
    memory. A disk snapshot's file holds the tensors and the plain part only (:func:`~.verify.packed`), so that
    torch's restricted loader reads it: nothing in a snapshot file is ever unpickled as code."""
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


def as_live(state: _T, live: object) -> _T:
    """``state`` (a snapshot's local shards) with each tensor whose counterpart in ``live`` (the same structure) is a
    DTensor made one like it (:func:`~..dtensors.like`: no communication), so that loading it writes each rank's
    shard in place; ``state`` itself where ``live`` holds no DTensor or another structure."""
    skeleton, saved = flatten(state)
    _, current = flatten(live)
    if len(saved) != len(current) or not any(is_dtensor(t) for t in current):
        return state
    return unflatten(skeleton, [like(s, t) for s, t in zip(saved, current)])


def load_training_state(trainer: "pl.Trainer", pl_module: "pl.LightningModule", state: TrainingState,
                        scaler_overflows: int = 0) -> None:
    """Put :func:`training_state` ``state`` (fresh tensors, see :meth:`SnapshotStore.load`) back into the fit.
    Under sharding the snapshot holds each rank's local shards: they go back into the live DTensors
    (:func:`as_live`)."""
    if any(is_dtensor(p) for p in pl_module.parameters()):
        state = as_live(state, training_state(trainer, pl_module))
    load_module_state(pl_module, state["module"])
    for opt, opt_state in zip(trainer.optimizers, state["optimizers"]):
        opt.load_state_dict(opt_state)
    for sched_cfg, sched_state in zip(trainer.lr_scheduler_configs, state["schedulers"]):
        sched_cfg.scheduler.load_state_dict(sched_state)
    scaler, saved = grad_scaler(trainer), state.get("scaler")
    if scaler is not None and saved:
        scaler.load_state_dict(restorable_scaler_state(saved, scaler.get_scale(), scaler_overflows))


Norms = Callable[[Iterable[Tensor]], list[float]]  # tensors -> their 2-norms (the diagnosis' own function)


@dataclass(eq=False)
class Snapshot:
    """Known-good training state at ``step``: where its tensors are (the store's business), their seal, and the
    guard's meta (the LR scale of its time, the running statistics that belong to it). Compared by identity."""

    step: int
    skeleton: Any = None  # flatten's: the structure with every tensor's place (:func:`~..tree.flatten`)
    tensors: list[Tensor] = field(default_factory=list)
    path: Optional[Path] = None
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0  # the bytes this process holds for it (its share under a ShardedStore)
    total_nbytes: int = 0  # the bytes of the whole state
    write: Optional[Write] = None  # its seal (and file), while the snapshot thread may still be at work on it
    seal: Optional[Seal] = None  # the digest of its tensors, taken when it was kept (:mod:`.verify`)
    size: Optional[int] = None  # DiskStore: the size its file was written at
    failed: Optional[str] = None  # why it could not be kept (a failed write): never a rollback target
    share: Optional["Snapshot"] = None  # ShardedStore: this rank's share, kept by the inner store
    norms: Optional[dict[str, float]] = None  # 2-norms of the module's floating tensors, once computed
    plan: Any = None  # ShardedStore: which rank keeps which tensor
    in_memory: bool = False  # DiskStore: the disk could not hold it; its tensors are kept in host memory instead


@dataclass(frozen=True)
class Refusal:
    """A snapshot refused when read back: its step, why (``reason``, a key of :data:`~.verify.REASONS`, and what was
    found), its file, and under a sharded store the ranks whose share failed."""

    step: int
    reason: str
    detail: str = ""
    path: Optional[str] = None
    ranks: Optional[tuple[int, ...]] = None

    def to_dict(self) -> dict[str, object]:
        """For an event's ``details.refused``: the same on every rank (the detail and the file are each rank's own,
        in its warning)."""
        out: dict[str, object] = {"step": self.step, "reason": self.reason, "why": REASONS[self.reason]}
        if self.ranks is not None:
            out["ranks"] = list(self.ranks)
        elif self.path is not None:
            out["file"] = self.path
        return out


@dataclass(frozen=True)
class Restored:
    """What a rollback restored: the snapshot (None: nothing verified), and the ones refused on the way."""

    snapshot: Optional[Snapshot] = None
    refused: tuple[Refusal, ...] = ()

    @property
    def step(self) -> Optional[int]:
        return None if self.snapshot is None else self.snapshot.step


def written_by_forward(skeleton: object, names: Optional[Iterable[str]]) -> Optional[set[int]]:
    """The flat indices (:func:`~..tree.flatten`) of the module entries ``names`` (its buffers: what a forward or
    a hook writes, not an optimizer step); None when not known (then every tensor counts as one)."""
    if names is None:
        return None
    module = skeleton.get("module") if isinstance(skeleton, Mapping) else None
    if not isinstance(module, Mapping):
        return set()
    return {i for i in (slot(module.get(n)) for n in names) if i is not None}


class SnapshotStore:
    """A ring of the newest ``keep`` known-good states of a fit (module docstring).

    Attributes:
        failures: ``{"step", "path", "error", "in_memory"}`` of each snapshot that could not be written (warned once
            per fit, the count said at its end); one kept in host memory instead (``in_memory``) is still a rollback
            target until a newer one takes its place, any other never is.
        waits: reads that had to wait for a write still in flight.
        refused: every snapshot refused when read back this fit (:meth:`refuse`), oldest first.
        writer: the snapshot thread (:mod:`.writer`) that seals every snapshot and writes a disk store's files.
        collective: reading a snapshot is a collective (:class:`~.sharded.ShardedStore`): every rank must make
            the same reads (``load``, ``restore``, ``settle``, ``prepare_norms``) in the same order.
    """

    mode = ""
    collective = False

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.ring: deque[Snapshot] = deque()
        self._spare: list[Snapshot] = []  # evicted snapshots, reused by the next capture
        self.failures: list[Failure] = []
        self._warned = False  # a failed write is warned once per fit (the count comes at its end)
        self._waits = 0
        # device-to-host copies on a side stream (CUDA only)
        self._copier: Optional[DeviceCopy[torch.cuda.Stream, torch.cuda.Event]] = None
        self.refused: list[Refusal] = []
        self.writer: Optional[SnapshotWriter] = SnapshotWriter()
        # snapshots kept beside the newest ``keep`` (:meth:`pin`): by role, each in the ring and never evicted by
        # newer ones until unpinned
        self.anchors: dict[str, Snapshot] = {}

    def __getstate__(self) -> dict[str, object]:
        """A copy (``copy.deepcopy``, ``pickle``) holds finished snapshots: the device copies in flight are waited for
        first, and the side stream and its events (CUDA objects, which do not pickle) stay behind; the copy makes its
        own at its first device copy."""
        if self._copier is not None:
            self._copier.wait()
        state = self.__dict__.copy()
        state["_copier"] = None
        return state

    def __len__(self) -> int:
        return len(self.ring)

    @property
    def waits(self) -> int:
        return self._waits

    @property
    def newest(self) -> Optional[Snapshot]:
        return self.ring[-1] if self.ring else None

    def newest_before(self, step: int) -> Optional[Snapshot]:
        """The newest snapshot taken at or before ``step`` that was kept (not failed), or None."""
        return next((snap for snap in reversed(self.ring) if snap.step <= step and not snap.failed), None)

    def targets(self, before: Optional[int] = None) -> list[Snapshot]:
        """The snapshots a rollback may restore, in the order it tries them: the kept ones newest first, then the
        one held in host memory because the disk refused it (a last resort: :class:`DiskStore`); ``before``: only
        those taken at or before that step."""
        kept = [s for s in reversed(self.ring) if not s.failed and (before is None or s.step <= before)]
        return [s for s in kept if not s.in_memory] + [s for s in kept if s.in_memory]

    def capture(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int,
                meta: dict[str, Any]) -> Snapshot:
        """Keep the fit's state now (:func:`training_state`) as the newest snapshot, evicting the oldest.

        Args:
            trainer: the fit's Trainer (optimizers, LR schedulers, grad scaler).
            pl_module: the LightningModule whose state dict is kept.
            step: the step the state is known good at.
            meta: the guard's own state of that time (the LR scale, running statistics), kept beside it.

        Returns:
            The snapshot (its copies may still be under way: :meth:`load` waits for them).
        """
        buffers = [name for name, _ in pl_module.named_buffers()]
        return self.take(step, training_state(trainer, pl_module), meta, buffers=buffers)

    def take(self, step: int, state: Mapping[str, object], meta: dict[str, Any],
             buffers: Optional[Iterable[str]] = None) -> Snapshot:
        """Keep ``state`` (live tensors, copied here) as the newest snapshot, evicting the oldest. ``buffers``: the
        names of ``state["module"]``'s entries that code other than an optimizer step writes (copied first from a
        device, and waited for on the device at once; see :mod:`.device_copy`); None: not known (all of them)."""
        self.poll()
        skeleton, live = flatten(state)
        live = [local(t) for t in live]  # sharded: this rank's own shards (1/N of the state, no second sharding)
        first = written_by_forward(skeleton, buffers)
        self._trim(self.keep - 1)  # evict first, so that at most `keep` copies (and the anchors) ever exist
        snap = self._spare.pop() if self._spare else Snapshot(step=step)
        snap.step, snap.meta, snap.failed, snap.norms, snap.seal = step, dict(meta), None, None, None
        self._keep(snap, skeleton, live, first)
        self.ring.append(snap)
        return snap

    def restore(self, snap: Snapshot, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                scaler_overflows: int = 0) -> None:
        """Load ``snap`` back into the fit (module, optimizers, schedulers, scaler: :func:`load_training_state`), once
        it is verified.

        Args:
            snap: a snapshot of this store.
            trainer, pl_module: the fit it goes back into.
            scaler_overflows: consecutive GradScaler overflows now (the scale is then not raised back).

        Raises:
            Refused: ``snap`` does not verify (nothing is loaded).
        """
        load_training_state(trainer, pl_module, self.load(snap), scaler_overflows)

    def restore_newest(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       scaler_overflows: int = 0) -> Restored:
        """Restore the first of :meth:`targets` that verifies, refusing each one before it that does not (nothing of
        a refused snapshot reaches the fit).

        Args:
            trainer, pl_module, scaler_overflows: as for :meth:`restore`.

        Returns:
            The snapshot restored (None when none verified) and those refused on the way.
        """
        snap, state, refused = self.first_verified(self.targets(), self.load)
        if snap is not None and state is not None:
            load_training_state(trainer, pl_module, state, scaler_overflows)
        return Restored(snap, tuple(refused))

    def newest_module(self) -> tuple[Optional[Snapshot], Optional[dict[str, object]], list[Refusal]]:
        """The module state dict (fresh tensors) of the first of :meth:`targets` that verifies, that snapshot, and
        the ones refused on the way."""
        return self.first_verified(self.targets(), self.load_module)

    def first_verified(self, candidates: Sequence[Snapshot],
                       read: Callable[[Snapshot], _T] ) -> tuple[Optional[Snapshot], Optional[_T], list[Refusal]]:
        """``(snapshot, read(snapshot), refused)`` for the first of ``candidates`` that ``read`` (a verified read)
        does not refuse; every one refused before it is refused for good (:meth:`refuse`)."""
        refused: list[Refusal] = []
        for snap in candidates:
            try:
                return snap, read(snap), refused
            except Refused as exc:
                refused.append(self.refuse(snap, exc))
        return None, None, refused

    def refuse(self, snap: Snapshot, exc: Refused, ranks: Optional[Sequence[int]] = None,
               reason: Optional[str] = None) -> Refusal:
        """``snap`` failed its check (``exc``; under a sharded store on ``ranks``, ``reason`` the one every rank
        records): warned once, recorded in :attr:`refused`, and out of the ring for good (its file, if any, is left
        where it is, to be looked at). A refusal already recorded is returned as it is."""
        if isinstance(exc.recorded, Refusal):
            return exc.recorded
        path = None if snap.path is None else str(snap.path)
        refusal = Refusal(snap.step, reason or exc.reason, exc.detail, path, None if ranks is None else tuple(ranks))
        exc.recorded = refusal
        self.refused.append(refusal)
        if any(s is snap for s in self.ring):
            self._evict(snap, keep_file=True)
        where = f" ({path})" if path else " (host memory)"
        warnings.warn(f"[nanguard] the snapshot of step {snap.step} is refused{where}: {exc}. It is never restored "
                      "(nothing of it reached the model) and is no rollback target again; a rollback falls back to "
                      "the next older snapshot that verifies (guard.snapshots.refused).", SnapshotReadWarning,
                      stacklevel=3)
        return refusal

    def drop_newest(self) -> None:
        """Forget the newest snapshot (it did not lead to recovery); keeps at least one."""
        if len(self.ring) > 1:
            self._evict(self.ring[-1])

    def pin(self, role: str, snap: Optional[Snapshot]) -> None:
        """Keep ``snap`` (one of the ring) beside the newest ``keep`` as the anchor ``role`` (in place of that role's
        earlier anchor, which goes back to being an ordinary member of the ring); None: unpin the role."""
        if snap is not None and not any(s is snap for s in self.ring):
            return
        if snap is None:
            self.anchors.pop(role, None)
        else:
            self.anchors[role] = snap
        self._trim(self.keep)

    def anchor(self, role: str) -> Optional[Snapshot]:
        """The snapshot pinned as ``role``, or None."""
        return self.anchors.get(role)

    def _trim(self, room: int) -> None:
        """Evict the oldest snapshots not pinned until at most ``room`` of them are left."""
        while sum(1 for s in self.ring if not self._pinned(s)) > room:
            self._evict(next(s for s in self.ring if not self._pinned(s)))

    def _pinned(self, snap: Snapshot) -> bool:
        return any(a is snap for a in self.anchors.values())

    def _evict(self, snap: Snapshot, keep_file: bool = False) -> None:
        """``snap`` leaves the ring and every role it was pinned as; its buffers are spare."""
        self.ring.remove(snap)
        self.anchors = {r: a for r, a in self.anchors.items() if a is not snap}
        self._forget(snap, keep_file=keep_file)
        self._spare.append(snap)

    def load(self, snap: Snapshot) -> Any:
        """The snapshot's state as fresh tensors (never aliasing the snapshot), verified against its seal; raises
        :class:`~.verify.Refused` (nothing read) if it does not verify."""
        return unflatten(snap.skeleton, self._read(snap, copy=True))

    def view(self, snap: Snapshot) -> list[Tensor]:
        """The snapshot's tensors in :func:`~..tree.flatten` order, verified (:class:`~.verify.Refused` if not), to be
        read at once and not kept: they may be the store's own buffers (no copy), which the next :meth:`take`
        overwrites."""
        return self._read(snap, copy=False)

    def load_module(self, snap: Snapshot) -> dict[str, object]:
        """The module state dict of ``snap`` (fresh tensors, verified)."""
        return self.load(snap)["module"]

    def prepare_norms(self, norms: Norms) -> None:
        """Drop the snapshots that could not be kept (:meth:`settle`), and make :meth:`module_norms` answerable for
        every other snapshot of the ring (a collective under a :class:`~.sharded.ShardedStore`; here the norms are
        computed when asked)."""
        self.settle()

    def module_norms(self, snap: Snapshot, norms: Norms) -> Optional[dict[str, float]]:
        """2-norms of the floating module tensors of ``snap`` by name (computed once per snapshot with
        ``norms``, from a verified read: :class:`~.verify.Refused` if it does not verify), or None where they cannot
        be had without a collective."""
        if snap.norms is None:
            module = self.load_module(snap)
            named = [(n, t) for n, t in module.items() if isinstance(t, Tensor) and is_strided(t)
                     and t.is_floating_point()]
            snap.norms = dict(zip([n for n, _ in named], norms(t for _, t in named)))
        return snap.norms

    # ------------------------------------------------------------------------------- writes and device copies

    def poll(self) -> None:
        """Report the writes that failed since the last look (a warning; :attr:`failures`), without waiting."""
        for snap in list(self.ring):
            self._check(snap, wait=False)

    def flush(self) -> None:
        """Wait for every copy, seal and write in flight, and report the ones that failed."""
        if self._copier is not None:
            self._copier.wait()
        for snap in list(self.ring):
            self._check(snap, wait=True)
        if self.writer is not None:
            self.writer.drain()  # the deletions of evicted files too

    def _done(self, snap: Snapshot, wait: bool) -> Optional[Write]:
        """``snap``'s work on the snapshot thread once it is done (waited for with ``wait``; counted in :attr:`waits`
        if it had to), its seal taken into ``snap``; None while it runs, or when there was none."""
        write = snap.write
        if write is None:
            return None
        if wait and write.wait():
            self._waits += 1
        if not write.done:
            return None
        snap.write, snap.seal = None, write.seal
        return write

    def _check(self, snap: Snapshot, wait: bool) -> None:
        """Is ``snap``'s seal (and write) done (waited for with ``wait``)? Then take its seal, and report its write if
        it failed (a store that writes)."""
        self._done(snap, wait)

    def _seal_later(self, snap: Snapshot, tensors: list[Tensor], event: Optional[torch.cuda.Event]) -> None:
        """Seal ``tensors`` (``snap``'s host copy; after the device ``event`` of its copies, if any) on the snapshot
        thread; without one, here."""
        copier = self._copier
        before = (lambda: copier.backend.synchronize(event)) if event is not None and copier is not None else None
        if self.writer is None:
            if before is not None:
                before()
            snap.seal = seal(tensors)
            return
        snap.write = self.writer.submit(None, before=before, seal=lambda: seal(tensors))

    def settle(self) -> None:
        """Before a snapshot is chosen as a rollback target: :meth:`flush`, then drop the snapshots that could not
        be kept from the ring (collective under a :class:`~.sharded.ShardedStore`)."""
        self.flush()
        self._drop_failed()

    def close(self) -> None:
        """End of fit (or an exception): :meth:`flush`, and end the snapshot thread."""
        self.flush()
        if self.writer is not None:
            self.writer.close()

    def before_optimizer_step(self) -> None:
        """An optimizer step is about to write the weights and its state: it waits, on the device, for the copies
        (CUDA)."""
        if self._copier is not None:
            self._copier.before_optimizer_step()

    def _drop_failed(self) -> None:
        for snap in [s for s in self.ring if s.failed]:
            self._evict(snap)

    def _report(self, snap: Snapshot, path: Optional[Path], error: str, in_memory: bool = False) -> None:
        """``snap`` could not be written: a rollback target only ``in_memory``; the first one of a fit is warned."""
        if not in_memory:
            snap.failed = error
        self.failures.append({"step": snap.step, "path": None if path is None else str(path), "error": error,
                              "in_memory": in_memory})
        if self._warned:
            return
        self._warned = True
        what = ("it is kept in host memory instead, as a rollback target of last resort (after every snapshot on "
                "disk that verifies; only the newest snapshot the disk refused is kept so)" if in_memory else
                "no file was left, and it is no rollback target")
        warnings.warn(f"[nanguard] snapshot at step {snap.step} not written: {error} ({path}); {what}. Training goes "
                      "on, later snapshots try the disk again; the count is said at the end of fit "
                      "(guard.snapshots.failures). Said once per fit.", SnapshotWriteWarning, stacklevel=3)

    def failure_summary(self) -> Optional[str]:
        """One line on the snapshots not written or refused this fit (None: none)."""
        said = []
        if self.failures:
            held = any(f["in_memory"] for f in self.failures)
            last = self.failures[-1]
            said.append(f"{len(self.failures)} snapshot(s) not written this fit (the last at step {last['step']}: "
                        f"{last['error']}){'; the newest of them is kept in host memory instead' if held else ''}")
        if self.refused:
            said.append(f"{len(self.refused)} snapshot(s) refused when read back (steps "
                        f"{', '.join(str(r.step) for r in self.refused)}: guard.snapshots.refused)")
        return "[nanguard] " + "; ".join(said) if said else None

    def _host_copy(self, buffers: list[Tensor], live: list[Tensor], first: Optional[set[int]]) -> tuple[list[Tensor],
                   Optional[torch.cuda.Event]]:
        """Copy ``live`` into the host ``buffers`` (allocated again only where the shapes changed; pinned for CUDA
        tensors): CPU tensors with ``copy_``, CUDA ones queued on the side stream (the host does not wait), the
        ``first`` indices first. Returns the buffers and the event after the device copies (None: none)."""
        same = len(buffers) == len(live) and all(
            (a.shape == b.shape and a.dtype == b.dtype) if is_strided(b) else not is_strided(a)
            for a, b in zip(buffers, live))
        if not same:
            pin = any(t.is_cuda for t in live) and torch.cuda.is_available()
            buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) if is_strided(t)
                       else t for t in live]  # sparse tensors are copied below, in their own layout
        early: list[tuple[Tensor, Tensor]] = []
        late: list[tuple[Tensor, Tensor]] = []
        for i, (dst, src) in enumerate(zip(buffers, live)):
            if not is_strided(src):  # a sparse buffer: a fresh copy (its number of stored elements may change)
                buffers[i] = copy_to_cpu(src)
            elif src.is_cuda:
                (early if first is None or i in first else late).append((dst, src))
            else:
                dst.copy_(src)
        if not early and not late:
            return buffers, None
        if self._copier is None:
            self._copier = DeviceCopy(CudaBackend())
        return buffers, self._copier.start(early, late)

    def _in_memory(self, snap: Snapshot, copy: bool) -> list[Tensor]:
        """``snap``'s host copy (``snap.tensors``; cloned with ``copy``), verified against its seal (the copy itself,
        so that what is returned is what was checked)."""
        if self._copier is not None:
            self._copier.wait()
        self._check(snap, wait=True)
        tensors = [t.clone() for t in snap.tensors] if copy else list(snap.tensors)
        check(snap.seal, tensors)
        return tensors

    # ------------------------------------------------------------------------- what an implementation does

    def _keep(self, snap: Snapshot, skeleton: object, live: list[Tensor], first: Optional[set[int]]) -> None:
        """Copy the tensors ``live`` of a state flattened into ``skeleton`` (:func:`~..tree.flatten`) into ``snap``
        (set ``snap.nbytes`` and ``snap.total_nbytes``) and have them sealed; ``first``: see :meth:`_host_copy`."""
        raise NotImplementedError

    def _read(self, snap: Snapshot, copy: bool) -> list[Tensor]:
        """The snapshot's tensors in :func:`~..tree.flatten` order, verified against its seal (:class:`~.verify.Refused`
        if they are not those it was kept with); fresh ones with ``copy``, else possibly the store's own."""
        raise NotImplementedError

    def _forget(self, snap: Snapshot, keep_file: bool = False) -> None:
        """``snap`` leaves the ring (its buffers may be reused by the next :meth:`_keep`: its seal is waited for);
        ``keep_file``: a store that writes files leaves its file (a refused snapshot's)."""
        self._check(snap, wait=True)


class MemoryStore(SnapshotStore):
    """Snapshots in preallocated CPU memory.

    Taking a snapshot copies into buffers allocated on first use (``copy_``, no allocation in steady state) and
    hands them to the snapshot thread to be sealed; restoring clones again and checks the clones against the seal
    (host memory flips bits too), so neither the live objects nor the snapshot alias each other. Sparse tensors (a
    graph's adjacency buffer) are copied in their own layout. From CUDA the buffers are pinned and filled on a
    side stream (:mod:`.device_copy`); a read waits for the copies.
    """

    mode = "memory"

    def _keep(self, snap: Snapshot, skeleton: object, live: list[Tensor], first: Optional[set[int]]) -> None:
        snap.skeleton = skeleton
        snap.tensors, event = self._host_copy(snap.tensors, live, first)
        snap.nbytes = snap.total_nbytes = sum(nbytes(t) for t in snap.tensors)
        self._seal_later(snap, list(snap.tensors), event)

    def _read(self, snap: Snapshot, copy: bool) -> list[Tensor]:
        return self._in_memory(snap, copy)


_SNAPSHOT_FILE = re.compile(r"snapshot-step\d+\.pt(\.tmp)?")


class _Staging:
    """Host buffers that one write at a time reads from."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.write: Optional[Write] = None
        self.snap: Optional[Snapshot] = None  # the snapshot being written from them


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _restricted_load(path: Path, written: Optional[int], mmap: bool) -> object:
    """``torch.load`` of a snapshot file with torch's restricted loader (``weights_only=True``: it rebuilds tensors
    and plain data, and refuses anything else without running it), mapped from the disk with ``mmap``; a file it
    cannot read is :class:`~.verify.Refused` with why (:func:`_unreadable`). A file that cannot be mapped (not one
    of torch's zip files) is read once more without mapping, for the restricted loader's own verdict."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own warnings about a file that is not ours
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise Refused("missing", f"no file at {path}") from None
    except Exception as exc:  # noqa: BLE001  (whatever the loader says of a file that is not what was written)
        if mmap and not isinstance(exc, pickle.UnpicklingError):
            return _restricted_load(path, written, mmap=False)
        raise _unreadable(path, written, exc) from None


def _unreadable(path: Path, written: Optional[int], exc: BaseException) -> Refused:
    """Why torch's restricted loader could not read the snapshot file ``path`` (written at ``written`` bytes):
    refused by that loader (a pickle of anything but tensors and plain data: it runs no code), cut short, or
    unreadable otherwise."""
    if isinstance(exc, pickle.UnpicklingError) and "weights only" in str(exc).lower():
        return Refused("restricted", _first_line(exc))
    try:
        size: Optional[int] = os.stat(path).st_size
    except OSError:
        size = None
    if written is not None and size is not None and size < written:
        return Refused("truncated", f"{size} bytes, written as {written}")
    return Refused("unreadable", _first_line(exc))


class DiskStore(SnapshotStore):
    """Snapshots as files in ``directory``: written to a temporary name, fsynced, then renamed.

    The step copies the state into preallocated host buffers (as :class:`MemoryStore` does) and hands them to a
    writer thread (:class:`~.writer.SnapshotWriter`), which seals them, saves, fsyncs and renames the file while
    training goes on. ``depth`` sets of buffers bound the writes in flight: a snapshot due while they are all being
    written waits for the oldest. Reading a snapshot whose write is in flight waits for it (:attr:`waits`); a
    failed write leaves no file, is reported (:class:`~..errors.SnapshotWriteWarning`, :attr:`failures`) and is
    never a rollback target, unless the disk refused it: then it is held in host memory, a target of last resort.
    A file is read with torch's restricted loader (``weights_only=True``), and used only once its header (the format,
    its step) and its tensors' digest are those written. ``background=False`` writes on the step, from
    the live tensors (the behaviour before the writer thread).
    """

    mode = "disk"

    def __init__(self, keep: int = 2, directory: Optional[Path] = None, background: bool = True,
                 depth: int = 1) -> None:
        super().__init__(keep)
        if directory is None:
            raise ValueError("disk snapshots need a directory")
        self.directory = Path(directory)
        if not background:
            self.writer = None
        self._staging = [_Staging() for _ in range(max(1, depth))]
        self._turn = 0
        self._held: list[Snapshot] = []  # the snapshot the disk refused that is kept in host memory (the newest)
        self.stale = self._remove_stale()

    def _remove_stale(self) -> list[str]:
        """Fit start: remove the snapshot files an earlier fit left in :attr:`directory` (a run killed, or ended,
        with its snapshots on disk: they belong to another run's timeline, and would pile up, one set per crash).
        Returns their names."""
        try:
            names = [n for n in os.listdir(self.directory) if _SNAPSHOT_FILE.fullmatch(n)]
        except OSError:  # no folder yet (or not one): nothing of ours there
            return []
        removed = []
        for name in sorted(names):
            try:
                (self.directory / name).unlink()
                removed.append(name)
            except OSError:
                pass
        return removed

    def _keep(self, snap: Snapshot, skeleton: object, live: list[Tensor], first: Optional[set[int]]) -> None:
        snap.path = path = self.directory / f"snapshot-step{snap.step}.pt"
        snap.write, snap.in_memory, snap.skeleton, snap.tensors, snap.size = None, False, skeleton, [], None
        step = snap.step
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.writer is None:
                snap.seal = seal([t.cpu() for t in live])
                snap.size = write_atomic(packed(skeleton, live, step), path)
                snap.nbytes = snap.total_nbytes = snap.size
                return
        except OSError as exc:  # the folder cannot be made (a file in its way), or the disk is full: keep it in memory
            tensors, event = self._host_copy([], live, first)
            snap.nbytes = snap.total_nbytes = sum(nbytes(t) for t in tensors)
            if snap.seal is None:
                self._seal_later(snap, tensors, event)
            self._hold(snap, tensors, why_not_written(exc))
            return
        except Exception as exc:  # noqa: BLE001  (written on the step: state that cannot be saved; no target)
            self._report(snap, path, why_not_written(exc))
            return
        staging = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if staging.write is not None:
            staging.write.wait()  # the bound on writes in flight: these buffers are still being written
            owner = staging.snap
            if owner is not None and owner.write is staging.write:
                self._check(owner, wait=True)  # failed on the disk: it takes these buffers (staging gets fresh ones)
        staging.tensors, event = self._host_copy(staging.tensors, live, first)
        tensors = list(staging.tensors)
        snap.nbytes = snap.total_nbytes = sum(nbytes(t) for t in tensors)
        snap.tensors = tensors  # until its write is done (kept in memory if the disk refuses it)
        copier = self._copier
        before = (lambda: copier.backend.synchronize(event)) if event is not None and copier is not None else None
        snap.write = staging.write = self.writer.submit(
            path, lambda: packed(skeleton, tensors, step), before, seal=lambda: seal(tensors))
        staging.snap = snap

    def _hold(self, snap: Snapshot, tensors: list[Tensor], error: str) -> None:
        """The disk refused ``snap``: keep ``tensors`` (its host copy) in memory as its state, in place of the older
        snapshot held so (no longer a rollback target: at most one snapshot's worth of memory is held)."""
        for old in self._held:
            old.failed, old.tensors, old.in_memory = "replaced in memory by a newer snapshot", [], False
        self._held = [snap]
        snap.tensors, snap.in_memory = tensors, True
        for staging in self._staging:  # these buffers are the snapshot's now
            if staging.tensors and tensors and staging.tensors[0] is tensors[0]:
                staging.tensors, staging.snap = [], None
        self._report(snap, snap.path, error, in_memory=True)

    def _read(self, snap: Snapshot, copy: bool) -> list[Tensor]:
        """Its host copy where the disk refused it; else its file, read with torch's restricted loader (mapped from
        the disk without ``copy``: read as it is used, not copied into memory first), whose header must be its own;
        its tensors checked against its seal either way."""
        self._check(snap, wait=True)
        if snap.failed:
            raise Refused("not_written", snap.failed)
        if snap.in_memory:
            return self._in_memory(snap, copy)
        assert snap.path is not None
        path = snap.path
        tensors = unpack(_restricted_load(path, snap.size, mmap=not copy), snap.step)
        check(snap.seal, tensors)
        return tensors

    def _forget(self, snap: Snapshot, keep_file: bool = False) -> None:
        # its write is done by now in practice (the oldest snapshot; the staging buffers wait for it anyway)
        self._check(snap, wait=True)
        if snap.path is not None and not snap.failed and not snap.in_memory and not keep_file:
            if self.writer is not None:  # (a failed write left no file of ours)
                self.writer.remove(snap.path)  # freeing a large file's blocks: on the writer thread
            else:
                snap.path.unlink(missing_ok=True)
        if snap in self._held:
            self._held.remove(snap)
        snap.path, snap.tensors, snap.in_memory = None, [], False

    def _check(self, snap: Snapshot, wait: bool) -> None:
        """Done with ``snap``'s write (waiting for it with ``wait``)? Then take its seal and size, report a failure
        and forget it: a disk that refused it leaves it in host memory (:meth:`_hold`), any other failure leaves no
        rollback target."""
        write = self._done(snap, wait)
        if write is None:
            return
        snap.size = write.size if write.path is not None else snap.size
        if write.error is not None and not snap.failed:
            if write.path is None:  # a seal alone (of a snapshot held in memory): it has none
                return
            if write.disk_error:
                self._hold(snap, snap.tensors, write.error)
                return
            self._report(snap, write.path, write.error)
        if not snap.in_memory:
            snap.tensors = []  # written (or failed otherwise): the staging buffers are the staging's again


def make_store(mode: str, keep: int, directory: Optional[Path] = None) -> SnapshotStore:
    """The store for ``recovery.snapshot`` (a replicated strategy's ranks each keep their share of it:
    :class:`~.sharded.ShardedStore` wraps it).

    Args:
        mode: ``"memory"`` or ``"disk"``.
        keep: how many snapshots the ring holds.
        directory: where a disk store writes its files.

    Returns:
        A :class:`MemoryStore` or :class:`DiskStore`.

    Raises:
        ValueError: another ``mode``, or a disk store without ``directory``.
    """
    if mode == "memory":
        return MemoryStore(keep)
    if mode == "disk":
        return DiskStore(keep, directory)
    raise ValueError(f"snapshot mode must be 'memory' or 'disk', got {mode!r}")
