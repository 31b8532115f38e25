"""Learning-rate cuts that LR schedulers keep: :func:`scale_lr` and :func:`current_lrs`.

Independent of Lightning: it takes optimizers and schedulers.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["scale_lr", "current_lrs", "reference_lrs", "common_ratio"]

# param-group keys that hold absolute learning rates (OneCycleLR, CyclicLR and the chainable schedulers)
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lr")
# scheduler attributes that hold absolute learning rates, per-group lists or scalars
_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min", "end_lr")


def _scaled(value: object, factor: float) -> object:
    if isinstance(value, Tensor):
        return value.mul_(factor) if value.is_floating_point() else value
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value * factor
    if isinstance(value, list):
        return [_scaled(v, factor) for v in value]
    return value


def _iter_schedulers(scheduler: object) -> Iterable[object]:
    yield scheduler
    for inner in getattr(scheduler, "_schedulers", None) or []:  # SequentialLR, ChainedScheduler
        yield from _iter_schedulers(inner)


def scale_lr(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[object], factor: float) -> None:
    """Multiply every learning rate by ``factor`` so that no torch LR scheduler undoes it.

    Scaling only ``param_groups[i]["lr"]`` is overwritten by schedulers that recompute the LR from stored
    absolutes (OneCycleLR from ``max_lr``/``initial_lr``/``min_lr``, LambdaLR from ``base_lrs``, cosine from
    ``base_lrs`` and ``eta_min``). All of them are affine in those absolutes, so scaling every one of them
    scales the whole future schedule.
    """
    for opt in optimizers:
        for group in opt.param_groups:
            for key in _GROUP_LR_KEYS:
                if key in group:
                    group[key] = _scaled(group[key], factor)
    seen: set[int] = set()
    for top in schedulers:
        for sched in _iter_schedulers(top):
            if id(sched) in seen:
                continue
            seen.add(id(sched))
            for attr in _SCHED_LR_ATTRS:
                if hasattr(sched, attr):
                    setattr(sched, attr, _scaled(getattr(sched, attr), factor))


def current_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> list[float]:
    return [float(g["lr"]) for opt in optimizers for g in opt.param_groups]


def reference_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> list[float]:
    """Per param group, the LR its schedule starts from: ``initial_lr`` (set by a torch scheduler, which decays
    ``lr`` but never it; :func:`scale_lr` scales both), else ``lr``."""
    return [float(g.get("initial_lr", g["lr"])) for opt in optimizers for g in opt.param_groups]


def common_ratio(before: Sequence[float], after: Sequence[float], rel_tol: float = 1e-6) -> Optional[float]:
    """``after[i] / before[i]`` when it is one positive finite ratio for every ``i`` (within ``rel_tol``), else
    None (no values, different lengths, a zero or non-finite LR, or ratios that differ)."""
    if not before or len(before) != len(after):
        return None
    ratios = [b / a if a > 0 and math.isfinite(a) and math.isfinite(b) else math.nan for a, b in zip(before, after)]
    first = ratios[0]
    if not all(r > 0 and math.isfinite(r) and math.isclose(r, first, rel_tol=rel_tol) for r in ratios):
        return None
    return first
