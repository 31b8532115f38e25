"""Diagnosis: from the evidence of an incident to a cause, a culprit and a suggestion.

:func:`diagnose` is called by the callback on an incident, before any state changes, with an
:class:`IncidentContext`. It fills ``cause``, ``culprit``, ``op``, ``details`` and ``suggestion`` of the
event and returns extra text for the incident report (e.g. the module frames of a replay), which
:func:`render_report` appends once the event's actions are final.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import checks, replay, stats
from .events import NaNEvent
from .replay import parse_anomaly_error

__all__ = ["IncidentContext", "diagnose", "diagnose_anomaly_error", "parse_anomaly_error", "SUGGESTIONS"]

SUGGESTIONS = {
    "input": "Bad input data: fix or drop these samples (check the data pipeline, normalisation and "
             "division by zero in feature engineering), or filter non-finite batches in the dataset.",
    "overflow": "Values exceed the dtype's range: normalise or scale the features, reorder the computation "
                "so large sums are not formed, or compute this op in float64 / float32 instead of half.",
    "precision": "Precision loss in the working dtype: compute this op in float64 (or float32 under AMP), "
                 "add an epsilon, or rescale the inputs.",
    "backward_op": "An op has an infinite or undefined derivative at these inputs (sqrt/norm at 0, log at 0, "
                   "pow with fractional exponent at 0): add an epsilon (e.g. sqrt(x + 1e-12)) or mask the rows.",
    "exploding_gradient": "Gradients are exploding: lower the learning rate, add warm-up, or clip the "
                          "gradient norm (clip.max_norm).",
    "optimizer": "The optimizer update made parameters non-finite from finite gradients: set Adam's eps to "
                 "1e-8 (not 0), lower the learning rate, or check weight decay and momentum settings.",
    "initialization": "Parameters were non-finite or badly scaled before training: re-initialise with "
                      "Xavier/He (nn.init.xavier_uniform_ / kaiming_normal_) and check loaded checkpoints.",
    "unknown": "Lower the learning rate, enable clipping, and rerun with NaNGuard(anomaly={'mode': 'always'}, "
               "check={'activations': 'always'}) to localise the first non-finite value.",
}


@dataclass
class IncidentContext:
    """Everything the diagnosis may look at; built by the callback on an incident only."""

    trainer: Any
    pl_module: Any
    event: NaNEvent
    batches: list[tuple[Any, int]] = field(default_factory=list)
    rng_states: list[Any] = field(default_factory=list)
    grad_norm: float = float("nan")
    norm_history: list[float] = field(default_factory=list)
    loss_history: list[float] = field(default_factory=list)
    param_findings: list[dict] = field(default_factory=list)
    input_findings: list[dict] = field(default_factory=list)
    grads_were_finite: Optional[bool] = None
    at_fit_start: bool = False
    replay: bool = False
    frames: int = 21
    float64_check: bool = True
    replayed: bool = False  # set by diagnose() when it replayed the window
    previous: Optional[NaNEvent] = None  # the last replayed incident, reused once anomaly.max_replays is spent
    replay_result: Any = None


def _zscore(value: float, history: list[float]) -> Optional[float]:
    finite = [h for h in history if math.isfinite(h)]
    if len(finite) < 5 or not math.isfinite(value):
        return None
    mean = statistics.fmean(finite)
    std = statistics.pstdev(finite) or 1e-12
    return (value - mean) / std


def diagnose(ctx: IncidentContext) -> str:
    """Fill the event's diagnosis fields from the evidence; return extra report text (may be empty).

    With ``ctx.replay`` the offending micro-batch is replayed (:func:`replay.replay_window`) to localise the
    first non-finite value; the returned text is then the module frames before it.
    """
    ev = ctx.event
    details = ev.details
    frames_text = ""
    cause: Optional[str] = None
    z = _zscore(ctx.grad_norm, ctx.norm_history)
    if z is not None:
        details["grad_norm_zscore"] = z
    if ctx.at_fit_start:
        cause = "initialization"
        details["nonfinite_parameters"] = _with_rows(ctx.pl_module, ctx.param_findings)
        ev.culprit = ctx.param_findings[0]["name"] if ctx.param_findings else None
    elif ctx.input_findings:
        cause = "input"
        details["inputs"] = ctx.input_findings
        ev.culprit = None
    elif ev.kind in ("parameter", "buffer"):
        details["nonfinite_parameters"] = _with_rows(ctx.pl_module, ctx.param_findings)
        ev.culprit = ctx.param_findings[0]["name"] if ctx.param_findings else None
        cause = "optimizer" if ctx.grads_were_finite else "unknown"
    else:
        if ctx.replay and ctx.batches:
            result = replay.replay_window(ctx.trainer, ctx.pl_module, ctx.batches, ctx.rng_states,
                                          frames=ctx.frames, float64_check=ctx.float64_check)
            ctx.replayed = True
            ctx.replay_result = result
            cause = _cause_from_replay(ctx, result)
            frames_text = result.frames_text
        elif not ctx.replay and ctx.previous is not None and ctx.previous.kind == ev.kind and ctx.previous.cause:
            prev = ctx.previous
            ev.culprit, ev.op, cause = prev.culprit, prev.op, prev.cause
            details["diagnosis_from"] = f"incident #{prev.index} (not replayed: anomaly.max_replays reached)"
            details.update({k: prev.details[k] for k in ("abs_max_float64", "dtype", "dtype_max", "extreme_features",
                                                         "forward_op", "backward_op") if k in prev.details})
        history = _history_cause(ctx)
        if cause is None:
            cause = history
        elif cause in ("overflow", "precision") and history == "exploding_gradient" and not details.get(
                "extreme_features"):
            # the values overflowed because the weights were already blowing up (a too-high LR), not because
            # of the data: the trend of the gradient norm is the cause, the overflow its symptom
            details["symptom"] = cause
            cause = history
    ev.cause = cause
    ev.suggestion = _suggestion(ctx, cause)
    return frames_text


def diagnose_anomaly_error(ctx: IncidentContext, found: dict) -> str:
    """Diagnose the error ``anomaly.mode: always`` raised in backward (``found``: :func:`parse_anomaly_error`).

    Replays the window like :func:`diagnose` (when ``ctx.replay``) and keeps the op anomaly mode named.
    """
    extra = diagnose(ctx)
    ev = ctx.event
    ev.details["anomaly_error"] = found
    ev.op = ev.op or found.get("op")
    if ev.cause in (None, "unknown"):
        ev.cause = "backward_op"
        ev.suggestion = _suggestion(ctx, "backward_op")
    return extra


def _history_cause(ctx: IncidentContext) -> str:
    """Exploding gradients from the healthy gradient-norm history (trend, or z-score of the last norm)."""
    details = ctx.event.details
    growth = stats.norm_growth(ctx.norm_history)
    if growth is not None:
        details["grad_norm_trend"] = {"recent_mean": growth[0], "earlier_mean": growth[1]}
        return "exploding_gradient"
    z = details.get("grad_norm_zscore")
    return "exploding_gradient" if z is not None and z > 6 else "unknown"


def _cause_from_replay(ctx: IncidentContext, res: Any) -> Optional[str]:
    ev, details = ctx.event, ctx.event.details
    details["replay"] = {"micro_batch": res.micro_batch, "reproduced": res.reproduced,
                         "loss_finite": res.loss_finite, "nonfinite_grads": res.nonfinite_grads[:5]}
    if res.errors:
        details["replay"]["errors"] = res.errors
    if res.float64 is not None:
        details["float64"] = res.float64
    if not res.reproduced:
        details["replay"]["note"] = "finite on replay: a nondeterministic op, or state changed before the replay"
        return None
    if res.forward is not None:
        ev.culprit = res.forward["module"]
        details["forward"] = res.forward
        if res.forward.get("call"):
            details["culprit_call"] = res.forward["call"]
        if res.forward_op:
            ev.op = res.forward_op.get("op") or res.forward_op.get("function")
            details["forward_op"] = res.forward_op
            if ev.culprit == "training_step" and res.forward_op.get("module"):
                ev.culprit = res.forward_op["module"]
        features = _extreme_features([b for b, _ in ctx.batches[res.micro_batch:res.micro_batch + 1]])
        if features:
            details["extreme_features"] = features
        f64 = res.float64
        if f64 is not None and f64.get("module_finite", f64.get("loss_finite")):
            dtype = getattr(torch, str(res.forward.get("dtype", "float32")), torch.float32)
            limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
            abs_max = f64.get("module_out_abs_max", math.nan)
            details["abs_max_float64"], details["dtype"], details["dtype_max"] = abs_max, str(dtype), limit
            return "overflow" if abs_max > limit else "precision"
        return None
    if res.backward is not None or res.backward_op is not None or res.anomaly is not None:
        if res.backward is not None:
            ev.culprit = res.backward["module"]
            details["backward"] = res.backward
        if res.backward_op is not None:
            details["backward_op"] = res.backward_op
        if res.anomaly is not None:
            details["anomaly"] = res.anomaly
        ev.op = (res.backward_op or {}).get("op") or (res.anomaly or {}).get("op")
        if ev.culprit is None and res.nonfinite_grads:
            ev.culprit = res.nonfinite_grads[0]
        f64 = res.float64
        if f64 is not None and f64.get("grads_finite"):
            return "precision"
        return "backward_op"
    return None


def _extreme_features(batches: list[Any], ratio: float = 1e6, limit: int = 10) -> list[dict]:
    """Feature columns (last dim) whose abs-max is ``ratio`` times the median column's: normalise these."""
    out = []
    for batch in batches:
        for path, t in checks.iter_batch_tensors(batch):
            if not t.is_floating_point() or t.dim() < 2 or t.shape[-1] < 2:
                continue
            col = t.detach().abs().reshape(-1, t.shape[-1]).double()
            col = torch.where(torch.isfinite(col), col, 0.0).amax(dim=0)
            median = float(col.median())
            idx = (col > ratio * max(median, 1e-30)).nonzero().flatten()[:limit].tolist()
            if idx:
                out.append({"field": path, "features": idx, "abs_max": [float(col[i]) for i in idx],
                            "median_abs_max": median})
    return out


