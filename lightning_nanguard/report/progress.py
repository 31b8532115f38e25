"""What the user sees on screen: the guard's status in the progress bar, and one-line messages.

Two values, ``ng_incidents`` (incidents so far, an integer) and ``ng_lr_scale`` (cumulative learning-rate
scale), are logged with ``pl_module.log(..., prog_bar=True, logger=False, on_step=True, on_epoch=False)``
only when they change (and once at the start of training). Lightning keeps the last progress-bar value of
a key until the next fit, so the status stays visible between changes, and its step-logging interval
(``log_every_n_steps``) does not apply to the progress bar.

No host-device sync: the values are host numbers logged as *CPU* tensors, so neither the logging call nor
Lightning's per-batch conversion of progress-bar values to Python numbers touches the accelerator. The
loggers never see these keys (``logger=False``); the ``nanguard/`` scalars are written separately at each
incident's own step (:mod:`.sinks`).

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
    if _bar_on_screen(bar):
        bar.print(message)
    else:
        rank_zero_info(message)


def warn(message: str) -> None:
    """A warning from global rank 0 (Lightning's ``rank_zero_warn``)."""
    rank_zero_warn(message)


class ProgressStatus:
    """Pushes the guard status into the progress bar when it changes."""

    def __init__(self) -> None:
        self._shown: Optional[tuple[int, float]] = None

    def reset(self) -> None:
        """Forget what was shown (a new fit clears Lightning's progress-bar values)."""
        self._shown = None

    def update(self, trainer: Any, pl_module: Any, incidents: int, lr_scale: float) -> None:
        """Call from ``on_train_batch_end``; logs only if the status changed since the last call."""
        status = (int(incidents), float(lr_scale))
        if status == self._shown or getattr(trainer, "barebones", False):
            return
        if getattr(pl_module, "_current_fx_name", None) is None:  # not inside a Trainer-managed hook
            return
        self._shown = status
        pl_module.log(INCIDENTS_KEY, torch.tensor(status[0], device="cpu"), prog_bar=True, logger=False,
                      on_step=True, on_epoch=False, sync_dist=False)
        pl_module.log(LR_SCALE_KEY, torch.tensor(status[1], device="cpu"), prog_bar=True, logger=False,
                      on_step=True, on_epoch=False, sync_dist=False)
