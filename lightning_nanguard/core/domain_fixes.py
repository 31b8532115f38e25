"""The words for a domain finding (:mod:`.domain`): what was outside the op's domain and the fix that fits the op.
Plain data and strings, no torch: :mod:`lightning_nanguard.core.causes` composes suggestions from them, and
``nanguard report`` imports the cause table without torch (it starts in a tenth of a second)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["MATMUL_OPS", "describe", "fix"]

# ops whose output is a sum of products: an overflow there is the sum exceeding the dtype's range
MATMUL_OPS = frozenset({"bmm", "mm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "einsum", "dot", "mv",
                        "sum", "conv1d", "conv2d", "conv3d", "convolution", "tensordot", "inner", "outer"})


def describe(domain: dict[str, Any]) -> str:
    """What was outside the op's domain, in words: ``the denominator of div is 0 at 3 position(s) (0/0)``."""
    name, what, n = domain.get("op", "the op"), domain.get("input"), domain.get("positions")
    if what == "an all -inf row":
        return f"{n} row(s) of the input of {name} are -inf everywhere (every position masked)"
    if what in ("a single sample", "no samples"):
        return (f"{name} reduces over {domain.get('samples')} element(s) with correction="
                f"{_fmt_num(domain.get('correction'))} ({what})")
    if what == "an empty selection":
        return f"{name} of an empty tensor (an empty selection)"
    if what == "every target ignored":
        return f"every target of {name} is ignore_index ({domain.get('ignore_index')}): a mean over no targets"
    if what in ("0 x inf", "inf - inf"):
        return f"{name} computes {what} at {n} position(s)"
    shown = "0" if what == "zero" else what
    tail = " (0/0)" if domain.get("zero_over_zero") else ""
    return f"the {domain.get('argument', 'input')} of {name} is {shown} at {n} position(s){tail}"


def _fmt_num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def fix(domain: dict[str, Any], dtype: Optional[str] = None) -> str:
    """The fix that fits the op and its out-of-domain input."""
    name, what = domain.get("op", ""), domain.get("input")
    made = str(domain.get("produced_by") or "")
    if name in ("log", "log2", "log10") and what == "zero":
        if made.startswith(("SoftmaxBackward", "_SoftmaxBackward")):
            return "take log_softmax of the logits instead of log(softmax(...)) (or cross_entropy on the logits)"
        if made.startswith("SigmoidBackward"):
            return ("use BCEWithLogitsLoss (binary_cross_entropy_with_logits) or F.logsigmoid on the logits instead "
                    "of log(sigmoid(...))")
        if made.startswith(("SumBackward", "ExpBackward")):
            return "use torch.logsumexp instead of log(sum(exp(...)))"
        return ("add an eps (log(x + 1e-8)) or clamp(min=1e-8) before the log; for a probability use log_softmax, "
                "BCEWithLogitsLoss or logsumexp on the logits")
    if what == "negative" and name.startswith(("log", "sqrt", "rsqrt")):
        return f"clamp the input of {name} to a positive value (x.clamp(min=1e-8)) or check why it is negative"
    if what == "negative" and name in ("pow", "float_power"):
        return "clamp the base (x.clamp(min=1e-8)) before a fractional power, or use an integer exponent"
    if name in ("div", "truediv", "true_divide", "divide", "rtruediv", "reciprocal", "rsqrt") or \
            (what == "zero" and name in ("pow", "float_power")):
        return ("add an eps to the denominator (x / (d + 1e-8)), clamp it (d.clamp(min=1e-8)), or use "
                "F.normalize(x, dim=..., eps=1e-12) for a per-sample normalisation")
    if what in ("a single sample", "no samples"):
        return ("a dimension of one element has no unbiased std/var: use correction=0 (unbiased=False), or guard "
                "the batch size (DataLoader(drop_last=True), or skip a batch of one sample)")
    if what == "an all -inf row":
        return ("let the mask leave at least one position in every row (e.g. never mask a sequence's own or first "
                "token), or fill with torch.finfo(dtype).min instead of -inf and zero the fully masked rows after "
                "the softmax")
    if what == "an empty selection":
        return "guard the empty selection (if mask.any(): ...), or divide the sum by count.clamp(min=1)"
    if what == "every target ignored":
        return ("a batch whose every target is ignore_index has no mean: skip it, or use reduction='sum' divided "
                "by the count clamped to 1")
    if what == "0 x inf":
        return ("mask with masked_fill or torch.where instead of multiplying by an infinite value (0 x inf is NaN), "
                "or fill with torch.finfo(dtype).min instead of -inf")
    if what == "inf - inf":
        return "use torch.finfo(dtype).min instead of -inf (inf - inf is NaN), or mask with torch.where"
    if what == "outside [-1, 1]":
        return f"clamp the input of {name} to [-1 + 1e-7, 1 - 1e-7]"
    return "clamp or mask its inputs, or add an eps"
