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
sum runs over the whole world; a DTensor's shard held by several ranks (a ``Replicate`` placement: tensor
parallel's replicated biases, hybrid sharding) is counted on one of them only (:func:`~..dtensors.norm_share`).

Replicas (``check.replicas``, DDP): the reduced gradient is identical on every rank by construction, so each rank
puts a summary of its own copy into the same all-reduce (:meth:`StepSync.own_parts`), which every rank reads alike,
with no extra collective and no extra host read:

- ``check.replica_compare: exact`` (the default): a checksum of the copy's bits (:func:`bits_checksum`, the sum of
  its words as integers, modulo 2^32), as three integers that float32 sums carry exactly: ``weight x (checksum
  mod p)`` for three primes (:func:`checksum_primes`), with weights that sum to 0 over ranks
  (:func:`checksum_weight`). Identical copies leave three zeros; one rank whose copy differs by any one element
  (any flipped bit) never does (:func:`checksums_disagree`).
- ``tolerance``: its norm (its sum, a sum signed by the rank, the sum of squares). Identical norms cancel in the
  signed sum to within rounding; a rank whose norm differs by more than ``check.replica_tolerance`` leaves its
  difference there (:func:`replicas_disagree`). For ranks whose copies may legitimately differ in their last bits.

Both count the non-finite copies. At every snapshot, a checksum of the weights' bits (:func:`weights_checksum`) is
compared across ranks (:meth:`StepSync.snapshot_agreement`: one small all-reduce per snapshot).

