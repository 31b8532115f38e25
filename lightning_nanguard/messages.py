"""How NaNGuard speaks: its error type and rank-zero messages."""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["NaNGuardError", "rank_zero_print", "log"]

log = logging.getLogger("lightning_nanguard")


class NaNGuardError(RuntimeError):
    """Raised when NaNGuard gives up and ``recovery.on_give_up`` is ``"raise"``."""


def rank_zero_print(trainer: Any, msg: str) -> None:
    """One line on stderr from global rank 0 (through the ``lightning_nanguard`` logger)."""
    if getattr(trainer, "global_rank", 0) == 0:
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        log.info(msg)
