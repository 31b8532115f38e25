"""Incident-time finders: which tensors, samples and features hold NaN/Inf.

These synchronise freely and return plain Python evidence; nothing here runs while training is healthy.
"""

from __future__ import annotations

from typing import Any, Iterable, TypedDict

import torch
from torch import Tensor

from ..core.dtensors import local
from ..core.layouts import coo_parts, is_strided, stored_values
from ..core.tree import iter_tensors

__all__ = ["find_nonfinite_tensors", "find_batch_nonfinite", "nonfinite_rows", "BatchFinding"]


class _Positions(TypedDict, total=False):
    samples: list[int]  # indices along dim 0
    features: list[int]  # indices along the last dim


class _Field(TypedDict):
    field: str
    nan: int
    inf: int
    shape: list[int]


class BatchFinding(_Field, _Positions, total=False):
    """A tensor of a batch holding NaN/Inf: its path, counts, shape, and which samples and features."""

    layout: str


def find_nonfinite_tensors(named: Iterable[tuple[str, Tensor]], limit: int = 20) -> list[dict[str, Any]]:
    """Names and counts of the floating tensors that hold NaN/Inf (a sparse tensor: among its stored values,
    with ``nnz`` and ``layout``)."""
    out: list[dict[str, Any]] = []
    for name, t in named:
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        values = stored_values(t, name)
        if values is None:
            continue
        values = values.detach()
        n_nan = int(torch.isnan(values).sum())
        n_inf = int(torch.isinf(values).sum())
        if n_nan or n_inf:
            entry: dict[str, Any] = {"name": name, "nan": n_nan, "inf": n_inf, "numel": t.numel(),
                                     "shape": list(t.shape)}
            if not is_strided(t):
                entry["layout"] = str(t.layout).replace("torch.", "")
                entry["nnz"] = values.shape[0] if values.dim() else 1
            out.append(entry)
            if len(out) >= limit:
                break
    return out


def find_batch_nonfinite(batch: object, limit: int = 50) -> list[BatchFinding]:
    """For every floating tensor of ``batch`` holding NaN/Inf: where it is, which samples and features.

    ``samples`` are indices along dim 0 (the batch dimension); ``features`` are indices along the last
    dimension for tensors of rank >= 2. A sparse tensor (COO, CSR, ...) is read through its stored values and
    their indices.
    """
    found: list[BatchFinding] = []
    for path, t in iter_tensors(batch):
        if not t.is_floating_point():
            continue
        values = stored_values(t, path)
        if values is None:
            continue
        bad_values = ~torch.isfinite(values.detach())
        if not bool(bad_values.any()):
            continue
        entry: BatchFinding = {
            "field": path,
            "nan": int(torch.isnan(values).sum()),
            "inf": int(torch.isinf(values).sum()),
            "shape": list(t.shape),
        }
        if is_strided(t):
            bad = bad_values
            if t.dim() >= 1:
                per_sample = bad.reshape(t.shape[0], -1).any(dim=1)
                entry["samples"] = per_sample.nonzero().flatten()[:limit].tolist()
            if t.dim() >= 2:
                per_feature = bad.reshape(-1, t.shape[-1]).any(dim=0)
                entry["features"] = per_feature.nonzero().flatten()[:limit].tolist()
        else:
            entry["layout"] = str(t.layout).replace("torch.", "")
            entry.update(_sparse_positions(t, limit))
        found.append(entry)
    return found


def _sparse_positions(t: Tensor, limit: int) -> _Positions:
    """``samples`` and ``features`` of a sparse tensor's non-finite stored entries."""
    parts = coo_parts(t)
    if parts is None:  # nested tensors: no sample index to give
        return {}
    indices, values = parts
    bad = ~torch.isfinite(values)
    per_entry = bad.reshape(values.shape[0], -1).any(dim=1)
    out: _Positions = {}
    if t.dim() >= 1:
        out["samples"] = indices[0][per_entry].unique()[:limit].tolist()
    if t.dim() >= 2:
        if indices.shape[0] == t.dim():  # the last dim is sparse: the column index of each bad entry
            out["features"] = indices[-1][per_entry].unique()[:limit].tolist()
        else:  # the last dim is dense (a hybrid tensor): the columns of the bad values
            out["features"] = bad.reshape(-1, t.shape[-1]).any(dim=0).nonzero().flatten()[:limit].tolist()
    return out


def nonfinite_rows(named: dict[str, Tensor], findings: list[dict], limit: int = 20) -> list[dict]:
    """``findings`` with, for 2-D+ tensors, the indices of the rows (dim 0) holding NaN/Inf."""
    out = []
    for f in findings:
        t = named.get(f["name"])
        t = None if t is None else local(t)  # a DTensor: the rows of this rank's shard
        if t is not None and t.dim() >= 2:
            if is_strided(t):
                bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
                f = dict(f, rows=bad.nonzero().flatten()[:limit].tolist())
            else:
                rows = _sparse_positions(t, limit).get("samples")
                if rows is not None:
                    f = dict(f, rows=rows)
        out.append(f)
    return out
