"""Known-good training state: what a snapshot holds, and the stores that keep a ring of them.

:func:`training_state` says what a snapshot takes from a fit (the module, every optimizer, every LR scheduler
and the GradScaler); :func:`load_training_state` puts it back. A :class:`SnapshotStore` keeps the newest
``keep`` of them and owns both directions: :meth:`~SnapshotStore.capture` takes the state of a fit,
:meth:`~SnapshotStore.restore` loads one back into it. Where the tensors live is the implementation's:

- :class:`MemoryStore`: preallocated CPU memory (``copy_``, no allocation in steady state; from CUDA, pinned
  memory filled on a side stream that the host never waits for on a healthy step: :mod:`.device_copy`);
- :class:`DiskStore`: one atomically written file per snapshot (``torch.save``, ``fsync``, rename), written by a
  background thread (:mod:`.writer`) from a host copy taken on the step like the memory store's; when the disk
  cannot hold a snapshot, the newest such one stays in host memory (still a rollback target);
- :class:`~.sharded.ShardedStore`: under a replicated strategy (DDP), each rank keeps only its share of every
  snapshot, in a memory or disk store, and a rollback puts every rank's share back into the live tensors in place.

A new store implements ``_keep``, ``load`` and ``_forget`` (and ``view``, to be read without a copy).
"""

from __future__ import annotations

import os
import re
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor

from ..detect.amp import grad_scaler
from ..dtensors import is_dtensor, like, local
from ..errors import SnapshotWriteWarning
from ..layouts import copy_to_cpu, is_strided, load_module_state, nbytes
from ..tree import flatten, slot, unflatten
from .device_copy import DeviceCopy
from .writer import SnapshotWriter, Write, why_not_written, write_atomic

__all__ = ["Snapshot", "SnapshotStore", "MemoryStore", "DiskStore", "make_store", "training_state", "as_live",
           "load_training_state", "restorable_scaler_state", "written_by_forward", "Norms"]


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


def as_live(state: Any, live: Any) -> Any:
    """``state`` (a snapshot's local shards) with each tensor whose counterpart in ``live`` (the same structure) is a
    DTensor made one like it (:func:`~..dtensors.like`: no communication), so that loading it writes each rank's
    shard in place; ``state`` itself where ``live`` holds no DTensor or another structure."""
    skeleton, saved = flatten(state)
    _, current = flatten(live)
    if len(saved) != len(current) or not any(is_dtensor(t) for t in current):
        return state
    return unflatten(skeleton, [like(s, t) for s, t in zip(saved, current)])


def load_training_state(trainer: Any, pl_module: Any, state: dict[str, Any], scaler_overflows: int = 0) -> None:
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
    scaler = grad_scaler(trainer)
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(restorable_scaler_state(state["scaler"], scaler.get_scale(), scaler_overflows))


Norms = Callable[[Iterable[Tensor]], list[float]]  # tensors -> their 2-norms (the diagnosis' own function)


@dataclass
class Snapshot:
    """Known-good training state at ``step``: where its tensors are (the store's business) and the guard's meta
    (the LR scale of its time, the running statistics that belong to it)."""

    step: int
    skeleton: Any = None
    tensors: list[Tensor] = field(default_factory=list)
    path: Optional[Path] = None
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0  # the bytes this process holds for it (its share under a ShardedStore)
    total_nbytes: int = 0  # the bytes of the whole state
    write: Optional[Write] = None  # its file, while a DiskStore's writer thread may still be writing it
    failed: Optional[str] = None  # why it could not be kept (a failed write): never a rollback target
    share: Optional["Snapshot"] = None  # ShardedStore: this rank's share, kept by the inner store
    norms: Optional[dict[str, float]] = None  # 2-norms of the module's floating tensors, once computed
    plan: Any = None  # ShardedStore: which rank keeps which tensor
    in_memory: bool = False  # DiskStore: the disk could not hold it; its tensors are kept in host memory instead


