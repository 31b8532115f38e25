"""How the guard's evidence agrees across ranks: identical decisions on every rank, for one small all-reduce per
optimizer step.

Under DDP the gradients are already all-reduced when the guard looks at them, so a decision taken from
the gradient norm is the same on every rank. Rank-local evidence (the loss, the inputs, the parameters
read after the previous step) is not: one rank skipping a step that another takes desynchronises the
replicas. :class:`Ranks` reduces the guard's evidence vector (:mod:`.vector`) across ranks with a
single ``all_reduce`` (no barrier, unlike ``strategy.reduce_boolean_decision`` which adds one); every rank
then reads the same flags, the mean loss, and takes the same decision.

Under FSDP (or any strategy whose class name says it shards: ``FSDP``, ``ModelParallel``,
:func:`.placement.shards_gradients`) gradients are sharded: the guard sums ``|g|^p`` over the local shards
(:func:`local_norm_power`) and the same all-reduce completes the norm, so the finite check and clipping still cost
one collective. (An inf-norm needs a MAX: a second all-reduce.) The sum runs over the whole world; a DTensor's
shard held by several ranks (a ``Replicate`` placement: tensor parallel's replicated biases, hybrid sharding) is
counted on one of them only (:func:`~..dtensors.norm_share`).

With the replica check (``check.replicas``, DDP) each rank's summary of its own copy of the reduced gradient rides
in the same all-reduce (:meth:`Ranks.own_parts`; the arithmetic is :mod:`.replicas`). At every snapshot the ranks
agree on the weights' checksum and on their flags with one small all-reduce (:meth:`Ranks.snapshot_agreement`).
On an incident only, :meth:`Ranks.gather` collects every rank's payload (``all_gather_object``: the incident's one
account, :func:`~..account.share_incident`) and :meth:`Ranks.reduced_norm` recomputes the reduced gradient.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.dtensors import norm_share, reduced
from .kernels import total_norm, total_norm_parts
from .placement import local_tensor, replicates, shards_gradients
from .replicas import (
    CHECKSUM_FIELDS,
    EPS32,
    REPLICA_FIELDS,
    _f32,
    bits_checksum,
    checksum_parts,
    checksum_primes,
    checksum_weight,
    checksums_disagree,
    replicas_disagree,
    weights_checksum,
)
from .vector import SCHEMA, StepFlags

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Ranks", "local_norm_power", "local_norm_powers"]


def local_norm_power(grads: Sequence[Tensor], norm_type: float, world: int = 1) -> Tensor:
    """``sum |g|^p`` over the local shards (``max |g|`` for the inf-norm) as a 0-dim float32 tensor, each shard
    weighted by :func:`~..dtensors.norm_share` (an element several of the ``world`` ranks hold counts once in the
    sum over ranks; a ``Partial`` gradient is completed first)."""
    shards: list[tuple[Tensor, float]] = []
    for g in grads:
        if g is None:
            continue
        g = reduced(g)
        share = 1.0 if math.isinf(norm_type) else norm_share(g, world)  # a max counts a copy any number of times
        shard = local_tensor(g)
        if shard.numel() > 0:  # a copy counted elsewhere is still added, times 0: a NaN or Inf in it stays NaN
            shards.append((shard, share))
    if not shards:
        return torch.zeros(())
    norms = torch.stack([n.float() for n in torch._foreach_norm([t for t, _ in shards], norm_type)])
    if math.isinf(norm_type):
        return norms.max()
    powers = norms.pow(norm_type)
    if any(share != 1.0 for _, share in shards):
        powers = powers * torch.tensor([share for _, share in shards], device=powers.device)
    return powers.sum()


def local_norm_powers(grads: Sequence[Tensor], norm_type: float, world: int = 1) -> Optional[Tensor]:
    """This rank's share of each gradient's ``sum |g|^p`` (``max |g|`` for the inf-norm), one per gradient of
    ``grads`` that is not None, weighted as :func:`local_norm_power` weighs it (an empty shard: 0), as a 1-dim float32
    tensor: what the gradient-flow window of a sharded run keeps (:mod:`.flow`). Summed over the tensors it is that
    total; None without gradients, or for the inf-norm with an empty shard (its inf-norm is an error)."""
    shards: list[Tensor] = []
    shares: list[float] = []
    for g in grads:
        if g is None:
            continue
        g = reduced(g)
        shares.append(1.0 if math.isinf(norm_type) else norm_share(g, world))
        shards.append(local_tensor(g))
    if not shards or math.isinf(norm_type) and any(t.numel() == 0 for t in shards):
        return None
    norms = torch.stack([n.float() for n in torch._foreach_norm(shards, norm_type)])
    if math.isinf(norm_type):
        return norms
    powers = norms.pow(norm_type)
    if any(share != 1.0 for share in shares):
        powers = powers * torch.tensor(shares, device=powers.device)
    return powers


_T = TypeVar("_T")


class Ranks:
    """How the guard's evidence agrees across ranks: the one all-reduce per step (:meth:`reduce`), the snapshot
    agreement (:meth:`snapshot_agreement`), the gathers of an incident (:meth:`gather`, :meth:`reduced_norm`).
    ``distributed`` is False on one process."""

    def __init__(self, world_size: int = 1, sharded: bool = False, norm_type: float = 2.0,
                 group: Optional[dist.ProcessGroup] = None, replicas: bool = False, tolerance: float = 1e-3,
                 exact: bool = True) -> None:
        self.world_size = int(world_size)
        self.distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        self.sharded = sharded and self.distributed
        self.norm_type = float(norm_type)
        self.group = group
        self._local: Optional[Tensor] = None
        # the replica check (check.replicas): full replicas whose reduced gradients must be identical
        self.replicas = replicas and self.distributed and not self.sharded
        self.rank = int(dist.get_rank(group)) if self.distributed else 0
        self.tolerance = float(tolerance)
        # far above what float32 sums of identical norms round to (module docstring of replicas_disagree)
        self.signed_limit = max(self.tolerance, 8 * self.world_size * EPS32)
        self.sq_limit = max(self.tolerance, 4 * self.world_size * math.sqrt(EPS32))
        # check.replica_compare: exact (a checksum of the copies' bits) or tolerance (their norms)
        self.exact = bool(exact)
        self.weight = checksum_weight(self.rank, self.world_size)
        self.primes = checksum_primes(self.world_size) if self.replicas and self.exact else ()
        self._primes: dict[torch.device, Tensor] = {}

    @classmethod
    def for_trainer(cls, trainer: "pl.Trainer", norm_type: float = 2.0, replicas: bool = False,
                    tolerance: float = 1e-3, exact: bool = True) -> "Ranks":
        strategy = getattr(trainer, "strategy", None)
        replicas = replicas and replicates(strategy, getattr(trainer, "lightning_module", None))
        return cls(int(getattr(trainer, "world_size", 1) or 1), shards_gradients(strategy), norm_type,
                   replicas=replicas, tolerance=tolerance, exact=exact)

    # ------------------------------------------------------------------------------------------- replicas

    def own_parts(self, norm: Tensor, grads: Sequence[Tensor] = ()) -> dict[str, Tensor]:
        """The replica fields of this rank's evidence vector, from its copy of the reduced gradient ``grads`` and
        its own norm of it (a few device ops, and with ``replica_compare: exact`` one integer sum per gradient: no
        host sync); empty without the replica check."""
        if not self.replicas:
            return {}
        norm = norm.detach().float()
        bad = ~torch.isfinite(norm)
        if self.exact:
            checksum = bits_checksum(grads)
            if checksum is None:
                return {"own_grad_bad": bad}
            primes = self._primes.get(checksum.device)
            if primes is None:
                primes = self._primes[checksum.device] = torch.tensor(self.primes, device=checksum.device)
            parts = checksum_parts(checksum, self.weight, primes).unbind()
            return {"own_grad_bad": bad, **dict(zip(CHECKSUM_FIELDS, parts))}
        own = torch.where(bad, 0.0, norm)
        return {"own_grad_norm": own, "own_grad_norm_signed": own if self.rank % 2 == 0 else -own,
                "own_grad_norm_sq": own * own, "own_grad_bad": bad}

    def replica_flag(self, vec: Tensor) -> Optional[Tensor]:
        """0-dim bool on the device: the reduced vector ``vec`` says the replicas disagree (no host sync); None
        without the check."""
        if not self.replicas:
            return None
        own, signed, sq, bad = (vec[SCHEMA.index[n]] for n in REPLICA_FIELDS)
        if self.exact:
            first = SCHEMA.index[CHECKSUM_FIELDS[0]]
            return (bad > 0) & (bad < self.world_size) | checksums_disagree(vec[first:first + len(CHECKSUM_FIELDS)])
        return replicas_disagree(own, signed, sq, bad, self.world_size, self.signed_limit, self.sq_limit)

    def disagreement(self, flags: StepFlags) -> Optional[dict[str, object]]:
        """The replicas' disagreement in a step's flags (read on the host, identical on every rank), with its
        evidence; None when they agree (or without the check)."""
        if not self.replicas:
            return None
        own, signed, sq, bad = (getattr(flags, n) for n in REPLICA_FIELDS)
        if self.exact:
            sums = [getattr(flags, n) for n in CHECKSUM_FIELDS]
            if not (0 < bad < self.world_size or checksums_disagree(sums)):
                return None
            return {"compared": "exact", "nonfinite_copies": int(bad), "checksum_fields": sums,
                    "primes": list(self.primes)}
        if not replicas_disagree(own, signed, sq, bad, self.world_size, self.signed_limit, self.sq_limit, _f32):
            return None
        world, n = self.world_size, self.world_size - int(bad)
        mean = own / n if n else math.nan
        found: dict[str, object] = {"compared": "tolerance", "nonfinite_copies": int(bad), "mean_grad_norm": mean,
                                 "tolerance": self.tolerance, "signed_limit": self.signed_limit,
                                 "square_limit": self.sq_limit}
        if not bad and mean:
            found["signed_deviation"] = abs(signed - own * (world % 2) / world) / mean
            found["square_deviation"] = math.sqrt(max(world * sq - own * own, 0.0) / (world - 1)) / mean
        return found

    def reduced_norm(self, grads: Optional[Sequence[Optional[Tensor]]],
                     params: Sequence[Tensor]) -> Optional[tuple[float, Optional[tuple[int, ...]]]]:
        """Incident only: the norm of the mean over ranks of ``grads`` (this rank's own gradient of each of
        ``params``, recomputed; None where a parameter got none; ``grads`` None: it could not be recomputed), with
        one all-reduce of the whole gradient, and (``replica_compare: exact``) the residues of its checksum
        (:func:`own_residues`; in each parameter's dtype, where it got a gradient), which a copy that the all-reduce
        made alike matches bit for bit. Every rank calls it; None when some rank could not recompute."""
        device = params[0].device if params else torch.device("cpu")
        failed = grads is None
        given = [g is not None for g in grads] if grads is not None else [False] * len(params)
        flat = [torch.zeros(p.numel(), device=device) if failed or g is None
                else g.detach().reshape(-1).float().to(device) for g, p in zip(grads or [None] * len(params), params)]
        flat.append(torch.full((1,), float(failed), device=device))
        buf = torch.cat(flat)
        dist.all_reduce(buf, group=self.group)
        if bool(buf[-1] > 0):
            return None
        mean = buf[:-1] / self.world_size
        residues = None
        if self.primes:
            parts = mean.split([p.numel() for p in params])
            checksum = bits_checksum(part.to(p.dtype) for part, p, g in zip(parts, params, given) if g)
            if checksum is not None:
                residues = tuple(int(v) for v in torch.remainder(checksum.cpu(), torch.tensor(self.primes)).tolist())
        return float(torch.linalg.vector_norm(mean, self.norm_type)), residues

    def snapshot_agreement(self, module: nn.Module, flags: Sequence[bool]) -> tuple[bool, list[bool]]:
        """Before a snapshot, on every rank: (are the weights bitwise the same on every rank?, is each of ``flags``
        set on any rank?). The weights' checksum (:func:`weights_checksum`; with the replica check) and the flags
        (e.g. a non-finite weight, a non-finite optimizer state) are compared with one all-reduce of 2 + len(flags)
        numbers (snapshot time: never per step), so that every rank takes the same decision. One process:
        ``(True, flags)``."""
        if not self.distributed:
            return True, list(flags)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        total = weights_checksum(module) if self.replicas else None
        c = total if total is not None else torch.zeros((), dtype=torch.int64, device=device)
        found = torch.stack([c, -c, *(torch.full((), int(f), dtype=torch.int64, device=c.device) for f in flags)])
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        high, minus_low, *agreed = found.tolist()
        return high == -minus_low, [bool(f) for f in agreed]

    def gather(self, payload: _T) -> list[_T]:
        """Every rank's ``payload`` (one ``all_gather_object``; incident only)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, payload, group=self.group)
        return gathered

    def grad_norm(self, grads: Sequence[Tensor]) -> Tensor:
        """The fused total norm; under sharding the local power sum that :meth:`reduce` completes."""
        if self.sharded:
            return local_norm_power(grads, self.norm_type, self.world_size)
        return total_norm(list(grads), self.norm_type)

    def grad_norms(self, grads: Sequence[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """:meth:`grad_norm` and the per-tensor parts it was reduced from (the gradient-flow window's row): the
        norms of ``grads``, or under sharding this rank's ``sum |g|^p`` shares (:func:`local_norm_powers`), which
        sum to the local power :meth:`reduce` completes; None where there is no such row."""
        if self.sharded:
            powers = local_norm_powers(grads, self.norm_type, self.world_size)
            if powers is None:
                return local_norm_power(grads, self.norm_type, self.world_size), None
            return (powers.max() if math.isinf(self.norm_type) else powers.sum()), powers
        return total_norm_parts(list(grads), self.norm_type)

    def reduce_powers(self, rows: Tensor) -> Tensor:
        """Sharded: every rank's ``sum |g|^p`` shares of a gradient-flow window summed (the inf-norm: the max) over
        ranks, one all-reduce; incident only, every rank at the same point. Otherwise ``rows`` as they are."""
        if not self.sharded:
            return rows
        out = rows.clone()
        op = dist.ReduceOp.MAX if math.isinf(self.norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(out, op=op, group=self.group)
        return out

    def reduce(self, vec: Tensor) -> Tensor:
        """Agree on a step's evidence vector (:mod:`.vector`) across ranks with one all-reduce (SUM); no host
        sync, no barrier. The grad scale is identical on every rank and is not reduced."""
        if not self.distributed:
            return vec
        self._local = vec.detach().clone()
        out = vec.clone()
        norm, summed = SCHEMA.norm, SCHEMA.summed
        if self.sharded and not math.isinf(self.norm_type):  # the norm's powers and the summed fields
            assert norm + 1 == summed.start
            dist.all_reduce(out[norm:summed.stop], group=self.group)  # (a view: reduced in place)
            out[norm] = out[norm].clamp_min(0).pow(1.0 / self.norm_type)
        else:  # unsharded: the gradient norm is already identical on every rank
            if self.sharded:  # inf-norm of shards: a MAX, the one case needing a second collective
                dist.all_reduce(out[norm:norm + 1], op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(out[summed], group=self.group)
        for i in SCHEMA.means:  # summed -> the mean over ranks; flags stay rank counts
            out[i] = out[i] / self.world_size
        return out

    def global_norm(self, norm: Optional[Tensor], value: float) -> Optional[Tensor]:
        """The norm to clip with: under sharding the completed ``value`` (already read), else ``norm``."""
        if norm is None or not self.sharded:
            return norm
        return torch.full((), value, dtype=norm.dtype, device=norm.device)

    def local_flags(self, local: Optional[Tensor] = None) -> list[bool]:
        """This rank's own ``*_bad`` flags of the last step, or of ``local`` (a step's vector before
        :meth:`reduce`, kept for a lagged read) (a host sync: incident only)."""
        local = self._local if local is None else local
        if local is None:
            return []
        return SCHEMA.local_flags(local)

    def shard_bad(self, local: Optional[Tensor] = None) -> bool:
        """Sharded: is this rank's own share of the gradient (its ``sum |g|^p`` before :meth:`reduce`) non-finite?
        (a host sync: incident only; False when not sharded)"""
        local = self._local if local is None else local
        return self.sharded and local is not None and not math.isfinite(float(local[SCHEMA.norm]))

    @property
    def last_local(self) -> Optional[Tensor]:
        """This rank's vector of the last :meth:`reduce`, before the reduction (None on one process)."""
        return self._local

    def any_rank(self, flag: bool, device: Optional[torch.device] = None) -> bool:
        """Is ``flag`` set on any rank? One all-reduce; for rare decisions (checkpoint time), never per step."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())
