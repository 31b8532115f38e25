"""Incident-time finders: which tensors, samples and features hold NaN/Inf.

These synchronise freely and return plain Python evidence; nothing here runs while training is healthy.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

from ..tree import iter_tensors

__all__ = ["find_nonfinite_tensors", "find_batch_nonfinite", "nonfinite_rows"]


def find_nonfinite_tensors(named: Iterable[tuple[str, Tensor]], limit: int = 20) -> list[dict[str, Any]]:
    """Names and counts of the floating tensors that hold NaN/Inf."""
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
    for path, t in iter_tensors(batch):
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


def nonfinite_rows(named: dict[str, Tensor], findings: list[dict], limit: int = 20) -> list[dict]:
    """``findings`` with, for 2-D+ tensors, the indices of the rows (dim 0) holding NaN/Inf."""
    out = []
    for f in findings:
        t = named.get(f["name"])
        if t is not None and t.dim() >= 2:
            bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
            f = dict(f, rows=bad.nonzero().flatten()[:limit].tolist())
        out.append(f)
    return out
