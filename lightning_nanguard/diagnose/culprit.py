"""The culprit of a run that runs away (a divergence, or gradients that explode before they are non-finite): the
module to look at first, from data the guard already holds.

1. The weights: a module whose parameters grew :data:`WEIGHT_CULPRIT_GROWTH` times (or more) since the newest
   snapshot from before the onset of the growth, the most of any module, is the culprit (``by: weights``,
   ``since_step``: that snapshot's step). A module
   whose own weights run away makes the gradients of every module *below* it grow faster than its own (they are
   multiplied by its weights in backward), so the gradient norms alone would name its neighbour.
2. Else the gradient-flow window (:func:`~..detect.flow.fastest_growing`): the module whose gradient norms grew the
   most over the window (``by: gradients``).

Both are read on an incident only (the weights' norms: one read; the window was captured with the incident).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..detect.flow import Growth, fastest, fastest_growing, module_of
from . import dynamics
from .context import IncidentContext

__all__ = ["runaway_culprit", "WEIGHT_CULPRIT_GROWTH"]

# a module whose weights grew this many times since the snapshot before the onset of the growth is the culprit of a
# divergence (healthy training moves a module's weight norm by a few percent over hundreds of steps)
WEIGHT_CULPRIT_GROWTH = 4.0


def runaway_culprit(ctx: IncidentContext, onset: Optional[int]) -> Optional[dict[str, Any]]:
    """The module that ran away (module docstring), with the evidence, or None when none stands out."""
    found = _by_weights(ctx, onset)
    if found is None and ctx.history.flow is not None:
        grown = fastest_growing(ctx.history.flow, onset)
        if grown is not None:
            found = dict(grown, by="gradients")
    return found


def _by_weights(ctx: IncidentContext, onset: Optional[int]) -> Optional[dict[str, Any]]:
    module = ctx.pl_module
    if module is None or ctx.history.reference is None or onset is None:
        return None
    reference = ctx.history.reference(onset)
    if reference is None:
        return None
    step, before = reference
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and n in before]
    if not named:
        return None
    now = dynamics.norms(p for _, p in named)
    old: dict[str, list[float]] = {}
    new: dict[str, list[float]] = {}
    for (name, _), value in zip(named, now):
        m = module_of(name)
        old.setdefault(m, []).append(before[name])
        new.setdefault(m, []).append(value)
    growth: list[Growth] = []
    for m in old:
        a, b = math.hypot(*old[m]), math.hypot(*new[m])
        if a > 0 and math.isfinite(b):
            growth.append((b / a, m, a, b))
    best = fastest(growth, WEIGHT_CULPRIT_GROWTH)
    if best is None:
        return None
    # only what does not depend on when the step was read: judged one step late (check.sync: lagged), the weights
    # already hold its update, so their growth is larger by one step's worth
    return {"module": best[1], "by": "weights", "since_step": step}
