"""One-line messages for the user, from global rank 0 only.

:func:`say` prints through the active progress bar (so the line lands on a line of its own, not on the
bar's), else through Lightning's rank-zero logger; :func:`warn` is Lightning's ``rank_zero_warn``. The
package installs no logging handlers of its own.
"""

from __future__ import annotations

from typing import Any

try:
    from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError:  # pragma: no cover
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn  # type: ignore[no-redef]

__all__ = ["say", "warn"]


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
