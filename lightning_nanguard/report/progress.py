"""What the user sees in the progress bar: the guard's status.

Two values, ``ng_incidents`` (incidents so far, an integer) and ``ng_lr_scale`` (cumulative learning-rate
scale), sit in ``trainer.progress_bar_metrics`` next to what the module logs with ``prog_bar=True``. They
are host numbers put there directly after each optimizer step: ``self.log`` would turn the count into a
float (``ng_incidents=1.000``), send it through the loggers and reduce it; this costs nothing and never
touches the accelerator. The loggers get the ``nanguard/`` scalars separately, at each incident's own
step (:mod:`.sinks`). One-line messages are :func:`lightning_nanguard.console.say`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["ProgressStatus", "INCIDENTS_KEY", "LR_SCALE_KEY"]

INCIDENTS_KEY = "ng_incidents"
LR_SCALE_KEY = "ng_lr_scale"


class ProgressStatus:
    """Puts the guard status into the progress bar's metrics."""

    def __init__(self, name: Optional[str] = None) -> None:
        self.keys = tuple(k.replace("ng_", f"ng_{name}_", 1) if name else k for k in (INCIDENTS_KEY, LR_SCALE_KEY))

    def update(self, trainer: Any, pl_module: Any, incidents: int, lr_scale: float) -> None:
        """Call from ``on_train_batch_end``."""
        if getattr(trainer, "barebones", False):
            return
        status = (int(incidents), float(lr_scale))
        shown = getattr(getattr(trainer, "_logger_connector", None), "_progress_bar_metrics", None)
        if isinstance(shown, dict):  # the dict behind trainer.progress_bar_metrics (renewed at every fit)
            shown.update(zip(self.keys, status))
            return
        if getattr(pl_module, "_current_fx_name", None) is None:  # not inside a Trainer-managed hook
            return
        for key, value in zip(self.keys, status):  # another Lightning: log them (as floats)
            pl_module.log(key, torch.tensor(float(value), device="cpu"), prog_bar=True, logger=False,
                          on_step=True, on_epoch=False, sync_dist=False)
