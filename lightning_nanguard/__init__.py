"""lightning_nanguard: a PyTorch Lightning callback that survives and explains NaN/Inf in training."""

from typing import TYPE_CHECKING, Any

from .config import NaNGuardConfig
from .errors import ConfigError, NaNGuardError

if TYPE_CHECKING:
    from .callback import NaNGuard
    from .events import NaNEvent

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]
__version__ = "0.1.0"

# imported when first used, so that the ``nanguard`` command (which needs neither) starts without torch and Lightning
_LAZY = {"NaNGuard": ".callback", "NaNEvent": ".events"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