def written_by_forward(skeleton: Any, names: Optional[Iterable[str]]) -> Optional[set[int]]:
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
        collective: reading a snapshot is a collective (:class:`~.sharded.ShardedStore`): every rank must make
            the same reads (``load``, ``restore``, ``settle``, ``prepare_norms``) in the same order.
    """

    mode = ""
    collective = False

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.ring: deque[Snapshot] = deque()
        self._spare: list[Snapshot] = []  # evicted snapshots, reused by the next capture
        self.failures: list[dict[str, Any]] = []
        self._warned = False  # a failed write is warned once per fit (the count comes at its end)
        self._waits = 0
        self._copier: Optional[DeviceCopy] = None  # device-to-host copies on a side stream (CUDA only)

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

    def capture(self, trainer: Any, pl_module: Any, step: int, meta: dict[str, Any]) -> Snapshot:
        """Keep the fit's state now (:func:`training_state`) as the newest snapshot, evicting the oldest."""
        buffers = [name for name, _ in pl_module.named_buffers()]
        return self.take(step, training_state(trainer, pl_module), meta, buffers=buffers)

    def take(self, step: int, state: dict[str, Any], meta: dict[str, Any],
             buffers: Optional[Iterable[str]] = None) -> Snapshot:
        """Keep ``state`` (live tensors, copied here) as the newest snapshot, evicting the oldest. ``buffers``: the
        names of ``state["module"]``'s entries that code other than an optimizer step writes (copied first from a
        device, and waited for on the device at once; see :mod:`.device_copy`); None: not known (all of them)."""
        self.poll()
        skeleton, live = flatten(state)
        live = [local(t) for t in live]  # sharded: this rank's own shards (1/N of the state, no second sharding)
        first = written_by_forward(skeleton, buffers)
        while len(self.ring) >= self.keep:  # evict first, so that at most `keep` copies ever exist
            old = self.ring.popleft()
            self._forget(old)
            self._spare.append(old)
        snap = self._spare.pop() if self._spare else Snapshot(step=step)
        snap.step, snap.meta, snap.failed, snap.norms = step, dict(meta), None, None
        self._keep(snap, skeleton, live, first)
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

    def load_module(self, snap: Snapshot) -> dict[str, Any]:
        """The module state dict of ``snap`` (fresh tensors)."""
        return self.load(snap)["module"]

    def prepare_norms(self, norms: Norms) -> None:
        """Drop the snapshots that could not be kept (:meth:`settle`), and make :meth:`module_norms` answerable for
        every other snapshot of the ring (a collective under a :class:`~.sharded.ShardedStore`; here the norms are
        computed when asked)."""
        self.settle()

    def module_norms(self, snap: Snapshot, norms: Norms) -> Optional[dict[str, float]]:
        """2-norms of the floating module tensors of ``snap`` by name (computed once per snapshot with
        ``norms``), or None where they cannot be had without a collective."""
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
        """Wait for every copy and write in flight, and report the ones that failed."""
        if self._copier is not None:
            self._copier.wait()
        for snap in list(self.ring):
            self._check(snap, wait=True)

    def _check(self, snap: Snapshot, wait: bool) -> None:
        """Is ``snap``'s write done (waited for with ``wait``)? Then report it if it failed (a store that writes)."""

    def settle(self) -> None:
        """Before a snapshot is chosen as a rollback target: :meth:`flush`, then drop the snapshots that could not
        be kept from the ring (collective under a :class:`~.sharded.ShardedStore`)."""
        self.flush()
        self._drop_failed()

    def close(self) -> None:
        """End of fit (or an exception): :meth:`flush`, and end the writer thread."""
        self.flush()

    def before_optimizer_step(self) -> None:
        """An optimizer step is about to write the weights and its state: it waits, on the device, for the copies
        (CUDA)."""
        if self._copier is not None:
            self._copier.before_optimizer_step()

    def _drop_failed(self) -> None:
        for snap in [s for s in self.ring if s.failed]:
            self.ring.remove(snap)
            self._forget(snap)
            self._spare.append(snap)

    def _report(self, snap: Snapshot, path: Optional[Path], error: str, in_memory: bool = False) -> None:
        """``snap`` could not be written: a rollback target only ``in_memory``; the first one of a fit is warned."""
        if not in_memory:
            snap.failed = error
        self.failures.append({"step": snap.step, "path": None if path is None else str(path), "error": error,
                              "in_memory": in_memory})
        if self._warned:
            return
        self._warned = True
        what = ("it is kept in host memory instead, as a rollback target (only the newest snapshot the disk refused "
                "is kept so)" if in_memory else "no file was left, and it is no rollback target")
        warnings.warn(f"[nanguard] snapshot at step {snap.step} not written: {error} ({path}); {what}. Training goes "
                      "on, later snapshots try the disk again; the count is said at the end of fit "
                      "(guard.snapshots.failures). Said once per fit.", SnapshotWriteWarning, stacklevel=3)

    def failure_summary(self) -> Optional[str]:
        """One line on the snapshots not written this fit (None: none)."""
        if not self.failures:
            return None
        held = any(f["in_memory"] for f in self.failures)
        last = self.failures[-1]
        return (f"[nanguard] {len(self.failures)} snapshot(s) not written this fit (the last at step {last['step']}: "
                f"{last['error']}){'; the newest of them is kept in host memory instead' if held else ''}")

    def _host_copy(self, buffers: list[Tensor], live: list[Tensor],
                   first: Optional[set[int]]) -> tuple[list[Tensor], Optional[Any]]:
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
            self._copier = DeviceCopy()
        return buffers, self._copier.start(early, late)

    # ------------------------------------------------------------------------- what an implementation does

    def _keep(self, snap: Snapshot, skeleton: Any, live: list[Tensor], first: Optional[set[int]]) -> None:
        """Copy the tensors ``live`` of a state flattened into ``skeleton`` (:func:`~..tree.flatten`) into ``snap``
        (set ``snap.nbytes`` and ``snap.total_nbytes``); ``first``: see :meth:`_host_copy`."""
        raise NotImplementedError

    def load(self, snap: Snapshot) -> Any:
        """The snapshot's state as fresh tensors (never aliasing the snapshot)."""
        raise NotImplementedError

    def view(self, snap: Snapshot) -> list[Tensor]:
        """The snapshot's tensors in :func:`~..tree.flatten` order, to be read at once and not kept: they may be the
        store's own buffers (no copy), which the next :meth:`take` overwrites."""
        return flatten(self.load(snap))[1]

    def _forget(self, snap: Snapshot) -> None:
        """``snap`` leaves the ring (its buffers may be reused by the next :meth:`_keep`)."""


