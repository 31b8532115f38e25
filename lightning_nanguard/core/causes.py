"""The causes an incident can be diagnosed with: one table of what each means, what to tell the user, and what
the recovery ladder does about it.

Each :class:`Cause` entry is all the package knows about a cause outside the rule that diagnoses it
(:mod:`lightning_nanguard.diagnose.rules`): adding a cause is one entry here plus its rule there. The ladder
(:mod:`lightning_nanguard.recover.ladder`) reads the policy fields and never spells a cause's name.

LR policies (``lr_cut``):

- ``"never"``: a smaller learning rate cannot fix it (bad data, bad weights, a dtype's range, an op's domain);
- ``"at_once"``: the dynamics diverge: cut at the first incident of a streak, by ``recovery.lr_factor``;
- ``"sized"``: the LR itself is too high: cut at once by ``recovery.divergence_lr_factor``, or further to the
  diagnosis' safe LR (:attr:`.Diagnosis.relative_update`'s ``safe_lr``);
- ``"escalation"``: not known to be the LR: cut only when the ladder escalates (a rollback forced because
  skipping did not help, ``recovery.reduce_lr_on_rollback``; ``recovery.reduce_lr_after`` incidents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .diagnosis import Diagnosis, Where
from .domain_fixes import MATMUL_OPS, describe, fix

__all__ = ["Cause", "CAUSES", "NAMES", "cause_entry", "suggest", "where_it_ran"]

# a suggestion drawn from an event's evidence (its diagnosis, culprit and op) and the cause's advice; None falls
# back to the advice
Suggest = Callable[[Where, Diagnosis, str], Optional[str]]


@dataclass(frozen=True)
class Cause:
    """One cause: its meaning, the user's advice and the ladder's policy."""

    name: str
    meaning: str  # one line, for the report and the docs
    advice: str  # what the user should do (the suggestion when the evidence adds nothing)
    lr_cut: str  # "never" | "at_once" | "sized" | "escalation" (module docstring)
    lr_reason: str = ""  # why a cut at once is made (the event's details.reasons)
    arms_clip: bool = True  # the first incident arms adaptive clipping (clip.adaptive: on_incident)
    in_incident_window: bool = True  # counts towards recovery.reduce_lr_after
    counts_toward_rollback: bool = True  # counts in the streak of incidents that forces a rollback (max_skips)
    gives_up: bool = False  # nothing can help: give up at once, without a rollback
    weights_suspect: bool = True  # a fit ending inside its streak may end on broken weights (restore_at_end)
    hardware_fault: bool = False  # counts against the rank's hardware (recovery.transient_limit)
    runaway_culprit: bool = False  # its culprit is the module that ran away (weights, gradient flow)
    suggest: Optional[Suggest] = None  # the evidence-specific suggestion


# ------------------------------------------------------------------------------- evidence-specific advice


def _where(ev: Where) -> tuple[str, str]:
    return (f" in {ev.culprit}" if ev.culprit else ""), (f" ({ev.op})" if ev.op else "")


def _number(value: object) -> Optional[str]:
    """``value`` written with 3 significant digits when it is a finite number; None when it is unknown (None, NaN,
    infinite), so that a sentence can leave it out instead of printing 'None' or 'nan'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value:.3g}"
    return None


def _fmt(value: object) -> str:
    return _number(value) or "?"


