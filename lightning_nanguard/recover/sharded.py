"""A replicated strategy's snapshots split across ranks: each rank keeps 1/N of every snapshot.

Under DDP every rank holds the same weights and optimizer state, so N full copies of a snapshot are N - 1 too
many. :class:`ShardPlan` gives every tensor of the flattened state (:func:`~..tree.flatten`) one owner, balanced by
bytes (largest first, to the rank holding least; ties to the lower index and rank). It is computed from the
shapes and dtypes alone, so every rank computes the same plan without a word. The module's buffers go to rank 0,
the rank DDP broadcasts buffers from at every forward: after a rollback every rank holds rank 0's buffers, which is
what the next forward would give them anyway. Tensors that are not strided (a sparse buffer) are kept by every
rank.

:class:`ShardedStore` keeps this rank's share in an inner store (:class:`~.snapshots.MemoryStore`, or
:class:`~.snapshots.DiskStore`: each rank writes only its share, to its own file). Reading a snapshot moves every
owner's tensors to every rank: for each owner, one ``broadcast`` per bucket of its tensors' bytes (:data:`BUCKET_BYTES`
at most: a larger tensor is split across buckets) on the default process group (on the CPU with gloo, through the
device with NCCL). A rollback (:meth:`ShardedStore.restore`) copies each bucket as it arrives straight into the live
tensors (weights, buffers, optimizer state), and each rank's own share from its store without a copy in between, so
the guard's extra host memory stays its share of the snapshots plus one bucket, during a rollback and after it; only
a tensor with no live place of its shape (an optimizer state that does not exist yet) comes as a fresh tensor.
Taking a snapshot issues no collective. Reading one is a collective, on the incident path only: every rank must
read the same snapshots in the same order, as the guard's incident path does (it runs on every rank, in lockstep).

The diagnosis reads an older snapshot's module weights only through their 2-norms (:meth:`ShardedStore.module_norms`):
:meth:`ShardedStore.prepare_norms`, called on every rank before an incident's diagnosis, has each rank compute the
norms of the module tensors it owns and one ``all_reduce`` of a float64 vector shares them, once per snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..dtensors import local
from ..layouts import is_strided, nbytes
from ..tree import flatten, iter_leaves, slot, unflatten
from .snapshots import Norms, Snapshot, SnapshotStore, load_training_state, training_state

__all__ = ["ShardPlan", "ShardedStore", "EVERY_RANK", "BUCKET_BYTES"]

EVERY_RANK = -1  # the owner of a tensor that every rank keeps
BUCKET_BYTES = 16 * 2**20  # the largest broadcast of a rebuild or restore (a larger tensor is split across buckets)


@dataclass(frozen=True)
class ShardPlan:
    """Which rank keeps which tensor of a flattened state.

    Attributes:
        owners: the owning rank of each tensor, or :data:`EVERY_RANK`.
        loads: the bytes each rank keeps (tensors kept by every rank not counted).
    """

    owners: tuple[int, ...]
    loads: tuple[int, ...]

    @classmethod
    def balance(cls, sizes: Sequence[int], world: int, to_first: Collection[int] = (),
                everywhere: Collection[int] = ()) -> "ShardPlan":
        """Owners for tensors of ``sizes`` bytes over ``world`` ranks: ``to_first`` to rank 0, ``everywhere`` to
        every rank, the rest largest first to the rank that holds least so far. Every rank but one then holds
        within one tensor's size of ``total / world``."""
        owners = [EVERY_RANK] * len(sizes)
        loads = [0] * world
        for i in sorted(set(to_first) - set(everywhere)):
            owners[i] = 0
            loads[0] += sizes[i]
        rest = sorted((i for i in range(len(sizes)) if i not in everywhere and i not in to_first),
                      key=lambda i: (-sizes[i], i))
        for i in rest:
            rank = min(range(world), key=lambda r: (loads[r], r))
            owners[i] = rank
            loads[rank] += sizes[i]
        return cls(tuple(owners), tuple(loads))

    def owned(self, rank: int) -> list[int]:
        """The indices ``rank`` keeps (its own and those every rank keeps), in order."""
        return [i for i, owner in enumerate(self.owners) if owner in (rank, EVERY_RANK)]


