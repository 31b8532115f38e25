"""The guard's compact status in the progress bar (``trainer.progress_bar_metrics``).

Two values, ``ng_incidents`` (incidents so far) and ``ng_lr_scale`` (cumulative learning-rate scale), are
logged with ``pl_module.log(..., prog_bar=True, logger=False, on_step=True, on_epoch=False)`` only when
they change (and once at the start of training). Lightning keeps the last progress-bar value of a key
until the next fit, so the status stays visible between changes, and its step-logging interval
(``log_every_n_steps``) does not apply to the progress bar.

No host-device sync: the values are host numbers and are logged as *CPU* tensors, so neither the
logging call nor Lightning's per-batch conversion of progress-bar values to Python numbers touches the
accelerator. The loggers never see these keys (``logger=False``); the ``nanguard/`` scalars are written
separately at each incident's own step (see :mod:`lightning_nanguard.events`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ProgressStatus", "INCIDENTS_KEY", "LR_SCALE_KEY"]

INCIDENTS_KEY = "ng_incidents"
LR_SCALE_KEY = "ng_lr_scale"


class ProgressStatus:
    """Pushes the guard status into the progress bar when it changes."""

    def __init__(self) -> None:
        self._shown: Optional[tuple[float, float]] = None

    def reset(self) -> None:
        """Forget what was shown (a new fit clears Lightning's progress-bar values)."""
        self._shown = None

    def update(self, trainer: Any, pl_module: Any, incidents: int, lr_scale: float) -> None:
        """Call from ``on_train_batch_end``; logs only if the status changed since the last call."""
        status = (float(incidents), float(lr_scale))
        if status == self._shown or getattr(trainer, "barebones", False):
            return
        if getattr(pl_module, "_current_fx_name", None) is None:  # not inside a Trainer-managed hook
            return
        self._shown = status
        for key, value in zip((INCIDENTS_KEY, LR_SCALE_KEY), status):
            pl_module.log(key, torch.tensor(value, device="cpu"), prog_bar=True, logger=False, on_step=True,
                          on_epoch=False, sync_dist=False)
