"""Incident replay: rerun the offending micro-batch on the same weights and record where it went bad.

Nothing here runs while training is healthy. On an incident,
:func:`replay_window` reruns ``training_step`` on the saved batch with the saved RNG state, inside the
precision plugin's forward context, and computes gradients with :func:`torch.autograd.grad` so ``.grad`` is
never touched. RNG, buffers (BatchNorm statistics), train/eval mode and ``log``/``log_dict`` are restored
afterwards, so a replay does not change training.

Like transformers' ``DebugUnderflowOverflow``, forward hooks record per module call the abs-min, abs-max and
number of non-finite values of inputs and outputs, but the statistics stay on the device and are read once,
at the end of the replay. Evidence gathered:

- forward: the first module call whose output is non-finite while its inputs were finite (post-order hooks
  make it the innermost module that ran the bad op), and the first op inside it (or, with no such module, in
  ``training_step``) that made a non-finite value (a TorchFunctionMode pass: a NaN its tensor inputs did not hold, or
  an infinity none of its inputs or scalar arguments carried), recomputed in float64 on the same inputs;
- backward: the first module, in backward order, whose input gradients are non-finite while its output
  gradients were finite (full backward hooks), and the first autograd function that produced NaN *or* Inf
  (hooks on the autograd graph) next to what ``detect_anomaly(check_nan=True)`` reports;
- float64: the same forward/backward on a float64 deep copy; finite there means overflow or precision loss.
"""

from __future__ import annotations

import copy
import re
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from ..core.dtensors import is_dtensor, local, sharded
from ..core.layouts import deepcopy_memo
from ..core.record import rng_state, set_rng_state
from ..core.tree import map_tensors
from ..detect.kernels import any_nonfinite_flag, total_norm
from ..recover.metrics import MetricUndo
from .probes import (
    FirstBadOp,
    Frame,
    FrameRecorder,
    GraphWatch,
    all_finite,
    floats_of,
    format_frames,
    forward_trace,
    is_compiled,
    public_name,
)

__all__ = ["ReplayResult", "replay_window", "reproduces", "local_gradients", "preserved_state", "parse_anomaly_error"]

_ANOMALY_RE = re.compile(r"Function '(\w+)' returned (nan|inf) values in its (\d+)(?:st|nd|rd|th) output")


# --------------------------------------------------------------------------------------------- replay


@dataclass
class ReplayResult:
    micro_batch: Optional[int] = None
    reproduced: bool = False
    loss_finite: Optional[bool] = None
    forward: Optional[dict] = None  # first bad module call (frame row)
    forward_op: Optional[dict] = None
    backward: Optional[dict] = None  # first bad module in backward order
    backward_op: Optional[dict] = None  # first autograd node producing NaN/Inf
    anomaly: Optional[dict] = None  # what detect_anomaly(check_nan=True) reported
    nonfinite_grads: list[str] = field(default_factory=list)
    norm_overflow: bool = False  # every gradient finite, their total norm not (an incident too)
    float64: Optional[dict] = None
    errors: list[str] = field(default_factory=list)
    frames_text: str = ""
    forward_rows: list[dict] = field(default_factory=list)  # module calls up to the first non-finite output
    lockstep: bool = False  # sharded: the same passes on every rank (:data:`LOCKSTEP`)