On an incident only, :func:`share_incident` gathers every rank's evidence and diagnosis, so that all
ranks adopt the account of the rank that produced the problem (the one rank 0 writes to the sinks).
"""

from __future__ import annotations

import math
import socket
import struct
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..dtensors import local, norm_share, reduced
from .amp import grad_scaler, reads_found_inf
from .kernels import total_norm
from .vector import SCHEMA

__all__ = ["StepSync", "shards_gradients", "replicates", "local_tensor", "local_norm_power", "share_incident",
           "choose_sync", "whereabouts", "replicas_disagree", "odd_ranks", "weights_checksum", "bits_checksum",
           "checksum_weight", "checksum_primes", "checksum_parts", "checksums_disagree", "own_residues",
           "odd_checksums", "REPLICA_FIELDS", "CHECKSUM_FIELDS"]

_SHARDING_NAMES = ("FSDP", "FullyShardedDataParallel", "ModelParallel")
_EVENT_FIELDS = ("kind", "cause", "culprit", "op", "details", "suggestion", "host", "device", "local_rank")
REPLICA_FIELDS = ("own_grad_norm", "own_grad_norm_signed", "own_grad_norm_sq", "own_grad_bad")
CHECKSUM_FIELDS = ("grad_checksum_0", "grad_checksum_1", "grad_checksum_2")
EPS32 = 2.0 ** -24  # float32's unit roundoff


def whereabouts(trainer: Any) -> dict[str, Any]:
    """Where this process runs: ``rank`` (global), ``host``, ``device`` (``cuda:3``, ``cpu``), ``local_rank``."""
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    return {"rank": int(getattr(trainer, "global_rank", 0) or 0), "host": socket.gethostname(),
            "device": str(device) if device is not None else "cpu",
            "local_rank": int(getattr(trainer, "local_rank", 0) or 0)}


def replicates(strategy: Any, module: Any = None) -> bool:
    """Does every rank of ``strategy`` hold the same whole training state, with gradients all-reduced over every
    parameter (DDP and its start methods)? Not a sharding strategy, not DeepSpeed (whose ZeRO stages partition the
    optimizer state), and no parameter of ``module`` left out of the all-reduce. Duck-typed on the class names."""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    if shards_gradients(strategy) or any("DeepSpeed" in n for n in names) or not any("DDP" in n for n in names):
        return False
    return not getattr(module, "_ddp_params_and_buffers_to_ignore", None)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (a double result of one float32 operation rounds to float32's own result)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _same(x: Any) -> Any:
    return x


def replicas_disagree(own: Any, signed: Any, sq: Any, bad: Any, world: int, signed_limit: float, sq_limit: float,
                      r: Callable[[Any], Any] = _same) -> Any:
    """Do the ranks' copies of the reduced gradient disagree? From the summed replica fields (:data:`REPLICA_FIELDS`).

    The same float32 operations on the device (0-dim tensors, ``r`` the identity) and on the host (floats, ``r``
    rounding each result to float32: :func:`_f32`), so that a step skipped on the device is judged alike one step
    later. Disagree when some copies are non-finite and others are not, or, every copy finite:

    - the signed sum: each rank adds its norm with the sign of its rank (+ even, - odd); identical norms leave
      ``mean sign x sum`` to within rounding (``world x eps``), one rank off by ``d`` leaves about ``+-d``: its
      deviation over the mean norm is compared with ``signed_limit``;
    - the sum of squares: ``world x sum(x^2) - sum(x)^2`` is the sum of the squared differences of every pair of
      ranks, never zero when they differ (two deviations cannot cancel), but it rounds at ``sqrt(eps)``: the root
      of their mean over ``world - 1`` pairs, over the mean norm, is compared with ``sq_limit``.

    Norms too large to square (or sum) in float32 compare nothing (NaN comparisons are false).
    """
    mixed = (bad > 0) & (bad < world)
    mean_sign = r((world % 2) / world)
    deviation = abs(r(signed - r(own * mean_sign)))
    by_sign = r(deviation * world) > r(abs(own) * r(signed_limit))
    pairs = r(r(sq * world) - r(own * own))
    by_square = r(pairs * r(float(world * world))) > r(r(own * own) * r(sq_limit * sq_limit * (world - 1)))
    return mixed | ((bad == 0) & (by_sign | by_square))


def odd_ranks(norms: Sequence[float], limit: float, recomputed: Optional[float] = None) -> tuple[list[int], str]:
    """Which ranks' copies disagree, from every rank's own norm of its copy: ``(ranks, how)``.

    With 3 or more ranks, by majority: the ranks whose norm is not within ``limit`` (relative) of a norm that more
    than half of the ranks share. Else (2 ranks, or no majority), from ``recomputed``, the norm of the reduced
    gradient recomputed from every rank's replayed local gradient: the rank farther from it, if it is at least
    twice as far as the other. ``([], "untold")`` when neither tells.
    """
    def close(a: float, b: float) -> bool:
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(a - b) <= limit * max(abs(a), abs(b))

    world = len(norms)
    if world >= 3:
        for x in norms:
            if sum(close(x, y) for y in norms) * 2 > world:
                return [r for r, y in enumerate(norms) if not close(x, y)], "majority"
    if recomputed is not None and math.isfinite(recomputed):
        far = [abs(x - recomputed) if math.isfinite(x) else math.inf for x in norms]
        order = sorted(range(world), key=lambda r: far[r])
        if far[order[-1]] > 0 and far[order[-1]] >= 2 * far[order[-2]]:
            return [order[-1]], "recomputed"
    return [], "untold"


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _words(t: Tensor) -> Tensor:
    """The bits of ``t`` as signed integers: int32 words for elements of 4 bytes and wider (an 8-byte element is
    two words), else of the element's width."""
    size = t.element_size()
    if size > 4 and size % 4 == 0:
        return t.reshape(-1).view(torch.int32)
    return t.view(_BITS.get(size, torch.uint8))


def bits_checksum(tensors: Iterable[Tensor]) -> Optional[Tensor]:
    """0-dim int64 tensor: the sum of the bit patterns of ``tensors`` (as integers: :func:`_words`) modulo 2^32 (as
    a signed 32-bit value), on the device. Exact (integer arithmetic wraps: the sum is modular) and independent
    of the order of the sum: identical copies give identical checksums, and a changed element of 4 bytes or less
    changes it, by ``d`` with ``0 < |d| < 2^32`` (one flipped bit: by +-2^b). Sparse, empty and sharded (DTensor)
    tensors are left out; None when nothing is left. No sync: one integer sum per tensor, in int32 (an int64 sum of
    the words would upcast every element: 4x the time on the CPU), and one of their stack."""
    parts: list[Tensor] = []
    with torch.no_grad():  # (cheaper than a detach per tensor: this runs every step, over every gradient)
        for t in tensors:
            if t.layout is not torch.strided or not t.numel() or hasattr(t, "placements"):
                continue
            size = t.element_size()
            words = t.view(_BITS[size]) if size in _BITS else _words(t)
            parts.append(words.sum(dtype=torch.int32))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0].long()
    first = parts[0].device
    same = all(p.device == first for p in parts)
    return torch.stack(parts if same else [p.to(first) for p in parts]).sum(dtype=torch.int32).long()


