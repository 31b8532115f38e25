"""NaNGuard for the unified ``lightning`` package: ``lightning_nanguard.lightning.NaNGuard``.

``lightning_nanguard.NaNGuard`` subclasses ``pytorch_lightning.Callback``. Its hooks work in a
``lightning.pytorch.Trainer`` too (hooks are called by name), but ``lightning.pytorch.cli.LightningCLI``
checks that a callback's class subclasses ``lightning.pytorch.Callback`` and refuses it. This class is the
same callback (constructor, behaviour, checkpoint ``state_key``) that subclasses both packages'
``Callback``, so either package's LightningCLI accepts it::

    python train.py fit --trainer.callbacks+=lightning_nanguard.lightning.NaNGuard
"""

from __future__ import annotations

import lightning.pytorch as _lp

from .callback import NaNGuard as _NaNGuard
from .config import NaNGuardConfig
from .errors import ConfigError, NaNGuardError
from .events import NaNEvent

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError"]

if issubclass(_NaNGuard, _lp.Callback):  # pragma: no cover - only the unified package is installed
    NaNGuard = _NaNGuard
else:

    class NaNGuard(_NaNGuard, _lp.Callback):  # type: ignore[no-redef]
        __doc__ = _NaNGuard.__doc__
