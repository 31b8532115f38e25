"""One-line messages for the user, from global rank 0 only.

:func:`say` prints through the active progress bar (so the line lands on a line of its own, not on the
bar's), else at INFO through the rank-zero logger of the Trainer's own package (``pytorch_lightning...`` or
``lightning.pytorch...``, so ``logging.getLogger("lightning.pytorch").setLevel(...)`` governs it as it
governs Lightning's own messages); :func:`warn` is ``lightning_utilities``' ``rank_zero_warn``, the one both
Lightning packages re-export. Nothing here imports a Lightning package or changes a logger: the package installs
no logging handlers of its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lightning_utilities.core.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["say", "warn"]


def _bar_on_screen(bar: object) -> bool:
    """Is a progress bar drawn right now? (TQDM: one of its bars exists; Rich: its live display runs.)"""
    if bar is None or not getattr(bar, "is_enabled", False):
        return False
    for name in ("_train_progress_bar", "_val_progress_bar", "_test_progress_bar", "_predict_progress_bar"):
        tqdm_bar = getattr(bar, name, None)
        if tqdm_bar is not None and not getattr(tqdm_bar, "disable", True):
            return True
    return getattr(bar, "progress", None) is not None  # RichProgressBar


def _logger(trainer: "pl.Trainer") -> logging.Logger:
    """The rank-zero logger of the package ``trainer`` comes from (``lightning.pytorch`` or ``pytorch_lightning``)."""
    modules = [cls.__module__ for cls in type(trainer).__mro__]  # a user's Trainer subclass: its base's package
    unified = any(m.startswith("lightning.pytorch.") for m in modules)
    return logging.getLogger(f"{'lightning.pytorch' if unified else 'pytorch_lightning'}.utilities.rank_zero")


def say(trainer: "pl.Trainer", message: str) -> None:
    """One line for the user, from global rank 0 only."""
    if getattr(trainer, "global_rank", 0) != 0:
        return
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and _bar_on_screen(bar):
        bar.print(message)
    else:
        _logger(trainer).info(message)


def warn(message: str) -> None:
    """A warning from global rank 0 (``rank_zero_warn``, as Lightning's own)."""
    rank_zero_warn(message)
