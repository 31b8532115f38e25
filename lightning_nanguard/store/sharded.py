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

Before any of a snapshot's bytes move, the ranks agree that every share of it verifies (:meth:`ShardedStore._agree`):
each rank checks its own shares of the candidates against their seals (:mod:`.verify`), and one ``all_reduce`` of
an int32 matrix (candidates x ranks: why each rank refused each, 0 where it did not) tells every rank the same
answer. A snapshot refused on any rank is refused on every rank, and a rollback restores the newest snapshot whose
every share verified everywhere: no rank ever holds a mix of two snapshots, and none starts a broadcast another
rank would not join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.dtensors import local
from ..core.layouts import is_strided, nbytes
from ..core.tree import flatten, iter_leaves, slot, unflatten
from .snapshots import Norms, Refusal, Restored, Snapshot, SnapshotStore, load_training_state, training_state
from .verify import REASONS, Refused

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ShardPlan", "ShardedStore", "EVERY_RANK", "BUCKET_BYTES"]

_T = TypeVar("_T")
# a layout's key: each tensor's shape, dtype and whether it is strided; the indices copied first
_LayoutKey = tuple[tuple[tuple[tuple[int, ...], torch.dtype, bool], ...], frozenset[int]]

_CODES = list(REASONS)  # a refusal's reason as a number for the agreement (its index + 1; 0: verified)

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
        self.writer = None  # the inner store's thread seals and writes the shares
        self._layout_key: Optional[_LayoutKey] = None
        self._layout: Optional[_Layout] = None
        self._ready: Optional[tuple[Snapshot, dict[int, Tensor]]] = None  # shares just agreed on (first_verified)

    @property
    def waits(self) -> int:
        return self.inner.waits

    # ------------------------------------------------------------------------------------------ keeping

    def _plan(self, live: list[Tensor], first: Optional[set[int]]) -> _Layout:
        key: _LayoutKey = (tuple((tuple(t.shape), t.dtype, is_strided(t)) for t in live), frozenset(first or ()))
        if key != self._layout_key or self._layout is None:
            sizes = [nbytes(t) for t in live]
            everywhere = {i for i, t in enumerate(live) if not is_strided(t)}
            plan = ShardPlan.balance(sizes, self.world_size, to_first=first or (), everywhere=everywhere)
            self._layout = _Layout(plan, tuple(tuple(t.shape) for t in live), tuple(t.dtype for t in live),
                                   tuple(plan.owned(self.rank)))
            self._layout_key = key
        return self._layout

    def _keep(self, snap: Snapshot, skeleton: object, live: list[Tensor], first: Optional[set[int]]) -> None:
        layout = self._plan(live, first)
        share = snap.share if snap.share is not None else Snapshot(step=snap.step)
        share.step, share.failed, share.meta = snap.step, None, {}
        share_skeleton, share_live = flatten([live[i] for i in layout.mine])
        share_first = None if first is None else {j for j, i in enumerate(layout.mine) if i in first}
        self.inner._keep(share, share_skeleton, share_live, share_first)
        snap.share, snap.skeleton, snap.plan = share, skeleton, layout
        snap.nbytes = share.nbytes
        snap.total_nbytes = sum(nbytes(t) for t in live)

    def _forget(self, snap: Snapshot, keep_file: bool = False) -> None:
        if snap.share is not None:
            self.inner._forget(snap.share, keep_file)

    # ------------------------------------------------------------------------------------------ reading

    def load(self, snap: Snapshot) -> Any:
        """The whole state of ``snap``, on every rank (a collective: broadcasts from each owner)."""
        layout: _Layout = snap.plan
        tensors = self._rebuild(snap, range(len(layout.shapes)))
        return unflatten(snap.skeleton, tensors)

    def load_module(self, snap: Snapshot) -> dict[str, object]:
        """The module state dict of ``snap``, on every rank (a collective: only the module's tensors move)."""
        module = snap.skeleton["module"]
        wanted = [i for _, leaf in iter_leaves(module) if (i := slot(leaf)) is not None]
        return unflatten(module, self._rebuild(snap, wanted))

    def restore(self, snap: Snapshot, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                scaler_overflows: int = 0) -> None:
        """Load ``snap`` back into the fit in place (a collective), once every rank's share of it verified (else
        :class:`~.verify.Refused` on every rank, nothing touched): every tensor of the snapshot goes, bucket by
        bucket as its owner broadcasts it, straight into the live tensor at its place (:meth:`load_into`), so no
        rank ever holds a whole state beside its own; then the usual loads (:func:`~.snapshots.load_training_state`)
        put the structure back, reading the live tensors themselves (no copy: an optimizer's state keeps them)."""
        state = self.load_into(snap, training_state(trainer, pl_module))
        load_training_state(trainer, pl_module, state, scaler_overflows)

    def restore_newest(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                       scaler_overflows: int = 0) -> Restored:
        """:meth:`restore` the newest snapshot whose every share verified on every rank (one agreement over all of
        :meth:`targets`, then the in-place restore of that one)."""
        snap, state, refused = self.first_verified(
            self.targets(), lambda s: self.load_into(s, training_state(trainer, pl_module)))
        if snap is not None and state is not None:
            load_training_state(trainer, pl_module, state, scaler_overflows)
        return Restored(snap, tuple(refused))

    def first_verified(self, candidates: Sequence[Snapshot],
                       read: Callable[[Snapshot], _T] ) -> tuple[Optional[Snapshot], Optional[_T], list[Refusal]]:
        """The newest of ``candidates`` whose every share verified on every rank (one agreement, :meth:`_agree`, for
        all of them), ``read`` of it (from the shares just verified), and the candidates refused."""
        views, refused = self._agree(list(candidates))
        chosen = next((s for s in candidates if s in views), None)
        if chosen is None:
            return None, None, refused
        self._ready = (chosen, views[chosen])
        try:
            return chosen, read(chosen), refused
        finally:
            self._ready = None

    def _agree(self, snaps: list[Snapshot]) -> tuple[dict[Snapshot, dict[int, Tensor]], list[Refusal]]:
        """This rank's verified shares of each of ``snaps`` that every rank verified, and the refusals of the others
        (refused on every rank alike: :meth:`~.snapshots.SnapshotStore.refuse`). One ``all_reduce`` (incident path)."""
        views, own, codes = self._verify_own(snaps)
        if snaps:
            summed = codes.to(self._device())
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # each rank wrote its own column only
            codes = summed.cpu()
        return views, self._decide(snaps, views, own, codes)

    def _verify_own(self, snaps: list[Snapshot]) -> tuple[dict[Snapshot, dict[int, Tensor]], dict[Snapshot, Refused],
                    Tensor]:
        """This rank's shares of ``snaps`` checked against their seals (no collective): the verified ones by flat
        index, the refusals, and their codes in this rank's column of a ``(len(snaps), world)`` int32 matrix (the
        reason's number, 0 where it verified)."""
        codes = torch.zeros(len(snaps), self.world_size, dtype=torch.int32)
        views: dict[Snapshot, dict[int, Tensor]] = {}
        own: dict[Snapshot, Refused] = {}
        for k, snap in enumerate(snaps):
            try:
                if snap.failed or snap.share is None:
                    raise Refused("not_written", snap.failed or "")
                views[snap] = dict(zip(snap.plan.mine, self.inner.view(snap.share)))
            except Refused as exc:
                own[snap] = exc
                codes[k, self.rank] = _CODES.index(exc.reason) + 1
        return views, own, codes

    def _decide(self, snaps: list[Snapshot], views: dict[Snapshot, dict[int, Tensor]], own: dict[Snapshot, Refused],
                codes: Tensor) -> list[Refusal]:
        """Refuse, on every rank alike, each of ``snaps`` some rank refused (``codes``: every rank's column, summed
        across ranks), dropping it from ``views``; the refusals."""
        refused = []
        for k, snap in enumerate(snaps):
            ranks = [r for r in range(self.world_size) if int(codes[k, r])]
            if not ranks:
                continue
            views.pop(snap, None)
            first = _CODES[int(codes[k, ranks[0]]) - 1]  # the lowest failing rank's reason: the same on every rank
            why = own.get(snap) or Refused("other_rank", f"rank {ranks[0]}: {REASONS[first]}")
            refused.append(self.refuse(snap, why, ranks, reason=first))
        return refused

    def load_into(self, snap: Snapshot, live: object) -> Any:
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
        """This rank's share of ``snap`` by flat index, verified (:meth:`~.snapshots.SnapshotStore.view`: possibly the
        store's own buffers, to be copied from at once), once every rank's share verified (:meth:`_agree`: a
        collective, unless :meth:`first_verified` just agreed on it); :class:`~.verify.Refused` on every rank if not."""
        if self._ready is not None and self._ready[0] is snap:
            return self._ready[1]
        views, refused = self._agree([snap])
        if snap not in views:
            refusal = refused[0]
            raise Refused(refusal.reason, refusal.detail, recorded=refusal)
        return views[snap]

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
        """Every snapshot of the ring gets the 2-norms of its module's floating tensors: each rank checks its shares
        against their seals and computes the norms of the tensors it owns, into one float64 vector with zeros
        elsewhere, followed by its column of the refusal codes (:meth:`_verify_own`), and one ``all_reduce`` (a sum:
        exact) completes both on every rank; a snapshot some rank refused is refused on every rank and gets no norms.
        Nothing when every snapshot has them already (the same on every rank: the ring is, once :meth:`settle` has
        dropped the snapshots some rank could not keep)."""
        self.settle()
        need = [s for s in self.ring if s.norms is None]
        if not need:
            return
        views, own, codes = self._verify_own(need)
        entries: list[tuple[int, str, int]] = []  # (snapshot, name, flat index): the same list on every rank
        for k, snap in enumerate(need):
            layout: _Layout = snap.plan
            for name, leaf in snap.skeleton["module"].items():
                i = slot(leaf)
                if i is not None and layout.dtypes[i].is_floating_point and layout.plan.owners[i] != EVERY_RANK:
                    entries.append((k, name, i))
        values = torch.zeros(len(entries) + codes.numel(), dtype=torch.float64)
        values[len(entries):] = codes.reshape(-1).double()
        for k, snap in enumerate(need):
            mine = [(j, i) for j, (kk, _, i) in enumerate(entries) if kk == k and snap.plan.plan.owners[i] == self.rank]
            if mine and snap in views:
                for (j, _), value in zip(mine, norms(views[snap][i] for _, i in mine)):
                    values[j] = value
        values = values.to(self._device())
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        summed = values.cpu()
        self._decide(need, views, own, summed[len(entries):].round().to(torch.int32).reshape(codes.shape))
        found = summed[:len(entries)].tolist()
        for snap in need:
            if snap in views:
                snap.norms = {}
        for (k, name, _), value in zip(entries, found):
            if need[k] in views:
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
