"""Evidence about the training dynamics, for naming a cause without a history: weight scales against the usual
initialisation scale, the relative size of an update, and growth layer by layer. Nothing here runs while
training is healthy (except :meth:`InitialScales.record`, once at fit start, which only queues device
norms; they are read on the first incident).

- :func:`expected_scale`: the RMS of a freshly initialised weight, ``1/sqrt(fan_in)``; the usual schemes are
  within a small factor of it (PyTorch's default ``nn.Linear``: 0.58x, Xavier: up to 1x, Kaiming-normal
  for ReLU: 1.41x).
- :func:`oversized`: the weight whose RMS, at fit start and now, is :data:`INIT_RATIO` times that scale.
- :func:`relative_update`: ``lr x |update| / |w|`` for one step at the onset of a growth: SGD moves the
  weights by ``lr / (1 - momentum) x |grad|``; adaptive optimizers (Adam, RMSprop, ...) move each element by
  about ``lr``, i.e. ``lr x sqrt(n)`` in all. For SGD, a gradient norm growing ``r``-fold per step also
  places the edge of stability (:func:`edge_lr`).
- :func:`layer_growth`: per-layer gradient RMS growing from the output side to the input side;
  :func:`activation_growth`: module outputs growing layer by layer in a replayed forward pass;
  :func:`short_growth`: a gradient norm growing geometrically over the last few steps.

Under sharding (DTensor parameters: FSDP2, tensor parallel) every norm here is that of the rank's local shard
and every RMS divides by the shard's own number of elements (a shard's RMS stands for the whole tensor's; an
empty shard has norm 0 and tells nothing): no collective on the incident path, where the ranks' branches may
differ. Each rank's diagnosis is gathered with its evidence, and the events take the account of one rank.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..core.dtensors import local

__all__ = ["INIT_RATIO", "RELATIVE_UPDATE_LR", "SAFE_RELATIVE_UPDATE", "WEIGHT_GROWTH", "LAYER_GROWTH",
           "LAYER_TREND", "LAYER_COUNT", "ACTIVATION_GROWTH", "ACTIVATION_STEP", "SHORT_GROWTH", "WEIGHT_RMS_FLOOR",
           "expected_scale", "fan_in", "InitialScales", "norms", "oversized", "relative_update", "layer_growth",
           "activation_growth", "short_growth", "growth_onset", "growth_rate", "edge_lr", "EDGE_MARGIN"]

INIT_RATIO = 1e3  # a weight this many times 1/sqrt(fan_in), at fit start and now, was initialised wrongly
RELATIVE_UPDATE_LR = 1.0  # one step moving the weights by their own size (healthy: ~1e-3): the LR is too high
# the relative update an LR cut aims at: SGD's is measured with the real gradient (a sane LR moves freshly
# initialised weights by up to about their size in the first steps); an adaptive optimizer's, lr x sqrt(n), is
# the largest step it can take: healthy runs use 1% (large models) to 10% (small ones) of the weights' RMS
SAFE_RELATIVE_UPDATE = {"sgd": 1.0, "adaptive": 0.05}
# the weights grew this many times since the reference (the newest snapshot from before the onset): the onset's
# gradient, taken on those grown weights, cannot be measured against the reference's
WEIGHT_GROWTH = 10.0
LAYER_GROWTH = 100.0  # per-layer gradient RMS, input side over output side
LAYER_TREND = 0.8  # ... with a consistent trend: the rank correlation of depth and log-RMS at least this
LAYER_COUNT = 4  # ... over at least this many weight layers (of 2 or more dims)
ACTIVATION_GROWTH = 1e3  # abs-max growth over a chain of weight layers in one forward pass
ACTIVATION_CHAIN = 4  # consecutive weight layers, each growing the abs-max ...
ACTIVATION_STEP = 2.0  # ... this many times or more (the output's over the previous layer's, or over its input)
# the relative update of a param group whose weights' RMS is below this (zero-initialised parameters) is measured
# against this RMS instead: against their own (tiny, or 0: no measure at all) any step would be absurdly large
WEIGHT_RMS_FLOOR = 1e-3
SHORT_GROWTH = 2.0  # per-step growth of the gradient norm ...
SHORT_GROWTH_STEPS = 2  # ... over this many consecutive steps (the incident's own norm included if finite)
# an LR cut sized from the growth rate aims this many times below the edge of stability: room for the sharpness
# to grow (it rises as training proceeds) before the new LR is at the edge again
EDGE_MARGIN = 4.0


def fan_in(shape: Sequence[int]) -> int:
    """Inputs per output unit of a weight (``torch.nn.init``'s convention: all dims but the first)."""
    return int(math.prod(shape[1:])) if len(shape) >= 2 else 0


def expected_scale(shape: Sequence[int]) -> Optional[float]:
    """``1/sqrt(fan_in)`` for a weight of 2 or more dims; None for biases, gains and scalars."""
    n = fan_in(shape)
    return 1.0 / math.sqrt(n) if n > 0 else None


def norms(tensors: Iterable[Tensor]) -> list[float]:
    """2-norms, read at once, in each tensor's own dtype (no float64 copy of a large weight); a norm that
    overflows its dtype (values near float32's max) is recomputed scaled by the tensor's abs-max."""
    ts = [local(t).detach() for t in tensors]  # a DTensor: its local shard
    if not ts:
        return []
    device = ts[0].device
    values = torch.stack([torch.linalg.vector_norm(t).double().to(device) for t in ts]).tolist()
    for i, (t, v) in enumerate(zip(ts, values)):
        if math.isinf(v):
            top = float(torch.linalg.vector_norm(t, math.inf))
            if math.isfinite(top) and top > 0:
                values[i] = top * float(torch.linalg.vector_norm(t / top))
    return values


class InitialScales:
    """The norm of every parameter at fit start, queued on the device at :meth:`record` and read on demand.

    Each parameter costs two reductions in its own dtype (2-norm and abs-max) and no copy; where the 2-norm
    overflowed the dtype, the abs-max (a lower bound of the 2-norm) stands in for it.
    """

    def __init__(self) -> None:
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._pending: list[Tensor] = []
        self._values: Optional[dict[str, float]] = None

    def record(self, module: nn.Module) -> None:
        named = [(n, local(p).detach()) for n, p in module.named_parameters()]  # a DTensor: its local shard
        self._shapes = {n: tuple(p.shape) for n, p in named}
        # (an empty parameter or shard, e.g. a table sized 0, has no inf-norm: torch raises; its norms are 0)
        self._pending = [torch.stack([torch.linalg.vector_norm(p).float(),
                                      torch.linalg.vector_norm(p, math.inf).float()]) if p.numel()
                         else torch.zeros(2, device=p.device) for _, p in named]
        self._values = None

    def read(self) -> dict[str, float]:
        """Parameter name -> its 2-norm at fit start (empty before :meth:`record`)."""
        if self._values is None:
            pairs: list[list[float]] = []
            if self._pending:
                device = self._pending[0].device
                pairs = torch.stack([v.to(device) for v in self._pending]).tolist()
            self._values = {n: (two if math.isfinite(two) else top) for n, (two, top) in zip(self._shapes, pairs)}
            self._pending = []
        return self._values

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        return self._shapes.get(name)


def _rms(norm: float, numel: int) -> float:
    return norm / math.sqrt(max(numel, 1))


def oversized(module: nn.Module, initial: dict[str, float], ratio: float = INIT_RATIO) -> Optional[dict[str, Any]]:
    """The weight (2-D or more) whose RMS was ``ratio`` times :func:`expected_scale` at fit start and still is
    (the largest such), as evidence; None when there is none or nothing was recorded at fit start."""
    named = [(n, p) for n, p in module.named_parameters() if p.dim() >= 2 and n in initial]
    if not named:
        return None
    now = norms(p for _, p in named)
    worst: Optional[dict[str, Any]] = None
    for (name, p), norm in zip(named, now):
        expected = expected_scale(p.shape)  # of the whole tensor; the RMS is its local shard's
        assert expected is not None
        n = local(p).numel()
        if not n:
            continue
        scale, at_start = _rms(norm, n), _rms(initial[name], n)
        if not (math.isfinite(scale) and math.isfinite(at_start)):
            continue
        found = scale / expected
        if found >= ratio and at_start / expected >= ratio and (worst is None or found > worst["ratio"]):
            worst = {"parameter": name, "scale": scale, "expected_scale": expected, "ratio": found,
                     "scale_at_fit_start": at_start, "ratio_at_fit_start": at_start / expected,
                     "fan_in": fan_in(p.shape)}
    return worst


def _sgd_like(group: dict[str, Any]) -> bool:
    return all(k in group for k in ("momentum", "dampening", "nesterov"))


def edge_lr(lr: float, growth: float, momentum: float = 0.0) -> float:
    """The LR at the edge of stability of SGD (heavy-ball ``momentum``) whose gradient norm grows ``growth``-fold
    per step at ``lr``.

    On a quadratic of curvature ``h`` SGD multiplies the error along it by ``1 - lr h`` per step (with momentum
    ``b``: the largest root of ``z^2 - (1 + b - lr h) z + b``, about ``lr h - 1 - b`` in size once that
    exceeds 1); it diverges when ``lr h > 2 (1 + b)``. A growth of ``r`` per step thus means ``lr h = r + 1 + b``,
    and the edge is at ``lr x 2 (1 + b) / (r + 1 + b)``."""
    return lr * 2.0 * (1.0 + momentum) / (growth + 1.0 + momentum)


def growth_rate(values: Sequence[float], ratio: float = SHORT_GROWTH,
                steps: int = SHORT_GROWTH_STEPS) -> Optional[float]:
    """The per-step growth of the final run of ``ratio``-fold growth of ``values``, when that run spans ``steps``
    steps or more (else None): the median of its ratios, the lower one of an even count. The first ratio is
    low (at the onset the gradient is not yet along the unstable direction), the last ones high once the
    blow-up turns non-linear; the median is the steady growth between."""
    run = list(values[growth_onset(values, ratio):])
    if len(run) < steps + 1 or not all(math.isfinite(v) and v > 0 for v in run):
        return None
    ratios = sorted(b / a for a, b in zip(run, run[1:]))
    return ratios[(len(ratios) - 1) // 2]


def relative_update(optimizers: Sequence[torch.optim.Optimizer], module: nn.Module, grad_norm: float,
                    reference: Optional[dict[str, float]] = None,
                    reference_step: Optional[int] = None, growth: Optional[float] = None,
                    lrs: Optional[dict[int, float]] = None) -> Optional[dict[str, Any]]:
    """``lr x |update| / |w|`` of one step (see the module docstring), with the gradient norm ``grad_norm`` and
    the weights whose norms ``reference`` holds (parameter name -> norm, from the onset of the growth) or,
    without one, the current ones. The largest over the optimizers' param groups, with ``safe_lr``: the LR
    at which it would be :data:`SAFE_RELATIVE_UPDATE`, or for SGD whose gradient norm grew ``growth``-fold per
    step (:func:`growth_rate`) :data:`EDGE_MARGIN` times below :func:`edge_lr` if that is lower; None when
    nothing can be computed. ``lrs``: the LR of a param group (by ``id``) at the step, where it differs from the
    group's LR now (a step judged after its scheduler stepped).

    Degenerate values give no estimate rather than an error: ``safe_lr`` (and the edge) is None where the
    relative update is 0 (an LR of 0: a warm-up from 0, a schedule that ends at 0) or infinite (an infinite LR,
    or weights whose norm overflowed); a param group with a NaN or negative LR, or without elements, is
    left out."""
    names = {id(p): n for n, p in module.named_parameters()}
    best: Optional[dict[str, Any]] = None
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []):
            params = [p for p in group["params"] if p.requires_grad]
            if not params or not isinstance(group.get("lr"), (int, float, Tensor)):
                continue
            lr = float(lrs[id(group)] if lrs is not None and id(group) in lrs else group["lr"])
            if math.isnan(lr) or lr < 0:
                continue  # no step size to compare (a NaN LR; a negative one ascends the gradient)
            known = [reference[names[id(p)]] for p in params if reference is not None and names.get(id(p)) in reference]
            current = norms(p for p in params if reference is None or names.get(id(p)) not in reference)
            w = math.sqrt(sum(v * v for v in known + current))
            n = sum(local(p).numel() for p in params)  # norms of local shards: their elements
            w = max(w, math.sqrt(n) * WEIGHT_RMS_FLOOR)  # zero-initialised parameters: a small, non-zero scale
            if not w > 0:
                continue  # NaN weights, or no elements at all
            if _sgd_like(group):
                if not math.isfinite(grad_norm) or grad_norm <= 0:  # unknown (e.g. check.gradients off)
                    continue
                momentum = float(group.get("momentum") or 0.0)
                whole = sum(p.numel() for p in params)  # the global norm against the shards': scaled up to them
                step = lr * grad_norm * math.sqrt(n / whole) / (1.0 - momentum if momentum < 1.0 else 1.0)
                kind = "sgd"
            else:
                step = lr * math.sqrt(n)
                kind = "adaptive"
            rel = step / w
            if math.isnan(rel):
                continue  # an infinite LR against weights whose norm overflowed
            if best is None or rel > best["relative_update"]:
                # an LR of 0 moves nothing and an infinite one everything: no LR to scale a safe one from
                safe = lr * SAFE_RELATIVE_UPDATE[kind] / rel if 0.0 < rel < math.inf else None
                best = {"relative_update": rel, "lr": lr, "optimizer": kind, "weight_norm": w,
                        "update_norm": step, "grad_norm": grad_norm if kind == "sgd" else None,
                        "reference_step": reference_step, "safe_lr": safe}
                if kind == "sgd" and growth is not None and safe is not None:
                    edge = edge_lr(lr, growth, float(group.get("momentum") or 0.0))
                    best.update(grad_norm_growth=growth, edge_lr=edge, safe_lr=min(safe, edge / EDGE_MARGIN))
    return best


def layer_growth(module: nn.Module, ratio: float = LAYER_GROWTH) -> Optional[dict[str, Any]]:
    """Per-layer gradient RMS (weights of 2 or more dims, in registration order, i.e. from the input side)
    growing from the output side towards the input side by ``ratio`` or more, over :data:`LAYER_COUNT` (4) or more
    layers with a consistent trend (rank correlation of depth and log-RMS >= :data:`LAYER_TREND`, 0.8): the
    signature of gradients exploding through depth. Needs finite gradients; None otherwise."""
    named = [(n, p) for n, p in module.named_parameters() if p.dim() >= 2 and p.grad is not None]
    if len(named) < LAYER_COUNT:
        return None
    grads = norms(p.grad for _, p in named)  # type: ignore[misc]  # not None: named keeps those with a gradient
    rms = [_rms(g, local(p).numel()) for (_, p), g in zip(named, grads)]
    if not all(math.isfinite(r) and r > 0 for r in rms):
        return None
    q = max(len(rms) // 4, 1)
    first, last = sum(rms[:q]) / q, sum(rms[-q:]) / q
    rho = _rank_correlation([-i for i in range(len(rms))], [math.log(r) for r in rms])
    if first < ratio * last or rho < LAYER_TREND:
        return None
    return {"layers": [n for n, _ in named], "grad_rms": rms, "input_side_over_output_side": first / last,
            "rank_correlation": rho}


def _rank_correlation(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    mean = (n - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    var = sum((x - mean) ** 2 for x in ra)
    return cov / var if var else 0.0


def activation_growth(rows: Sequence[dict], module: nn.Module) -> Optional[dict[str, Any]]:
    """Module outputs of a replayed forward pass (frame rows in call order, up to the first non-finite one)
    whose abs-max grows :data:`ACTIVATION_STEP` (2) times or more at each of :data:`ACTIVATION_CHAIN` or more
    consecutive weight layers (leaf modules holding a 2-D+ weight), by :data:`ACTIVATION_GROWTH` in all:
    activations exploding through depth."""
    layers = []
    for row in rows:
        try:
            sub = module.get_submodule(row["module"])
        except (AttributeError, ValueError, TypeError):
            continue
        if any(True for _ in sub.children()) or not any(p.dim() >= 2 for p in sub.parameters(recurse=False)):
            continue
        layers.append(row)
    def out(row: dict) -> float:  # an output that overflowed from finite inputs grew without bound
        return math.inf if row.get("out_nonfinite") and not row.get("in_nonfinite") else row["out_abs_max"]

    best: list[dict] = []
    run: list[dict] = []
    for row in layers:
        if run and out(row) >= ACTIVATION_STEP * out(run[-1]):
            run.append(row)
        else:
            run = [row] if row["in_abs_max"] > 0 and out(row) >= ACTIVATION_STEP * row["in_abs_max"] else []
        if len(run) > len(best):
            best = list(run)
    if len(best) < ACTIVATION_CHAIN:
        return None
    start, end = best[0]["in_abs_max"], out(best[-1])
    if not end >= ACTIVATION_GROWTH * start:
        return None
    return {"layers": [r["module"] for r in best], "abs_max": [start] + [out(r) for r in best]}


def short_growth(values: Sequence[float], ratio: float = SHORT_GROWTH,
                 steps: int = SHORT_GROWTH_STEPS) -> Optional[list[float]]:
    """The tail of ``values`` (finite, positive) when each of its last ``steps`` ratios is ``ratio`` or more."""
    tail = [v for v in values if math.isfinite(v)][-(steps + 1):]
    if len(tail) < steps + 1 or any(a <= 0 or b < ratio * a for a, b in zip(tail, tail[1:])):
        return None
    return tail


def growth_onset(values: Sequence[float], ratio: float = SHORT_GROWTH) -> int:
    """Index in ``values`` where the final run of ``ratio``-fold growth began (the last index without one)."""
    i = len(values) - 1
    while i > 0 and math.isfinite(values[i]) and math.isfinite(values[i - 1]) and values[i - 1] > 0 \
            and values[i] >= ratio * values[i - 1]:
        i -= 1
    return max(i, 0)
