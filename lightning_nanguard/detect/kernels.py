"""Fused device-side checks: non-finite flags and the total gradient norm.

Functions named ``*_flag`` return a 0-dim bool tensor on the device and never synchronise; the guard folds
them, with the total gradient norm and the loss, into the step's evidence vector (:mod:`.vector`), which it
reads once per optimizer step.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

from ..core.dtensors import local
from ..core.layouts import is_strided, stored_values

__all__ = ["nonfinite_flag", "any_nonfinite_flag", "dense_nonfinite_flag", "total_norm", "total_norm_parts",
           "CPU_CHUNK"]

# CPU: tensors below this many elements are concatenated (bounded temporary copy: 4 MiB of float32)
CPU_CHUNK = 1 << 20


def nonfinite_flag(t: Tensor) -> Tensor:
    """0-dim bool tensor: does ``t`` hold any NaN or +-Inf? (no host sync)"""
    return ~torch.isfinite(t.detach()).all()


def any_nonfinite_flag(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """0-dim bool tensor: does any of ``tensors`` hold a NaN or +-Inf? A few fused kernels, no host sync.

    Exact (no overflow on huge finite values) and ``None`` for an empty list; integer tensors are ignored, sparse
    and nested ones are judged by their stored values (:mod:`~lightning_nanguard.core.layouts`).
    Each result is tested in its own dtype, so a float64 value beyond float32's range is still finite.

    - CUDA and other devices: one fused inf-norm (abs-max, multi-tensor apply) per device.
    - CPU, where a kernel per tensor costs microseconds and torch's inf-norm is not vectorised (~5 ns per
      element): small tensors are concatenated into bounded chunks and reduced as ``sum(chunk * 0)``, which is
      0 when every value is finite and NaN otherwise; large tensors use ``aminmax`` (one pass, no copy).
    """
    floats = [local(t).detach() if is_strided(t) else stored_values(t, coalesce=False) for t in tensors
              if t.is_floating_point() or t.is_complex()]  # a DTensor: its local shard
    return dense_nonfinite_flag([t for t in floats if t is not None])  # sparse, nested: their stored values


def dense_nonfinite_flag(floats: Sequence[Tensor]) -> Optional[Tensor]:
    """:func:`any_nonfinite_flag` of floating strided tensors (detached), for callers that prepared them."""
    if not floats:
        return None
    results: list[Tensor] = []
    others: dict[torch.device, list[Tensor]] = {}
    small: list[Tensor] = []
    small_numel = 0
    for t in floats:
        if t.device.type != "cpu":
            if t.numel():  # an empty tensor holds nothing non-finite, and its inf-norm is an error
                others.setdefault(t.device, []).append(t)
        elif t.numel() >= CPU_CHUNK or t.is_complex():
            results.extend(torch.aminmax(t) if not t.is_complex() else (t.mul(0).sum(),))
        else:
            small.append(t.reshape(-1))
            small_numel += t.numel()
            if small_numel >= CPU_CHUNK:
                results.append(torch.cat(small).mul_(0).sum())
                small, small_numel = [], 0
    if small:
        results.append(torch.cat(small).mul_(0).sum() if len(small) > 1 else small[0].mul(0).sum())
    for group in others.values():
        results.extend(torch._foreach_norm(group, math.inf))
    by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for r in results:  # grouped by dtype: each value is judged in its own range
        by_key.setdefault((r.device, r.dtype), []).append(r)
    flags = [~torch.isfinite(torch.stack(rs)).all() for rs in by_key.values()]
    return _any(flags)


def _any(flags: Sequence[Tensor]) -> Tensor:
    first = flags[0]
    for f in flags[1:]:
        first = first | f.to(first.device)
    return first


def total_norm(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Fused total norm of ``tensors`` (e.g. gradients) as a 0-dim float tensor; 0 for an empty list.

    The same arithmetic as ``torch.nn.utils.get_total_norm`` (a foreach norm per tensor, then the norm of
    their stack), so clipping with it is bitwise what the Trainer's clipping computes; the common case of
    one device and dtype skips its per-tensor ``.to()`` calls (a dispatch each, every step). A sparse gradient
    counts with its coalesced values (torch's own norm functions refuse sparse tensors).
    """
    return total_norm_parts(tensors, norm_type, parts=False)[0]


def total_norm_parts(tensors: Sequence[Tensor], norm_type: float = 2.0,
                     parts: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`total_norm` and the per-tensor norms it was reduced from (a 1-dim float32 device tensor, one per
    tensor, in order: what the gradient-flow window keeps, :mod:`.flow`); None where there is no such stack (an
    empty list, sparse tensors, an inf-norm over empty tensors). The total is bitwise :func:`total_norm`'s."""
    if math.isinf(norm_type):  # the inf-norm of an empty tensor is an error (an empty parameter's gradient)
        kept = [t for t in tensors if t.numel()]
        aligned = len(kept) == len(tensors)
        tensors = kept
    else:
        aligned = True
    if not tensors:
        return torch.zeros(()), None
    try:
        total, stacked = _total_norm(tensors, norm_type, parts)
        return total, stacked if aligned else None
    except (NotImplementedError, RuntimeError):  # no cost to dense runs: sparse tensors raise in torch's norms
        if all(is_strided(t) for t in tensors):
            raise
    values = [v for v in (t if is_strided(t) else stored_values(t) for t in tensors) if v is not None]
    return (_total_norm(values, norm_type, False)[0] if values else torch.zeros(())), None


def _total_norm(tensors: Sequence[Tensor], norm_type: float, parts: bool) -> tuple[Tensor, Optional[Tensor]]:
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype for t in tensors) and (
            first.device.type in ("cpu", "cuda")):
        stacked = torch.stack(torch._foreach_norm(list(tensors), norm_type))
        return torch.linalg.vector_norm(stacked, norm_type), stacked
    total = torch.nn.utils.get_total_norm(tensors, norm_type=norm_type, error_if_nonfinite=False, foreach=None)
    if not parts:
        return total, None
    # mixed devices or dtypes (rare): the per-tensor norms once more, gathered on the total's device
    return total, torch.stack([torch.linalg.vector_norm(t.detach(), norm_type).to(total.device, torch.float32)
                               for t in tensors])
