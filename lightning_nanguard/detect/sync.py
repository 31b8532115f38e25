"""Identical decisions on every rank, for one small all-reduce per optimizer step.

Under DDP the gradients are already all-reduced when the guard looks at them, so a decision taken from
the gradient norm is the same on every rank. Rank-local evidence (the loss, the inputs, the parameters
read after the previous step) is not: one rank skipping a step that another takes desynchronises the
replicas. :class:`StepSync` reduces the guard's evidence vector (:mod:`.vector`) across ranks with a
single ``all_reduce`` (no barrier, unlike ``strategy.reduce_boolean_decision`` which adds one); every rank
then reads the same flags, the mean loss, and takes the same decision.

Under FSDP (or any strategy whose class name says it shards: ``FSDP``, ``ModelParallel``) gradients are
sharded: the guard sums ``|g|^p`` over the local shards and the same all-reduce completes the norm, so the
finite check and clipping still cost one collective. (An inf-norm needs a MAX: a second all-reduce.) The
sum runs over the whole world, which is right for full sharding; hybrid sharding (replicas of shards)
would over-count the norm by the number of replicas.

On an incident only, :func:`share_incident` gathers every rank's evidence and diagnosis, so that all
ranks adopt the account of the first rank that saw the problem (the one rank 0 writes to the sinks).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .amp import grad_scaler, reads_found_inf
from .kernels import total_norm
from .vector import SCHEMA

__all__ = ["StepSync", "shards_gradients", "replicates_state", "local_tensor", "local_norm_power", "share_incident",
           "choose_sync"]

_SHARDING_NAMES = ("FSDP", "FullyShardedDataParallel", "ModelParallel")
_EVENT_FIELDS = ("kind", "cause", "culprit", "op", "details", "suggestion")


def shards_gradients(strategy: Any) -> bool:
    """Does ``strategy`` shard gradients across ranks? (duck-typed on the class names, no isinstance)"""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    return any(key in name for name in names for key in _SHARDING_NAMES)


def replicates_state(strategy: Any) -> bool:
    """Does every rank of ``strategy`` hold the same whole training state (DDP and its start methods)? Not a
    sharding strategy, and not DeepSpeed (whose ZeRO stages partition the optimizer state). Duck-typed on the class
    names."""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    return any("DDP" in name for name in names) and not any("DeepSpeed" in name for name in names) \
        and not shards_gradients(strategy)


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a tensor (a DTensor's local tensor; a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def local_norm_power(grads: Sequence[Tensor], norm_type: float) -> Tensor:
    """``sum |g|^p`` over the local shards (``max |g|`` for the inf-norm) as a 0-dim float32 tensor."""
    local = [local_tensor(g) for g in grads if g is not None]
    local = [g for g in local if g.numel() > 0]
    if not local:
        return torch.zeros(())
    norms = torch.stack([n.float() for n in torch._foreach_norm(local, norm_type)])
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


class StepSync:
    """How the guard's per-step flags agree across ranks. ``distributed`` is False on one process."""

    def __init__(self, world_size: int = 1, sharded: bool = False, norm_type: float = 2.0,
                 group: Optional[Any] = None) -> None:
        self.world_size = int(world_size)
        self.distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        self.sharded = sharded and self.distributed
        self.norm_type = float(norm_type)
        self.group = group
        self._local: Optional[Tensor] = None

    @classmethod
    def for_trainer(cls, trainer: Any, norm_type: float = 2.0) -> "StepSync":
        strategy = getattr(trainer, "strategy", None)
        return cls(int(getattr(trainer, "world_size", 1) or 1), shards_gradients(strategy), norm_type)

    def grad_norm(self, grads: Sequence[Tensor]) -> Tensor:
        """The fused total norm; under sharding the local power sum that :meth:`reduce` completes."""
        if self.sharded:
            return local_norm_power(grads, self.norm_type)
        return total_norm(list(grads), self.norm_type)

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
        :meth:`reduce`, kept for a lagged read) (syncs: incident only)."""
        local = self._local if local is None else local
        if local is None:
            return []
        return SCHEMA.local_flags(local)

    @property
    def last_local(self) -> Optional[Tensor]:
        """This rank's vector of the last :meth:`reduce`, before the reduction (None on one process)."""
        return self._local

    def any_rank(self, flag: bool, device: Any = None) -> bool:
        """Is ``flag`` set on any rank? One all-reduce; for rare decisions (checkpoint time), never per step."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def share_incident(sync: StepSync, event: Any, extra: str, local: Optional[Tensor] = None) -> str:
    """On an incident: gather every rank's evidence and make every rank adopt the same account.

    The chosen rank is the first one with local evidence (a non-finite loss, input or parameter), else the
    first whose diagnosis found something of its own (bad inputs, an op), else rank 0. ``event.rank`` becomes
    that rank and ``event.details["ranks"]`` lists the ranks with evidence. Returns the chosen rank's report
    text. Costs one ``all_gather_object``; never called in steady state. ``local``: the rank's vector of the
    incident's step when it is not the last one reduced (a lagged read).
    """
    if not sync.distributed:
        return extra
    local = sync.local_flags(local)
    own = bool(event.op) or bool(event.details.get("inputs")) or event.kind == "input"
    evidence = 2 if any(local) else 1 if own else 0
    payload = {"rank": int(dist.get_rank()),
               "evidence": evidence, "local": local, "extra": extra,
               "event": {k: getattr(event, k) for k in _EVENT_FIELDS}}
    gathered: list[Any] = [None] * sync.world_size
    dist.all_gather_object(gathered, payload, group=sync.group)
    best = max(gathered, key=lambda p: (p["evidence"], -p["rank"]))
    for key, value in best["event"].items():
        setattr(event, key, value)
    event.rank = best["rank"]
    event.details = dict(event.details)
    event.details["ranks"] = [p["rank"] for p in gathered if p["evidence"] > 0]
    return best["extra"]


def choose_sync(mode: str, trainer: Any, pl_module: Any) -> tuple[bool, str]:
    """``check.sync`` for this fit: (read the flags lagged?, why, in words for the user).

    ``auto`` is lagged when the device is not the CPU (where every op has finished when it returns, so a
    read waits for nothing) and every optimizer can skip a bad step on the device: a fused torch optimizer
    (``found_inf``), or any optimizer under a GradScaler (its ``found_inf``). Manual optimization always reads
    eagerly.
    """
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    scaled = grad_scaler(trainer) is not None
    cannot = [type(o).__name__ for o in optimizers if not scaled and not reads_found_inf(o)]
    if mode == "eager":
        return False, "check.sync: eager: one host sync per step"
    if not getattr(pl_module, "automatic_optimization", True):
        return False, "manual optimization: each optimizer.step() is judged when it is called, one host sync each"
    if mode == "lagged":
        if cannot:
            return True, (f"check.sync: lagged; optimizer {cannot[0]} cannot skip a step on the device: a bad step is "
                          "applied, then undone one step later by a rollback to the newest snapshot")
        return True, "check.sync: lagged: bad steps are skipped on the device, the flags are read one step late"
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if device is None or torch.device(device).type == "cpu":
        return False, "on the CPU every op has finished when it returns: reading the flags waits for nothing"
    if cannot or not optimizers:
        name = cannot[0] if cannot else "(none)"
        return False, (f"optimizer {name} is not fused: one host sync per step; use {name}(fused=True) to "
                       "remove it")
    if scaled and any(not reads_found_inf(o) for o in optimizers):
        return True, ("16-mixed: the GradScaler skips bad steps; its own check of a non-fused optimizer still reads "
                      "once per step (fused=True removes it)")
    return True, "every optimizer skips bad steps on the device (fused): no host sync on a healthy step"
