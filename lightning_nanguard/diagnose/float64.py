"""The float64 pass of an incident replay: the micro-batch that reproduced the fault, rerun with every floating
parameter, buffer and input in float64 (autocast off). Finite there means the working dtype is the problem
(overflow or precision), non-finite there too that the values themselves are out of range.

One process holds the whole module: :func:`float64_pass` runs on a float64 deep copy (twice the memory of a float32
module; a ``torch.compile``'d module is copied as the module it wraps). A sharded module is gathered instead
(:func:`.lockstep.whole_float64`) and run by :func:`float64_run` too.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import TYPE_CHECKING, Optional, TypeVar

import torch
from torch import nn

from ..core.layouts import deepcopy_memo
from ..core.tree import map_tensors
from ..detect.kernels import any_nonfinite_flag
from .probes import FrameRecorder, is_compiled
from ..core.jsonvalue import JSONDict
from .rerun import ReplayResult, RngState, fresh, gradients, noop, run_step

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["float64_pass", "float64_run"]

_T = TypeVar("_T")
_M = TypeVar("_M", bound=nn.Module)


def _to_double(obj: _T) -> _T:
    return map_tensors(obj, lambda t: t.double() if t.is_floating_point() else t)


def _eager_copy(module: _M) -> _M:
    """A deep copy of ``module`` without ``torch.compile``: a compiled submodule (``OptimizedModule``) is
    copied as the module it wraps, and a LightningModule compiled whole gets its own methods back (the
    compiled ``forward`` and ``*_step`` that Lightning set on it are bound to the original module)."""
    memo = deepcopy_memo(module)
    for m in module.modules():
        for child in m.children():
            if is_compiled(child) and id(child) not in memo:
                memo[id(child)] = copy.deepcopy(child._orig_mod, memo)
    ctx = getattr(module, "_compiler_ctx", None)
    if ctx is not None:
        memo[id(ctx)] = None
    twin = copy.deepcopy(module, memo)
    for key in ctx or ():  # "original_forward", "original_training_step", ...: the methods Lightning compiled
        if key.startswith("original_"):
            twin.__dict__.pop(key[len("original_"):], None)
    return twin


def float64_pass(module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
                 res: ReplayResult) -> JSONDict:
    """Forward (+ backward) on a float64 deep copy: finite there means the working dtype is the problem."""
    twin = _eager_copy(module).double()
    object.__setattr__(twin, "log", noop)  # a LightningModule's methods, shadowed on the copy
    object.__setattr__(twin, "log_dict", noop)
    if "_trainer" in vars(module):  # a LightningModule drops its trainer when copied: global_rank, global_step,
        twin.__dict__["_trainer"] = module.__dict__["_trainer"]  # current_epoch must read as in the replay
    try:
        return float64_run(twin, type(module).__name__, batch, batch_idx, rng, res)
    finally:
        del twin


def float64_run(twin: "pl.LightningModule", root: str, batch: object, batch_idx: int, rng: Optional[RngState],
                res: ReplayResult) -> JSONDict:
    """``training_step`` of ``twin`` (a module whose every floating parameter and buffer is float64; ``root``: the
    name of the original module's class) on the float64 batch, with its gradients: is it finite, and the culprit
    module's own output there."""
    named = [(n, p) for n, p in twin.named_parameters() if p.requires_grad]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    rec = FrameRecorder(twin, backward=False, root_name=f"<{root}>")
    try:
        with rec:
            loss = run_step(twin, _to_double(fresh(batch)), batch_idx, rng, nullcontext())
        grads = gradients(loss, named) if loss is not None else []
    finally:
        torch.set_default_dtype(previous)
    rec.read()
    grad_flag = any_nonfinite_flag([g for g in grads if g is not None])
    out: JSONDict = {"loss_finite": loss is not None and bool(torch.isfinite(loss.detach()).all()),
                           "grads_finite": grad_flag is None or not bool(grad_flag)}
    out["finite"] = out["loss_finite"] and out["grads_finite"]
    if loss is not None:
        out["loss"] = float(loss.detach().sum())
    if res.forward and res.forward.get("module") != "training_step":  # the culprit's own output in float64
        frame = next((f for f in rec.forward_frames if f.module == res.forward["module"]
                      and f.call == res.forward["call"]), None)
        if frame is not None:
            out["module_out_abs_max"] = frame.stats[3]
            out["module_finite"] = frame.stats[5] == 0
    return out
