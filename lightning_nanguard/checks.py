"""Pure checks over tensors and nested batches.

Functions named ``*_flag`` return a 0-dim bool tensor on the device and never synchronise; the caller
folds flags into the one host read it makes per optimizer step. Functions named ``find_*`` run only on
an incident: they synchronise freely and return plain Python evidence.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "nonfinite_flag",
    "any_nonfinite_flag",
    "total_norm",
    "iter_batch_tensors",
    "find_nonfinite_tensors",
    "find_batch_nonfinite",
    "is_finite_number",
]


def is_finite_number(x: float) -> bool:
    return math.isfinite(x)


def nonfinite_flag(t: Tensor) -> Tensor:
    """0-dim bool tensor: does ``t`` hold any NaN or +-Inf? (no host sync)"""
    return ~torch.isfinite(t.detach()).all()


def any_nonfinite_flag(tensors: Sequence[Tensor]) -> Optional[Tensor]:
    """0-dim bool tensor: does any of ``tensors`` hold a NaN or +-Inf? One fused kernel per device/dtype.

    Uses the inf-norm (abs-max), which cannot overflow for finite values and propagates NaN. Returns
    ``None`` for an empty list. Integer tensors are ignored (always finite).
    """
    floats = [t.detach() for t in tensors if t.is_floating_point() or t.is_complex()]
    if not floats:
        return None
    norms = torch._foreach_norm(floats, math.inf)
    by_device: dict[torch.device, list[Tensor]] = {}
    for n in norms:
        by_device.setdefault(n.device, []).append(n.float())
    flags = [~torch.isfinite(torch.stack(ns)).all() for ns in by_device.values()]
    first = flags[0]
    for f in flags[1:]:
        first = first | f.to(first.device)
    return first


def total_norm(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Fused total norm of ``tensors`` (e.g. gradients) as a 0-dim float tensor; 0 for an empty list."""
    if not tensors:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(tensors, norm_type=norm_type, error_if_nonfinite=False, foreach=None)


def iter_batch_tensors(batch: Any, path: str = "batch") -> Iterable[tuple[str, Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested batch.

    Understands tensors, mappings, namedtuples, dataclasses, lists and tuples; other leaves are ignored.
    """
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from iter_batch_tensors(v, f"{path}[{k!r}]")
    elif isinstance(batch, tuple) and hasattr(batch, "_fields"):
        for k in batch._fields:
            yield from iter_batch_tensors(getattr(batch, k), f"{path}.{k}")
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from iter_batch_tensors(getattr(batch, f.name), f"{path}.{f.name}")
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from iter_batch_tensors(v, f"{path}[{i}]")


def find_nonfinite_tensors(named: Iterable[tuple[str, Tensor]], limit: int = 20) -> list[dict[str, Any]]:
    """Names and counts of the floating tensors that hold NaN/Inf (syncs; incident path only)."""
    out = []
    for name, t in named:
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        t = t.detach()
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        if n_nan or n_inf:
            out.append({"name": name, "nan": n_nan, "inf": n_inf, "numel": t.numel(), "shape": list(t.shape)})
            if len(out) >= limit:
                break
    return out


def find_batch_nonfinite(batch: Any, limit: int = 50) -> list[dict[str, Any]]:
    """For every floating tensor of ``batch`` holding NaN/Inf: where it is, which samples and features.

    ``samples`` are indices along dim 0 (the batch dimension); ``features`` are indices along the last
    dimension for tensors of rank >= 2.
    """
    found = []
    for path, t in iter_batch_tensors(batch):
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t.detach())
        if not bool(bad.any()):
            continue
        entry: dict[str, Any] = {
            "field": path,
            "nan": int(torch.isnan(t).sum()),
            "inf": int(torch.isinf(t).sum()),
            "shape": list(t.shape),
        }
        if t.dim() >= 1:
            per_sample = bad.reshape(t.shape[0], -1).any(dim=1)
            entry["samples"] = per_sample.nonzero().flatten()[:limit].tolist()
        if t.dim() >= 2:
            per_feature = bad.reshape(-1, t.shape[-1]).any(dim=0)
            entry["features"] = per_feature.nonzero().flatten()[:limit].tolist()
        found.append(entry)
    return found
