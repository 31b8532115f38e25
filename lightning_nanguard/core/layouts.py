"""Tensors that are not plain strided arrays: sparse (COO, CSR, CSC, BSR, BSC) and nested tensors.

A graph network keeps its adjacency as a sparse buffer, a batch may carry one, and an embedding with
``sparse=True`` has sparse gradients. Every check of the guard reads the *stored values* of such a tensor
(a sparse tensor's implicit zeros are finite), every copy keeps its layout (snapshots, the float64 twin, a
rollback), and a finder names the sparse indices of a bad entry. A layout the guard cannot read (e.g.
mkldnn) is skipped, with one warning per layout and name: a safety callback never crashes a healthy run
over a tensor it does not understand.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

from .console import warn
from .dtensors import local

__all__ = ["COMPRESSED", "is_strided", "stored_values", "raw_values", "checkable", "coo_parts", "nbytes",
           "copy_to_cpu", "deepcopy_memo", "load_module_state", "unchecked", "warn_once"]

COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_warned: set[tuple[str, ...]] = set()


def is_strided(t: Tensor) -> bool:
    """A plain dense tensor (what every fused check and copy of the guard was written for)."""
    return t.layout is torch.strided and not t.is_nested


def warn_once(key: tuple[str, ...], message: str) -> None:
    """One warning per ``key`` for the life of the process (from global rank 0)."""
    if key in _warned:
        return
    _warned.add(key)
    warn(message)


def unchecked(t: Tensor, name: Optional[str]) -> None:
    """Warn once per layout and name that ``t`` is skipped by every check."""
    layout = str(t.layout).replace("torch.", "")
    warn_once(("unchecked", layout, name or ""),
              f"[nanguard] {name or 'a tensor'} has layout {layout}, which NaNGuard cannot read: it is not checked "
              "for NaN/Inf (convert it to a dense or sparse COO/CSR tensor to have it checked)")


def raw_values(t: Tensor) -> Optional[Tensor]:
    """The stored values of ``t`` as a strided view of its storage (``t`` itself when strided; COO as stored,
    duplicates included; a DTensor: those of its local shard); None for a layout without one."""
    t = local(t)
    layout = t.layout
    if layout is torch.strided and not t.is_nested:
        return t
    if layout is torch.sparse_coo:
        return t._values()
    if layout in COMPRESSED or t.is_nested:
        return t.values()
    return None


def stored_values(t: Tensor, name: Optional[str] = None, coalesce: bool = True) -> Optional[Tensor]:
    """The values a check must read, as a strided tensor: ``t`` itself when strided, the values of a COO tensor
    (coalesced, unless ``coalesce`` is False), the values of a compressed or nested one; None (after one
    warning) for a layout it cannot read.

    A device flag needs no coalescing (no sort, no sync): a NaN/Inf stored anywhere makes the coalesced tensor
    non-finite too. Finders and norms coalesce, so that indices are unique and duplicates are summed. A DTensor
    is read through its local shard (:mod:`.dtensors`)."""
    t = local(t)
    if t.layout is torch.sparse_coo and coalesce:
        return t.detach().coalesce()._values()
    values = raw_values(t)
    if values is None:
        unchecked(t, name)
    return values


def checkable(named: Iterable[tuple[str, Tensor]]) -> list[Tensor]:
    """The stored values of every floating tensor of ``named`` that a check can read (detached; a tensor of
    a layout it cannot read is skipped with one warning naming it)."""
    out = []
    for name, t in named:
        if t.is_floating_point() or t.is_complex():
            values = stored_values(t, name, coalesce=False)
            if values is not None:
                out.append(values.detach())
    return out


def coo_parts(t: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """``(indices [sparse_dim, nnz], values [nnz, *dense_dims])`` of a sparse tensor, coalesced; None for
    any other layout. Incident path only (a compressed tensor is converted)."""
    if t.layout is torch.sparse_coo:
        c = t.detach().coalesce()
    elif t.layout in COMPRESSED:
        c = t.detach().to_sparse_coo().coalesce()
    else:
        return None
    return c._indices(), c._values()


def nbytes(t: Tensor) -> int:
    """Bytes held by ``t`` (indices and values of a sparse tensor)."""
    if is_strided(t):
        return t.numel() * t.element_size()
    if t.layout is torch.sparse_coo:
        return nbytes(t._indices()) + nbytes(t._values())
    if t.layout in COMPRESSED:
        compressed, plain = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                             else (t.ccol_indices(), t.row_indices()))
        return nbytes(compressed) + nbytes(plain) + nbytes(t.values())
    values = raw_values(t)
    return nbytes(values) if values is not None else 0


def copy_to_cpu(t: Tensor) -> Tensor:
    """A CPU copy of ``t`` in its own layout (never aliasing it)."""
    t = t.detach()
    return t.to("cpu") if t.device.type != "cpu" else t.clone()


def deepcopy_memo(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo with clones of the module's tensors that deepcopy cannot copy (compressed
    sparse tensors have no storage to copy): ``copy.deepcopy(module, deepcopy_memo(module))``."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if not is_strided(t) and t.layout is not torch.sparse_coo and id(t) not in memo:
            memo[id(t)] = t.clone() if not isinstance(t, nn.Parameter) else nn.Parameter(t.detach().clone(),
                                                                                          t.requires_grad)
    return memo


def _copy_back(module: nn.Module, name: str, current: Tensor, saved: Tensor) -> None:
    """Restore buffer ``name`` of ``module`` (now ``current``) to ``saved``: in place where the layout allows,
    else (a compressed buffer with another number of stored elements) by putting a copy of ``saved`` in its
    place."""
    with torch.no_grad():
        try:
            if current.layout in COMPRESSED and current.values().shape != saved.values().shape:
                raise RuntimeError("compressed layouts copy only the same number of stored elements")
            current.copy_(saved)
            return
        except RuntimeError:
            pass
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._buffers[attr] = saved.detach().clone().to(current.device)


def load_module_state(module: nn.Module, state: dict[str, Any]) -> None:
    """``module.load_state_dict(state)`` (strict), where a buffer that is not strided is put back on its own:
    a compressed sparse buffer whose number of stored elements changed since ``state`` was taken (a graph
    rebuilt by the forward) cannot be copied in place."""
    special = {name: buf for name, buf in module.named_buffers() if buf is not None and not is_strided(buf)
               and name in state}
    if not special:
        module.load_state_dict(state)
        return
    for name, buf in special.items():
        _copy_back(module, name, buf, state[name])
    result = module.load_state_dict({k: v for k, v in state.items() if k not in special}, strict=False)
    missing = [k for k in result.missing_keys if k not in special]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, "
                           f"unexpected keys {result.unexpected_keys}")
