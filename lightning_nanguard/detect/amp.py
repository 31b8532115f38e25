"""Mixed precision: the GradScaler as the guard sees it.

Under ``16-mixed`` the loss the guard sees before backward is scaled, a fused optimizer's gradients are
still scaled at ``on_before_optimizer_step``, and a non-finite gradient is usually a routine scaler
overflow (the scaler skips the step and halves its scale), not divergence. These helpers read the scale
without a host sync, unscale what must be unscaled, and decide when overflows stop being routine
(:class:`OverflowWatch`). ``bf16-mixed`` has no scaler: every non-finite value is a real incident.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from .flags import StepFlags

__all__ = ["grad_scaler", "scale_tensor", "unscale_value", "scale_flag", "ensure_unscaled", "OverflowWatch"]


def grad_scaler(trainer: Any) -> Optional[Any]:
    """The enabled GradScaler of the trainer's precision plugin, or None (duck-typed)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "unscale_") and scaler.is_enabled() else None


def scale_tensor(scaler: Optional[Any]) -> Optional[Tensor]:
    """The scaler's current scale as a device tensor (no sync), or None before its first use."""
    if scaler is None:
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, Tensor) else None


def unscale_value(value: Tensor, scaler: Optional[Any]) -> Tensor:
    """``value`` (e.g. a scaled loss) divided by the current scale, on device; unchanged without a scaler."""
    scale = scale_tensor(scaler)
    return value if scale is None else value / scale.to(value.device).float()


def scale_flag(scaler: Optional[Any], device: torch.device) -> Tensor:
    """The ``grad_scale`` entry of the step's :class:`StepFlags` vector: the scale, or nan without one."""
    scale = scale_tensor(scaler)
    if scale is None:
        return torch.full((), math.nan, device=device)
    return scale.detach().float().to(device).reshape(())


def ensure_unscaled(scaler: Any, optimizer: Any) -> None:
    """Lightning leaves a fused optimizer's grads scaled; unscale them so norms and checks are real.

    ``scaler.step`` then sees the optimizer as unscaled and passes no ``grad_scale`` to the fused kernel;
    the recorded inf checks also let a step whose grads the guard set to None go through ``scaler.step``.
    """
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


class OverflowWatch:
    """Counts consecutive GradScaler overflows and says when they stop being routine: after
    ``patience`` in a row, or once the scale falls below ``min_scale``."""

    def __init__(self, patience: int, min_scale: float) -> None:
        self.patience = int(patience)
        self.min_scale = float(min_scale)
        self.overflows = 0  # consecutive overflow steps
        self.scale: Optional[float] = None  # the scale read with the latest step's flags (no extra sync)

    def observe(self, flags: StepFlags, grads_bad: bool, scaled: bool) -> bool:
        """Feed one step's flags (``grads_bad``: its non-finite gradients count); True when this step is an
        overflow that persisted too long."""
        self.scale = flags.grad_scale if scaled and math.isfinite(flags.grad_scale) else None
        if not scaled or flags.local_bad:
            return False
        if not grads_bad:
            self.overflows = 0
            return False
        self.overflows += 1
        scale = flags.grad_scale
        return self.overflows >= self.patience or (math.isfinite(scale) and scale < self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return {"overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.overflows = int(state.get("overflows", 0))
