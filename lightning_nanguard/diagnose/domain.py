"""What an op's inputs say about its non-finite output: the op that made a NaN, its own float64 recompute, and
which input was outside the op's domain. Nothing here runs while training is healthy: the replay's op pass
(:class:`~.probes.FirstBadOp`) calls it on the ops of the culprit's call, and only once on the op it names.

- :func:`made_nonfinite`: does an op's output hold a NaN its tensor inputs did not, or an infinity that neither
  its tensor inputs nor its scalar arguments carried? ``masked_fill(mask, -inf)`` writes the infinity it was
  given: it is never the op; the ``softmax`` of the all ``-inf`` row it leaves is.
- :func:`op_evidence`: the op recomputed in float64 (autocast off) on the same inputs, its working dtype (the one
  that ran: autocast's, not the parameters'), and the input outside its domain (:func:`out_of_domain`).
- :func:`fix`: the fix that fits the op and that input, for the suggestion.
- :func:`inner_op`: the first aten op inside a Python composite (``multi_head_attention_forward``) that made the
  non-finite value, named as autograd names its backward (``_softmax`` -> ``SoftmaxBackward0``).
"""

from __future__ import annotations

import math
import re
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.domain_fixes import MATMUL_OPS, describe, fix
from ..core.dtensors import is_dtensor, local
from ..core.jsonvalue import JSONDict, JSONValue
from ..core.tree import iter_tensors, map_tensors

__all__ = ["made_nonfinite", "scalars_of", "op_name", "in_place", "names_itself", "op_evidence", "out_of_domain",
           "describe", "fix", "inner_op", "autograd_name", "MATMUL_OPS"]

_T = TypeVar("_T")
# an op as a dispatch or function mode sees it: an aten OpOverload, a torch function, a Tensor method
Op = Callable[..., object]
# what :func:`inner_op` found: the op, its arguments, keyword arguments and output
OpCall = tuple[Op, Sequence[object], Mapping[str, object], object]


def _floats(obj: object) -> list[Tensor]:
    return [t for _, t in iter_tensors(obj, "") if t.is_floating_point() and t.layout == torch.strided and t.numel()]


def scalars_of(obj: object) -> list[float]:
    """The Python numbers among an op's (nested) arguments: a fill value, an exponent, a divisor."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, (list, tuple)):
        return [s for o in obj for s in scalars_of(o)]
    if isinstance(obj, dict):
        return [s for o in obj.values() for s in scalars_of(o)]
    return []


def _flags(tensors: list[Tensor]) -> tuple[bool, bool]:
    """(any NaN, any infinity) over ``tensors``, read at once."""
    if not tensors:
        return False, False
    v = torch.stack([torch.stack([torch.isnan(t).any(), torch.isinf(t).any()]).to(tensors[0].device)
                     for t in (x.detach() for x in tensors)]).any(0).tolist()
    return bool(v[0]), bool(v[1])


def made_nonfinite(ins: list[Tensor], outs: list[Tensor], scalars: Sequence[float] = ()) -> bool:
    """The op made it: its output holds a NaN and no tensor input does (a NaN passed on was made upstream; one
    from a scalar argument, ``loss * nan``, is made here), or an infinity that no input, tensor or scalar, carried
    (``masked_fill(mask, -inf)`` writes the infinity it was given)."""
    out_nan, out_inf = _flags(outs)
    if not (out_nan or out_inf):
        return False
    in_nan, in_inf = _flags(ins)
    in_inf = in_inf or any(math.isinf(s) for s in scalars)
    return not in_nan and (out_nan or not in_inf)


_IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__",
                               "__ipow__", "__imod__"})


def in_place(func: object) -> bool:
    """Does ``func`` write into its first argument (``div_``, ``__itruediv__``, ``aten.masked_fill_``)?"""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet if packet is not None else func, "__name__", "") or ""
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def op_name(func: object) -> str:
    """``__truediv__`` and ``__itruediv__`` -> ``truediv``, ``aten._softmax`` -> ``softmax``, ``log_`` -> ``log``."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet if packet is not None else func, "__name__", None) or str(func)
    if name in _IN_PLACE_DUNDERS:
        name = "__" + name[3:]
    return name.strip("_")


def autograd_name(aten_name: str) -> str:
    """How autograd names the backward of an aten op: ``_softmax`` -> ``SoftmaxBackward0``."""
    return "".join(p[:1].upper() + p[1:] for p in aten_name.strip("_").split("_") if p) + "Backward0"


def _double(obj: _T) -> _T:
    return map_tensors(obj, lambda t: t.detach().double() if t.is_floating_point() else t)


