"""What the user sees on screen: the guard's status in the progress bar, and one-line messages.

Two values, ``ng_incidents`` (incidents so far, an integer) and ``ng_lr_scale`` (cumulative learning-rate
scale), sit in ``trainer.progress_bar_metrics`` next to what the module logs with ``prog_bar=True``. They
are host numbers put there directly after each optimizer step: ``self.log`` would turn the count into a
float (``ng_incidents=1.000``), send it through the loggers and reduce it; this costs nothing and never
touches the accelerator. The loggers get the ``nanguard/`` scalars separately, at each incident's own
step (:mod:`.sinks`).

:func:`say` prints a line from global rank 0 through the active progress bar (so it lands on a line of
its own, not on the bar's), else through Lightning's rank-zero logger. The package installs no logging
handlers of its own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

try:
    from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError:  # pragma: no cover
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn  # type: ignore[no-redef]

__all__ = ["ProgressStatus", "INCIDENTS_KEY", "LR_SCALE_KEY", "say", "warn"]

INCIDENTS_KEY = "ng_incidents"
LR_SCALE_KEY = "ng_lr_scale"


def _bar_on_screen(bar: Any) -> bool:
    """Is a progress bar drawn right now? (TQDM: one of its bars exists; Rich: its live display runs.)"""
    if bar is None or not getattr(bar, "is_enabled", False):
        return False
    for name in ("_train_progress_bar", "_val_progress_bar", "_test_progress_bar", "_predict_progress_bar"):
        tqdm_bar = getattr(bar, name, None)
        if tqdm_bar is not None and not getattr(tqdm_bar, "disable", True):
            return True
    return getattr(bar, "progress", None) is not None  # RichProgressBar


def say(trainer: Any, message: str) -> None:
    """One line for the user, from global rank 0 only."""
    if getattr(trainer, "global_rank", 0) != 0:
        return
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and _bar_on_screen(bar):
        bar.print(message)
    else:
        rank_zero_info(message)


def warn(message: str) -> None:
    """A warning from global rank 0 (Lightning's ``rank_zero_warn``)."""
    rank_zero_warn(message)


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