# why a replay of a sharded module (DTensor parameters) does less: its forward and backward are collectives
LOCKSTEP = ("sharded (DTensor parameters): the replay's forward and backward are collectives, so every rank runs the "
            "same passes: one forward and backward per micro-batch, every micro-batch; the op search, anomaly mode "
            "and float64 passes, which only a rank that reproduced the fault would run, were not run")


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Restore RNG, buffers, torchmetrics states, train modes and ``log``/``log_dict`` of ``module`` on exit."""
    rng = rng_state()
    metrics = MetricUndo(module)  # a replayed training_step must not count its batch in the user's metrics again
    metrics.arm()
    modes = {m: m.training for m in module.modules()}
    buffers = {n: (b, b.detach().clone()) for n, b in module.named_buffers()}
    shadowed: dict[str, Any] = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    object.__setattr__(module, "log", _noop)
    object.__setattr__(module, "log_dict", _noop)
    try:
        yield
    finally:
        for k in ("log", "log_dict"):
            module.__dict__.pop(k, None)
        module.__dict__.update(shadowed)
        with torch.no_grad():
            for name, (buf, saved) in buffers.items():
                owner_name, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_name) if owner_name else module
                if owner._buffers.get(attr) is not buf:
                    owner._buffers[attr] = buf  # the forward replaced the buffer object: put the original back
                buf.copy_(saved)
        for m, mode in modes.items():
            m.training = mode
        metrics.undo()
        set_rng_state(rng)
        _reshard(module)


def _reshard(module: nn.Module) -> None:
    """FSDP2: a replay's forward all-gathered the weights, and only a completed ``backward()`` reshards them (not a
    forward whose loss was None, nor one cut short by an error): put every FSDP module back on its sharded
    parameters (local, no collective), so that what follows (a rollback, the optimizer step) sees the DTensors."""
    for m in module.modules():
        reshard = getattr(m, "reshard", None)
        if callable(reshard) and hasattr(m, "unshard"):
            reshard()


def _loss_of(output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def _run(module: Any, batch: Any, batch_idx: int, rng: Any, ctx: Any) -> Optional[Tensor]:
    set_rng_state(rng)
    with ctx, torch.enable_grad():
        return _loss_of(module.training_step(batch, batch_idx))


def _grads(loss: Tensor, named: Sequence[tuple[str, Tensor]]) -> list[Optional[Tensor]]:
    if not loss.requires_grad or not named:
        return [None] * len(named)
    params = [p for _, p in named]
    # torch.autograd.grad refuses checkpoint(..., use_reentrant=True); under FSDP2 it finds no gradient at all (the
    # sharded parameters are not in the graph of the all-gathered ones that the forward used): a real backward,
    # whose reduce-scatter every rank of a lockstep replay makes alike
    if _reentrant_checkpoint(loss) or any(is_dtensor(p) for p in params):
        return _backward_grads(loss, params)
    return list(torch.autograd.grad(loss.sum(), params, allow_unused=True))


def _reentrant_checkpoint(loss: Tensor) -> bool:
    """Does the graph of ``loss`` run through ``torch.utils.checkpoint`` with ``use_reentrant=True``?"""
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return False


def _backward_grads(loss: Tensor, params: Sequence[Tensor]) -> list[Optional[Tensor]]:
    """The gradients of ``params`` through ``loss.backward()``, every ``.grad`` put back as it was."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.sum().backward()
        return [p.grad for p in params]
    finally:
        for p, g in zip(params, saved):
            p.grad = g


@contextmanager
def eager() -> Iterator[None]:
    """Run ``torch.compile``'d modules and functions eagerly: the replay's hooks and modes would otherwise
    make dynamo trace them again (recompiling the user's graphs, or failing on the hooks)."""
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if set_stance is None:  # pragma: no cover  (torch < 2.6)
        yield
        return
    with set_stance("force_eager"):
        yield