def weights_checksum(module: Any) -> Optional[Tensor]:
    """0-dim int64 tensor: :func:`bits_checksum` of every parameter of ``module``; None without parameters."""
    return bits_checksum(module.parameters())


# ------------------------------------------------------------------- the exact replica check, in float32 sums

FLOAT32_EXACT = 2 ** 24  # every integer up to this is exact in float32, and so is every partial sum below it


def checksum_weight(rank: int, world: int) -> int:
    """The rank's weight in the checksum fields: non-zero integers that sum to 0 over the ``world`` ranks, so that
    identical checksums cancel and one rank's difference never does. +1, -1 alternating; with an odd number of
    ranks the last three are 2, -1, -1."""
    if world % 2 and rank >= world - 3:
        return (2, -1, -1)[rank - (world - 3)]
    return 1 if rank % 2 == 0 else -1


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def checksum_primes(world: int, count: int = 3) -> tuple[int, ...]:
    """The ``count`` largest odd primes ``p`` with ``sum(|weight|) x (p - 1) < 2^24``: every field (the ranks'
    weighted residues modulo ``p``) and every partial sum of it is an integer that float32 holds exactly, whatever
    the order of the all-reduce. Their product (2^69 for 2 ranks, 2^42 at 1,000, above 2^32 up to 8,190) bounds
    what the check misses: a checksum difference that is a multiple of every prime, which no difference of two
    :func:`bits_checksum` values (``0 < |d| < 2^32``) is below 8,191 ranks."""
    total = sum(abs(checksum_weight(r, world)) for r in range(world))
    n = max(3, (FLOAT32_EXACT - 1) // total)
    found: list[int] = []
    while len(found) < count and n >= 3:
        if _is_prime(n):
            found.append(n)
        n -= 1
    return tuple(found)


def checksum_parts(checksum: Tensor, weight: int, primes: Tensor) -> Tensor:
    """This rank's checksum fields: ``weight x (checksum mod p)`` for each of ``primes`` (an int64 tensor on the
    checksum's device), as float32, exact (:func:`checksum_primes`). A few device ops on 0-dim tensors, no sync."""
    return (torch.remainder(checksum, primes) * weight).float()


def checksums_disagree(summed: Union[Tensor, Sequence[Any]]) -> Any:
    """Do the ranks' checksums differ? From the checksum fields summed over ranks: identical checksums cancel
    (the weights sum to 0), so every field is 0; one rank whose checksum differs by ``d`` leaves ``weight x (d mod
    p)`` in each, 0 for all of them only when ``d`` is a multiple of every prime. Exact: an integer compared with
    0, the same on the device (a float32 tensor) and on the host (floats)."""
    if isinstance(summed, Tensor):
        return summed.ne(0).any()
    return any(v != 0 for v in summed)


def own_residues(parts: Sequence[float], weight: int) -> tuple[int, ...]:
    """This rank's checksum modulo each prime, back from its (unreduced) checksum fields."""
    return tuple(int(round(v)) // weight for v in parts)


def odd_checksums(residues: Sequence[Optional[Sequence[int]]],
                  recomputed: Optional[Sequence[int]] = None) -> tuple[list[int], str]:
    """Which ranks' copies differ, exactly, from every rank's checksum residues (:func:`own_residues`): with 3 or
    more ranks the ones that differ from the residues more than half of the ranks share (``majority``); else the
    ranks that differ from ``recomputed``, the residues of the reduced gradient recomputed from every rank's
    replayed local gradient, when some rank's copy matches it (``recomputed``). ``([], "untold")`` otherwise."""
    keys = [None if r is None else tuple(r) for r in residues]
    world = len(keys)
    if world >= 3:
        for k in keys:
            if k is not None and keys.count(k) * 2 > world:
                return [r for r, x in enumerate(keys) if x != k], "majority"
    if recomputed is not None and tuple(recomputed) in keys:
        return [r for r, x in enumerate(keys) if x != tuple(recomputed)], "recomputed"
    return [], "untold"


def shards_gradients(strategy: Any) -> bool:
    """Does ``strategy`` shard gradients across ranks? (duck-typed on the class names, no isinstance)"""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    return any(key in name for name in names for key in _SHARDING_NAMES)


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a tensor (a DTensor's local tensor; a plain tensor as it is)."""
    return local(t)


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


class StepSync:
    """How the guard's per-step flags agree across ranks. ``distributed`` is False on one process."""

    def __init__(self, world_size: int = 1, sharded: bool = False, norm_type: float = 2.0,
                 group: Optional[Any] = None, replicas: bool = False, tolerance: float = 1e-3,
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
    def for_trainer(cls, trainer: Any, norm_type: float = 2.0, replicas: bool = False,
                    tolerance: float = 1e-3, exact: bool = True) -> "StepSync":
        strategy = getattr(trainer, "strategy", None)
        replicas = replicas and replicates(strategy, getattr(trainer, "lightning_module", None))
        return cls(int(getattr(trainer, "world_size", 1) or 1), shards_gradients(strategy), norm_type,
                   replicas=replicas, tolerance=tolerance, exact=exact)

    # ------------------------------------------------------------------------------------------- replicas

    def own_parts(self, norm: Tensor, grads: Sequence[Tensor] = ()) -> dict[str, Tensor]:
        """The replica fields of this rank's evidence vector, from its copy of the reduced gradient ``grads`` and
        its own norm of it (a few device ops, and with ``replica_compare: exact`` one integer sum per gradient: no
        sync); empty without the replica check."""
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
        """0-dim bool on the device: the reduced vector ``vec`` says the replicas disagree (no sync); None without
        the check."""
        if not self.replicas:
            return None
        own, signed, sq, bad = (vec[SCHEMA.index[n]] for n in REPLICA_FIELDS)
        if self.exact:
            first = SCHEMA.index[CHECKSUM_FIELDS[0]]
            return (bad > 0) & (bad < self.world_size) | checksums_disagree(vec[first:first + len(CHECKSUM_FIELDS)])
        return replicas_disagree(own, signed, sq, bad, self.world_size, self.signed_limit, self.sq_limit)

    def disagreement(self, flags: Any) -> Optional[dict[str, Any]]:
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
        found: dict[str, Any] = {"compared": "tolerance", "nonfinite_copies": int(bad), "mean_grad_norm": mean,
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

    def snapshot_agreement(self, module: Any, flags: Sequence[bool]) -> tuple[bool, list[bool]]:
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

    def gather(self, payload: Any) -> list[Any]:
        """Every rank's ``payload`` (one ``all_gather_object``; incident only)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, payload, group=self.group)
        return gathered

    def grad_norm(self, grads: Sequence[Tensor]) -> Tensor:
        """The fused total norm; under sharding the local power sum that :meth:`reduce` completes."""
        if self.sharded:
            return local_norm_power(grads, self.norm_type, self.world_size)
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

    def shard_bad(self, local: Optional[Tensor] = None) -> bool:
        """Sharded: is this rank's own share of the gradient (its ``sum |g|^p`` before :meth:`reduce`) non-finite?
        (syncs: incident only; False when not sharded)"""
        local = self._local if local is None else local
        return self.sharded and local is not None and not math.isfinite(float(local[SCHEMA.norm]))

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


def share_incident(sync: StepSync, event: Any, extra: str, local: Optional[Tensor] = None,
                   own_norm: Optional[float] = None, recomputed: Optional[tuple[float, Any]] = None,
                   found: Optional[bool] = None) -> str:
    """On an incident: gather every rank's evidence and make every rank adopt the same account.

    The chosen rank is the one that produced the fault:

    - a replica disagreement (``event.kind == "replica"``; ``own_norm``: this rank's norm of its copy of the
      reduced gradient, ``recomputed``: the norm and checksum residues of the reduced gradient recomputed from the
      replays, :meth:`StepSync.reduced_norm`): the first rank whose copy disagrees, by its checksum
      (:func:`odd_checksums`, ``replica_compare: exact``), else by its norm (:func:`odd_ranks`);
    - the first whose own weights hold the non-finite values (under sharding a rank checks its own shards, and a
      bad shard spoils every rank's loss through the forward's all-gather);
    - else the first whose own replay of its own micro-batches reproduced the fault (``details.replay``);
    - else the first with local evidence (a non-finite loss, input, parameter or module output);
    - else the first whose diagnosis found something of its own (bad inputs, an op);
    - else (sharded) the first whose own share of the gradient is non-finite (a fault after the backward, in one
      rank's shard: the others' are finite);
    - else nobody knows: rank 0's account, and ``details.ranks`` is empty (e.g. a fault that no rank's replay
      reproduces, in a gradient the all-reduce spread to every rank).

    ``event.rank`` (and ``host``, ``device``, ``local_rank``) become the chosen rank's and
    ``event.details["ranks"]`` lists the ranks with evidence (the disagreeing ones, for a replica). Returns the
    chosen rank's report text. Costs one ``all_gather_object``; never called in steady state. ``local``: the
    rank's vector of the incident's step when it is not the last one reduced (a lagged read). ``found``: an
    incident outside a step (before a snapshot or a checkpoint, at validation or the end of fit): this rank's own
    evidence (its weights or optimizer state non-finite), instead of a step's flags.
    """
    if not sync.distributed:
        return extra
    residues = None
    if event.kind == "replica" and own_norm is not None and sync.primes:  # this rank's checksum, from its fields
        vec = sync.last_local if local is None else local
        if vec is not None:
            first = SCHEMA.index[CHECKSUM_FIELDS[0]]
            residues = own_residues(vec[first:first + len(CHECKSUM_FIELDS)].tolist(), sync.weight)
    shard = found is None and sync.shard_bad(local)
    own_flags = [bool(found)] if found is not None else sync.local_flags(local)
    own = bool(event.op) or bool(event.details.get("inputs")) or event.kind == "input"
    reproduced = bool((event.details.get("replay") or {}).get("reproduced"))
    weights = event.kind in ("parameter", "buffer") and bool(event.details.get("nonfinite_parameters"))
    evidence = 5 if weights else 4 if reproduced else 3 if any(own_flags) else 2 if own else 1 if shard else 0
    payload = {"rank": sync.rank, "evidence": evidence, "local": own_flags, "extra": extra, "own_norm": own_norm,
               "residues": None if residues is None else list(residues),
               "event": {k: getattr(event, k) for k in _EVENT_FIELDS}}
    gathered = sync.gather(payload)
    ranks = [p["rank"] for p in gathered if p["evidence"] > 0]
    best = max(gathered, key=lambda p: (p["evidence"], -p["rank"]))
    odd: Optional[tuple[list[int], str]] = None
    norm, checksum = recomputed if recomputed is not None else (None, None)
    if event.kind == "replica" and own_norm is not None:
        norms = [math.nan if p["own_norm"] is None else float(p["own_norm"]) for p in gathered]
        odd = ([], "untold")
        if sync.primes:  # exact: by the copies' checksums
            odd = odd_checksums([p["residues"] for p in gathered], checksum)
        if not odd[0]:
            odd = odd_ranks(norms, sync.tolerance, norm)
        ranks = odd[0]
        if odd[0]:
            best = gathered[odd[0][0]]
    for key, value in best["event"].items():
        setattr(event, key, value)
    event.rank = best["rank"]
    event.details = dict(event.details)
    event.details["ranks"] = ranks
    if odd is not None:
        event.details["replica"] = dict(event.details.get("replica") or {}, grad_norms=norms, odd_ranks=odd[0],
                                        found_by=odd[1], recomputed_grad_norm=norm)
        if sync.primes:
            event.details["replica"]["checksum_residues"] = [p["residues"] for p in gathered]
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