def _no_autocast(tensors: list[Tensor]) -> AbstractContextManager[object]:
    device = tensors[0].device.type if tensors else "cpu"
    try:
        return torch.autocast(device, enabled=False)
    except Exception:  # pragma: no cover  (a device autocast does not know)
        return nullcontext()


def op_evidence(func: Op, args: Sequence[object], kwargs: Optional[Mapping[str, object]], out: object,
                float64: bool = True) -> JSONDict:
    """The evidence of the op that made a non-finite value: its working dtype and that dtype's max, the count of
    non-finite output positions, with ``float64`` the op recomputed in float64 on the same inputs with autocast
    off (finite there, and its abs-max: overflow or precision is judged at the op, not at the module), and the
    input outside its domain (:func:`out_of_domain`).

    Sharded (``DTensor`` arguments: tensor parallel) the op is recomputed on this rank's local shards, a computation
    of this rank alone (recomputed as a DTensor op it could redistribute: a collective the other ranks do not
    make); where its output is a partial sum over ranks (a row-wise layer's matmul), the recompute is this rank's
    part of it (``partial``)."""
    partial = any(is_dtensor(t) and any(pl.is_partial() for pl in t.placements) for _, t in iter_tensors(out, ""))
    args, kwargs, out = map_tensors(args, local), map_tensors(kwargs, local), map_tensors(out, local)
    outs = _floats(out)
    ins = _floats([args, kwargs])
    dtype = outs[0].dtype if outs else torch.float32
    bad = torch.stack([(~torch.isfinite(t.detach())).sum() for t in outs]).sum() if outs else torch.zeros(())
    found: JSONDict = {"dtype": str(dtype), "dtype_max": torch.finfo(dtype).max, "positions": int(bad)}
    if partial:
        found["partial"] = True
    if any(math.isnan(s) for s in scalars_of([args, kwargs])):
        found["nan_argument"] = True  # a NaN given to the op (loss * nan): passed on, no input out of its domain
    try:
        if not float64:
            raise _Skipped
        with _no_autocast(ins), torch.no_grad():
            # a cast to a narrower dtype (x.half(), x.to(torch.float16)) recomputed in float64 is its input
            again = _floats(_double(args[:1])) if op_name(func) in _CASTS else \
                _floats(func(*_double(args), **_double(kwargs)))
        if again:
            a = torch.stack([t.abs().amax() if t.numel() else t.new_zeros(()) for t in
                             (torch.where(torch.isfinite(t), t, 0.0) for t in again)]).amax()
            found["float64_finite"] = all(bool(torch.isfinite(t).all()) for t in again)
            found["abs_max_float64"] = float(a)
    except _Skipped:
        pass
    except Exception as err:  # the recompute is evidence, never an error of the replay
        found["float64_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
    domain = out_of_domain(op_name(func), args, kwargs or {}, outs)
    if domain:
        found["domain"] = domain
    return found


_CASTS = frozenset({"half", "bfloat16", "float", "to", "type", "type_as", "to_copy", "_to_copy"})


class _Skipped(Exception):
    pass


def _arg(args: Sequence[object], kwargs: Mapping[str, object], i: int, name: str, default: object = None) -> object:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _count(mask: object) -> int:
    return int(mask.sum()) if isinstance(mask, Tensor) else int(bool(mask))


def _producer(t: object) -> Optional[str]:
    """The autograd name of the op that made ``t`` (one level through ``1 - x`` and ``x + eps``)."""
    node = getattr(t, "grad_fn", None)
    if node is None:
        return None
    name = node.name()
    if name.startswith(("RsubBackward", "SubBackward", "AddBackward", "NegBackward", "MulBackward")):
        inner = next((n for n, _ in node.next_functions if n is not None and n.name() != "AccumulateGrad"), None)
        return inner.name() if inner is not None else name
    return name


def out_of_domain(name: str, args: object, kwargs: Mapping[str, object], outs: list[Tensor]) -> Optional[JSONDict]:
    """Which input of op ``name`` was outside its domain, at how many positions: ``zero``, ``negative``, ``an all
    -inf row``, ``a single sample``, ``an empty selection``, ``every target ignored``, ``0 x inf``, ``inf - inf``,
    ``outside [-1, 1]``; None when the op is not one this knows."""
    check = _CHECKS.get(name)
    if check is None:
        return None
    args = tuple(args) if isinstance(args, (list, tuple)) else (args,)
    try:
        with torch.no_grad():
            return check(_Call(name, args[0] if args else None, args, kwargs, outs))
    except Exception:  # evidence only
        return None


@dataclass
class _Call:
    """One call of the op ``name``: its first argument ``x``, all its arguments and its floating outputs."""

    name: str
    x: object
    args: tuple[object, ...]
    kwargs: Mapping[str, object]
    outs: list[Tensor]

    @property
    def floating(self) -> Optional[Tensor]:
        """The first argument when it is a floating tensor, else None."""
        return self.x if isinstance(self.x, Tensor) and self.x.is_floating_point() else None

    def arg(self, i: int, name: str, default: object = None) -> object:
        return _arg(self.args, self.kwargs, i, name, default)

    def found(self, what: str, positions: int, argument: str = "input", **more: JSONValue) -> JSONDict:
        return {"op": self.name, "input": what, "argument": argument, "positions": positions, **more}


_Check = Callable[[_Call], Optional[JSONDict]]  # the input of one call outside its op's domain, or None


def _log(op: _Call) -> Optional[JSONDict]:
    x = op.floating
    if x is not None:
        zeros, negs = _count(x == 0), _count(x < 0)
        if zeros or negs:
            return op.found("zero" if zeros else "negative", zeros or negs, produced_by=_producer(x))
    return None


def _log1p(op: _Call) -> Optional[JSONDict]:
    x = op.floating
    if x is not None and _count(x <= -1):
        return op.found("at or below -1", _count(x <= -1))
    return None


def _sqrt(op: _Call) -> Optional[JSONDict]:
    x = op.floating
    if x is not None:
        negs = _count(x < 0)
        if negs:
            return op.found("negative", negs)
        if op.name == "rsqrt" and _count(x == 0):
            return op.found("zero", _count(x == 0))
    return None


def _as_tensor(value: object) -> object:
    """A Python number (not a bool) as a 0-dim tensor; anything else as it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value))
    return value


def _division(op: _Call) -> Optional[JSONDict]:
    num, den = (None, op.x) if op.name == "reciprocal" else (op.arg(1, "other"), op.x) \
        if op.name == "rtruediv" else (op.x, op.arg(1, "other"))
    den = _as_tensor(den)
    if isinstance(den, Tensor):
        zero = den == 0
        n = _count(zero)
        if n:
            num = _as_tensor(num)
            both = _count(zero & (num == 0)) if isinstance(num, Tensor) else 0
            if op.outs and zero.dim() == 0:
                n = int(op.outs[0].numel())
            return op.found("zero", n, argument="denominator", zero_over_zero=bool(both))
    return None


def _spread(op: _Call) -> Optional[JSONDict]:
    """``std``/``var`` over fewer samples than their correction."""
    x = op.floating
    if x is not None and op.outs:
        correction = op.kwargs.get("correction")
        if correction is None:
            args = op.args
            unbiased = op.kwargs.get("unbiased", args[1] if len(args) > 1 and isinstance(args[1], bool) else True)
            correction = 1 if unbiased else 0
        if not isinstance(correction, (int, float)):  # (torch takes a number)
            return None
        samples = x.numel() // max(op.outs[0].numel(), 1)
        if samples <= correction:
            return op.found("a single sample" if samples == 1 else "no samples", int(op.outs[0].numel()),
                            samples=samples, correction=float(correction))
    return None


def _softmax(op: _Call) -> Optional[JSONDict]:
    x = op.floating
    dim = op.arg(1, "dim", -1)
    if x is not None and isinstance(dim, int) and x.dim():
        rows = _count(torch.isneginf(x).all(dim)) if op.name != "softmin" else _count(torch.isposinf(x).all(dim))
        if rows:
            return op.found("an all -inf row", rows, dim=dim)
        pos = _count(torch.isposinf(x).any(dim))
        if pos:
            return op.found("+inf in a row", pos, dim=dim)
    return None


def _mean(op: _Call) -> Optional[JSONDict]:
    if isinstance(op.x, Tensor) and op.x.numel() == 0:
        return op.found("an empty selection", 1)
    return None


def _classification_loss(op: _Call) -> Optional[JSONDict]:
    target = op.arg(1, "target")
    ignore = op.arg(4, "ignore_index", -100)
    if isinstance(target, Tensor) and isinstance(ignore, int) and not target.is_floating_point() and \
            target.numel() and _count(target == ignore) == target.numel() and \
            op.kwargs.get("reduction", "mean") == "mean":
        return op.found("every target ignored", int(target.numel()), argument="target", ignore_index=ignore)
    return None


def _operands(op: _Call) -> Optional[tuple[Tensor, Tensor]]:
    """The two operands of a binary op as tensors; None when the second is neither a tensor nor a number."""
    if len(op.args) <= 1:
        return None
    x, y = op.x, op.args[1]
    if not isinstance(x, (Tensor, int, float)):  # (not a number: no domain to check)
        return None
    xs = x if isinstance(x, Tensor) else torch.tensor(float(x))
    ys = y if isinstance(y, Tensor) else torch.tensor(float(y)) if isinstance(y, (int, float)) else None
    return None if ys is None else (xs, ys)


def _product(op: _Call) -> Optional[JSONDict]:
    both = _operands(op)
    if both is not None:
        xs, ys = both
        n = _count((torch.isinf(xs) & (ys == 0)) | ((xs == 0) & torch.isinf(ys)))
        if n:
            return op.found("0 x inf", n)
    return None


def _difference(op: _Call) -> Optional[JSONDict]:
    both = _operands(op)
    if both is not None:
        xs, ys = both
        same = torch.sign(xs) == torch.sign(ys)
        n = _count(torch.isinf(xs) & torch.isinf(ys) & (same if op.name in ("sub", "subtract", "rsub") else ~same))
        if n:
            return op.found("inf - inf", n)
    return None


def _inverse_trig(op: _Call) -> Optional[JSONDict]:
    x = op.floating
    if x is not None:
        n = _count(x.abs() > 1) if op.name != "atanh" else _count(x.abs() >= 1)
        if n:
            return op.found("outside [-1, 1]", n)
    return None


def _power(op: _Call) -> Optional[JSONDict]:
    e = op.arg(1, "exponent")
    x = op.floating
    if x is not None and isinstance(e, (int, float)):
        if e != int(e) and _count(x < 0):
            return op.found("negative", _count(x < 0), exponent=float(e))
        if e < 0 and _count(x == 0):
            return op.found("zero", _count(x == 0), exponent=float(e))
    return None


# op name -> the check of its family's domain (each op in one family)
_CHECKS: dict[str, _Check] = {name: check for names, check in (
    (("log", "log2", "log10"), _log),
    (("log1p",), _log1p),
    (("sqrt", "rsqrt"), _sqrt),
    (("div", "truediv", "true_divide", "divide", "rtruediv", "reciprocal"), _division),
    (("std", "var", "std_mean", "var_mean"), _spread),
    (("softmax", "log_softmax", "softmin"), _softmax),
    (("mean", "nanmean"), _mean),
    (("cross_entropy", "nll_loss"), _classification_loss),
    (("mul", "multiply"), _product),
    (("add", "sub", "subtract", "rsub"), _difference),
    (("acos", "asin", "atanh"), _inverse_trig),
    (("pow", "float_power"), _power),
) for name in names}


class _FirstAten(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: Optional[OpCall] = None

    def __torch_dispatch__(self, func: Op, types: Sequence[type], args: Sequence[object] = (),
                           kwargs: Optional[Mapping[str, object]] = None) -> object:
        kwargs = kwargs or {}
        before = args
        if self.found is None and in_place(func) and args and isinstance(args[0], Tensor):
            before = (args[0].clone(), *args[1:])
        out = func(*args, **kwargs)
        if self.found is None:
            outs = _floats(out)
            if outs and made_nonfinite(_floats([before, kwargs]), outs, scalars_of([before, kwargs])):
                self.found = (func, before, kwargs, out)
        return out


def inner_op(func: Op, args: Sequence[object], kwargs: Optional[Mapping[str, object]]) -> Optional[OpCall]:
    """The aten op inside the Python composite ``func`` that made the non-finite value (``func`` rerun once on
    the same inputs, without autograd): (the op, its arguments, keyword arguments, output); None when none did or
    it cannot run again."""
    mode = _FirstAten()
    try:
        with torch.no_grad(), mode:
            func(*args, **(kwargs or {}))
    except Exception:
        return None
    return mode.found


_RESHAPES = ("Transpose", "View", "Permute", "Reshape", "UnsafeView", "Squeeze", "Unsqueeze", "Expand", "Clone",
             "Select", "Slice", "AsStrided", "T")


def names_itself(grad_name: Optional[str]) -> bool:
    """Does the autograd node of a composite's output name an op that computed it (``MseLossBackward0``,
    ``NllLossBackward0``), rather than a reshape of what an op inside computed (``TransposeBackward0`` at the end
    of ``multi_head_attention_forward``)? No node (nothing required grad) names nothing."""
    if not grad_name:
        return False
    return re.sub(r"Backward\d*$", "", grad_name) not in _RESHAPES
