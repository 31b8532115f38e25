"""Mixed precision: the GradScaler as the guard sees it.

Under ``16-mixed`` the loss the guard sees before backward is scaled, a fused optimizer's gradients are
still scaled at ``on_before_optimizer_step``, and a non-finite gradient is usually a routine scaler
overflow (the scaler skips the step and halves its scale), not divergence. These helpers read the scale
without a host sync, unscale what must be unscaled, and decide when overflows stop being routine.
``bf16-mixed`` has no scaler: every non-finite value is a real incident.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["grad_scaler", "scale_tensor", "unscale_value", "scale_parts", "ensure_unscaled", "overflow_is_incident",
           "restorable_scaler_state"]


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


def scale_parts(scaler: Optional[Any], device: torch.device) -> list[Tensor]:
    """``[scale]`` as a 1-element tensor on ``device`` to read with the step's flags, or ``[]``."""
    scale = scale_tensor(scaler)
    return [] if scale is None else [scale.detach().float().to(device).view(1)]


def ensure_unscaled(scaler: Any, optimizer: Any) -> None:
    """Lightning leaves a fused optimizer's grads scaled; unscale them so norms and checks are real.

    ``scaler.step`` then sees the optimizer as unscaled and passes no ``grad_scale`` to the fused kernel;
    the recorded inf checks also let a step whose grads the guard set to None go through ``scaler.step``.
    """
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def overflow_is_incident(consecutive: int, scale: Optional[float], patience: int, min_scale: float) -> bool:
    """Is the ``consecutive``-th overflow in a row (at ``scale``) persistent enough to be an incident?"""
    return consecutive >= patience or (scale is not None and scale < min_scale)


def restorable_scaler_state(snapshot: dict[str, Any], scaler: Any, overflows: int) -> dict[str, Any]:
    """The scaler state a rollback restores: the snapshot's, except while the scaler is overflowing.

    A rollback during a streak of overflows must not raise the scale back to the snapshot's value (that
    scale is what overflows): the scale is capped at the current one. After any other incident (a NaN
    loss, bad inputs) the snapshot's scale is restored as it was.
    """
    state = dict(snapshot)
    if overflows > 0 and "scale" in state:
        state["scale"] = min(float(state["scale"]), float(scaler.get_scale()))
    return state