@dataclass(frozen=True)
class _Layout:
    """A snapshot's tensors as the plan sees them: their shapes and dtypes, and this rank's share."""

    plan: ShardPlan
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    mine: tuple[int, ...]  # the flat indices of this rank's share, in the share's order

    def nbytes(self, i: int) -> int:
        return _numel(self.shapes[i]) * _itemsize(self.dtypes[i])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_of(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class ShardedStore(SnapshotStore):
    """Each of ``world_size`` ranks keeps its share of every snapshot in ``inner`` (module docstring).

    Attributes:
        inner: the store of this rank's shares (memory or disk).
        world_size, rank: the ranks of the default process group, and this one.
    """

    collective = True

    def __init__(self, inner: SnapshotStore, world_size: int, rank: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__(inner.keep)
        self.inner = inner
        self.mode = inner.mode
        self.world_size, self.rank = int(world_size), int(rank)
        self.bucket_bytes = int(bucket_bytes)
        self.failures = inner.failures  # one list: the inner store reports its failed writes there
        self._layout_key: Any = None
        self._layout: Optional[_Layout] = None

    @property
    def waits(self) -> int:
        return self.inner.waits

    # ------------------------------------------------------------------------------------------ keeping

    def _plan(self, live: list[Tensor], first: Optional[set[int]]) -> _Layout:
        key = (tuple((tuple(t.shape), t.dtype, is_strided(t)) for t in live), frozenset(first or ()))
        if key != self._layout_key or self._layout is None:
            sizes = [nbytes(t) for t in live]
            everywhere = {i for i, t in enumerate(live) if not is_strided(t)}
            plan = ShardPlan.balance(sizes, self.world_size, to_first=first or (), everywhere=everywhere)
            self._layout = _Layout(plan, tuple(tuple(t.shape) for t in live), tuple(t.dtype for t in live),
                                   tuple(plan.owned(self.rank)))
            self._layout_key = key
        return self._layout

    def _keep(self, snap: Snapshot, skeleton: Any, live: list[Tensor], first: Optional[set[int]]) -> None:
        layout = self._plan(live, first)
        share = snap.share if snap.share is not None else Snapshot(step=snap.step)
        share.step, share.failed, share.meta = snap.step, None, {}
        share_skeleton, share_live = flatten([live[i] for i in layout.mine])
        share_first = None if first is None else {j for j, i in enumerate(layout.mine) if i in first}
        self.inner._keep(share, share_skeleton, share_live, share_first)
        snap.share, snap.skeleton, snap.plan = share, skeleton, layout
        snap.nbytes = share.nbytes
        snap.total_nbytes = sum(nbytes(t) for t in live)

    def _forget(self, snap: Snapshot) -> None:
        if snap.share is not None:
            self.inner._forget(snap.share)

    # ------------------------------------------------------------------------------------------ reading

    def load(self, snap: Snapshot) -> Any:
        """The whole state of ``snap``, on every rank (a collective: broadcasts from each owner)."""
        layout: _Layout = snap.plan
        tensors = self._rebuild(snap, range(len(layout.shapes)))
        return unflatten(snap.skeleton, tensors)

    def load_module(self, snap: Snapshot) -> dict[str, Any]:
        """The module state dict of ``snap``, on every rank (a collective: only the module's tensors move)."""
        module = snap.skeleton["module"]
        wanted = [i for _, leaf in iter_leaves(module) if (i := slot(leaf)) is not None]
        return unflatten(module, self._rebuild(snap, wanted))

    def restore(self, snap: Snapshot, trainer: Any, pl_module: Any, scaler_overflows: int = 0) -> None:
        """Load ``snap`` back into the fit in place (a collective): every tensor of the snapshot goes, bucket by
        bucket as its owner broadcasts it, straight into the live tensor at its place (:meth:`load_into`), so no
        rank ever holds a whole state beside its own; then the usual loads (:func:`~.snapshots.load_training_state`)
        put the structure back, reading the live tensors themselves (no copy: an optimizer's state keeps them)."""
        state = self.load_into(snap, training_state(trainer, pl_module))
        load_training_state(trainer, pl_module, state, scaler_overflows)

    def load_into(self, snap: Snapshot, live: Any) -> Any:
        """The whole state of ``snap`` on every rank (a collective), written into ``live`` (the state it is loaded
        into, e.g. :func:`~.snapshots.training_state`'s live tensors): each tensor of the snapshot whose place in
        ``live`` holds a tensor of its shape and dtype is copied there and returned as it; the others (an
        optimizer's state that does not exist yet, a sparse buffer) come as fresh tensors. Extra memory: one bucket,
        and the owned tensors of the snapshot's share as its store reads them (none from memory)."""
        layout: _Layout = snap.plan
        places = {path: local(t) for path, t in iter_leaves(live) if isinstance(t, Tensor)}
        targets: list[Optional[Tensor]] = [None] * len(layout.shapes)
        for path, leaf in iter_leaves(snap.skeleton):
            i = slot(leaf)
            if i is None:
                continue
            t = places.get(path)
            if t is not None and is_strided(t) and t.is_contiguous() and layout.plan.owners[i] != EVERY_RANK \
                    and tuple(t.shape) == layout.shapes[i] and t.dtype == layout.dtypes[i]:
                targets[i] = t
        return unflatten(snap.skeleton, self._rebuild(snap, range(len(layout.shapes)), targets))

    def _own(self, snap: Snapshot) -> dict[int, Tensor]:
        """This rank's share of ``snap`` by flat index, as its store reads it (:meth:`~.snapshots.SnapshotStore.view`:
        possibly the store's own buffers, to be copied from at once)."""
        if snap.failed:
            raise RuntimeError(f"the snapshot of step {snap.step} was not kept ({snap.failed})")
        assert snap.share is not None
        layout: _Layout = snap.plan
        return dict(zip(layout.mine, self.inner.view(snap.share)))

    def _rebuild(self, snap: Snapshot, wanted: Sequence[int],
                 targets: Optional[Sequence[Optional[Tensor]]] = None) -> list[Optional[Tensor]]:
        """The tensors ``wanted`` of ``snap`` (flat indices; None elsewhere), on every rank: each owner broadcasts
        its own, packed as bytes into buckets of at most ``bucket_bytes``. A tensor with a ``targets`` entry is
        copied into it (from each bucket as it arrives) and returned as it; the others are fresh CPU tensors."""
        layout: _Layout = snap.plan
        owners = layout.plan.owners
        own = self._own(snap)
        out: list[Optional[Tensor]] = [None] * len(layout.shapes)
        if targets is None:
            targets = [None] * len(layout.shapes)
        device = self._device()

        def put(i: int, src: Tensor) -> None:
            target = targets[i]
            if target is not None:
                target.copy_(src)
                out[i] = target
            elif is_strided(src):
                out[i] = torch.empty(layout.shapes[i], dtype=layout.dtypes[i]).copy_(src)
            else:
                out[i] = src.clone()  # a sparse tensor every rank keeps

        with torch.no_grad():
            for i in wanted:
                if owners[i] in (EVERY_RANK, self.rank):
                    put(i, own[i])
                else:  # filled from the broadcasts below, bytes as they come
                    target = targets[i]
                    out[i] = target if target is not None else torch.empty(layout.shapes[i], dtype=layout.dtypes[i])
            for owner in range(self.world_size):
                moving = [i for i in sorted(set(wanted)) if owners[i] == owner and layout.nbytes(i) > 0]
                for pieces, total in self._buckets(layout, moving):
                    buf = torch.empty(total, dtype=torch.uint8, device=device)
                    if owner == self.rank:
                        for i, start, end, off in pieces:
                            buf[off:off + end - start].copy_(_bytes_of(own[i])[start:end])
                    dist.broadcast(buf, src=owner)
                    if owner != self.rank:
                        for i, start, end, off in pieces:
                            _bytes_of(out[i])[start:end].copy_(buf[off:off + end - start])  # type: ignore[arg-type]
                    del buf  # one bucket at a time
        return out

    def _buckets(self, layout: _Layout, indices: list[int]) -> list[tuple[list[tuple[int, int, int, int]], int]]:
        """The bytes of the tensors ``indices``, in order, packed into buckets of at most ``bucket_bytes`` (a tensor
        larger than the room left is split across buckets): ``(pieces, total bytes)``, each piece ``(index, its
        first byte, its end, its offset in the bucket)``."""
        buckets: list[tuple[list[tuple[int, int, int, int]], int]] = []
        cur: list[tuple[int, int, int, int]] = []
        total = 0
        limit = max(1, self.bucket_bytes)
        for i in indices:
            size, start = layout.nbytes(i), 0
            while start < size:
                if total >= limit:
                    buckets.append((cur, total))
                    cur, total = [], 0
                take = min(size - start, limit - total)
                cur.append((i, start, start + take, total))
                total += take
                start += take
        if cur:
            buckets.append((cur, total))
        return buckets

    def _device(self) -> torch.device:
        """Where the broadcasts go: the CPU for gloo (and MPI), the current CUDA device for NCCL."""
        backend = str(dist.get_backend())
        if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    # --------------------------------------------------------------------------------- norms for the diagnosis

    def prepare_norms(self, norms: Norms) -> None:
        """Every snapshot of the ring gets the 2-norms of its module's floating tensors: each rank computes those of
        the tensors it owns, into one float64 vector with zeros elsewhere, and one ``all_reduce`` (a sum: exact)
        completes it on every rank. Nothing when every snapshot has them already (the same on every rank: the ring
        is, once :meth:`settle` has dropped the snapshots some rank could not keep)."""
        self.settle()
        need = [s for s in self.ring if s.norms is None]
        if not need:
            return
        entries: list[tuple[int, str, int]] = []  # (snapshot, name, flat index): the same list on every rank
        for k, snap in enumerate(need):
            layout: _Layout = snap.plan
            for name, leaf in snap.skeleton["module"].items():
                i = slot(leaf)
                if i is not None and layout.dtypes[i].is_floating_point and layout.plan.owners[i] != EVERY_RANK:
                    entries.append((k, name, i))
        values = torch.zeros(len(entries), dtype=torch.float64)
        for k, snap in enumerate(need):
            mine = [(j, i) for j, (kk, _, i) in enumerate(entries) if kk == k and snap.plan.plan.owners[i] == self.rank]
            if mine:
                own = self._own(snap)
                for (j, _), value in zip(mine, norms(own[i] for _, i in mine)):
                    values[j] = value
        values = values.to(self._device())
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        found = values.tolist()
        for snap in need:
            snap.norms = {}
        for (k, name, _), value in zip(entries, found):
            need[k].norms[name] = value  # type: ignore[index]  # a dict: set just above

    def module_norms(self, snap: Snapshot, norms: Norms) -> Optional[dict[str, float]]:
        """The norms :meth:`prepare_norms` gathered (None if it was not called for ``snap``: never a collective
        here, where only some ranks may ask)."""
        return snap.norms

    # --------------------------------------------------------------------------- writes and device copies

    def poll(self) -> None:
        for snap in list(self.ring):
            if snap.share is not None:
                self.inner._check(snap.share, wait=False)
        self._failed_shares()

    def flush(self) -> None:
        if self.inner._copier is not None:
            self.inner._copier.wait()
        for snap in list(self.ring):
            if snap.share is not None:
                self.inner._check(snap.share, wait=True)
        writer = getattr(self.inner, "writer", None)
        if writer is not None:
            writer.drain()  # the deletions of evicted files too
        self._failed_shares()

    def settle(self) -> None:
        """:meth:`flush`, then agree across ranks which snapshots every rank kept its share of (one ``all_reduce``,
        disk only: a write can fail on one rank), and drop the others from the ring on every rank."""
        self.flush()
        if self.inner.mode == "disk" and self.ring:
            kept = torch.tensor([0 if s.failed else 1 for s in self.ring], dtype=torch.int32, device=self._device())
            dist.all_reduce(kept, op=dist.ReduceOp.MIN)
            for snap, ok in zip(list(self.ring), kept.tolist()):
                if not ok and not snap.failed:
                    self._report(snap, None, "another rank's share could not be written")
        self._drop_failed()

    def close(self) -> None:
        self.flush()
        self.inner.close()

    def before_optimizer_step(self) -> None:
        self.inner.before_optimizer_step()

    def _failed_shares(self) -> None:
        """This rank's share could not be written: the snapshot is not whole (decided for all ranks in
        :meth:`settle`)."""
        for snap in self.ring:
            if snap.share is not None and snap.share.failed and not snap.failed:
                snap.failed = snap.share.failed