def _step_counter(trainer: Any) -> Any:
    """The progress counter behind ``trainer.global_step`` under automatic optimization (the only kind a replay
    runs for), or None where the Trainer has none."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    optim = getattr(getattr(loop, "automatic_optimization", None), "optim_progress", None)
    total = getattr(getattr(getattr(optim, "optimizer", None), "step", None), "total", None)
    return total if isinstance(getattr(total, "completed", None), int) else None


@contextmanager
def at_step(trainer: Any, step: Optional[int]) -> Iterator[None]:
    """Inside the block ``trainer.global_step`` (and the module's) is ``step``: a step judged one step late (or at
    the end of fit) is replayed at its own number, so a ``training_step`` that reads it (a schedule, a
    curriculum, a fault injected at that step) runs as it did."""
    counter = _step_counter(trainer)
    if counter is None or step is None or counter.completed == step:
        yield
        return
    now, counter.completed = counter.completed, int(step)
    try:
        yield
    finally:
        counter.completed = now


def replay_window(trainer: Any, module: Any, batches: list[tuple[Any, int]], rng_states: list[Any],
                  frames: int = 21, float64_check: bool = True, norm_type: float = 2.0,
                  step: Optional[int] = None) -> ReplayResult:
    """Replay each micro-batch of the window until one reproduces the incident (a non-finite loss, output or
    gradient, or a total gradient norm, of ``norm_type``, that overflows); collect the evidence. ``step``: the
    step the window belongs to (:func:`at_step`)."""
    with eager(), at_step(trainer, step):
        return _replay_window(trainer, module, batches, rng_states, frames, float64_check, norm_type)


def _replay_window(trainer: Any, module: Any, batches: list[tuple[Any, int]], rng_states: list[Any],
                   frames: int, float64_check: bool, norm_type: float) -> ReplayResult:
    lockstep = sharded(module)  # every rank runs the same passes (:data:`LOCKSTEP`)
    result = ReplayResult(lockstep=lockstep)
    found: Optional[ReplayResult] = None
    plugin = getattr(trainer, "precision_plugin", None)
    for i, (batch, batch_idx) in enumerate(batches):
        rng = rng_states[i] if i < len(rng_states) else None
        result = ReplayResult(micro_batch=i, lockstep=lockstep)
        with preserved_state(module), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            warnings.filterwarnings("ignore", message="For backward hooks to be called")  # a ModelOutput
            try:
                _replay_one(result, module, batch, batch_idx, rng, plugin, frames, norm_type, float64_check)
            except Exception as err:  # the replay must never break training
                result.errors.append(f"replay: {type(err).__name__}: {err}")
        if lockstep:  # the other ranks replay every micro-batch: so does this one, keeping the first that reproduced
            found = found or (result if result.reproduced else None)
            continue
        if result.reproduced:
            if float64_check:
                with preserved_state(module):
                    try:
                        result.float64 = _float64_pass(module, batch, batch_idx, rng, result)
                    except Exception as err:
                        result.errors.append(f"float64: {type(err).__name__}: {err}")
            break
    return found or result


def _reruns(trainer: Any, module: Any, batches: list[tuple[Any, int]], rng_states: list[Any],
            step: Optional[int]) -> Iterator[Optional[Tensor]]:
    """Rerun ``training_step`` on each micro-batch of the window (at its ``step``, with its RNG state, in the
    precision plugin's forward context) and yield its loss (None where it returns none); the caller works on it
    before the next one, while nothing of training changes (:func:`preserved_state`)."""
    plugin = getattr(trainer, "precision_plugin", None)
    with eager(), at_step(trainer, step):
        for i, (batch, batch_idx) in enumerate(batches):
            rng = rng_states[i] if i < len(rng_states) else None
            with preserved_state(module):
                yield _run(module, batch, batch_idx, rng, _ctx(plugin))


def reproduces(trainer: Any, module: Any, batches: list[tuple[Any, int]], rng_states: list[Any],
               norm_type: float = 2.0, step: Optional[int] = None) -> Optional[bool]:
    """Does the window give a non-finite loss, gradient or total gradient norm (``norm_type``: an overflowing
    norm of finite gradients is an incident too) on the module's weights as they are now? The light rerun
    behind the end-of-fit check: no hooks, no float64 pass, and, like :func:`replay_window`, it changes
    nothing (RNG, buffers, metrics, modes and ``.grad`` are left as they were). None when it could not run."""
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
            grads = [local(g) for g in _grads(loss, named) if g is not None]
            found = found or bool(grads) and not bool(torch.isfinite(total_norm(grads, norm_type)))
            if found and not lockstep:
                return True
    except Exception:  # the check must never break training
        return None
    return found


def local_gradients(trainer: Any, module: Any, batches: list[tuple[Any, int]], rng_states: list[Any],
                    params: list[Tensor], step: Optional[int] = None) -> Optional[list[Optional[Tensor]]]:
    """This rank's own gradient of each of ``params`` over the window, as its backward computed it before the
    all-reduce (each micro-batch's loss divided by ``accumulate_grad_batches``, as Lightning does), recomputed on
    the weights as they are now, with the same RNG states; nothing is changed (as :func:`reproduces`). None where
    a parameter gets no gradient; None for the whole when it could not run."""
    scale = 1.0 / max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
    trainable = [(i, p) for i, p in enumerate(params) if p.requires_grad]
    total: list[Optional[Tensor]] = [None] * len(params)
    try:
        for loss in _reruns(trainer, module, batches, rng_states, step):
            if loss is None:
                return None
            grads = _grads(loss * scale, [("", p) for _, p in trainable])
            for (j, _), g in zip(trainable, grads):
                if g is not None:
                    before = total[j]
                    total[j] = g if before is None else before + g
    except Exception:  # the recompute must never break training
        return None
    return total


def _ctx(plugin: Any) -> Any:
    return plugin.forward_context() if plugin is not None else nullcontext()


def _replay_one(res: ReplayResult, module: Any, batch: Any, batch_idx: int, rng: Any, plugin: Any,
                frames: int, norm_type: float = 2.0, float64: bool = True) -> None:
    """Replay one micro-batch under a frame recorder: whether it reproduces, where it first went non-finite
    (forward or backward), then, on a rank that reproduced it, the op pass or the anomaly pass."""
    named = [(public_name(n), p) for n, p in module.named_parameters() if p.requires_grad]
    rec, grads = _recorded_run(res, module, batch, batch_idx, rng, plugin, named)
    bad_grads = _nonfinite_gradients(res, named, grads, norm_type)
    first_fwd = _first_bad_forward(res, rec, frames, bad_grads)
    if res.lockstep:
        if bad_grads:
            first_bwd = rec.first_bad(rec.backward_frames)
            res.backward = first_bwd.row() if first_bwd is not None else None
        return  # the passes below run on a rank that reproduced the fault only (:data:`LOCKSTEP`)
    if res.forward is not None:
        where = (first_fwd.module, first_fwd.call) if first_fwd is not None else None
        with preserved_state(module):  # every pass starts from the same buffers
            res.forward_op = _op_pass(module, batch, batch_idx, rng, plugin, where, float64)
        return
    if bad_grads:
        _first_bad_backward(res, rec, frames)
        with preserved_state(module):
            res.backward_op, res.anomaly = _anomaly_pass(module, batch, batch_idx, rng, plugin, named)


def _recorded_run(res: ReplayResult, module: Any, batch: Any, batch_idx: int, rng: Any, plugin: Any,
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


def _loss_and_grads(res: ReplayResult, module: Any, batch: Any, batch_idx: int, rng: Any, plugin: Any,
                    named: list[tuple[str, Tensor]]) -> list[Optional[Tensor]]:
    loss = _run(module, batch, batch_idx, rng, _ctx(plugin))
    res.loss_finite = None if loss is None else bool(torch.isfinite(loss.detach()).all())
    # (sharded: the backward is a collective the other ranks make, whatever this rank's loss)
    return _grads(loss, named) if loss is not None and (res.loss_finite or res.lockstep) else []


def _nonfinite_gradients(res: ReplayResult, named: list[tuple[str, Tensor]], grads: list[Optional[Tensor]],
                         norm_type: float) -> list[str]:
    """The names of the non-finite gradients (the first 20 in ``res``); where there is none, whether the total
    norm of the finite ones overflows."""
    bad_grads = [n for (n, _), g in zip(named, grads) if g is not None and not all_finite(floats_of(g))]
    if res.lockstep and res.loss_finite is False:
        bad_grads = []  # (the gradients of a non-finite loss, computed for the other ranks' sake, say nothing more)
    res.nonfinite_grads = bad_grads[:20]
    if not bad_grads:
        finite = [local(g) for g in grads if g is not None]  # sharded: this rank's shards (a DTensor norm: collective)
        res.norm_overflow = bool(finite) and not bool(torch.isfinite(total_norm(finite, norm_type)))
    return bad_grads


def _first_bad_forward(res: ReplayResult, rec: FrameRecorder, frames: int, bad_grads: list[str]) -> Optional[Frame]:
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


def _first_bad_backward(res: ReplayResult, rec: FrameRecorder, frames: int) -> None:
    """The first module in backward order whose gradient is non-finite, and up to ``frames`` modules before it."""
    first_bwd = rec.first_bad(rec.backward_frames)
    end = first_bwd.index + 1 if first_bwd is not None else len(rec.backward_frames)
    if first_bwd is not None:
        res.backward = first_bwd.row()
    ring = rec.backward_frames[max(0, end - frames): end]
    if ring:
        res.frames_text = format_frames(ring, "backward (module, grad wrt outputs -> grad wrt inputs):")


def _op_pass(module: Any, batch: Any, batch_idx: int, rng: Any, plugin: Any,
             where: Optional[tuple[str, int]], float64: bool = True) -> Optional[dict]:
    rec = FrameRecorder(module, backward=False, root_name=f"<{type(module).__name__}>")
    mode = FirstBadOp(rec, where, float64)
    with rec, mode:
        _run(module, batch, batch_idx, rng, _ctx(plugin))
    return mode.found


def _anomaly_pass(module: Any, batch: Any, batch_idx: int, rng: Any, plugin: Any,
                  named: list) -> tuple[Optional[dict], Optional[dict]]:
    anomaly: Optional[dict] = None
    watch: Optional[GraphWatch] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autograd.detect_anomaly(check_nan=True):
            loss = _run(module, batch, batch_idx, rng, _ctx(plugin))
            if loss is None or not loss.requires_grad:
                return None, None
            watch = GraphWatch(loss)
            try:
                with watch.growing(module) if _reentrant_checkpoint(loss) else nullcontext():
                    _grads(loss, named)
            except RuntimeError as err:
                anomaly = parse_anomaly_error(err) or {"message": str(err).splitlines()[0]}
            finally:
                watch.remove()
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" in text and anomaly is not None:
            anomaly["traceback"] = forward_trace(text)
    return watch.found, anomaly


def parse_anomaly_error(error: BaseException) -> Optional[dict]:
    """``Function 'PowBackward0' returned nan values in its 0th output.`` -> op, value, output; else None."""
    m = _ANOMALY_RE.search(str(error))
    if m is None:
        return None
    return {"message": str(error).splitlines()[0], "op": m.group(1), "value": m.group(2), "output": int(m.group(3))}


def _to_double(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.double() if t.is_floating_point() else t)


def _eager_copy(module: nn.Module) -> nn.Module:
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


def _float64_pass(module: Any, batch: Any, batch_idx: int, rng: Any, res: ReplayResult) -> dict:
    """Forward (+ backward) on a float64 deep copy: finite there means the working dtype is the problem."""
    twin = _eager_copy(module).double()
    # a LightningModule's methods, shadowed on the copy; nn.Module types every attribute it sets as Tensor | Module
    twin.log, twin.log_dict = _noop, _noop  # type: ignore[assignment]
    if "_trainer" in vars(module):  # a LightningModule drops its trainer when copied: global_rank, global_step,
        twin.__dict__["_trainer"] = module.__dict__["_trainer"]  # current_epoch must read as in the replay
    named = [(n, p) for n, p in twin.named_parameters() if p.requires_grad]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    rec = FrameRecorder(twin, backward=False, root_name=f"<{type(module).__name__}>")
    try:
        with rec:
            loss = _run(twin, _to_double(batch), batch_idx, rng, nullcontext())
        grads = _grads(loss, named) if loss is not None else []
    finally:
        torch.set_default_dtype(previous)
    rec.read()
    grad_flag = any_nonfinite_flag([g for g in grads if g is not None])
    out: dict[str, Any] = {"loss_finite": loss is not None and bool(torch.isfinite(loss.detach()).all()),
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
    del twin
    return out
