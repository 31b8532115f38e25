"""lightning_nanguard: a PyTorch Lightning callback that survives and explains NaN/Inf in training."""

from .callback import NaNGuard
from .config import ConfigError, NaNGuardConfig
from .errors import NaNGuardError
from .report.events import NaNEvent

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]
__version__ = "0.1.0"
