"""Gradient clipping on healthy steps, from the total norm the guard computes anyway.

- a fixed limit, ``clip.max_norm``;
- :class:`ZClip`: adaptive z-score clipping of the total gradient norm (Kumar et al., 2025, "ZClip"): clip
  at ``mean + z_threshold * std`` of recent healthy norms once warmed up; the statistics are updated with
  the *clipped* norm so one outlier does not inflate the threshold for the steps that follow;
- :func:`adaptive_grad_clip_`: unit-wise adaptive gradient clipping (AGC, Brock et al., 2021, NFNets):
  every row of a weight (every output unit) keeps ``||g_row|| <= clip_factor * max(||w_row||, eps)``;
  fused foreach ops on device, no sync.

:class:`Clipper` applies them in that order (the smallest norm limit wins) and keeps the gradient-norm
statistics that also tell whether a run is diverging (:meth:`Clipper.diverging`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Optional

import torch
from torch import Tensor

from ..config import ClipConfig
from ..core.counters import Counters
from ..core.layouts import is_strided, warn_once
from ..detect.spikes import RunningStats, norm_growth

__all__ = ["ZClip", "Clipper", "adaptive_grad_clip_", "unitwise_norms", "CLIPS_BEFORE_LR_CUT", "AGC_EPS",
           "NORM_HISTORY", "DIVERGING_Z", "DIVERGING_WINDOW"]

# consecutive steps clipped by the adaptive (z-score) clip that roll back and cut the LR: at z=2.5 a healthy
# run clips ~1% of its steps, one at a time; a run whose every step needs clipping diverges, only more slowly
CLIPS_BEFORE_LR_CUT = 10
# AGC: a unit's gradient is clipped to clip.agc_clip_factor times its weight norm, or times this where the weight
# norm is smaller (a zero-initialised layer still learns: its gradients are not clipped to nothing)
AGC_EPS = 1e-3
# healthy gradient norms kept (Clipper.history): the baseline of the diagnosis' z-score and trend of the gradient
# norm (grad_norm_zscore, grad_norm_trend) and of a spike's cause
NORM_HISTORY = 200
# Clipper.diverging (snapshots wait): the latest gradient norm's z-score above this many times clip.z_threshold ...
DIVERGING_Z = 2.0
# ... or the last DIVERGING_WINDOW healthy norms growing geometrically (:func:`~.spikes.norm_growth`: the last 5
# average more than 10 times the 20 before them)
DIVERGING_WINDOW = 25


class ZClip:
    """Adaptive z-score clipping of the total gradient norm.

    ``threshold()`` is ``None`` during the first ``warmup_steps`` norms, then
    ``mean + z_threshold * std`` of the running statistics. ``update(norm)`` feeds one healthy norm,
    capped at the current threshold (ZClip updates with the clipped norm), and returns the threshold that
    applied to it. A norm of exactly 0 (a step without gradients: a frozen start, a detached loss) is not
    learned: it says nothing about the scale of the gradients, and a warm-up on zeros alone would clip every
    later gradient to nothing.

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
        if math.isfinite(norm) and norm != 0:
            self.stats.update(min(norm, limit) if limit is not None else norm)
        self.streak = self.streak + 1 if limit is not None and norm > limit else 0
        return limit

    def state_dict(self) -> dict[str, object]:
        return self.stats.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state)
        self.streak = 0


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
    return out  # type: ignore[return-value]  # every slot filled: ndim <= 1 above, > 1 here


@torch.no_grad()
def adaptive_grad_clip_(params: Iterable[Tensor], clip_factor: float = 0.01, eps: float = AGC_EPS,
                        norm_type: float = 2.0) -> None:
    """Unit-wise adaptive gradient clipping, in place: scale every unit's gradient down to at most
    ``clip_factor * max(||w_unit||, eps)``. Units within the bound are left bitwise unchanged.

    Same result as timm's ``adaptive_clip_grad``; the scalings are fused foreach ops and nothing syncs.
    """
    pairs = [(p.detach(), p.grad.detach()) for p in params if p.grad is not None]
    if not all(is_strided(g) for _, g in pairs):  # sparse gradients (nn.Embedding(sparse=True)): left alone
        warn_once(("agc", "sparse"), "[nanguard] clip.agc_clip_factor: sparse gradients are not clipped unit-wise "
                                     "(their norm still counts towards clip.max_norm and the adaptive clip)")
        pairs = [(p, g) for p, g in pairs if is_strided(g)]
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


def _clip_above(params: list[Tensor], norm: Tensor, limit: float, when: Optional[Tensor]) -> None:
    """``clip_grads_with_norm_(params, limit, norm)`` where ``norm > limit`` (and ``when``), else nothing: on the
    device, bitwise what the host-side clip does either way."""
    # compared in float64 like the host's float; a zero norm makes the coefficient clamp to exactly 1.0
    above = (norm if norm.device.type == "mps" else norm.double()) > limit
    if when is not None:
        above = above & when.to(above.device)
    torch.nn.utils.clip_grads_with_norm_(params, limit, torch.where(above, norm, torch.zeros_like(norm)))


