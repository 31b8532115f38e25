"""Divergence without NaN: a finite loss or gradient norm running away, from the first steps of a run.

:class:`DivergenceWatch` is fed the loss and the total gradient norm of every healthy optimizer step, the
host floats the guard reads once per step anyway: no device work, no sync, nothing that changes training.
It needs no warm-up. Four rules (``check.divergence_*``; ``g`` is ``divergence_growth``, ``k``
``divergence_steps``, ``F`` ``divergence_factor``):

- **loss growth**: the loss grew by at least ``g`` at each of the last ``k`` steps, and its last value is
  ``10`` times every loss before that streak (a new record by far; at the very start of a run, where there
  is nothing before the streak, the streak alone). A loss that grows ``g``-fold step after step is the
  signature of unstable dynamics; noise does not compound like that, and the record condition keeps the
  heavy-tailed losses of tiny batches from looking like it.
- **loss blow-up**: the loss grew by ``g**2`` at each of the last 2 steps and ends ``100`` times every loss
  before them (a run that goes from healthy to NaN in three steps; only after ``k + 3`` losses, so that the
  first steps of a run answer to the rule above).
- **gradient-norm growth**: the same on the total gradient norm, and only while the loss grew by ``g``
  over the same streak too. The gradient norm alone legitimately grows fast (LR warm-up, a zero-initialised
  layer, escaping a plateau), but then the loss falls.
- **far above the first loss**: the loss stayed above ``F`` times the first loss of the run, and ``10``
  times every loss before it left that level, for ``k + 2`` consecutive steps (e.g. AdamW at lr=10: 5.5,
  then about 2,000 for good, never NaN). The first loss is the untrained model's: a healthy run falls below
  it, and a loss that legitimately rises (warm-up, one-cycle, noisy batches) stays within a few times it;
  the record condition keeps one lucky-low first batch from making the usual level look "far above".

A loss that reaches zero or goes negative (hinge losses, log-likelihoods, contrastive objectives) has no
growth factor: once one is seen, the rules are off for the rest of the fit (the gradient-norm rule needs the
loss to grow too); only non-finite values are caught then. One event per episode: the growth rules re-arm
after a step without growth, the far-above rule once the loss is back below ``F`` times the first, and an
event of either silences the other meanwhile.

The watch belongs to the known-good state: snapshots keep it and a rollback restores it.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Optional

__all__ = ["DivergenceWatch", "RECORD_FACTOR", "BLOWUP_STEPS", "growth_streak"]

# the last value of a growth streak must be this many times every value before the streak
RECORD_FACTOR = 10.0
# the loss blow-up rule: the loss grew g**2-fold at each of this many last steps (and ends RECORD_FACTOR**2 times
# every loss before them)
BLOWUP_STEPS = 2


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a <= 0 or b <= 0:
        return None
    return b / a


def growth_streak(values: list[float], growth: float) -> int:
    """How many of the last consecutive ratios of ``values`` are at least ``growth`` (0 when the last is not)."""
    n = 0
    for a, b in zip(reversed(values[:-1]), reversed(values[1:])):
        r = _ratio(a, b)
        if r is None or r < growth:
            break
        n += 1
    return n


class DivergenceWatch:
    """The four divergence rules over the healthy steps' loss and gradient norm (see the module docstring).

    ``observe(step, loss, grad_norm)`` returns the evidence (a dict) when the step completes a divergence,
    else None. ``growing()`` tells whether a growth streak is under way (the guard then defers snapshots: a
    snapshot taken during the growth would be a rollback target that cannot help).
    """

    def __init__(self, mode: str = "act", growth: float = 2.0, steps: int = 3, factor: float = 100.0) -> None:
        self.enabled = mode != "off"
        self.growth = float(growth)
        self.steps = int(steps)
        self.factor = float(factor)
        self.first_loss: Optional[float] = None
        self.window: deque[tuple[int, Optional[float], float]] = deque(maxlen=self.steps + 1)  # (step, loss, norm)
        self.loss_max = -math.inf  # over every loss that left the window
        self.norm_max = -math.inf
        self.above: list[tuple[int, float, float]] = []  # consecutive (step, loss, norm) above factor * first_loss
        self.latched = False  # the far-above rule fired; re-armed when the loss falls back below its threshold
        self.onset: tuple[int, Optional[float], float] = (0, None, math.nan)  # the step before `above` began
        self.seen_max = -math.inf  # every loss before the current `above` run
        self.above_floor = -math.inf  # RECORD_FACTOR x seen_max when the `above` run began
        self.streak_latched = False  # a growth streak fired; re-armed by a step without growth
        self.seen = 0  # losses observed
        self.positive = True  # every loss so far was > 0 (the loss rules need it)

    def growing(self) -> bool:
        """A divergence may be under way: the loss far above its first value, or grown ``g``-fold at each of
        the last ``k - 1`` steps. (The guard defers snapshots meanwhile; a single ``g``-fold step is common
        noise and defers nothing.)"""
        losses = [v for _, v, _ in self.window if v is not None]
        return bool(self.above) or (self.enabled and len(losses) == len(self.window)
                                    and growth_streak(losses, self.growth) >= self.steps - 1)

    def observe(self, step: int, loss: Optional[float], grad_norm: float) -> Optional[dict[str, object]]:
        if not self.enabled or (loss is not None and not math.isfinite(loss)):
            return None
        if loss is not None and self.first_loss is None:
            self.first_loss = loss
        self.seen += loss is not None
        if loss is not None and loss <= 0:
            self.positive = False  # not a positive quantity: growth factors of the loss mean nothing
        if len(self.window) == self.window.maxlen:
            _, old_loss, old_norm = self.window[0]
            if old_loss is not None:
                self.loss_max = max(self.loss_max, old_loss)
            if math.isfinite(old_norm):
                self.norm_max = max(self.norm_max, old_norm)
        self.window.append((step, loss, grad_norm))
        return self._far_above(step, loss) or self._streak()

    def _streak(self) -> Optional[dict[str, object]]:
        if len(self.window) < 2:
            return None
        (_, loss0, norm0), (_, loss1, norm1) = self.window[-2], self.window[-1]
        if (_ratio(loss0, loss1) or 0.0) < self.growth and (_ratio(norm0, norm1) or 0.0) < self.growth:
            self.streak_latched = False  # no growth at this step: no rule can complete, and a latch re-arms
            return None
        steps = [s for s, _, _ in self.window]
        losses = [v for _, v, _ in self.window if v is not None]
        norms = [v for _, _, v in self.window]
        if len(losses) < len(self.window) or not self.positive:  # a step without a loss value in the window
            return None
        rule = None
        fast = self.growth ** 2
        before = max([self.loss_max] + losses[:-(BLOWUP_STEPS + 1)])
        if growth_streak(losses, self.growth) >= self.steps and losses[-1] >= RECORD_FACTOR * self.loss_max:
            rule = "loss_growth"
        elif (self.seen >= self.steps + 3 and growth_streak(losses, fast) >= BLOWUP_STEPS
              and losses[-1] >= RECORD_FACTOR ** 2 * before):
            rule = "loss_blowup"
        elif (growth_streak(norms, self.growth) >= self.steps and norms[-1] >= RECORD_FACTOR * self.norm_max
              and (_ratio(losses[0], losses[-1]) or 0.0) >= self.growth):
            rule = "grad_norm_growth"
        if rule is None or self.streak_latched:
            self.streak_latched = self.streak_latched and (growth_streak(losses, self.growth) > 0
                                                           or growth_streak(norms, self.growth) > 0)
            return None
        self.streak_latched = True  # one event per streak: the next needs a step without growth first
        self.latched = self.latched or bool(self.above)  # and the same episode is not reported again as far above
        first = -(BLOWUP_STEPS + 1) if rule == "loss_blowup" else 0
        steps, losses, norms = steps[first:], losses[first:], norms[first:]
        evidence = {"rule": rule, "steps": steps, "losses": losses, "grad_norms": norms, "onset_step": steps[0],
                    "onset_loss": losses[0], "onset_grad_norm": norms[0], "growth": self.growth}
        if rule == "loss_growth" and self.loss_max > -math.inf:
            evidence["loss_max_before"] = self.loss_max
        if rule == "loss_blowup":
            evidence["loss_max_before"] = before
        if rule == "grad_norm_growth" and self.norm_max > -math.inf:
            evidence["grad_norm_max_before"] = self.norm_max
        return evidence

    def _far_above(self, step: int, loss: Optional[float]) -> Optional[dict[str, object]]:
        first = self.first_loss
        if loss is None or first is None or not self.positive:
            return None
        try:
            return self._above(step, loss, first)
        finally:
            self.seen_max = max(self.seen_max, loss)

    def _above(self, step: int, loss: float, first: float) -> Optional[dict[str, object]]:
        if loss < self.factor * first:
            self.above, self.latched = [], False  # back near the early level: re-armed
            return None
        if self.latched:
            return None
        if not self.above and self.streak_latched:  # a growth rule reported this episode, and it still grows
            self.latched = True  # the same episode: silent until the loss is back below the factor
            return None
        if not self.above:  # the last step below: where the run left its early level
            self.onset = self.window[-2] if len(self.window) > 1 else (step - 1, first, math.nan)
            self.above_floor = RECORD_FACTOR * self.seen_max  # and far above every loss before, too
        if loss < self.above_floor:
            self.above = []
            return None
        self.above.append((step, loss, self.window[-1][2]))
        if len(self.above) < self.steps + 2:
            return None
        self.latched = self.streak_latched = True
        return {"rule": "loss_above_first", "steps": [s for s, _, _ in self.above],
                "losses": [v for _, v, _ in self.above], "grad_norms": [v for _, _, v in self.above],
                "first_loss": first, "factor": self.factor, "onset_step": self.onset[0],
                "onset_loss": self.onset[1], "onset_grad_norm": self.onset[2]}

    # ---------------------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, object]:
        return {"first_loss": self.first_loss, "window": [list(w) for w in self.window], "loss_max": self.loss_max,
                "norm_max": self.norm_max, "above": [list(a) for a in self.above], "latched": self.latched,
                "onset": list(self.onset), "seen_max": self.seen_max, "above_floor": self.above_floor,
                "streak_latched": self.streak_latched, "seen": self.seen,
                "positive": self.positive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        first = state.get("first_loss")
        self.first_loss = None if first is None else float(first)
        self.window = deque(((int(s), None if lo is None else float(lo), float(n)) for s, lo, n in
                             state.get("window", [])), maxlen=self.steps + 1)
        self.loss_max = float(state.get("loss_max", -math.inf))
        self.norm_max = float(state.get("norm_max", -math.inf))
        self.above = [(int(s), float(lo), float(n)) for s, lo, n in state.get("above", [])]
        self.latched = bool(state.get("latched", False))
        self.seen_max = float(state.get("seen_max", -math.inf))
        self.above_floor = float(state.get("above_floor", -math.inf))
        self.streak_latched = bool(state.get("streak_latched", False))
        self.seen = int(state.get("seen", 0))
        self.positive = bool(state.get("positive", True))
        step, loss, norm = state.get("onset", (0, None, math.nan))
        self.onset = (int(step), None if loss is None else float(loss), float(norm))