def _with_rows(pl_module: Any, findings: list[dict], limit: int = 20) -> list[dict]:
    """Add, for 2-D+ parameters, the indices of the rows (dim 0) holding NaN/Inf."""
    if pl_module is None:
        return findings
    state = dict(pl_module.named_parameters())
    state.update(dict(pl_module.named_buffers()))
    out = []
    for f in findings:
        t = state.get(f["name"])
        if t is not None and t.dim() >= 2:
            bad = ~torch.isfinite(t.detach()).reshape(t.shape[0], -1).all(dim=1)
            f = dict(f, rows=bad.nonzero().flatten()[:limit].tolist())
        out.append(f)
    return out


def _suggestion(ctx: IncidentContext, cause: str) -> str:
    ev, d = ctx.event, ctx.event.details
    where = f" in {ev.culprit}" if ev.culprit else ""
    op = f" ({ev.op})" if ev.op else ""
    base = SUGGESTIONS[cause]
    if cause == "input" and ctx.input_findings:
        f = ctx.input_findings[0]
        feats = f" features {f['features'][:10]}" if f.get("features") else ""
        return f"{f['field']} holds NaN/Inf at samples {f.get('samples', [])[:10]}{feats}. " + base
    if cause in ("overflow", "precision"):
        feats = d.get("extreme_features")
        hint = (f"normalise feature(s) {feats[0]['features']} of {feats[0]['field']} (abs-max "
                f"{max(feats[0]['abs_max']):.3g} vs median {feats[0]['median_abs_max']:.3g}), or compute it in float64"
                if feats else "normalise or scale the inputs, or compute it in float64")
        if cause == "overflow":
            return (f"Overflow{where}{op}: values reach {d.get('abs_max_float64', math.nan):.3g}, beyond "
                    f"{d.get('dtype', 'the dtype')}'s max {d.get('dtype_max', math.nan):.3g}; {hint}.")
        return f"Precision loss{where}{op}: finite in float64, not in {d.get('dtype', 'the working dtype')}; {hint}."
    if cause == "backward_op":
        src = (d.get("backward_op") or d.get("anomaly") or {}).get("traceback")
        at = f" (forward: {src})" if src else ""
        return f"The backward of {ev.op or 'an op'}{where} is infinite or undefined at these inputs{at}. " + base
    if cause in ("optimizer", "initialization") and ev.culprit:
        return f"Non-finite values in {ev.culprit}. " + base
    if cause == "unknown" and ev.culprit and (d.get("float64") or {}).get("module_finite") is False:
        src = (d.get("forward_op") or {}).get("source")
        at = f" at {src}" if src else ""
        return (f"The first non-finite value appeared{where}{op}{at} and stays non-finite in float64: the op's "
                "input is outside its domain (log or sqrt of a negative, 0/0, inf-inf); clamp or mask its "
                "inputs, add an epsilon, or check the weights feeding it for divergence.")
    if cause == "unknown" and ev.culprit:
        return f"The first non-finite value appeared{where}{op}. " + base
    return base


def render_report(ctx: IncidentContext, frames_text: str = "") -> str:
    ev = ctx.event
    lines = [
        f"NaNGuard incident #{ev.index} at step {ev.step} (epoch {ev.epoch}, batch {ev.batch_idx}, rank {ev.rank})",
        "=" * 80,
        f"kind:       {ev.kind}",
        f"cause:      {ev.cause}",
        f"culprit:    {ev.culprit}",
        f"op:         {ev.op}",
        f"actions:    {', '.join(ev.actions)}",
        f"suggestion: {ev.suggestion}",
        "",
        "evidence:",
    ]
    for key, value in ev.details.items():
        lines.append(f"  {key}: {value}")
    if ctx.norm_history:
        tail = ", ".join(f"{v:.4g}" for v in ctx.norm_history[-10:])
        lines.append(f"  last healthy gradient norms: {tail}")
    if ctx.loss_history:
        tail = ", ".join(f"{v:.4g}" for v in ctx.loss_history[-10:])
        lines.append(f"  last healthy losses: {tail}")
    if frames_text:
        lines += ["", "frames before the first non-finite value:", frames_text]
    return "\n".join(lines) + "\n"
