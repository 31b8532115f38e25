"""Diagnosis: from the evidence of an incident to a cause, a culprit and a suggestion.

:func:`diagnose` is called on an incident (or a divergence event), before any state changes, with an
:class:`IncidentContext`. The rules fill its ``diagnosis`` in (a typed :class:`~..core.diagnosis.Diagnosis`, which
they read back, never the event's details); then the event's ``cause``, ``culprit``, ``op``, ``details`` (written
once, from the diagnosis) and ``suggestion``. It returns extra text for the incident report (e.g. the module
frames of a replay), which :func:`~lightning_nanguard.report.render.render_report` appends once the event's actions
are final.

The rules, in order (each puts its evidence in the diagnosis, shown in ``details`` under the key named in
brackets):

1. non-finite parameters at fit start: ``initialization`` [nonfinite_parameters];
2. non-finite inputs (samples and features found in the batch): ``input`` [inputs];
3. non-finite parameters or buffers after a step with finite gradients: ``optimizer`` (e.g. Adam ``eps=0``);
4. otherwise (a non-finite loss, gradient or activation, or a finite ``divergence``) the micro-batch is
   replayed (:mod:`.replay`; not for a divergence, where nothing is non-finite) to find *where*, judged at
   the op that made the value (:func:`_judged_at_op`): finite when that op is recomputed in float64 is
   ``overflow`` (beyond its working dtype's max) or ``precision``; non-finite there too is ``domain`` (its
   inputs are outside its domain: log of 0, 0/0, std of one sample, softmax of an all -inf row) [domain], or
   ``precision`` where the float64 model is finite (the inputs are the dtype's artefact); a NaN/Inf first
   appearing in backward is ``backward_op`` (``precision`` if the float64 backward is finite). *Why* comes
   from the step's own evidence (:mod:`.dynamics`), which needs no history, so these rules hold from step 0.
   First, though: a replay that is clean on the step's own weights (the same batch, the same RNG state) is
   ``transient`` [replay.reproduced: false], a fault that does not come back (hardware, a racy kernel), and
   none of a-e apply (the step's dynamics did not make it non-finite). Not when the replay did not complete,
   nor when the step's update was applied before its flags were read (``check.sync: lagged`` with an
   optimizer that cannot skip on the device: the replay ran on other weights); and an incident that is not
   replayed (``anomaly.mode: off``, ``anomaly.max_replays`` spent, manual optimization) is never ``transient``,
   nor does it inherit that cause from the last replayed one:

   a. a weight whose RMS was, at fit start, and still is ``1e3`` times ``1/sqrt(fan_in)`` (the usual
      Xavier/Kaiming scale, within a small factor): ``initialization``, culprit that parameter
      [initialization: parameter, scale, expected_scale, ratio, fan_in]; this wins over any replay finding;
   b. a ``backward_op`` finding, or an overflow/precision finding explained by extreme input features
      (columns ``1e6`` times the median column) [extreme_features], stays as the replay found it;
   c. the relative update ``lr x |update| / |w|`` at the onset of the growth (the last step before the
      gradient norm started growing 2-fold per step; SGD: ``lr / (1 - momentum) x |grad|``, adaptive
      optimizers: ``lr x sqrt(n)``; the weights of the newest snapshot from before the onset, or of fit
      start) is 1 or more (healthy training: about ``1e-3``): ``learning_rate`` [relative_update]. Weights
      already moving by their own size each step before anything grew: the LR, not the network, is wrong.
      For SGD, a gradient norm growing ``r``-fold per step (the median ratio of its final 2-fold run) also
      places the edge of stability at ``lr x 2 (1 + momentum) / (r + 1 + momentum)`` [edge_lr], and the
      safe LR is at most a quarter of it;
   d. ``exploding_gradient`` when the relative update at the onset was small and the gradients grew:
      per-layer gradient RMS growing 100x from the output side to the input side [layer_growth];
      activations growing layer by layer over 4+ weight layers in the replayed forward pass
      [activation_growth]; the gradient norm growing 2-fold per step over the last 2 steps, however short
      the history [grad_norm_growth]; or the healthy history growing geometrically (last 5 steps 10x the
      earlier ones) or the incident's norm 6 standard deviations above it [grad_norm_trend,
      grad_norm_zscore];
   e. otherwise the replay's finding, or ``unknown``.

   When a, c or d overrides an overflow/precision finding, the finding is kept in ``details.symptom``;
5. GradScaler overflows that persisted past ``check.amp_overflow_patience`` with nothing else known:
   ``overflow``; anything else is ``unknown``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from ..core.causes import cause_entry, suggest
from ..core.diagnosis import Diagnosis, ReplayNote
from ..core.events import NaNEvent
from ..core.layouts import coo_parts, is_strided
from ..core.tree import iter_tensors
from ..detect.divergence import growth_streak
from ..detect.find import nonfinite_rows
from ..detect.flow import replay_outputs
from ..detect.spikes import history_zscore, norm_growth
from . import domain, dynamics, lockstep, replay, rerun
from .context import IncidentContext
from .culprit import runaway_culprit
from .rerun import ReplayResult

__all__ = ["IncidentContext", "diagnose", "diagnose_anomaly_error", "TRANSIENT", "GRAD_NORM_Z", "EXTREME_FEATURE_RATIO"]

TRANSIENT = "transient"  # the cause of a fault whose replay (same batch, weights, RNG state) is clean
# the incident's gradient norm this many standard deviations above the healthy history's is an exploding
# gradient (rule 4d, grad_norm_zscore)
GRAD_NORM_Z = 6.0
# an input feature column (last dim) whose abs-max is this many times the median column's is badly scaled data:
# it explains an overflow or precision finding (rule 4b, extreme_features)
EXTREME_FEATURE_RATIO = 1e6

def diagnose(ctx: IncidentContext) -> str:
    """Diagnose the incident of ``ctx``: fill ``ctx.diagnosis`` in, then write the event's cause, culprit, op,
    details and suggestion from it (:func:`_conclude`).

    Args:
        ctx: the incident's context; with ``ctx.replay`` the offending micro-batch is replayed
            (:func:`replay.replay_window`) to localise the first non-finite value.

    Returns:
        Extra report text: the module frames before the first non-finite value of a replay (may be empty).
    """
    frames_text = _diagnose(ctx)
    _conclude(ctx)
    return frames_text


def _diagnose(ctx: IncidentContext) -> str:
    """The rules of the module docstring, on ``ctx``: the event's cause, culprit and op, and ``ctx.diagnosis``
    (the event's details are left alone); returns the replay's module frames."""
    ev, found = ctx.event, ctx.diagnosis
    evidence = ctx.evidence
    frames_text = ""
    cause: Optional[str] = None
    _agree_on_replay(ctx)
    found.grad_norm_zscore = history_zscore(evidence.grad_norm, ctx.history.norm_history)
    if ctx.written:  # the step wrote into its own batch: the NaN found there is its own (Responder._look)
        found.batch_written = [dict(w) for w in ctx.written]
    if evidence.at_fit_start:
        cause = "initialization"
        found.nonfinite_parameters = _with_rows(ctx.pl_module, evidence.param_findings)
        ev.culprit = evidence.param_findings[0]["name"] if evidence.param_findings else None
    elif ctx.input_findings:
        cause = "input"
        found.inputs = ctx.input_findings
        ev.culprit = None
    elif ev.kind in ("parameter", "buffer"):
        found.nonfinite_parameters = _with_rows(ctx.pl_module, evidence.param_findings)
        ev.culprit = evidence.param_findings[0]["name"] if evidence.param_findings else None
        cause = "optimizer" if evidence.grads_were_finite else "unknown"
    else:
        cause, frames_text = _cause_of_step(ctx)
        if ev.culprit is None and cause_entry(cause).runaway_culprit:  # the module that ran away (weights, flow)
            runaway = runaway_culprit(ctx, _onset(ctx)[0])
            if runaway is not None:
                ev.culprit = runaway["module"]
                found.runaway = runaway
    ev.cause = _persisting_overflows(ctx, cause)
    return frames_text


def _conclude(ctx: IncidentContext) -> None:
    """Write what the diagnosis found into the event's details, once, for the user, and the suggestion."""
    ev = ctx.event
    ev.details.update(ctx.diagnosis.to_details())
    ev.suggestion = suggest(ev, ev.cause or "unknown", ctx.diagnosis)


def _agree_on_replay(ctx: IncidentContext) -> None:
    """Sharded: every rank replays or none (the replay is a collective); say so when this rank wanted to and does
    not."""
    if ctx.lockstep is not None and ctx.replay and ctx.batches:  # (the same on every rank: the budget, the window)
        wanted = _would_replay(ctx)
        ctx.replay = ctx.lockstep.agree(wanted)
        if wanted and not ctx.replay:
            ctx.diagnosis.replay_skipped = (
                "sharded: the replay is a collective (forward and backward all-gather) and another rank's own "
                "evidence (its inputs, its weights) named the cause: no rank replayed")


def _cause_of_step(ctx: IncidentContext) -> tuple[Optional[str], str]:
    """Rule 4 of the module docstring: the cause of a non-finite loss, gradient or activation (from its replay, or
    the last replayed incident's) or of a divergence, then the step's dynamics; and the replay's module frames."""
    ev = ctx.event
    cause: Optional[str] = None
    frames_text = ""
    rows: list[dict] = []
    if ev.kind == "divergence":
        pass  # nothing is non-finite: nothing to replay
    elif ctx.replay and ctx.batches:
        # a micro-batch the step wrote into in place is replayed on copies of what it wrote (rerun.Rewritten)
        batches = rerun.rewritten(ctx.batches, ctx.written) if ctx.written else ctx.batches
        result = replay.replay_window(ctx.trainer, ctx.pl_module, batches, ctx.rng_states,
                                      frames=ctx.frames, float64_check=ctx.float64_check,
                                      norm_type=ctx.history.norm_type, step=ctx.replay_step,
                                      timeout=ctx.replay_timeout, lock=ctx.lockstep)
        ctx.replayed = True
        cause = _cause_from_replay(ctx, result)
        frames_text = result.frames_text
        rows = result.forward_rows
        # the replay's outputs per module, for the event's pictures (under DDP every rank adopts the account's
        # diagnosis; Responder._record puts them next to the gradient-flow window)
        ctx.diagnosis.replay_outputs = replay_outputs(rows)
    elif (not ctx.replay and ctx.previous is not None and ctx.previous[0].kind == ev.kind and ctx.previous[0].cause
          and ctx.previous[0].cause != TRANSIENT):  # (only a replay tells a fault that does not come back)
        cause = _reused(ctx, *ctx.previous)
    if cause != TRANSIENT:  # clean on the same weights: the step's dynamics did not make it non-finite
        cause = _dynamics_cause(ctx, cause, rows)
    return cause, frames_text


# what an incident reuses of the last replayed one's diagnosis (rule 4, anomaly.max_replays spent)
_REUSED = ("abs_max_float64", "dtype", "dtype_max", "extreme_features", "forward_op", "backward_op", "domain",
           "judged_at")


def _reused(ctx: IncidentContext, prev: NaNEvent, before: Diagnosis) -> Optional[str]:
    """The diagnosis of ``prev``, the last replayed incident of the same kind (``anomaly.max_replays`` is spent):
    its culprit, op, cause and replay evidence (``before``: its diagnosis)."""
    ev, found = ctx.event, ctx.diagnosis
    ev.culprit, ev.op = prev.culprit, prev.op
    found.diagnosis_from = f"incident #{prev.index} (not replayed: anomaly.max_replays reached)"
    for key in _REUSED:
        setattr(found, key, getattr(before, key))
    return prev.cause


def _persisting_overflows(ctx: IncidentContext, cause: Optional[str]) -> Optional[str]:
    """Rule 5: under 16-mixed, GradScaler overflows that persisted with nothing else known are ``overflow``."""
    evidence = ctx.evidence
    if evidence.scaler_overflows is not None:
        ctx.diagnosis.grad_scale, ctx.diagnosis.scaler_overflows = evidence.grad_scale, evidence.scaler_overflows
        # (the replay computes unscaled gradients: a scaled overflow does not come back there)
        if evidence.only_gradients and ctx.event.kind == "gradient" and cause in (None, "unknown", TRANSIENT):
            return "overflow"  # overflows persisted beyond check.amp_overflow_patience / amp_min_scale
    return cause


def diagnose_anomaly_error(ctx: IncidentContext, found: dict) -> str:
    """Diagnose the error ``anomaly.mode: always`` raised in backward (``found``: :func:`parse_anomaly_error`).

    Replays the window like :func:`diagnose` (when ``ctx.replay``) and keeps the op anomaly mode named.
    """
    extra = _diagnose(ctx)
    ev = ctx.event
    ctx.diagnosis.anomaly_error = found
    ev.op = ev.op or found.get("op")
    if ev.cause in (None, "unknown", TRANSIENT):  # anomaly mode saw the op fail in the real backward
        ev.cause = "backward_op"
    _conclude(ctx)
    return extra


def _would_replay(ctx: IncidentContext) -> bool:
    """Would :func:`diagnose` replay the window on this rank? (its branches, in order: the rank's own inputs or weights
    explain an incident without a replay)"""
    return not ctx.evidence.at_fit_start and not ctx.input_findings and ctx.event.kind not in (
        "parameter", "buffer", "divergence")


def _dynamics_cause(ctx: IncidentContext, found: Optional[str], rows: list[dict]) -> Optional[str]:
    """Rules 4a-4e of the module docstring: the cause from the step's own evidence, given the replay's
    finding ``found`` and its forward frame ``rows``."""
    ev, diagnosis = ctx.event, ctx.diagnosis
    module = ctx.pl_module
    cause: Optional[str] = None
    initial = ctx.initial.read() if ctx.initial is not None else {}
    if module is not None and initial:
        init = dynamics.oversized(module, initial)
        if init is not None:
            diagnosis.initialization = init
            ev.culprit, ev.op = init["parameter"], None
            cause = "initialization"
    data_explained = found in ("overflow", "precision") and bool(diagnosis.extreme_features)
    if cause is None and (found == "backward_op" or data_explained):
        return found
    if cause is None and module is not None:
        cause = _learning_rate(ctx)
    if cause is None:
        cause = _exploding(ctx, rows)
    if cause is None:
        return found if found is not None else "unknown"
    if found in ("overflow", "precision") and cause != found:
        # the values overflowed because the weights or gradients were already blowing up, not because of the
        # data: the dynamics are the cause, the overflow their symptom
        diagnosis.symptom = found
    return cause


def _onset(ctx: IncidentContext) -> tuple[Optional[int], float]:
    """The step where the growth began and the gradient norm there (the divergence watch's, or from the
    healthy history: where the final run of 2-fold growth began)."""
    divergence = ctx.evidence.divergence
    if divergence is not None:
        return divergence.get("onset_step"), float(divergence.get("onset_grad_norm", math.nan))
    values, steps = _history(ctx)
    if not values:
        return None, math.nan
    i = dynamics.growth_onset(values)
    return steps[i], values[i]


def _history(ctx: IncidentContext) -> tuple[list[float], list[int]]:
    """The healthy gradient norms up to the incident (its own norm last if finite), and their steps: the
    history's are consecutive up to its newest one's (skipped incident steps are not in it)."""
    past, grad_norm = ctx.history, ctx.evidence.grad_norm
    end = past.norm_history_end if past.norm_history_end is not None else ctx.event.step - 1
    n = len(past.norm_history)
    values, steps = list(past.norm_history), list(range(end - n + 1, end + 1))
    if math.isfinite(grad_norm):
        values.append(grad_norm)
        steps.append(ctx.event.step)
    return values, steps


def _norm_at(ctx: IncidentContext, step: int) -> float:
    """The gradient norm of ``step`` (the divergence's streak, else the healthy history); NaN when not known."""
    sources: tuple[tuple[list[float], Sequence[Optional[int]]], ...] = (_streak(ctx), _history(ctx))
    for values, steps in sources:
        if step in steps:
            return values[steps.index(step)]
    return math.nan


def _learning_rate(ctx: IncidentContext) -> Optional[str]:
    """Rule 4c: the relative update at the onset of the growth."""
    step, grad_norm = _onset(ctx)
    reference: Optional[tuple[int, dict[str, float]]] = None
    if step is not None and ctx.history.reference is not None:
        found = ctx.history.reference(step)
        if found is not None:
            trainable = [n for n, p in ctx.pl_module.named_parameters() if p.requires_grad and n in found[1]]
            reference = (found[0], {n: found[1][n] for n in trainable})
    initial = ctx.initial.read() if ctx.initial is not None else {}
    if reference is None and initial:
        reference = (0, initial)
    if reference is not None and step is not None and reference[0] < step and _grown(ctx, reference[1]):
        # no weights from the onset, only older ones, and the weights grew a lot since: the onset's gradient
        # (taken on grown weights) against them would overstate the update, by 1e18 after a long growth. The
        # reference step's own gradient is the one taken on them.
        at = _norm_at(ctx, reference[0])
        if math.isfinite(at) and at > 0:
            step, grad_norm = reference[0], at
    optimizers = getattr(ctx.trainer, "optimizers", None) or []
    update = dynamics.relative_update(optimizers, ctx.pl_module, grad_norm,
                                      reference[1] if reference else None, reference[0] if reference else None,
                                      growth=dynamics.growth_rate(_norms(ctx, since=ctx.history.lr_cut_step)),
                                      lrs=ctx.evidence.step_lrs)
    if update is None:
        return None
    update["onset_step"] = step
    ctx.diagnosis.relative_update = update
    return "learning_rate" if update["relative_update"] >= dynamics.RELATIVE_UPDATE_LR else None


def _grown(ctx: IncidentContext, reference: dict[str, float]) -> bool:
    """The trainable weights' norm is now :data:`~.dynamics.WEIGHT_GROWTH` times (or more) their norm in
    ``reference`` (parameter name -> norm), or no longer finite. (``math.hypot``: a float64 weight's norm past
    1e154 squares past a Python float, an OverflowError for ``**``.)"""
    named = [(n, p) for n, p in ctx.pl_module.named_parameters() if p.requires_grad and n in reference]
    before = math.hypot(*(reference[n] for n, _ in named))
    now = math.hypot(*dynamics.norms(p for _, p in named))
    return bool(named) and (not math.isfinite(now) or now >= dynamics.WEIGHT_GROWTH * before)


def _streak(ctx: IncidentContext) -> tuple[list[float], list[Optional[int]]]:
    """The gradient norms up to the incident and their steps: the divergence's streak, or :func:`_history`."""
    divergence = ctx.evidence.divergence
    if divergence is None:
        values, steps = _history(ctx)
        return values, list(steps)
    values = [math.nan if v is None else float(v) for v in divergence.get("grad_norms", [])]
    return values, list(divergence.get("steps", [])) or [None] * len(values)


def _norms(ctx: IncidentContext, since: Optional[int] = None) -> list[float]:
    """The gradient norms of :func:`_streak`; ``since``: only those of later steps (a growth measured before an
    LR cut says nothing about the edge of stability at the LR after it)."""
    values, steps = _streak(ctx)
    return [v for v, s in zip(values, steps) if since is None or s is None or s > since]


def _exploding(ctx: IncidentContext, rows: list[dict]) -> Optional[str]:
    """Rule 4d: gradients (or activations) growing through depth or from step to step."""
    found = ctx.diagnosis
    module = ctx.pl_module
    if module is not None and math.isfinite(ctx.evidence.grad_norm):
        layers = dynamics.layer_growth(module)
        if layers is not None:
            found.layer_growth = layers
            return "exploding_gradient"
    if module is not None and rows:
        acts = dynamics.activation_growth(rows, module)
        if acts is not None:
            found.activation_growth = acts
            return "exploding_gradient"
    tail = dynamics.short_growth(_norms(ctx))
    if tail is not None:
        found.grad_norm_growth = tail
        return "exploding_gradient"
    history = _history_cause(ctx)
    return history if history == "exploding_gradient" else None


def _history_cause(ctx: IncidentContext) -> str:
    """Exploding gradients from the healthy gradient-norm history (trend, or z-score of the last norm)."""
    found = ctx.diagnosis
    growth = norm_growth(ctx.history.norm_history)
    if growth is not None:
        found.grad_norm_trend = {"recent_mean": growth[0], "earlier_mean": growth[1]}
        return "exploding_gradient"
    z = found.grad_norm_zscore
    return "exploding_gradient" if z is not None and z > GRAD_NORM_Z else "unknown"


def _cause_from_replay(ctx: IncidentContext, res: ReplayResult) -> Optional[str]:
    """The replay's finding (``res``), before the step's dynamics: ``transient`` when it did not come back, else
    where it first appeared (forward or backward) and how that op or module judges it; its evidence in
    ``ctx.diagnosis``."""
    _record_replay(ctx.diagnosis, res)
    if not res.reproduced:
        return _unreproduced(ctx, res)
    if res.forward is not None:
        return _forward_cause(ctx, res, res.forward)
    if res.backward is not None or res.backward_op is not None or res.anomaly is not None:
        return _backward_cause(ctx.event, ctx.diagnosis, res)
    return None


def _record_replay(found: Diagnosis, res: ReplayResult) -> None:
    """What the replay did (``found.replay``), and its float64 rerun (``found.float64``)."""
    found.replay = ReplayNote(res.micro_batch, res.reproduced, res.loss_finite, res.nonfinite_grads[:5],
                              norm_overflow=res.norm_overflow, errors=res.errors,
                              sharded=lockstep.LOCKSTEP if res.lockstep else None,
                              # (sharded: through what the values came; the timeout that ended it)
                              received=res.received, timeout=res.timeout, float64=res.float64_note)
    if res.float64 is not None:
        found.float64 = res.float64


def _unreproduced(ctx: IncidentContext, res: ReplayResult) -> Optional[str]:
    """A replay that came back finite: ``transient`` on the step's own weights; nothing known when it did not
    complete or ran on other weights."""
    note = ctx.diagnosis.replay
    assert note is not None  # (_record_replay wrote it)
    if res.errors or res.timeout is not None:
        note.note = "the replay did not complete: nothing is known about the fault"
        return None
    if not ctx.evidence.same_weights:
        note.note = ("finite on replay, but on other weights: the step's update was applied before its flags were "
                     "read (an optimizer that cannot skip on the device)")
        return None
    if ctx.written:
        note.note = ("finite on replay, but of a batch the step wrote into in place: the replay ran on the values it "
                     "wrote, not on those it was given")
        return None
    note.note = ("finite on replay of the same batch on the same weights and RNG state: a fault that does not "
                 "come back")
    return TRANSIENT


def _forward_cause(ctx: IncidentContext, res: ReplayResult, forward: dict) -> Optional[str]:
    """A value that first went non-finite in forward (``forward``: the replay's module call): its module and op,
    extreme input features, and the cause judged at the op (:func:`_judged_at_op`) or else at the module's
    output."""
    ev, found = ctx.event, ctx.diagnosis
    ev.culprit = forward["module"]
    found.forward = forward
    if forward.get("call"):
        found.culprit_call = forward["call"]
    if res.forward_op:
        ev.op = res.forward_op.get("op") or domain.op_name(res.forward_op.get("function"))
        found.forward_op = res.forward_op
        if ev.culprit == "training_step" and res.forward_op.get("module"):
            ev.culprit = res.forward_op["module"]
        if res.forward_op.get("wrote_batch"):  # the op wrote into the step's own batch: the values it was fed are
            _wrote_batch(found, res.forward_op)  # gone, nothing judges it (no float64 recompute, no domain)
            return None
    micro_batch = res.micro_batch or 0  # (a replay that reproduced the fault names its micro-batch)
    features = _extreme_features([b for b, _ in ctx.batches[micro_batch:micro_batch + 1]])
    if features:
        found.extreme_features = features
    at_op = _judged_at_op(found, res.forward_op, res.float64)
    return at_op if at_op is not None else _judged_at_module(found, forward, res.float64)


def _wrote_batch(found: Diagnosis, op: dict) -> None:
    """The in-place op that wrote the non-finite values into the batch tensor the step wrote (``op``: the op pass's
    finding), into that tensor's entry of ``found.batch_written``."""
    for entry in found.batch_written or []:
        if entry["field"] == op["wrote_batch"]:
            entry.update(function=op.get("function"), source=op.get("source"))
            break


def _judged_at_module(found: Diagnosis, forward: dict, f64: Optional[dict]) -> Optional[str]:
    """Overflow or precision judged at the culprit module's output: finite in the float64 model, beyond or within
    its dtype's max; None when the float64 model is not finite there (or was not run)."""
    if f64 is not None and f64.get("module_finite", f64.get("loss_finite")):
        dtype = getattr(torch, str(forward.get("dtype", "float32")), torch.float32)
        limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
        abs_max = f64.get("module_out_abs_max", math.nan)
        found.abs_max_float64, found.dtype, found.dtype_max = abs_max, str(dtype), limit
        return "overflow" if abs_max > limit else "precision"
    return None


def _backward_cause(ev: NaNEvent, found: Diagnosis, res: ReplayResult) -> str:
    """A value that first went non-finite in backward: its module, op (the replay's, else anomaly mode's) and
    ``backward_op``, or ``precision`` where the float64 backward is finite."""
    if res.backward is not None:
        ev.culprit = res.backward["module"]
        found.backward = res.backward
    if res.backward_op is not None:
        found.backward_op = res.backward_op
    if res.anomaly is not None:
        found.anomaly = res.anomaly
    ev.op = (res.backward_op or {}).get("op") or (res.anomaly or {}).get("op")
    if ev.culprit is None and res.nonfinite_grads:
        ev.culprit = res.nonfinite_grads[0]
    f64 = res.float64
    if f64 is not None and f64.get("grads_finite"):
        return "precision"
    return "backward_op"


def _judged_at_op(found: Diagnosis, op: Optional[dict], f64: Optional[dict]) -> Optional[str]:
    """Overflow, precision or domain, judged at the op that made the non-finite value (``op``: its evidence,
    :func:`~.domain.op_evidence`) rather than at the module's output: the op recomputed in float64 on the same
    inputs finite and beyond its working dtype's max is ``overflow``, finite within it ``precision``; non-finite
    there too, the op's inputs are outside its domain: ``domain``, unless the float64 model (``f64``) is finite,
    where those inputs are themselves an artefact of the dtype (a probability that underflowed to 0): ``precision``.
    None without the op's float64 recompute (``anomaly.float64_check: false``, or it could not run), and for an op
    given a NaN as an argument (``loss * nan``)."""
    if not op or "float64_finite" not in op or op.get("nan_argument"):
        return None  # (a NaN given as an argument, loss * nan: nothing was outside the op's domain)
    found.dtype, found.dtype_max, found.judged_at = op["dtype"], op["dtype_max"], "op"
    if op.get("domain"):
        found.domain = op["domain"]
    if op["float64_finite"]:
        found.abs_max_float64 = op["abs_max_float64"]
        return "overflow" if op["abs_max_float64"] > op["dtype_max"] else "precision"
    if f64 is not None and f64.get("module_finite", f64.get("loss_finite")):
        return "precision"
    if found.domain is None:
        found.domain = {"op": op.get("inner_function") or op.get("function"), "input": None,
                        "positions": op.get("positions")}
    return "domain"


def _extreme_features(batches: list[Any], ratio: float = EXTREME_FEATURE_RATIO, limit: int = 10) -> list[dict]:
    """Feature columns (last dim) whose abs-max is ``ratio`` times the median column's: normalise these."""
    out = []
    for batch in batches:
        for path, t in iter_tensors(batch):
            if not t.is_floating_point() or t.dim() < 2 or t.shape[-1] < 2 or t.numel() == 0:
                continue  # (an empty field, e.g. boxes [batch, 0, 4], has no column abs-max)
            col = _column_abs_max(t)
            if col is None:
                continue
            median = float(col.median())
            idx = (col > ratio * max(median, 1e-30)).nonzero().flatten()[:limit].tolist()
            if idx:
                out.append({"field": path, "features": idx, "abs_max": [float(col[i]) for i in idx],
                            "median_abs_max": median})
    return out


def _column_abs_max(t: torch.Tensor) -> Optional[torch.Tensor]:
    """Finite abs-max of every column (last dim) of ``t`` in float64; a sparse tensor's implicit zeros count as 0."""
    if is_strided(t):
        a = t.detach().abs().reshape(-1, t.shape[-1]).double()
        return torch.where(torch.isfinite(a), a, 0.0).amax(dim=0)
    parts = coo_parts(t)
    if parts is None:
        return None
    indices, values = parts
    a = values.abs().double()
    a = torch.where(torch.isfinite(a), a, 0.0)
    zeros = torch.zeros(t.shape[-1], dtype=torch.float64, device=a.device)
    if indices.shape[0] == t.dim():  # the last dim is sparse: each stored value into its column
        return zeros.scatter_reduce(0, indices[-1], a, "amax")
    return torch.maximum(zeros, a.reshape(-1, t.shape[-1]).amax(dim=0)) if a.numel() else zeros


def _with_rows(pl_module: Optional[torch.nn.Module], findings: list[dict]) -> list[dict]:
    """Add, for 2-D+ parameters, the indices of the rows (dim 0) holding NaN/Inf."""
    if pl_module is None:
        return findings
    named: dict[str, torch.Tensor] = dict(pl_module.named_parameters())
    named.update(dict(pl_module.named_buffers()))
    return nonfinite_rows(named, findings)


def spike_cause(grad_norm: float, norm_history: Sequence[float], growth: float, steps: int,
                after_healthy: bool = False) -> tuple[str, dict[str, Any]]:
    """A finite loss spike: ``exploding_gradient`` only with evidence that the gradients grew; else ``input`` when
    its loss was taken on weights that gave a healthy loss a step before (``after_healthy``: the step before was
    no spike, or a spike whose update was skipped, so the weights are still those): the batch is far outside what
    these weights give on the others, the data's fault [spike_after_healthy]; else ``unknown`` (a phase the LR is
    too high for, after a spike whose update landed), with that evidence for the event's details.

    Growth is the gradient norm rising ``growth``-fold at each of the last ``steps`` steps up to the spike's own
    norm [grad_norm_growth] (``check.divergence_growth``, ``check.divergence_steps``), or the healthy history
    before the spike growing geometrically, its last 5 norms averaging 10x the earlier ones [grad_norm_trend].
    A large norm at the spike alone is not growth: a hard batch has a large gradient too. ``norm_history``: the
    healthy norms before the spike, oldest first."""
    norms = [*norm_history[-steps:], grad_norm]
    if len(norms) > steps and growth_streak(norms, growth) >= steps:
        return "exploding_gradient", {"grad_norm_growth": norms}
    trend = norm_growth(norm_history)
    if trend is not None:
        return "exploding_gradient", {"grad_norm_trend": {"recent_mean": trend[0], "earlier_mean": trend[1]}}
    if after_healthy:
        return "input", {"spike_after_healthy": True}
    return "unknown", {}


def persistent_clipping_cause() -> str:
    """The adaptive clip acting on many steps in a row: the gradient norm grows faster than its statistics."""
    return "exploding_gradient"


def drifted_replicas_cause() -> str:
    """DDP replicas whose weights drifted apart between two snapshots: nothing tells why (a fault too small for the
    per-step check, or an update one rank made alone)."""
    return "unknown"
