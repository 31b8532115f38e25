"""lightning_nanguard: a PyTorch Lightning callback that survives and explains NaN/Inf in training.

``NaNGuard`` (a ``pytorch_lightning.Callback``) is imported on first access, so that importing this package, or
``lightning_nanguard.lightning`` (the same callback for the unified ``lightning`` package), imports no Lightning
package it did not ask for.
"""

from typing import TYPE_CHECKING, Any

from .config import NaNGuardConfig
from .errors import ConfigError, NaNGuardError
from .events import NaNEvent

if TYPE_CHECKING:
    from .classic import NaNGuard

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "NaNGuard":
        from .classic import NaNGuard

        return NaNGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"NaNGuard"})
