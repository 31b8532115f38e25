"""What the user should do about an incident: one or two sentences per cause, filled in from the evidence."""

from __future__ import annotations

import math
from typing import Optional

from ..report.events import NaNEvent

__all__ = ["SUGGESTIONS", "SPIKE_SUGGESTION", "suggest"]

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
    "learning_rate": "The learning rate is too high: lower it (at least an order of magnitude below the one "
                     "that blew up), or add warm-up.",
    "optimizer": "The optimizer update made parameters non-finite from finite gradients: set Adam's eps to "
                 "1e-8 (not 0), lower the learning rate, or check weight decay and momentum settings.",
    "initialization": "Parameters were non-finite or badly scaled before training: re-initialise with "
                      "Xavier/He (nn.init.xavier_uniform_ / kaiming_normal_) and check loaded checkpoints.",
    "unknown": "Lower the learning rate, enable clipping, and rerun with NaNGuard(anomaly={'mode': 'always'}, "
               "check={'activations': 'always'}) to localise the first non-finite value.",
}

SPIKE_SUGGESTION = ("The loss jumped far above its recent level: a bad batch, a learning rate that is too high "
                    "for this phase (add warm-up or lower it), or missing clipping (clip.adaptive: always, "
                    "clip.max_norm). Repeated spikes usually precede a divergence to NaN.")


def _number(value: object) -> Optional[str]:
    """``value`` written with 3 significant digits when it is a finite number; None when it is unknown (None, NaN,
    infinite), so that the sentence leaves it out instead of printing 'None' or 'nan'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.3g}"
    return None


def suggest(ev: NaNEvent, cause: str, input_findings: Optional[list[dict]] = None) -> str:
    """One or two sentences for the user, drawn from the evidence in ``ev.details``."""
    d = ev.details
    where = f" in {ev.culprit}" if ev.culprit else ""
    op = f" ({ev.op})" if ev.op else ""
    base = SUGGESTIONS[cause]
    if cause == "input" and input_findings:
        f = input_findings[0]
        columns = f" features {f['features'][:10]}" if f.get("features") else ""
        return f"{f['field']} holds NaN/Inf at samples {f.get('samples', [])[:10]}{columns}. " + base
    if cause in ("overflow", "precision"):
        feats: Optional[list[dict]] = d.get("extreme_features")
        hint = (f"normalise feature(s) {feats[0]['features']} of {feats[0]['field']} (abs-max "
                f"{max(feats[0]['abs_max']):.3g} vs median {feats[0]['median_abs_max']:.3g}), or compute it in float64"
                if feats else "normalise or scale the inputs, or compute it in float64")
        if cause == "overflow" and "abs_max_float64" not in d:  # no replay evidence (e.g. GradScaler overflows)
            return base
        if cause == "overflow":
            return (f"Overflow{where}{op}: values reach {d.get('abs_max_float64', math.nan):.3g}, beyond "
                    f"{d.get('dtype', 'the dtype')}'s max {d.get('dtype_max', math.nan):.3g}; {hint}.")
        return f"Precision loss{where}{op}: finite in float64, not in {d.get('dtype', 'the working dtype')}; {hint}."
    if cause == "backward_op":
        src = (d.get("backward_op") or d.get("anomaly") or {}).get("traceback")
        at = f" (forward: {src})" if src else ""
        return f"The backward of {ev.op or 'an op'}{where} is infinite or undefined at these inputs{at}. " + base
    if cause == "initialization" and d.get("initialization"):
        f = d["initialization"]
        return (f"{f['parameter']} was initialised {f['ratio']:.3g}x too large: RMS {f['scale']:.3g} against the "
                f"usual {f['expected_scale']:.3g} (1/sqrt(fan_in), fan_in={f['fan_in']}); no learning rate helps. "
                "Re-initialise it with nn.init.xavier_uniform_ / kaiming_normal_, or check what loads or scales it.")
    if cause == "learning_rate" and d.get("relative_update"):
        f = d["relative_update"]
        lr, rel, safe = _number(f.get("lr")), _number(f.get("relative_update")), _number(f.get("safe_lr"))
        growth, edge_lr = _number(f.get("grad_norm_growth")), _number(f.get("edge_lr"))
        edge = (f"; the gradient norm grew {growth}x per step, which puts the edge of stability near {edge_lr}"
                if growth and edge_lr else "")
        what = f": one step moves the weights by {rel}x their own size{edge}" if rel else ""
        lower = f"Lower it to about {safe} or below" if safe else "Lower it by at least an order of magnitude"
        return f"The learning rate{f' ({lr})' if lr else ''} is too high{what}. {lower}, or add warm-up."
    if cause == "exploding_gradient" and (d.get("layer_growth") or d.get("activation_growth")):
        what = "gradients grow layer by layer towards the input" if d.get("layer_growth") else \
            "activations grow layer by layer"
        return (f"Gradients are exploding through depth ({what}): add normalisation layers or residual scaling, "
                "use Kaiming/Xavier initialisation, lower the learning rate or clip the gradient norm "
                "(clip.max_norm).")
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
