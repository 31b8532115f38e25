"""Prevention: act on the statistics the guard already gathers, before a NaN appears.

Three small, independent pieces, each testable without Lightning:

- :class:`RunningStats`: mean and variance of a scalar stream: exact (Welford) during a warm-up, then an
  exponential moving average. Host-side floats fed from the one value per step the guard already reads,
  so it adds no device work and no host-device sync.
- :class:`ZClip`: adaptive z-score clipping of the total gradient norm (Kumar et al., 2025, "ZClip"):
  clip at ``mean + z_threshold * std`` of recent healthy norms once warmed up; statistics are updated with
  the *clipped* norm so one outlier does not inflate the threshold for the steps that follow.
- :class:`SpikeDetector`: a loss spike is a loss ``z`` standard deviations *above* its running mean
  (one-sided: a falling loss is never a spike).
- :func:`adaptive_grad_clip_`: unit-wise adaptive gradient clipping (AGC, Brock et al., 2021, NFNets):
  every row of a weight (every output unit) keeps ``||g_row|| <= clip_factor * max(||w_row||, eps)``.
  Fused foreach ops on device, no sync.

Why not torchmetrics for the running statistics: the guard needs the statistic on the host (to decide),
and it already holds the loss and gradient norm there after its single ``.tolist()``; a torchmetrics
metric would add device kernels per step, and its cross-rank reduction a collective. The gradient norm
is computed from all-reduced gradients, so it is identical on every rank anyway.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["RunningStats", "ZClip", "SpikeDetector", "adaptive_grad_clip_", "unitwise_norms",
           "SPIKE_SUGGESTION", "SPIKES_BEFORE_LR_CUT", "CLIPS_BEFORE_LR_CUT"]

# loss spikes within recovery.incident_window steps that cut the LR whatever check.spike_action says (one
# spike is noise the detector may have missed; repeated ones are a divergence under way, often one that
# clipping slows down but cannot stop)
SPIKES_BEFORE_LR_CUT = 3
# consecutive steps clipped by the adaptive (z-score) clip that cut the LR: at z=2.5 a healthy run clips ~1%
# of its steps, one at a time; a run whose every step needs clipping diverges, only more slowly
CLIPS_BEFORE_LR_CUT = 10

SPIKE_SUGGESTION = ("The loss jumped far above its recent level: a bad batch, a learning rate that is too high "
                    "for this phase (add warm-up or lower it), or missing clipping (clip.adaptive: always, "
                    "clip.max_norm). Repeated spikes usually precede a divergence to NaN.")


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

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "var": self.var, "m2": self._m2}

    def load_state_dict(self, state: Any) -> None:
        if isinstance(state, (tuple, list)):  # the callback's former (mean, var, count) tuple
            mean, var, count = state
            state = {"mean": mean, "var": var, "count": count, "m2": var * count}
        self.count = int(state.get("count", 0))
        self.mean = float(state.get("mean", 0.0))
        self.var = float(state.get("var", 0.0))
        self._m2 = float(state.get("m2", self.var * self.count))


def norm_growth(history: Sequence[float], recent: int = 5, ratio: float = 10.0) -> Optional[tuple[float, float]]:
    """``(recent_mean, earlier_mean)`` when the last ``recent`` finite values average more than ``ratio``
    times the earlier ones (the signature of a divergence: gradient norms growing geometrically), else None."""
    values = [h for h in history if math.isfinite(h)]
    late, early = values[-recent:], values[:-recent]
    if not late or not early:
        return None
    late_mean, early_mean = sum(late) / len(late), sum(early) / len(early)
    return (late_mean, early_mean) if late_mean > ratio * early_mean else None


class ZClip:
    """Adaptive z-score clipping of the total gradient norm.

    ``threshold()`` is ``None`` during the first ``warmup_steps`` norms, then
    ``mean + z_threshold * std`` of the running statistics. ``update(norm)`` feeds one healthy norm,
    capped at the current threshold (ZClip updates with the clipped norm), and returns the threshold that
    applied to it.

    Example::

        zclip = ZClip(z_threshold=2.5, alpha=0.97, warmup_steps=25)
        limit = zclip.threshold()
        if limit is not None and norm > limit:
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm_tensor)
        zclip.update(norm)
    """

    def __init__(self, z_threshold: float = 2.5, alpha: float = 0.97, warmup_steps: int = 25) -> None:
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        self.z_threshold = float(z_threshold)
        self.stats = RunningStats(alpha, warmup_steps)
        self.streak = 0  # consecutive updates above the threshold

    @property
    def mean(self) -> Optional[float]:
        return self.stats.mean if self.stats.count else None

    def threshold(self) -> Optional[float]:
        if not self.stats.ready:
            return None
        return self.stats.mean + self.z_threshold * self.stats.std

    def zscore(self, norm: float) -> Optional[float]:
        return self.stats.zscore(norm) if self.stats.ready else None

    def update(self, norm: float) -> Optional[float]:
        limit = self.threshold()
        if math.isfinite(norm):
            self.stats.update(min(norm, limit) if limit is not None else norm)
        self.streak = self.streak + 1 if limit is not None and norm > limit else 0
        return limit

    def state_dict(self) -> dict[str, Any]:
        return self.stats.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.stats.load_state_dict(state)
        self.streak = 0


class SpikeDetector:
    """One-sided z-score test of the loss against its running statistics.

    ``observe(loss)`` returns the z-score when ``loss`` is a spike (``z > z_threshold`` after ``warmup``
    values), else ``None``, and then updates the statistics: with the loss itself, or, for a spike, with the
    loss capped at the threshold, so that one spike neither hides the next one nor shifts the baseline.
    The standard deviation is floored at ``rel_floor * |mean|`` so that an almost constant loss (full-batch
    training, a converged run) does not turn a 1% wobble into a spike.
    """

    def __init__(self, z_threshold: float = 6.0, warmup: int = 50, alpha: float = 0.98,
                 rel_floor: float = 0.01) -> None:
        if z_threshold <= 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        self.z_threshold = float(z_threshold)
        self.rel_floor = float(rel_floor)
        self.stats = RunningStats(alpha, warmup)
        self._recent: list[int] = []  # steps of recent spikes

    def repeated(self, step: int, count: int, window: int) -> bool:
        """Note a spike at ``step``; True when it is the ``count``-th within ``window`` steps (then forgets
        them, so the next escalation needs ``count`` new spikes). ``count`` 0 never escalates."""
        self._recent = [s for s in self._recent if s > step - window] + [step]
        if count < 1 or len(self._recent) < count:
            return False
        self._recent = []
        return True

    def observe(self, loss: float) -> Optional[float]:
        if not math.isfinite(loss):
            return None
        if not self.stats.ready:
            self.stats.update(loss)
            return None
        z = self.stats.zscore(loss, self.rel_floor)
        band = self.z_threshold * max(self.stats.std, self.rel_floor * abs(self.stats.mean), 1e-12)
        self.stats.update(min(max(loss, self.stats.mean - band), self.stats.mean + band))
        return z if z > self.z_threshold else None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.stats.state_dict(), recent=list(self._recent))

    def load_state_dict(self, state: Any) -> None:
        self.stats.load_state_dict(state)
        if isinstance(state, dict):
            self._recent = [int(s) for s in state.get("recent", [])]


def unitwise_norms(tensors: list[Tensor], norm_type: float = 2.0) -> list[Tensor]:
    """Per-unit norms: the whole-tensor norm (0-dim) for scalars and vectors (biases, gains), the norm of
    every row (``[rows, 1, ...]``, over all dims but the first) for matrices and conv kernels."""
    out: list[Optional[Tensor]] = [None] * len(tensors)
    flat = [i for i, t in enumerate(tensors) if t.ndim <= 1]
    if flat:
        for i, n in zip(flat, torch._foreach_norm([tensors[i] for i in flat], norm_type)):
            out[i] = n
    for i, t in enumerate(tensors):
        if t.ndim > 1:
            out[i] = torch.linalg.vector_norm(t, norm_type, dim=tuple(range(1, t.ndim)), keepdim=True)
    return out  # type: ignore[return-value]


@torch.no_grad()
def adaptive_grad_clip_(params: Iterable[Tensor], clip_factor: float = 0.01, eps: float = 1e-3,
                        norm_type: float = 2.0) -> None:
    """Unit-wise adaptive gradient clipping, in place: scale every unit's gradient down to at most
    ``clip_factor * max(||w_unit||, eps)``. Units within the bound are left bitwise unchanged.

    Same result as timm's ``adaptive_clip_grad``; the scalings are fused foreach ops and nothing syncs.
    """
    pairs = [(p.detach(), p.grad.detach()) for p in params if p.grad is not None]
    if not pairs:
        return
    weights = [p for p, _ in pairs]
    grads = [g for _, g in pairs]
    max_norms = torch._foreach_clamp_min(unitwise_norms(weights, norm_type), eps)
    torch._foreach_mul_(max_norms, clip_factor)
    grad_norms = torch._foreach_clamp_min(unitwise_norms(grads, norm_type), 1e-6)
    scales = torch._foreach_div(max_norms, grad_norms)
    torch._foreach_clamp_max_(scales, 1.0)
    torch._foreach_mul_(grads, scales)
