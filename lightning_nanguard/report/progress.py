"""What the user sees in the progress bar: the guard's status, once there is something to say.

Nothing while the run is healthy: the user's ``progress_bar_metrics``, ``callback_metrics`` and ``logged_metrics``
are what they would be without the guard. From the first incident or learning-rate cut on, two floats,
``ng_incidents`` (incidents so far) and ``ng_lr_scale`` (cumulative learning-rate scale), are logged after
every optimizer step through Lightning's public API: ``pl_module.log(..., prog_bar=True, logger=False,
on_step=True, on_epoch=False)`` from ``on_train_batch_end``, where logging is allowed. They are 0-dim CPU
tensors (never a host-to-device copy, never reduced over ranks), so they also appear in ``callback_metrics``
(as every progress-bar value does) and never reach the loggers; the loggers get the ``nanguard/`` scalars
separately (:mod:`.sinks`). One-line messages are :func:`lightning_nanguard.core.console.say`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ProgressStatus", "INCIDENTS_KEY", "LR_SCALE_KEY"]

INCIDENTS_KEY = "ng_incidents"
LR_SCALE_KEY = "ng_lr_scale"


class ProgressStatus:
    """Logs the guard status to the progress bar from the first incident or LR cut on."""

    def __init__(self, name: Optional[str] = None) -> None:
        self.keys = tuple(k.replace("ng_", f"ng_{name}_", 1) if name else k for k in (INCIDENTS_KEY, LR_SCALE_KEY))

    def update(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incidents: int,
               lr_scale: float) -> None:
        """Call from ``on_train_batch_end``."""
        if incidents == 0 and lr_scale == 1.0:  # healthy so far: nothing to say
            return
        if getattr(trainer, "barebones", False) or getattr(pl_module, "_current_fx_name", None) is None:
            return  # barebones refuses self.log; outside a Trainer-managed hook there is nothing to log into
        for key, value in zip(self.keys, (incidents, lr_scale)):
            pl_module.log(key, torch.tensor(float(value), device="cpu"), prog_bar=True, logger=False, on_step=True,
                          on_epoch=False, sync_dist=False, batch_size=1)
