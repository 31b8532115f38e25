"""The replica check's arithmetic (``check.replicas``, DDP): pure functions over numbers and tensors.

The reduced gradient is identical on every rank by construction, so each rank puts a summary of its own copy into
the step's one all-reduce (:meth:`.ranks.Ranks.own_parts`), which every rank reads alike, with no extra collective
and no extra host read:

- ``check.replica_compare: exact`` (the default): a checksum of the copy's bits (:func:`bits_checksum`, the sum of
  its words as integers, modulo 2^32), as three integers that float32 sums carry exactly: ``weight x (checksum
  mod p)`` for three primes (:func:`checksum_primes`), with weights that sum to 0 over ranks
  (:func:`checksum_weight`). Identical copies leave three zeros; one rank whose copy differs by any one element
  (any flipped bit) never does (:func:`checksums_disagree`).
- ``tolerance``: its norm (its sum, a sum signed by the rank, the sum of squares). Identical norms cancel in the
  signed sum to within rounding; a rank whose norm differs by more than ``check.replica_tolerance`` leaves its
  difference there (:func:`replicas_disagree`). For ranks whose copies may legitimately differ in their last bits.

Both count the non-finite copies. At every snapshot, a checksum of the weights' bits (:func:`weights_checksum`) is
compared across ranks (:meth:`.ranks.Ranks.snapshot_agreement`: one small all-reduce per snapshot). On an incident,
:func:`odd_checksums` and :func:`odd_ranks` name the ranks whose copies differ.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

__all__ = ["replicas_disagree", "odd_ranks", "weights_checksum", "bits_checksum", "checksum_weight",
           "checksum_primes", "checksum_parts", "checksums_disagree", "own_residues", "odd_checksums",
           "REPLICA_FIELDS", "CHECKSUM_FIELDS", "EPS32", "FLOAT32_EXACT"]

REPLICA_FIELDS = ("own_grad_norm", "own_grad_norm_signed", "own_grad_norm_sq", "own_grad_bad")
CHECKSUM_FIELDS = ("grad_checksum_0", "grad_checksum_1", "grad_checksum_2")
EPS32 = 2.0 ** -24  # float32's unit roundoff


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


def weights_checksum(module: nn.Module) -> Optional[Tensor]:
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


def checksums_disagree(summed: Union[Tensor, Sequence[float]]) -> Union[Tensor, bool]:
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
