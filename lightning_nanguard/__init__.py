"""lightning_nanguard: a PyTorch Lightning callback that survives and explains NaN/Inf in training.

``NaNGuard`` (a ``pytorch_lightning.Callback``) and ``NaNEvent`` are imported on first access, so that importing
this package, or ``lightning_nanguard.lightning`` (the same callback for the unified ``lightning`` package),
imports no Lightning package it did not ask for, and the ``nanguard`` command (which needs neither) starts
without torch.
"""

from typing import TYPE_CHECKING

from .config import NaNGuardConfig
from .errors import ConfigError, NaNGuardError

if TYPE_CHECKING:
    from .classic import NaNGuard
    from .core.events import NaNEvent

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]
__version__ = "0.1.0"

# imported when first used
_LAZY = {"NaNGuard": ".classic", "NaNEvent": ".core.events"}


def __getattr__(name: str) -> "type[NaNGuard] | type[NaNEvent]":
    """``NaNGuard`` and ``NaNEvent``, imported on first access."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