class Clipper:
    """Clipping of healthy steps and the statistics of their gradient norms.

    Attributes:
        zclip: the adaptive clip's running statistics (part of every snapshot).
        armed: adaptive (z-score) clipping is on: from the start (``clip.adaptive: always``), or since
            :meth:`arm` (the first incident, or a loss spike with ``check.spike_action: clip``).
        history: the last :data:`NORM_HISTORY` (200) healthy gradient norms (for the diagnosis).
        history_end: the step of the newest of them (None: not known, e.g. none yet).
        last_norm: the gradient norm of the latest step, healthy or not.

    Steps whose gradients a norm limit scaled down are counted (``counters["clipped_steps"]``).
    """

    def __init__(self, cfg: ClipConfig, counters: Counters) -> None:
        self.cfg = cfg
        self.counters = counters
        self.zclip = ZClip(cfg.z_threshold, cfg.ema_alpha, cfg.warmup_steps)
        self.armed = cfg.adaptive == "always"
        self.history: deque[float] = deque(maxlen=NORM_HISTORY)
        self.history_end: Optional[int] = None
        self.last_norm = math.nan

    @property
    def active(self) -> bool:
        """Does a healthy step need its gradient norm to be clipped? (a fixed or an armed adaptive limit)"""
        return self.cfg.max_norm is not None or self.armed

    def arm(self) -> bool:
        """Adaptive clipping from now on; True when it was off until now."""
        was, self.armed = self.armed, True
        return not was

    def saw(self, norm_value: float) -> None:
        """The gradient norm of the step just read, healthy or not."""
        self.last_norm = norm_value

    def reset_streak(self) -> None:
        """The persistent clipping was acted on (:meth:`clipping_persists`): count afresh."""
        self.zclip.streak = 0

    def zscore(self, norm_value: float) -> Optional[float]:
        """The z-score of a norm against the adaptive clip's statistics (None while warming up)."""
        return self.zclip.zscore(norm_value)

    def threshold(self, extra: Optional[float] = None) -> Optional[float]:
        """The smallest of ``clip.max_norm``, ``extra`` and, when :attr:`armed`, the z-score limit."""
        limits = [x for x in (self.cfg.max_norm, extra) if x is not None]
        limit = self.zclip.threshold() if self.armed else None
        if limit is not None:
            limits.append(limit)
        return min(limits) if limits else None

    def clip(self, params: list[Tensor], norm: Optional[Tensor], norm_value: float,
             extra: Optional[float] = None, step: Optional[int] = None) -> None:
        """Clip a healthy step (norm limits, then AGC) and learn from its norm (the norm of ``step``)."""
        limit = self.threshold(extra)
        if norm is not None and limit is not None and norm_value > limit:
            # takes the parameters (it scales p.grad); given bare grad tensors it silently does nothing
            torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
            self.counters.add("clipped_steps")
        if self.cfg.agc_clip_factor is not None:
            adaptive_grad_clip_(params, self.cfg.agc_clip_factor)
        if norm is not None:
            self._learn(norm_value, step)

    def _learn(self, norm_value: float, step: Optional[int]) -> None:
        self.zclip.update(norm_value)
        self.history.append(norm_value)
        self.history_end = step

    def clip_on_device(self, params: list[Tensor], norm: Optional[Tensor],
                       spike: Optional[Tensor] = None, spike_to: Optional[float] = None
                       ) -> tuple[Optional[float], Optional[float]]:
        """Clip without reading this step's norm (``check.sync: lagged``); returns the limits applied: without,
        and with ``spike_to`` (a loss spike with ``check.spike_action: clip``, where the device flag ``spike``
        is set).

        The limits come from the statistics of the steps already read (host floats, as on the eager path);
        the comparison with this step's norm is made on the device: where ``norm > limit`` the gradients are
        scaled exactly as :meth:`clip` scales them, elsewhere by exactly 1 (bitwise unchanged). The step's
        norm is learned by :meth:`observe` once it is read.
        """
        limit = self.threshold()
        spike_limit = self.threshold(spike_to) if spike is not None and spike_to is not None else None
        if norm is not None:
            for lim, when in ((limit, None if spike is None or spike_limit is None else ~spike), (spike_limit, spike)):
                if lim is not None:
                    _clip_above(params, norm, lim, when)
        if self.cfg.agc_clip_factor is not None:
            adaptive_grad_clip_(params, self.cfg.agc_clip_factor)
        return limit, spike_limit

    def observe(self, norm_value: float, limit: Optional[float], step: Optional[int] = None) -> None:
        """Learn a lagged step's norm (of ``step``), once read; ``limit``: what :meth:`clip_on_device` applied
        to it."""
        if limit is not None and norm_value > limit:
            self.counters.add("clipped_steps")
        self._learn(norm_value, step)

    def clipping_persists(self) -> bool:
        """The adaptive clip had to act on ``CLIPS_BEFORE_LR_CUT`` steps in a row: the norm grows faster than
        its statistics can follow, a divergence that clipping slows but does not stop."""
        return self.armed and self.zclip.streak >= CLIPS_BEFORE_LR_CUT

    def diverging(self) -> bool:
        """Is the gradient norm growing geometrically, or far above its statistics? (Snapshots wait: finite
        is not known-good, and a snapshot of a run on its way to NaN is a rollback target that cannot help.)"""
        z = self.zclip.zscore(self.last_norm)
        far_above = z is not None and z > DIVERGING_Z * self.zclip.z_threshold
        return far_above or norm_growth(list(self.history)[-DIVERGING_WINDOW:]) is not None

    def state_dict(self) -> dict[str, object]:
        return {"zclip": self.zclip.state_dict(), "armed": self.armed, "history": list(self.history),
                "history_end": self.history_end, "last_norm": self.last_norm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zclip.load_state_dict(state.get("zclip", {}))
        self.armed = bool(state.get("armed", self.armed))
        self.history.extend(state.get("history", []))
        self.history_end = state.get("history_end")
        self.last_norm = float(state.get("last_norm", math.nan))
