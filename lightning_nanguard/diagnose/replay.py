"""Incident replay: rerun the offending micro-batch on the same weights and record where it went bad.

Nothing here runs while training is healthy. On an incident,
:func:`replay_window` reruns ``training_step`` on the saved batch with the saved RNG state, inside the
precision plugin's forward context, and computes gradients with :func:`torch.autograd.grad` so ``.grad`` is
never touched. RNG, buffers (BatchNorm statistics), train/eval mode and ``log``/``log_dict`` are restored
afterwards, so a replay does not change training (:mod:`.rerun`).

Like transformers' ``DebugUnderflowOverflow``, forward hooks record per module call the abs-min, abs-max and
number of non-finite values of inputs and outputs, but the statistics stay on the device and are read once,
at the end of the replay. Evidence gathered (the passes: :mod:`.passes`):

- forward: the first module call whose output is non-finite while its inputs were finite (post-order hooks
  make it the innermost module that ran the bad op), and the first op inside it (or, with no such module, in
  ``training_step``) that made a non-finite value (a TorchFunctionMode pass: a NaN its tensor inputs did not hold, or
  an infinity none of its inputs or scalar arguments carried), recomputed in float64 on the same inputs;
- backward: the first module, in backward order, whose input gradients are non-finite while its output
  gradients were finite (full backward hooks), and the first autograd function that produced NaN *or* Inf
  (hooks on the autograd graph) next to what ``detect_anomaly(check_nan=True)`` reports;
- float64: the same forward/backward on a float64 deep copy; finite there means overflow or precision (:mod:`.float64`).

A sharded module (DTensor parameters: FSDP2, tensor parallel) is replayed by every rank together, with the same
passes (:mod:`.lockstep`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import Tensor

from ..core.dtensors import local, sharded
from ..detect.kernels import total_norm
from .float64 import float64_pass
from .lockstep import Lockstep, lockstep_window
from .passes import (
    anomaly_pass,
    first_bad_backward,
    first_bad_forward,
    nonfinite_gradients,
    op_pass,
    parse_anomaly_error,
    recorded_run,
)
from .rerun import (
    Batches,
    ReplayResult,
    RngState,
    at_step,
    eager,
    forward_context,
    gradients,
    preserved_state,
    quiet_hooks,
    run_step,
    trainable,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.plugins import Precision

__all__ = ["ReplayResult", "replay_window", "reproduces", "local_gradients", "preserved_state", "parse_anomaly_error"]


def replay_window(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
                  rng_states: Sequence[Optional[RngState]], frames: int = 21, float64_check: bool = True,
                  norm_type: float = 2.0, step: Optional[int] = None, timeout: Optional[float] = None,
                  lock: Optional[Lockstep] = None) -> ReplayResult:
    """Replay each micro-batch of the window until one reproduces the incident (a non-finite loss, output or
    gradient, or a total gradient norm that overflows) and collect the evidence. Changes nothing of training.

    Args:
        trainer: the fit's Trainer (its precision plugin and step counter).
        module: the LightningModule, on the weights the incident was judged on.
        batches: the window's micro-batches with their ``batch_idx``.
        rng_states: the RNG state before each micro-batch (None: not kept).
        frames: module calls kept before the first non-finite one, for the frames text.
        float64_check: also run the float64 pass on the micro-batch that reproduced.
        norm_type: the norm whose overflow of finite gradients is an incident too.
        step: the step the window belongs to (:func:`at_step`).
        timeout: seconds (``anomaly.replay_timeout``) after which no pass starts.
        lock: the ranks' agreement of a sharded replay (:class:`.Lockstep`); a sharded module (DTensor
            parameters) is replayed on every rank together even without one.

    Returns:
        The evidence of the first micro-batch that reproduced, else of the last one replayed
        (``ReplayResult.timeout`` says where a timeout ended it).
    """
    if lock is not None or sharded(module):
        lock = lock or Lockstep(timeout=timeout)
        return lockstep_window(trainer, module, batches, rng_states, lock, frames, float64_check, norm_type, step)
    with eager(), at_step(trainer, step):
        return _replay_window(trainer, module, batches, rng_states, frames, float64_check, norm_type,
                              None if timeout is None else time.monotonic() + timeout)


def _replay_window(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
                   rng_states: Sequence[Optional[RngState]], frames: int, float64_check: bool, norm_type: float,
                   deadline: Optional[float]) -> ReplayResult:
    result = ReplayResult()
    plugin = getattr(trainer, "precision_plugin", None)
    for i, (batch, batch_idx) in enumerate(batches):
        if deadline is not None and time.monotonic() > deadline:
            result.timeout = f"before micro-batch {i}"
            break
        rng = rng_states[i] if i < len(rng_states) else None
        result = ReplayResult(micro_batch=i)
        with preserved_state(module), quiet_hooks():
            try:
                _replay_one(result, module, batch, batch_idx, rng, plugin, frames, norm_type, float64_check)
            except Exception as err:  # the replay must never break training
                result.errors.append(f"replay: {type(err).__name__}: {err}")
        if result.reproduced:
            if float64_check and deadline is not None and time.monotonic() > deadline:
                result.timeout = "before the float64 pass"
            elif float64_check:
                with preserved_state(module):
                    try:
                        result.float64 = float64_pass(module, batch, batch_idx, rng, result)
                    except Exception as err:
                        result.errors.append(f"float64: {type(err).__name__}: {err}")
            break
    return result


def _reruns(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
            rng_states: Sequence[Optional[RngState]], step: Optional[int]) -> Iterator[Optional[Tensor]]:
    """Rerun ``training_step`` on each micro-batch of the window (at its ``step``, with its RNG state, in the
    precision plugin's forward context) and yield its loss (None where it returns none); the caller works on it
    before the next one, while nothing of training changes (:func:`preserved_state`)."""
    plugin = getattr(trainer, "precision_plugin", None)
    with eager(), at_step(trainer, step):
        for i, (batch, batch_idx) in enumerate(batches):
            rng = rng_states[i] if i < len(rng_states) else None
            with preserved_state(module):
                yield run_step(module, batch, batch_idx, rng, forward_context(plugin))


def reproduces(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
               rng_states: Sequence[Optional[RngState]], norm_type: float = 2.0,
               step: Optional[int] = None) -> Optional[bool]:
    """Does the window give a non-finite loss, gradient or total gradient norm on the module's weights as they are
    now? The light rerun behind the end-of-fit check: no hooks, no float64 pass, and, like :func:`replay_window`, it
    changes nothing (RNG, buffers, metrics, modes and ``.grad``).

    Args:
        trainer, module, batches, rng_states, step: as for :func:`replay_window`.
        norm_type: the norm whose overflow of finite gradients counts as non-finite.

    Returns:
        True when it is non-finite, False when finite, None when it could not run.
    """
    named = [("", p) for p in module.parameters() if p.requires_grad]
    lockstep = sharded(module)  # every rank reruns every micro-batch, forward and backward (:data:`LOCKSTEP`)
    found = False
    try:
        for loss in _reruns(trainer, module, batches, rng_states, step):
            if loss is None:
                continue
            found = found or not bool(torch.isfinite(loss.detach()).all())
            if found and not lockstep:
                return True
            grads = [local(g) for g in gradients(loss, named) if g is not None]
            found = found or bool(grads) and not bool(torch.isfinite(total_norm(grads, norm_type)))
            if found and not lockstep:
                return True
    except Exception:  # the check must never break training
        return None
    return found


def local_gradients(trainer: "pl.Trainer", module: "pl.LightningModule", batches: Batches,
                    rng_states: Sequence[Optional[RngState]], params: list[Tensor],
                    step: Optional[int] = None) -> Optional[list[Optional[Tensor]]]:
    """This rank's own gradient of each of ``params`` over the window, as its backward computed it before the
    all-reduce (each micro-batch's loss divided by ``accumulate_grad_batches``, as Lightning does), recomputed on
    the weights as they are now with the same RNG states; nothing is changed (as :func:`reproduces`).

    Args:
        trainer, module, batches, rng_states, step: as for :func:`replay_window`.
        params: the parameters whose gradients are wanted, in the order returned.

    Returns:
        One gradient per parameter (None where it gets none), or None when the rerun could not run.
    """
    scale = 1.0 / max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
    total: list[Optional[Tensor]] = [None] * len(params)
    try:
        for loss in _reruns(trainer, module, batches, rng_states, step):
            if loss is None:
                return None
            grads = gradients(loss * scale, [("", p) for _, p in trainable])
            for (j, _), g in zip(trainable, grads):
                if g is not None:
                    before = total[j]
                    total[j] = g if before is None else before + g
    except Exception:  # the recompute must never break training
        return None
    return total


def _replay_one(res: ReplayResult, module: "pl.LightningModule", batch: object, batch_idx: int, rng: Optional[RngState],
                plugin: Optional["Precision"], frames: int, norm_type: float = 2.0, float64: bool = True) -> None:
    """Replay one micro-batch under a frame recorder: whether it reproduces, where it first went non-finite
    (forward or backward), then the op pass or the anomaly pass."""
    named = trainable(module)
    rec, grads = recorded_run(res, module, batch, batch_idx, rng, plugin, named)
    bad_grads = nonfinite_gradients(res, named, grads, norm_type)
    first_fwd = first_bad_forward(res, rec, frames, bad_grads)
    if res.forward is not None:
        where = (first_fwd.module, first_fwd.call) if first_fwd is not None else None
        with preserved_state(module):  # every pass starts from the same buffers
            res.forward_op = op_pass(module, batch, batch_idx, rng, plugin, where, float64)
        return
    if bad_grads:
        first_bad_backward(res, rec, frames)
        with preserved_state(module):
            res.backward_op, res.anomaly = anomaly_pass(module, batch, batch_idx, rng, plugin, named)