def _input(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    found = d.inputs or []
    if not found:
        return None
    f = found[0]
    columns = f" features {f['features'][:10]}" if f.get("features") else ""
    return f"{f['field']} holds NaN/Inf at samples {f.get('samples', [])[:10]}{columns}. " + advice


def _feature_hint(d: Diagnosis) -> str:
    feats = d.extreme_features
    if not feats:
        return "normalise or scale the inputs, or compute it in float64"
    f = feats[0]
    return (f"normalise feature(s) {f['features']} of {f['field']} (abs-max {_fmt(max(f['abs_max']))} vs median "
            f"{_fmt(f['median_abs_max'])}), or compute it in float64")


def _function(d: Diagnosis) -> str:
    """The name of the op that made the value, as the user called it (``bmm``, ``log``, ``softmax``)."""
    f = d.forward_op or {}
    return str(f.get("inner_function") or f.get("function") or "the op").strip("_")


def _wider(dtype: str) -> str:
    """The dtype to compute an op in instead of ``dtype``: float32 for a half type, else float64."""
    return "float32" if ("16" in dtype or "8" in dtype) else "float64"


def _overflow(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    if d.abs_max_float64 is None:  # no replay evidence (e.g. GradScaler overflows)
        return None
    where, op = _where(ev)
    dtype = str(d.dtype if d.dtype is not None else "the dtype").replace("torch.", "")
    reach = f"values reach {_fmt(d.abs_max_float64)}, beyond {dtype}'s max {_fmt(d.dtype_max)}"
    if d.judged_at == "op" and _function(d) in MATMUL_OPS and not d.extreme_features:
        return (f"Overflow{where}{op}: {reach}: the sum exceeds {dtype}'s range: compute it in {_wider(dtype)} or "
                "scale before the product (e.g. divide one factor by sqrt of the normaliser first).")
    return f"Overflow{where}{op}: {reach}; {_feature_hint(d)}."


def _precision(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    where, op = _where(ev)
    dtype = str(d.dtype if d.dtype is not None else "the working dtype").replace("torch.", "")
    found = d.domain
    if found and found.get("input"):
        return (f"Precision loss{where}{op}: in {dtype} {describe(found)}, not in float64: "
                f"{fix(found, dtype)}, or compute this op in {_wider(dtype)}.")
    hint = _feature_hint(d) if dtype == "float32" or d.extreme_features else \
        f"compute this op in {_wider(dtype)} (autocast(enabled=False) around it), or rescale its inputs"
    return f"Precision loss{where}{op}: finite in float64, not in {dtype}; {hint}."


def _domain(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    found = d.domain or {}
    where, op = _where(ev)
    src = (d.forward_op or {}).get("source")
    at = f" at {src}" if src else ""
    what = describe(found) if found.get("input") else f"{_function(d)} made a NaN from finite inputs"
    fixed = fix(found) if found.get("input") else "clamp or mask its inputs, or add an eps"
    return (f"Outside the op's domain{where}{op}{at}: {what}, in float64 too. Fix: {fixed}.")


def _backward_op(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    where, _ = _where(ev)
    src = (d.backward_op or d.anomaly or {}).get("traceback")
    at = f" (forward: {src})" if src else ""
    return f"The backward of {ev.op or 'an op'}{where} is infinite or undefined at these inputs{at}. " + advice


def _initialization(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    f = d.initialization
    if not f:
        return f"Non-finite values in {ev.culprit}. " + advice if ev.culprit else None
    # the scale it was given, measured at fit start (later steps' updates of a blown-up weight inflate the ratio)
    ratio, scale = f.get("ratio_at_fit_start", f["ratio"]), f.get("scale_at_fit_start", f["scale"])
    return (f"{f['parameter']} was initialised {_fmt(ratio)}x too large: RMS {_fmt(scale)} at fit start against "
            f"the usual {_fmt(f['expected_scale'])} (1/sqrt(fan_in), fan_in={f['fan_in']}); no learning rate helps. "
            "Re-initialise it with nn.init.xavier_uniform_ / kaiming_normal_, or check what loads or scales it.")


def _learning_rate(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    f = d.relative_update
    if not f:
        return None
    lr, rel, safe = _number(f.get("lr")), _number(f.get("relative_update")), _number(f.get("safe_lr"))
    growth, edge_lr = _number(f.get("grad_norm_growth")), _number(f.get("edge_lr"))
    edge = (f"; the gradient norm grew {growth}x per step, which puts the edge of stability near {edge_lr}"
            if growth and edge_lr else "")
    what = f": one step moves the weights by {rel}x their own size{edge}" if rel else ""
    lower = f"Lower it to about {safe} or below" if safe else "Lower it by at least an order of magnitude"
    return f"The learning rate{f' ({lr})' if lr else ''} is too high{what}. {lower}, or add warm-up."


def _exploding(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    if not (d.layer_growth or d.activation_growth):
        return None
    what = "gradients grow layer by layer towards the input" if d.layer_growth else \
        "activations grow layer by layer"
    return (f"Gradients are exploding through depth ({what}): add normalisation layers or residual scaling, use "
            "Kaiming/Xavier initialisation, lower the learning rate or clip the gradient norm (clip.max_norm).")


def _culprit(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    return f"Non-finite values in {ev.culprit}. " + advice if ev.culprit else None


def where_it_ran(ev: Where, ranks: Optional[list[int]] = None) -> str:
    """``rank 1 on host node7 (cuda:1)``: where the event's rank ran, as far as the event knows it.

    Args:
        ev: the event.
        ranks: the ranks with evidence of their own (:class:`~..respond.account.Account`; None: one process or not
            agreed yet; empty: several ranks, and none has evidence of its own).

    Returns:
        The words, for a sentence.
    """
    if ranks == []:  # several ranks, and none has evidence of its own
        return "an unknown rank (no rank's own evidence or replay shows it)"
    host = f" on host {ev.host}" if ev.host else ""
    device = f" ({ev.device})" if ev.device else ""
    return f"rank {ev.rank}{host}{device}"


def _transient(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    what = "Its replicas disagreed" if ev.kind == "replica" else "It was non-finite"
    return (f"{what} at step {ev.step} on {where_it_ran(ev, d.ranks)}, and the replay of the same batch on the same "
            "weights and RNG state was clean: a fault that does not come back. " + advice)


def _written(d: Diagnosis) -> Optional[str]:
    """A NaN the step wrote into its own batch in place (``d.batch_written``): what can be told, and the fix."""
    entry = next((w for w in d.batch_written or [] if w.get("nonfinite")), None)
    if entry is None:
        return None
    field, function = entry["field"], str(entry.get("function") or "")
    by = f": {function} at {entry['source']}" if function and entry.get("source") else (
        f": {function}" if function else "")
    name = function.strip("_")
    name = name[1:] if function.startswith("__i") else name  # __itruediv__ -> truediv
    hint = f"; if {name} is what made it: {fix({'op': name})}" if name else ""
    return (f"training_step wrote into its batch in place ({field}, version {entry['version_before']} -> "
            f"{entry['version_after']}{by}), and the {entry['nonfinite']} non-finite value(s) there are what it "
            "wrote: the values it was given are overwritten, so whether the data or the op made them cannot be told. "
            f"Clone the batch before writing into it ({field}.clone()) and the next incident names the op and its "
            f"domain{hint}.")


def _unknown(ev: Where, d: Diagnosis, advice: str) -> Optional[str]:
    written = _written(d)
    if written is not None:
        return written
    if not ev.culprit:
        return None
    where, op = _where(ev)
    if (d.float64 or {}).get("module_finite") is False:
        src = (d.forward_op or {}).get("source")
        at = f" at {src}" if src else ""
        return (f"The first non-finite value appeared{where}{op}{at} and stays non-finite in float64: the op's input "
                "is outside its domain (log or sqrt of a negative, 0/0, inf-inf); clamp or mask its inputs, add an "
                "epsilon, or check the weights feeding it for divergence.")
    return f"The first non-finite value appeared{where}{op}. " + advice


# ------------------------------------------------------------------------------------------------ the table

CAUSES: dict[str, Cause] = {c.name: c for c in (
    Cause("input", "non-finite values in the batch", lr_cut="never", arms_clip=False, in_incident_window=False,
          weights_suspect=False,
          advice="Bad input data: fix or drop these samples (check the data pipeline, normalisation and division by "
                 "zero in feature engineering), or filter non-finite batches in the dataset.", suggest=_input),
    Cause("overflow", "a value beyond the range of its dtype (finite in float64)", lr_cut="never",
          advice="Values exceed the dtype's range: normalise or scale the features, reorder the computation so large "
                 "sums are not formed, or compute this op in float64 / float32 instead of half.", suggest=_overflow),
    Cause("precision", "precision lost in the working dtype (finite in float64)", lr_cut="never",
          advice="Precision loss in the working dtype: compute this op in float64 (or float32 under AMP), add an "
                 "epsilon, or rescale the inputs.", suggest=_precision),
    Cause("domain", "an op fed inputs outside its domain in the forward pass (log of 0, 0/0, std of one sample, "
                    "softmax of an all -inf row); float64 does not help", lr_cut="never",
          advice="An op got inputs outside its domain (log of 0 or of a negative, 0/0, std of one sample, softmax of "
                 "a row masked to -inf everywhere): add an eps, clamp or mask its inputs, or use the stable form "
                 "(log_softmax, BCEWithLogitsLoss, logsumexp).", suggest=_domain),
    Cause("backward_op", "an op whose derivative is infinite or undefined at its inputs", lr_cut="never",
          advice="An op has an infinite or undefined derivative at these inputs (sqrt/norm at 0, log at 0, pow with "
                 "fractional exponent at 0): add an epsilon (e.g. sqrt(x + 1e-12)) or mask the rows.",
          suggest=_backward_op),
    Cause("exploding_gradient", "gradients growing through depth or from step to step", lr_cut="at_once",
          lr_reason="exploding gradients", runaway_culprit=True,
          advice="Gradients are exploding: lower the learning rate, add warm-up, or clip the gradient norm "
                 "(clip.max_norm).", suggest=_exploding),
    Cause("learning_rate", "one step moves the weights by their own size or more", lr_cut="sized",
          lr_reason="the learning rate is too high", runaway_culprit=True,
          advice="The learning rate is too high: lower it (at least an order of magnitude below the one that blew "
                 "up), or add warm-up.", suggest=_learning_rate),
    Cause("optimizer", "the optimizer made finite weights non-finite from finite gradients", lr_cut="escalation",
          advice="The optimizer update made parameters non-finite from finite gradients: set Adam's eps to 1e-8 (not "
                 "0), lower the learning rate, or check weight decay and momentum settings.", suggest=_culprit),
    Cause("initialization", "weights non-finite or far off their usual scale before the first step",
          lr_cut="never", gives_up=True,
          advice="Parameters were non-finite or badly scaled before training: re-initialise with Xavier/He "
                 "(nn.init.xavier_uniform_ / kaiming_normal_) and check loaded checkpoints.",
          suggest=_initialization),
    Cause("transient", "the replay of the same batch on the same weights and RNG state is clean: a fault that does "
                       "not come back (a flaky GPU, a bit flip in memory or on the interconnect, a racy kernel)",
          lr_cut="never", arms_clip=False, in_incident_window=False, counts_toward_rollback=False,
          weights_suspect=False, hardware_fault=True,
          advice="Nothing in the run needs fixing: the step was skipped and nothing else changed. If it comes back on "
                 "the same rank, test that GPU (nvidia-smi -q -d ECC for memory errors, dcgmi diag -r 3, or a burn-in "
                 "such as gpu-burn) or ask the scheduler to exclude the host; on a racy kernel, "
                 "torch.use_deterministic_algorithms(True) tells.", suggest=_transient),
    Cause("unknown", "no rule explains it", lr_cut="escalation",
          advice="Lower the learning rate, enable clipping, and rerun with NaNGuard(anomaly={'mode': 'always'}, "
                 "check={'activations': 'always'}) to localise the first non-finite value.", suggest=_unknown),
)}

NAMES = tuple(CAUSES)
_NONE = CAUSES["unknown"]  # the policy of an incident without a diagnosis


def cause_entry(name: Optional[str]) -> Cause:
    """The entry of ``name``; an incident without a diagnosis (None) follows ``unknown``'s policy."""
    return _NONE if name is None else CAUSES[name]


def suggest(event: Where, name: Optional[str], found: Diagnosis) -> str:
    """One or two sentences for the user about ``event``.

    Args:
        event: the event (its culprit, op, step and where it ran).
        name: its cause (None: undiagnosed, ``unknown``'s advice).
        found: what its diagnosis found (empty: nothing).

    Returns:
        The suggestion drawn from the evidence, else the cause's advice.
    """
    entry = cause_entry(name)
    said = entry.suggest(event, found, entry.advice) if entry.suggest is not None else None
    return said if said is not None else entry.advice
