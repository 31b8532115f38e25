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

from .events import NaNEvent

__all__ = ["IncidentContext", "diagnose", "SUGGESTIONS"]

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


def _zscore(value: float, history: list[float]) -> Optional[float]:
    finite = [h for h in history if math.isfinite(h)]
    if len(finite) < 5 or not math.isfinite(value):
        return None
    mean = statistics.fmean(finite)
    std = statistics.pstdev(finite) or 1e-12
    return (value - mean) / std


def diagnose(ctx: IncidentContext) -> str:
    """Fill the event's diagnosis fields from the evidence; return extra report text (may be empty)."""
    ev = ctx.event
    details = ev.details
    cause = "unknown"
    if ctx.at_fit_start:
        cause = "initialization"
        details["nonfinite_parameters"] = ctx.param_findings
        ev.culprit = ctx.param_findings[0]["name"] if ctx.param_findings else None
    elif ctx.input_findings:
        cause = "input"
        details["inputs"] = ctx.input_findings
        ev.culprit = None
    elif ev.kind in ("parameter", "buffer"):
        details["nonfinite_parameters"] = ctx.param_findings
        ev.culprit = ctx.param_findings[0]["name"] if ctx.param_findings else None
        cause = "optimizer" if ctx.grads_were_finite else "unknown"
    else:
        z = _zscore(ctx.grad_norm, ctx.norm_history)
        recent = [h for h in ctx.norm_history[-5:] if math.isfinite(h)]
        older = [h for h in ctx.norm_history[:-5] if math.isfinite(h)]
        if z is not None:
            details["grad_norm_zscore"] = z
        if recent and older and statistics.fmean(recent) > 10 * statistics.fmean(older):
            cause = "exploding_gradient"
            details["grad_norm_trend"] = {"recent_mean": statistics.fmean(recent),
                                          "earlier_mean": statistics.fmean(older)}
        elif z is not None and z > 6:
            cause = "exploding_gradient"
    ev.cause = cause
    ev.suggestion = SUGGESTIONS[cause]
    return ""


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