class MemoryStore(SnapshotStore):
    """Snapshots in preallocated CPU memory.

    Taking a snapshot copies into buffers allocated on first use (``copy_``, no allocation in steady state);
    restoring clones again, so neither the live objects nor the snapshot alias each other. Sparse tensors (a
    graph's adjacency buffer) are copied in their own layout. From CUDA the buffers are pinned and filled on a
    side stream (:mod:`.device_copy`); a read waits for the copies.
    """

    mode = "memory"

    def _keep(self, snap: Snapshot, skeleton: Any, live: list[Tensor], first: Optional[set[int]]) -> None:
        snap.skeleton = skeleton
        snap.tensors, _ = self._host_copy(snap.tensors, live, first)
        snap.nbytes = snap.total_nbytes = sum(nbytes(t) for t in snap.tensors)

    def load(self, snap: Snapshot) -> Any:
        if self._copier is not None:
            self._copier.wait()
        return unflatten(snap.skeleton, snap.tensors, clone=True)

    def view(self, snap: Snapshot) -> list[Tensor]:
        if self._copier is not None:
            self._copier.wait()
        return list(snap.tensors)


_SNAPSHOT_FILE = re.compile(r"snapshot-step\d+\.pt(\.tmp)?")


class _Staging:
    """Host buffers that one write at a time reads from."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.write: Optional[Write] = None
        self.snap: Optional[Snapshot] = None  # the snapshot being written from them


class DiskStore(SnapshotStore):
    """Snapshots as files in ``directory``: written to a temporary name, fsynced, then renamed.

    The step copies the state into preallocated host buffers (as :class:`MemoryStore` does) and hands them to a
    writer thread (:class:`~.writer.SnapshotWriter`), which saves, fsyncs and renames the file while training
    goes on. ``depth`` sets of buffers bound the writes in flight: a snapshot due while they are all being
    written waits for the oldest. Reading a snapshot whose write is in flight waits for it (:attr:`waits`); a
    failed write leaves no file, is reported (:class:`~..errors.SnapshotWriteWarning`, :attr:`failures`) and is
    never a rollback target. ``background=False`` writes on the step, from the live tensors (the behaviour before
    the writer thread).
    """

    mode = "disk"

    def __init__(self, keep: int = 2, directory: Optional[Path] = None, background: bool = True,
                 depth: int = 1) -> None:
        super().__init__(keep)
        if directory is None:
            raise ValueError("disk snapshots need a directory")
        self.directory = Path(directory)
        self.writer: Optional[SnapshotWriter] = SnapshotWriter() if background else None
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

    def _keep(self, snap: Snapshot, skeleton: Any, live: list[Tensor], first: Optional[set[int]]) -> None:
        snap.path = path = self.directory / f"snapshot-step{snap.step}.pt"
        snap.write, snap.in_memory, snap.skeleton, snap.tensors = None, False, skeleton, []
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.writer is None:
                write_atomic(unflatten(skeleton, live), path)
                snap.nbytes = snap.total_nbytes = path.stat().st_size
                return
        except OSError as exc:  # the folder cannot be made (a file in its way), or the disk is full: keep it in memory
            tensors, _ = self._host_copy([], live, first)
            snap.nbytes = snap.total_nbytes = sum(nbytes(t) for t in tensors)
            self._hold(snap, tensors, why_not_written(exc))
            return
        except Exception as exc:  # noqa: BLE001  (written on the step: state that cannot be pickled; no target)
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
        snap.write = staging.write = self.writer.submit(path, lambda: unflatten(skeleton, tensors), before)
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

    def _readable(self, snap: Snapshot) -> bool:
        """Wait for ``snap``'s write; whether it is held in host memory (a write the disk refused) rather than in
        its file. Raises if it was not kept at all."""
        self._check(snap, wait=True)
        if snap.failed:
            raise RuntimeError(f"the snapshot of step {snap.step} was not written ({snap.failed})")
        if snap.in_memory and self._copier is not None:
            self._copier.wait()
        return snap.in_memory

    def load(self, snap: Snapshot) -> Any:
        if self._readable(snap):
            return unflatten(snap.skeleton, snap.tensors, clone=True)
        assert snap.path is not None
        return torch.load(snap.path, map_location="cpu", weights_only=False)

    def view(self, snap: Snapshot) -> list[Tensor]:
        """The file's tensors mapped from the disk (``mmap``: read as they are used, not copied into memory first);
        the host copy of one the disk refused."""
        if self._readable(snap):
            return list(snap.tensors)
        assert snap.path is not None
        try:
            return flatten(torch.load(snap.path, map_location="cpu", weights_only=False, mmap=True))[1]
        except RuntimeError:  # not a zip file (an older format): read whole
            return SnapshotStore.view(self, snap)

    def _forget(self, snap: Snapshot) -> None:
        # its write is done by now in practice (the oldest snapshot; the staging buffers wait for it anyway)
        self._check(snap, wait=True)
        if snap.path is not None and not snap.failed and not snap.in_memory:  # a failed write left no file of ours
            if self.writer is not None:
                self.writer.remove(snap.path)  # freeing a large file's blocks: on the writer thread
            else:
                snap.path.unlink(missing_ok=True)
        if snap in self._held:
            self._held.remove(snap)
        snap.path, snap.tensors, snap.in_memory = None, [], False

    def _check(self, snap: Snapshot, wait: bool) -> None:
        """Done with ``snap``'s write (waiting for it with ``wait``)? Then report a failure and forget it: a disk
        that refused it leaves it in host memory (:meth:`_hold`), any other failure leaves no rollback target."""
        write = snap.write
        if write is None:
            return
        if wait and write.wait():
            self._waits += 1
        if write.done:
            snap.write = None
            if write.error is not None and not snap.failed:
                if write.disk_error:
                    self._hold(snap, snap.tensors, write.error)
                    return
                self._report(snap, write.path, write.error)
            snap.tensors = []  # written (or failed otherwise): the staging buffers are the staging's again

    def flush(self) -> None:
        super().flush()
        if self.writer is not None:
            self.writer.drain()  # the deletions of evicted files too

    def close(self) -> None:
        self.flush()
        if self.writer is not None:
            self.writer.close()


def make_store(mode: str, keep: int, directory: Optional[Path] = None) -> SnapshotStore:
    """The store for ``recovery.snapshot`` (``memory`` or ``disk``). (A replicated strategy's ranks each keep their
    share of it: :class:`~.sharded.ShardedStore` wraps it.)"""
    if mode == "memory":
        return MemoryStore(keep)
    if mode == "disk":
        return DiskStore(keep, directory)
    raise ValueError(f"snapshot mode must be 'memory' or 'disk', got {mode!r}")
