"""Mixed precision: the GradScaler as the guard sees it.

Under ``16-mixed`` the loss the guard sees before backward is scaled, a fused optimizer's gradients are
still scaled at ``on_before_optimizer_step``, and a non-finite gradient is usually a routine scaler
overflow (the scaler skips the step and halves its scale), not divergence. These helpers read the scale
without a host sync, unscale what must be unscaled, and decide when overflows stop being routine
(:class:`OverflowWatch`). ``bf16-mixed`` has no scaler: every non-finite value is a real incident.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from .vector import StepFlags

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from torch.amp import GradScaler

__all__ = ["grad_scaler", "scale_tensor", "unscale_value", "scale_flag", "ensure_unscaled", "reads_found_inf",
           "skip_on_device", "clear_device_skip", "OverflowWatch"]


def grad_scaler(trainer: "pl.Trainer") -> Optional["GradScaler"]:
    """The enabled GradScaler of the trainer's precision plugin, or None (duck-typed)."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and hasattr(scaler, "unscale_") and scaler.is_enabled() else None


def scale_tensor(scaler: Optional["GradScaler"]) -> Optional[Tensor]:
    """The scaler's current scale as a device tensor (no sync), or None before its first use."""
    if scaler is None:
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, Tensor) else None


def unscale_value(value: Tensor, scaler: Optional["GradScaler"]) -> Tensor:
    """``value`` (e.g. a scaled loss) divided by the current scale, on device; unchanged without a scaler."""
    scale = scale_tensor(scaler)
    return value if scale is None else value / scale.to(value.device).float()


def scale_flag(scaler: Optional["GradScaler"], device: torch.device) -> Tensor:
    """The ``grad_scale`` entry of the step's :class:`StepFlags` vector: the scale, or nan without one."""
    scale = scale_tensor(scaler)
    if scale is None:
        return torch.full((), math.nan, device=device)
    return scale.detach().float().to(device).reshape(())


def ensure_unscaled(scaler: "GradScaler", optimizer: torch.optim.Optimizer) -> None:
    """Lightning leaves a fused optimizer's grads scaled; unscale them so norms and checks are real.

    ``scaler.step`` then sees the optimizer as unscaled and passes no ``grad_scale`` to the fused kernel;
    the recorded inf checks also let a step whose grads the guard set to None go through ``scaler.step``.
    """
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer.step()`` honour a device ``found_inf`` tensor (skip the whole update when it is 1)?

    The GradScaler contract: an optimizer that sets ``_step_supports_amp_scaling`` (torch's Adam, AdamW, SGD,
    Adagrad built with ``fused=True``) reads ``getattr(self, "found_inf", None)`` in ``step()`` and leaves
    parameters, moments and step counters untouched when it is set; one still taking the older ``grad_scaler``
    keyword does not.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    try:
        return "grad_scaler" not in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # pragma: no cover - a step without a signature
        return False


def skip_on_device(optimizer: Any,  # (it gains the found_inf attribute, which Optimizer does not declare)
                    skip: Tensor, scaler: Optional["GradScaler"]) -> bool:
    """Make the coming ``optimizer.step()`` skip when the 0-dim float ``skip`` is 1, without a host read.

    Under a GradScaler the flag joins the scaler's own ``found_inf`` of this optimizer (after ``unscale_``):
    the scaler then skips the step (a fused optimizer on the device, another after its own read) and lowers
    its scale, as for an overflow; it cannot tell the two apart. Otherwise a fused optimizer gets it as
    ``found_inf`` (removed by :func:`clear_device_skip` after the step). Returns False when the optimizer
    cannot skip on the device: its step will be applied.
    """
    if scaler is not None:
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for t in found.values():
            t.copy_(torch.maximum(t, skip.to(device=t.device, dtype=t.dtype)))
        return bool(found)
    if reads_found_inf(optimizer):
        optimizer.found_inf = skip
        return True
    return False


def clear_device_skip(optimizer: Any, skip: Optional[Tensor]) -> None:
    """Remove the ``found_inf`` that :func:`skip_on_device` gave ``optimizer`` (as the GradScaler does)."""
    if skip is not None and getattr(optimizer, "found_inf", None) is skip:
        del optimizer.found_inf


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

    def state_dict(self) -> dict[str, object]:
        return {"overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.overflows = int(state.get("overflows", 0))
