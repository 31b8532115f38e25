"""The passes of an incident replay over one micro-batch, shared by the one-process replay (:mod:`.replay`) and the
lockstep one of a sharded module (:mod:`.lockstep`); nothing here runs while training is healthy.

- :func:`recorded_run`: ``training_step`` and its gradients under a :class:`~.probes.FrameRecorder` (forward and
  full backward hooks on every module), then :func:`nonfinite_gradients`, :func:`first_bad_forward` (the first
  module call whose output is non-finite while its inputs were finite; post-order hooks make it the innermost
  module that ran the bad op) and :func:`first_bad_backward` (the first module, in backward order, whose input
  gradients are non-finite while its output gradients were finite);
- :func:`op_pass`: the forward again under :class:`~.probes.FirstBadOp`, naming the first op inside that module call
  (or, with no such module, in ``training_step``) that made a non-finite value, recomputed in float64 on its inputs;
- :func:`anomaly_pass`: forward and backward under ``detect_anomaly(check_nan=True)`` with a
  :class:`~.probes.GraphWatch` on the autograd graph, naming the first backward function that produced NaN *or* Inf
  next to what anomaly mode reports (:func:`parse_anomaly_error`).
"""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ..core.dtensors import local
from ..core.jsonvalue import JSONDict
from ..detect.kernels import total_norm
from .probes import FirstBadOp, Frame, FrameRecorder, GraphWatch, all_finite, floats_of, format_frames, forward_trace
from .rerun import (
    ReplayResult,
    Rewritten,
    RngState,
    forward_context,
    gradients,
    preserved_state,
    reentrant_checkpoint,
    run_step,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import Precision

__all__ = ["recorded_run", "nonfinite_gradients", "first_bad_forward", "first_bad_backward", "op_pass",
           "anomaly_pass", "parse_anomaly_error"]

_ANOMALY_RE = re.compile(r"Function '(\w+)' returned (nan|inf) values in its (\d+)(?:st|nd|rd|th) output")


def recorded_run(res: ReplayResult, module: "pl.LightningModule", batch: object, batch_idx: int,
                 rng: Optional[RngState], plugin: Optional["Precision"],
                 named: list[tuple[str, Tensor]]) -> tuple[FrameRecorder, list[Optional[Tensor]]]:
    """``training_step`` and its gradients under a frame recorder (its frames read), without backward hooks where
    they break the module; the loss's finiteness goes into ``res``."""
    rec = FrameRecorder(module, backward=True, root_name=f"<{type(module).__name__}>")
    try:
        with rec:
            grads = _loss_and_grads(res, module, batch, batch_idx, rng, plugin, named)
    except RuntimeError as err:  # e.g. an in-place op on a hooked output: replay without backward hooks
        res.errors.append(f"backward hooks: {err}".splitlines()[0])
        rec = FrameRecorder(module, backward=False, root_name=f"<{type(module).__name__}>")
        with preserved_state(module), rec:
            grads = _loss_and_grads(res, module, batch, batch_idx, rng, plugin, named)
    rec.read()
    return rec, grads


def _loss_and_grads(res: ReplayResult, module: "pl.LightningModule", batch: object, batch_idx: int,
                    rng: Optional[RngState], plugin: Optional["Precision"],
                    named: list[tuple[str, Tensor]]) -> list[Optional[Tensor]]:
    loss = run_step(module, batch, batch_idx, rng, forward_context(plugin))
    res.loss_finite = None if loss is None else bool(torch.isfinite(loss.detach()).all())
    # (sharded: the backward is a collective the other ranks make, whatever this rank's loss)
    return gradients(loss, named) if loss is not None and (res.loss_finite or res.lockstep) else []


def nonfinite_gradients(res: ReplayResult, named: list[tuple[str, Tensor]], grads: list[Optional[Tensor]],
                        norm_type: float) -> list[str]:
    """The names of the non-finite gradients (the first 20 in ``res``); where there is none, whether the total
    norm of the finite ones overflows."""
    bad_grads = [n for (n, _), g in zip(named, grads) if g is not None and not all_finite(floats_of(g))]
    if res.lockstep and res.loss_finite is False:
        # (the gradients of a non-finite loss, computed for the other ranks' sake, say nothing more)
        res.nonfinite_grads = []
        return []
    res.nonfinite_grads = bad_grads[:20]
    if not bad_grads:
        finite = [local(g) for g in grads if g is not None]  # sharded: this rank's shards (a DTensor norm: collective)
        res.norm_overflow = bool(finite) and not bool(torch.isfinite(total_norm(finite, norm_type)))
    return bad_grads


def first_bad_forward(res: ReplayResult, rec: FrameRecorder, frames: int, bad_grads: list[str]) -> Optional[Frame]:
    """The first module call whose output is non-finite (its row and up to ``frames`` calls before it in ``res``),
    or the loss; and whether the replay reproduced the incident."""
    first_fwd = rec.first_bad(rec.forward_frames)
    res.forward_rows = [f.row() for f in rec.forward_frames[:first_fwd.index + 1 if first_fwd is not None else None]]
    res.reproduced = bool(first_fwd is not None or res.loss_finite is False or bad_grads or res.norm_overflow)
    if first_fwd is not None:
        res.forward = first_fwd.row()
        ring = rec.forward_frames[max(0, first_fwd.index - frames + 1): first_fwd.index + 1]
        res.frames_text = format_frames(ring, "forward (module call, inputs -> output):")
    elif res.loss_finite is False:
        res.forward = {"module": "training_step", "call": 0}
    return first_fwd


def first_bad_backward(res: ReplayResult, rec: FrameRecorder, frames: int) -> None:
    """The first module in backward order whose gradient is non-finite, and up to ``frames`` modules before it."""
    first_bwd = rec.first_bad(rec.backward_frames)
    end = first_bwd.index + 1 if first_bwd is not None else len(rec.backward_frames)
    if first_bwd is not None:
        res.backward = first_bwd.row()
    ring = rec.backward_frames[max(0, end - frames): end]
    if ring:
        res.frames_text = format_frames(ring, "backward (module, grad wrt outputs -> grad wrt inputs):")


def op_pass(module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
            plugin: Optional["Precision"], where: Optional[tuple[str, int]],
            float64: bool = True) -> Optional[JSONDict]:
    """The op that made the first non-finite value inside the module call ``where`` (None: in all of
    ``training_step``): :class:`~.probes.FirstBadOp`'s finding. Where no op of this rank made it and a collective
    ran there (sharded), it came in through that collective: ``{"op": None, "function": its name, "received": its
    name}``. A micro-batch its step wrote into in place (:class:`~.rerun.Rewritten`) runs on a copy, and the first
    in-place op that writes a non-finite value into a tensor the step wrote is named (:class:`~.probes.FirstBadOp`'s
    ``written``)."""
    written: list[tuple[str, Tensor]] = []
    if isinstance(batch, Rewritten):
        batch, written = batch.copy()
    rec = FrameRecorder(module, backward=False, root_name=f"<{type(module).__name__}>")
    mode = FirstBadOp(rec, where, float64, written=written)
    with rec, mode:
        run_step(module, batch, batch_idx, rng, forward_context(plugin))
    if mode.found is None and mode.collectives:
        name = mode.collectives[0]
        return {"op": None, "function": name, "module": where[0] if where else None, "received": name}
    return mode.found


def anomaly_pass(module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
                 plugin: Optional["Precision"],
                 named: list[tuple[str, Tensor]]) -> tuple[Optional[JSONDict], Optional[JSONDict]]:
    anomaly: Optional[JSONDict] = None
    watch: Optional[GraphWatch] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=True):
            loss = run_step(module, batch, batch_idx, rng, forward_context(plugin))
            if loss is None or not loss.requires_grad:
                return None, None
            watch = GraphWatch(loss)
            try:
                with watch.growing(module) if reentrant_checkpoint(loss) else nullcontext():
                    gradients(loss, named)
            except RuntimeError as err:
                anomaly = parse_anomaly_error(err) or {"message": str(err).splitlines()[0]}
            finally:
                watch.remove()
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" in text and anomaly is not None:
            anomaly["traceback"] = forward_trace(text)
    return watch.found, anomaly


def parse_anomaly_error(error: BaseException) -> Optional[JSONDict]:
    """``Function 'PowBackward0' returned nan values in its 0th output.`` -> op, value, output; else None."""
    m = _ANOMALY_RE.search(str(error))
    if m is None:
        return None
    return {"message": str(error).splitlines()[0], "op": m.group(1), "value": m.group(2), "output": int(m.group(3))}
