"""The parameters and buffers of the module: one cheap device flag when they are checked, and names on an
incident."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..core.dtensors import local
from ..core.layouts import checkable, is_strided
from .find import find_nonfinite_tensors
from .kernels import CPU_CHUNK, dense_nonfinite_flag

__all__ = ["WeightCheck"]


class WeightCheck:
    """``any_nonfinite_flag`` over a module's parameters and buffers, cheaply, whenever they are checked (before a
    snapshot or validation; after every optimizer step only while ``check.loss`` or ``check.gradients`` is off).

    Walking ``parameters()`` and ``buffers()`` and preparing the tensors costs a Python call or a dispatch
    per tensor, every step. Here the floating tensors are collected once (with flat views of the small CPU
    ones, ready to concatenate) and re-collected when :meth:`refresh` is called (at every snapshot and
    rollback) or when any tensor's storage moved (``p.data = ...``; checked per call by data pointer). A
    parameter registered mid-fit is therefore seen from the next snapshot on.

    A sparse adjacency buffer (COO, CSR, ...) is checked by its stored values (:mod:`..layouts`); a layout
    that cannot be read is skipped with one warning.

    Buffers that hold NaN/Inf before training are by design (a float causal mask of -inf, a padding table):
    :meth:`exempt_nonfinite_buffers` leaves them out of every check. Parameters never are.
    """

    def __init__(self) -> None:
        self.exempt: frozenset[str] = frozenset()  # names never checked (e.g. a causal mask holding -inf)
        self._module: Optional[nn.Module] = None
        self._tensors: list[Tensor] = []
        self._ptrs: list[int] = []
        # flat views of small contiguous CPU tensors, per dtype, and the preallocated buffer they are
        # concatenated into (a fresh multi-MB allocation per step costs page faults, more than the reduction)
        self._small: list[tuple[list[Tensor], Tensor]] = []
        self._rest: list[Tensor] = []  # everything else, through any_nonfinite_flag
        self._layouts: list[tuple[str, Tensor]] = []  # sparse and nested tensors (see ..layouts)

    def refresh(self) -> None:
        self._module = None

    def exempt_nonfinite_buffers(self, module: nn.Module) -> list[str]:
        """Exempt the buffers that are non-finite now (before training); returns their names."""
        named = list(module.named_buffers())
        flag = dense_nonfinite_flag(checkable(named))
        found = find_nonfinite_tensors(named, limit=len(named)) if flag is not None and bool(flag) else []
        self.exempt = frozenset(f["name"] for f in found)
        self.refresh()
        return sorted(self.exempt)

    def named(self, module: nn.Module) -> list[tuple[str, Tensor]]:
        """The checked ``(name, tensor)`` pairs: parameters, then buffers, without the exempt ones."""
        return [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers())
                if n not in self.exempt]

    def find(self, module: nn.Module) -> list[dict]:
        """Names and counts of the non-finite parameters and buffers (syncs; incident path only)."""
        named = self.named(module)
        flag = dense_nonfinite_flag(checkable(named))
        if flag is None or not bool(flag):
            return []
        return find_nonfinite_tensors(named)

    def _collect(self, module: nn.Module) -> None:
        named = [(n, t) for n, t in self.named(module) if t.is_floating_point() or t.is_complex()]
        sources = [t for _, t in named if is_strided(t)]
        # sparse and nested tensors: their stored values, taken at every check (a copy of another sparsity moves them)
        self._layouts = [(n, t) for n, t in named if not is_strided(t)]
        tensors = [local(t).detach() for t in sources]  # a DTensor: its local shard (:mod:`..dtensors`)
        self._module, self._tensors = module, sources  # the parameters themselves: ``.data =`` moves their pointer
        self._ptrs = [local(t).data_ptr() for t in sources]
        small = [t for t in tensors if t.device.type == "cpu" and not t.is_complex() and t.is_contiguous()
                 and t.numel() < CPU_CHUNK]
        if sum(t.numel() for t in small) > 4 * CPU_CHUNK or len(small) < 2:
            small = []
        ids = {id(t) for t in small}
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in small:
            by_dtype.setdefault(t.dtype, []).append(t.view(-1))
        self._small = [(views, torch.empty(sum(v.numel() for v in views), dtype=dtype))
                       for dtype, views in by_dtype.items()]
        self._rest = [t for t in tensors if id(t) not in ids]

    def flag(self, module: nn.Module) -> Optional[Tensor]:
        """0-dim bool tensor: does any floating parameter or buffer of ``module`` hold NaN/Inf? (no sync)"""
        if module is not self._module or [local(t).data_ptr() for t in self._tensors] != self._ptrs:
            self._collect(module)
        parts = []
        for views, buf in self._small:  # sum(x * 0) is 0 when every x is finite, NaN otherwise
            parts.append(~torch.isfinite(torch.cat(views, out=buf).mul_(0).sum()))
        rest = self._rest + checkable(self._layouts) if self._layouts else self._rest
        flag = dense_nonfinite_flag(rest) if rest else None
        if flag is not None:
            parts.append(flag)
        if not parts:
            return None
        flag = parts[0]
        for p in parts[1:]:
            flag = flag | p.to(flag.device)
        return flag
