"""A run that has stopped learning because its steps are too large: a cheap trigger, then a probe.

The trigger reads only the host loss of every healthy optimizer step (the float the guard reads anyway: no device
work, no sync). With ``W`` = ``check.stall_window``, its **progress** is (mean loss over the ``W`` steps before
the last ``W``) minus (mean over the last ``W``), over the spread of the last ``W``: below ``stall_progress`` the
loss has stopped falling against its noise. On its own that signal is weak (benchmarks/results/
rescue-stall-signals.md: healthy warm-up + cosine runs reach -0.30 while stalled ones sit near 0), so it only
**arms** the watch: the next ``K`` = ``check.stall_probe_steps`` steps' micro-batches are kept (copies, bounded,
only while armed), and then the guard runs the lower-LR probe (:mod:`..diagnose.lr_probe`) on them. Its verdict
(:func:`gain_ratio`, :func:`best_factor`) is the separating signal: from a copy of the weights and optimizer, ``K``
steps on those batches at the run's LR and at ``LR/10``; a stall is a gain at ``LR/10`` at least
``stall_gain_ratio`` times the gain at the run's LR (healthy runs' largest: 0.70; stalled runs' medians: >= 2.15;
the default 1.2 is about their geometric mean, low enough for the second stage of a stall, 1.26 after a warm restart
to 20x).

After a probe the history restarts (a new window is needed), and after a probe that found nothing the next one
waits twice as long as the last (``cooldown``, from ``2 W``): a long healthy run probes O(log steps) times.
Everything here is host floats and counters; its state is bounded (``2 W`` losses) and saved.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Optional, Sequence

from ..core.tree import map_tensors

__all__ = ["StallWatch", "progress", "gain_ratio", "best_factor", "PROBE_FACTORS", "MAX_COOLDOWN", "ANCHOR_WINDOWS"]

# the LR factors a confirmed stall's probe also measures (beside 1 and 1/10, the verdict's): the cut is the one
# of them that learns most on the probe's batches
PROBE_FACTORS = (0.1, 0.03)
# the longest wait between two probes, in steps (the doubling cooldown stops here)
MAX_COOLDOWN = 100_000
# a stall's rollback targets beside the newest snapshots (the fit's first one, the last one before the LR rose) are
# kept for this many stall windows (check.stall_window): a run whose LR is too high from the start or from a warm
# restart stalls within a few windows (the rescue benchmark's stall events: 146 steps after the start, 90 after the
# restart, with windows of 50); later, rolling back that far loses more than it saves
ANCHOR_WINDOWS = 20


def progress(losses: Sequence[float], window: int) -> Optional[float]:
    """(mean of the ``window`` losses before the last ``window``) - (mean of the last ``window``), over the spread
    of the last ``window``; None with fewer than ``2 * window`` losses."""
    if len(losses) < 2 * window:
        return None
    old, new = list(losses)[-2 * window:-window], list(losses)[-window:]
    return (statistics.fmean(old) - statistics.fmean(new)) / max(statistics.pstdev(new), 1e-12)


def gain_ratio(before: float, after_lr: float, after_low: float) -> Optional[float]:
    """What the lower LR gained on the probe's batches against what the run's LR gained (``inf`` where the run's LR
    gained nothing and the lower one did); None where the lower LR gained nothing either (no LR helps) or a loss is
    not finite."""
    if not all(math.isfinite(v) for v in (before, after_lr, after_low)):
        return None
    low, run = before - after_low, before - after_lr
    if low <= 0:
        return None
    return low / run if run > 0 else math.inf


def best_factor(before: float, after: dict[float, float]) -> Optional[float]:
    """The LR factor below 1 whose probe ended lowest (None: none gained)."""
    finite = {f: a for f, a in after.items() if f < 1.0 and math.isfinite(a) and a < before}
    return min(finite, key=lambda f: (finite[f], -f)) if finite else None


class StallWatch:
    """The trigger and the probe's batches (module docstring).

    ``observe(step, loss)`` after every healthy step returns True when it arms the watch; while :attr:`armed`,
    ``collect(batches)`` keeps a copy of each step's micro-batches and returns True once ``probe_steps`` steps are
    kept (then :meth:`take` hands them over and the watch restarts).
    """

    def __init__(self, mode: str = "act", window: int = 50, threshold: float = 0.5, probe_steps: int = 20,
                 ratio: float = 1.2, remaining: float = 0.6) -> None:
        self.enabled = mode != "off"
        self.window, self.threshold, self.probe_steps, self.ratio = int(window), float(threshold), int(probe_steps), \
            float(ratio)
        self.losses: deque[float] = deque(maxlen=2 * self.window)
        # the fit's first window of losses (sum and count): a stall's loss is still near where the fit began
        self.remaining = float(remaining)
        self.start_sum, self.start_count = 0.0, 0
        self.cooldown = 2 * self.window  # steps before the next probe may be armed (after the history fills)
        self.wait = 0  # steps left of the cooldown
        self.armed_at: Optional[int] = None  # the step that armed the watch
        self.trigger: dict[str, Any] = {}
        self.kept: list[list[tuple[object, int]]] = []  # the micro-batches of the steps since arming (copies)
        self.probes = 0

    @property
    def armed(self) -> bool:
        return self.armed_at is not None

    def observe(self, step: int, loss: Optional[float]) -> bool:
        """A healthy step's loss. True when the watch arms now."""
        if not self.enabled or self.armed or loss is None or not math.isfinite(loss):
            return False
        self.losses.append(loss)
        if self.start_count < self.window:
            self.start_sum += loss
            self.start_count += 1
        if self.wait > 0:
            self.wait -= 1
            return False
        value = progress(self.losses, self.window)
        if value is None or value >= self.threshold:
            return False
        self.armed_at = step
        self.trigger = {"step": step, "progress": value, "window": self.window, "threshold": self.threshold,
                        "mean_before": statistics.fmean(list(self.losses)[:self.window]),
                        "mean_last": statistics.fmean(list(self.losses)[self.window:]),
                        "onset_step": step - 2 * self.window + 1}
        return True

    def collect(self, batches: Sequence[tuple[object, int]]) -> bool:
        """Keep a copy of one optimizer step's micro-batches; True once the probe has its ``probe_steps`` steps."""
        if not self.armed or not batches:
            return False
        self.kept.append([(map_tensors(b, lambda t: t.detach().clone()), int(i)) for b, i in batches])
        return len(self.kept) >= self.probe_steps

    @property
    def start(self) -> Optional[float]:
        """The mean loss of the fit's first ``window`` healthy steps (None until they are in)."""
        return self.start_sum / self.start_count if self.start_count >= self.window else None

    def far_from_start(self, loss: float) -> bool:
        """Is ``loss`` (the probe's, before its steps) still at least ``remaining`` of :attr:`start`? A run that has
        learned most of what separates it from its first steps is not stalled, even where a lower LR lowers its
        loss on batches it has seen (annealing: an SGD run under a warm restart, a converged regression)."""
        start = self.start
        return start is not None and start > 0 and loss >= self.remaining * start

    def take(self, stalled: bool) -> list[list[tuple[object, int]]]:
        """Hand over the kept batches and restart: a new history; after a probe that found nothing (``stalled``
        False) the next waits twice as long as the last."""
        kept, self.kept = self.kept, []
        self.armed_at = None
        self.losses.clear()
        self.probes += 1
        self.cooldown = 2 * self.window if stalled else min(2 * self.cooldown, MAX_COOLDOWN)
        self.wait = 0 if stalled else self.cooldown
        return kept

    def disarm(self) -> None:
        """Forget the kept batches (a rollback, an incident: they were taken on other weights)."""
        self.kept, self.armed_at = [], None

    # ---------------------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, object]:
        """Bounded: the last ``2 W`` losses and the cooldown (the kept batches are not saved: a resumed run
        arms afresh)."""
        return {"losses": list(self.losses), "cooldown": self.cooldown, "wait": self.wait, "probes": self.probes,
                "start_sum": self.start_sum, "start_count": self.start_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque((float(v) for v in state.get("losses", [])), maxlen=2 * self.window)
        self.cooldown = int(state.get("cooldown", 2 * self.window))
        self.wait = int(state.get("wait", 0))
        self.probes = int(state.get("probes", 0))
        self.start_sum, self.start_count = float(state.get("start_sum", 0.0)), int(state.get("start_count", 0))
        self.disarm()
