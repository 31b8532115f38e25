"""Running statistics of the loss and the gradient norm, and what counts as abnormal in them.

Host-side floats fed from the values the guard reads once per step anyway: no device work, no sync.
(torchmetrics would add device kernels per step and, under DDP, a collective, for a value that is
already on the host and identical on every rank.)

- :class:`RunningStats`: mean and variance of a scalar stream, exact (Welford) during a warm-up, then an
  exponential moving average; :meth:`RunningStats.zscore` is the package's one z-score.
- :class:`SpikeDetector`: a loss spike is a loss ``z`` spreads *above* its running mean (one-sided: a falling
  loss is never a spike), the spread widened by the recent tail of the losses.
- :func:`norm_growth`: the signature of a divergence in a history of gradient norms.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Optional, Sequence

from torch import Tensor

__all__ = ["RunningStats", "SpikeDetector", "LossWatch", "norm_growth", "history_zscore", "PEAK_SHARE", "PEAK_DECAY",
           "SPIKE_ALPHA", "SPIKE_REL_FLOOR", "SPIKE_PATIENCE", "SHIFT_SPIKES", "SHIFT_WINDOW", "ZSCORE_MIN_HISTORY",
           "TREND_STEPS", "TREND_RATIO"]

# a z-score against a history (:func:`history_zscore`) needs this many finite values: fewer give no spread to
# measure against
ZSCORE_MIN_HISTORY = 5
# :func:`norm_growth`: the last this many gradient norms of a history ...
TREND_STEPS = 5
# ... averaging this many times the earlier ones are a divergence under way (gradient norms growing
# geometrically), the diagnosis' grad_norm_trend and the snapshots' wait (:meth:`.Clipper.diverging`)
TREND_RATIO = 10.0


class RunningStats:
    """Mean/variance of a scalar stream: exact over the first ``warmup`` values, then an EMA.

    The exact start avoids the bias of an EMA seeded with one value and a variance of zero; after the
    warm-up, ``mean`` and ``var`` follow the recent past with decay ``alpha`` (West's EMA variance).
    Non-finite values are ignored.
    """

    def __init__(self, alpha: float = 0.97, warmup: int = 25) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup!r}")
        self.alpha = float(alpha)
        self.warmup = int(warmup)
        self.count = 0
        self.mean = 0.0
        self.var = 0.0
        self._m2 = 0.0  # Welford's sum of squared deviations, during the warm-up

    @classmethod
    def of(cls, values: Iterable[float]) -> "RunningStats":
        """Exact (population) statistics of the finite ``values``."""
        values = [v for v in values if math.isfinite(v)]
        stats = cls(warmup=max(len(values), 1))
        for v in values:
            stats.update(v)
        return stats

    @property
    def ready(self) -> bool:
        return self.count >= self.warmup

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))

    def update(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.count += 1
        delta = value - self.mean
        if self.count <= self.warmup:
            self.mean += delta / self.count
            self._m2 += delta * (value - self.mean)
            self.var = self._m2 / self.count
        else:
            a = self.alpha
            self.mean = a * self.mean + (1.0 - a) * value
            self.var = a * (self.var + (1.0 - a) * delta * delta)

    def zscore(self, value: float, rel_floor: float = 0.0) -> float:
        """``(value - mean) / std``, with ``std`` floored at ``rel_floor * |mean|`` (and a tiny absolute)."""
        std = max(self.std, rel_floor * abs(self.mean), 1e-12)
        return (value - self.mean) / std

    def state_dict(self) -> dict[str, object]:
        return {"count": self.count, "mean": self.mean, "var": self.var, "m2": self._m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state.get("count", 0))
        self.mean = float(state.get("mean", 0.0))
        self.var = float(state.get("var", 0.0))
        self._m2 = float(state.get("m2", self.var * self.count))


def history_zscore(value: float, history: Sequence[float], min_count: int = ZSCORE_MIN_HISTORY) -> Optional[float]:
    """z-score of ``value`` against the exact statistics of a history (None with fewer than ``min_count``
    finite values, for a non-finite ``value``, or for a history without spread, e.g. all-zero gradient norms:
    any other value would be 1e12 standard deviations away)."""
    stats = RunningStats.of(history)
    if stats.count < min_count or not math.isfinite(value) or stats.var == 0:
        return None
    return stats.zscore(value)


def norm_growth(history: Sequence[float], recent: int = TREND_STEPS,
                ratio: float = TREND_RATIO) -> Optional[tuple[float, float]]:
    """``(recent_mean, earlier_mean)`` when the last ``recent`` finite values average more than ``ratio``
    times the earlier ones (the signature of a divergence: gradient norms growing geometrically), else None.
    Zeros are left out: steps without gradients (a frozen start) give no scale to grow from."""
    values = [h for h in history if math.isfinite(h) and h != 0]
    late, early = values[-recent:], values[:-recent]
    if not late or not early:
        return None
    late_mean, early_mean = sum(late) / len(late), sum(early) / len(early)
    return (late_mean, early_mean) if late_mean > ratio * early_mean else None


# the spread of the spike test is at least this share of how far the highest recent loss rose above the mean
# (:attr:`SpikeDetector.peak`): with check.spike_z 6, a spike rises 3x as far above the mean as any loss of the
# last ~1,000 steps did. Per-batch losses of tiny batches are heavy-tailed (a batch holding one hard sample costs
# 5-50x the typical one), so a Gaussian z-test on their EMA fires on healthy batches; the peak learns the tail.
# A Gaussian loss stream's peak is ~3 standard deviations: there the standard deviation still decides.
PEAK_SHARE = 0.5
# the peak's decay per step: the memory of a heavy tail, ~1,000 steps (a hard batch once every epoch of up to
# a few hundred batches stays learned); measured on tests/healthy_runs.py's corpus (tests/test_healthy_corpus.py)
PEAK_DECAY = 0.999
# the decay per step of the spike test's mean and variance once warmed up (an EMA with a memory of ~50 steps:
# the baseline follows a falling loss); the healthy corpus above holds no spike with it
SPIKE_ALPHA = 0.98
# the spike test's spread is at least this share of |mean|: an almost constant loss (full-batch training, a
# converged run) does not turn a 1% wobble into a spike (check.spike_z's help names it)
SPIKE_REL_FLOOR = 0.01
# spikes in a row whose steps were skipped (check.spike_action: skip_step) after which the loss counts as not
# coming back: the weights stayed those of the last healthy step while this many different batches all spiked,
# so the weights (the update before the first spike), not the batches, are wrong: the run rolls back to before the
# first spike and the batches since are dropped (PaLM). Longer than a short corrupt stretch (the rescue
# benchmark's 5 batches), far shorter than PaLM's windows of 200-500 batches
SPIKE_PATIENCE = 20
# skipped spikes, each the first after a healthy batch, within SHIFT_WINDOW tests, that mean the loss has moved
# (a harder shard mixed in, a curriculum stage), not a bad stretch: the statistics a skipped spike leaves as they
# were then learn the spike's loss. A corrupt stretch of consecutive batches is one such spike; a GRU whose
# data gets harder met its first 3 hard batches, 50 and 13 steps apart, at 1e8 spreads (benchmarks/mixture.py:
# held, the hard source was never learned and the run ended 9x worse than without a guard)
SHIFT_SPIKES = 3
SHIFT_WINDOW = 100


class SpikeDetector:
    """One-sided test of the loss against its running statistics, with a spread that learns a heavy tail.

    ``observe(loss)`` returns the z-score ``(loss - mean) / spread`` when ``loss`` is a spike (``z >
    z_threshold`` after ``warmup`` values), else ``None``, and then updates the statistics: with the loss
    itself, or, for a spike, with the loss capped at the threshold, so that one spike neither hides the next
    one of its size nor shifts the baseline much.

    The spread (:meth:`spread`) is the largest of:

    - the standard deviation of the EMA (decay ``alpha``, :data:`SPIKE_ALPHA`; exact over the warm-up);
    - ``rel_floor * |mean|`` (:data:`SPIKE_REL_FLOOR`), so that an almost constant loss (full-batch training, a
      converged run) does not turn a 1% wobble into a spike;
    - ``PEAK_SHARE`` of :attr:`peak`, how far the highest recent loss rose above the mean (decaying by
      ``PEAK_DECAY`` per step; a capped spike counts up to the threshold), so that the heavy right tail of
      per-batch losses (batches of a few samples, a hard batch every epoch) widens the test instead of firing
      it, and a tail that came once keeps the test wide for a thousand steps or so.

    ``hold`` (``check.spike_action: skip_step``): a spike's step is skipped and its loss leaves the statistics as
    they were, so a bad stretch of batches never teaches the test its loss. Where the spikes come apart, each the
    first after a healthy batch, :data:`SHIFT_SPIKES` of them within :data:`SHIFT_WINDOW` tests, the loss itself
    has moved: the last of them is learned whole (:attr:`shifted`; the peak takes its full rise above the mean,
    so that losses like it are no longer spikes while the peak decays), its step still skipped.

    Statistics warmed up on losses that were all exactly 0 have no scale at all (every later loss would be a
    spike of 1e12 standard deviations): the warm-up starts again from the next loss.
    """

    def __init__(self, z_threshold: float = 6.0, warmup: int = 50, alpha: float = SPIKE_ALPHA,
                 rel_floor: float = SPIKE_REL_FLOOR, hold: bool = False) -> None:
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        self.z_threshold = float(z_threshold)
        self.hold = bool(hold)  # a spike leaves the statistics as they were (its step is skipped)
        self.held = 0  # spikes in a row that left them so (their steps skipped: the weights are those before them)
        self.after_healthy = True  # the latest spike's loss was taken on weights whose loss a step before was healthy
        self._spiked = False  # the latest test found a spike whose update was not held back
        self.rel_floor = float(rel_floor)
        self.stats = RunningStats(alpha, warmup)
        self.peak = 0.0  # how far the highest recent loss rose above the mean, decaying by PEAK_DECAY per step
        self._last: tuple[float, ...] = ()  # the latest test's mean, std, peak and spread, before it updated them
        self._recent: list[int] = []  # steps of recent spikes
        self.tests = 0  # tests made (while ready)
        self._starts: deque[int] = deque(maxlen=SHIFT_SPIKES)  # tests at which a held spike followed a healthy one
        self.shifted = False  # the latest spike was learned whole: the loss has moved (class docstring)

    def repeated(self, step: int, count: int, window: int) -> bool:
        """Note a spike at ``step``; True when it is the ``count``-th within ``window`` steps (then forgets
        them, so the next escalation needs ``count`` new spikes). ``count`` 0 never escalates."""
        self._recent = [s for s in self._recent if s > step - window] + [step]
        if count < 1 or len(self._recent) < count:
            return False
        self._recent = []
        return True

    def _scaleless(self) -> bool:
        """Warmed up, on losses that were all exactly 0: nothing to measure a spike against."""
        return self.stats.ready and self.stats.mean == 0 and self.stats.var == 0 and self.peak == 0

    def spread(self) -> float:
        """The spread of the test (see the class docstring), never below 1e-12."""
        stats = self.stats
        return max(stats.std, self.rel_floor * abs(stats.mean), PEAK_SHARE * self.peak, 1e-12)

    @property
    def last(self) -> dict[str, float]:
        """The terms of the latest test, as they were before it updated them (a spike event's details): ``mean``,
        ``std``, ``peak``, ``spread`` and ``threshold`` (a loss above it was a spike); empty before the first."""
        if not self._last:
            return {}
        mean, std, peak, spread = self._last
        return {"mean": mean, "std": std, "peak": peak, "spread": spread,
                "threshold": mean + self.z_threshold * spread}

    def test_terms(self) -> Optional[tuple[float, float]]:
        """``(mean, spread)`` of the test :meth:`observe` makes while ready (None before): a loss is a spike when
        ``(loss - mean) / spread > z_threshold``, in float64; the same test can be made on the device."""
        if not self.stats.ready or self._scaleless():
            return None
        return self.stats.mean, self.spread()

    def observe(self, loss: float) -> Optional[float]:
        if not math.isfinite(loss):
            return None
        if self._scaleless():  # warm up again from this loss
            self.stats, self.peak = RunningStats(self.stats.alpha, self.stats.warmup), 0.0
        stats = self.stats
        if not stats.ready:
            stats.update(loss)
            self.peak = max(loss - stats.mean, self.peak * PEAK_DECAY)  # against the exact mean so far
            return None
        mean, spread = stats.mean, self.spread()
        z = (loss - mean) / spread
        band = self.z_threshold * spread
        self._last = (mean, stats.std, self.peak, spread)
        self.tests += 1
        self.shifted = False
        if z > self.z_threshold:
            # on weights that gave a healthy loss a step before: the previous step was no spike, or one held back
            self.after_healthy = not self._spiked
            self._spiked = not self.hold
            if self.hold:  # its update never lands: its loss neither widens the spread nor shifts the mean ...
                self.held += 1
                if self.held == 1:
                    self._starts.append(self.tests)
                if len(self._starts) < SHIFT_SPIKES or self.tests - self._starts[0] >= SHIFT_WINDOW:
                    return z
                # ... unless the spikes keep coming apart: the loss has moved, learn it
                self.shifted, self._starts = True, deque(maxlen=SHIFT_SPIKES)
                self.peak = max(loss - mean, self.peak)
                stats.update(min(loss, mean + band))
                return z
        else:
            self.held, self._spiked = 0, False
        capped = min(max(loss, mean - band), mean + band)
        self.peak = max(capped - mean, self.peak * PEAK_DECAY)
        stats.update(capped)
        return z if z > self.z_threshold else None

    def state_dict(self) -> dict[str, object]:
        return dict(self.stats.state_dict(), peak=self.peak, recent=list(self._recent), held=self.held,
                    tests=self.tests, starts=list(self._starts))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state)
        self.peak = float(state.get("peak", 0.0))
        self._recent = [int(s) for s in state.get("recent", [])]
        self.held = int(state.get("held", 0))
        self.tests = int(state.get("tests", 0))
        self._starts = deque((int(s) for s in state.get("starts", [])), maxlen=SHIFT_SPIKES)


class LossWatch:
    """The loss of every judged step: its history and the spike test (``check.spike_*``).

    Attributes:
        detector: the spike test's running statistics (part of every snapshot).
        history: the last 200 losses of healthy steps (for the diagnosis).
    """

    def __init__(self, action: str, z_threshold: float, warmup: int) -> None:
        self.enabled = action != "off"
        self.detector = SpikeDetector(z_threshold, warmup, hold=action == "skip_step")
        self.history: deque[float] = deque(maxlen=200)

    def observe(self, loss: Optional[float]) -> Optional[float]:
        """Feed the loss of a step with finite local evidence (None when the loss is not checked); its
        z-score when it is a spike."""
        if loss is None or not self.enabled:
            return None
        return self.detector.observe(loss)

    def spike_flag(self, loss: Tensor) -> Optional[Tensor]:
        """0-dim bool device tensor: is ``loss`` (the step's loss on the device, not read) a spike? The test of
        :meth:`observe` with the statistics of the steps before, made on the device; None while it cannot fire."""
        terms = self.detector.test_terms() if self.enabled else None
        if terms is None:
            return None
        mean, std = terms
        return (loss.double() - mean) / std > self.detector.z_threshold

    def healthy(self, loss: Optional[float]) -> None:
        if loss is not None:
            self.history.append(loss)

    def state_dict(self) -> dict[str, object]:
        return {"spikes": self.detector.state_dict(), "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state.get("spikes", {}))
        self.history.extend(state.get("history", []))
