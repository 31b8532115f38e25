"""lightning_nanguard: a PyTorch Lightning callback that survives and explains NaN/Inf in training."""

from .callback import NaNGuard
from .config import NaNGuardConfig
from .errors import ConfigError, NaNGuardError
from .events import NaNEvent

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]
__version__ = "0.1.0"
