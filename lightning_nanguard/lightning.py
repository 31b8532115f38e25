"""NaNGuard for the unified ``lightning`` package: ``lightning_nanguard.lightning.NaNGuard``.

``lightning_nanguard.NaNGuard`` subclasses ``pytorch_lightning.Callback``. Its hooks work in a
``lightning.pytorch.Trainer`` too (hooks are called by name), but ``lightning.pytorch.cli.LightningCLI``
checks that a callback's class subclasses ``lightning.pytorch.Callback`` and refuses it, and importing it
imports ``pytorch_lightning``, which rebinds the logger and the deprecation-warning category that both packages
share (``lightning_utilities.core.rank_zero``): ``logging.getLogger("lightning.pytorch")`` settings and warning
filters on ``lightning.pytorch``'s deprecations would stop working. This module never imports
``pytorch_lightning``: its ``NaNGuard`` is the same callback (constructor, behaviour, checkpoint ``state_key``)
as a ``lightning.pytorch.Callback``, which the unified package's LightningCLI accepts::

    python train.py fit --trainer.callbacks+=lightning_nanguard.lightning.NaNGuard

``FaultInjector`` is :class:`lightning_nanguard.testing.FaultInjector` as a ``lightning.pytorch.Callback``.
"""

from __future__ import annotations

import lightning.pytorch as _lp

from .callback import NaNGuardBase as _NaNGuard
from .config import NaNGuardConfig
from .core.events import NaNEvent
from .errors import ConfigError, NaNGuardError
from .faults import FaultInjectorBase as _FaultInjector

__all__ = ["NaNGuard", "NaNGuardConfig", "NaNEvent", "ConfigError", "NaNGuardError", "FaultInjector"]


# NaNGuardBase's hooks are annotated with pytorch_lightning's Trainer and LightningModule (classic.py's base), which
# are other classes than lightning.pytorch's: no annotation names both (hooks are called by name, so both work)
class NaNGuard(_NaNGuard, _lp.Callback):  # type: ignore[misc]
    __doc__ = _NaNGuard.__doc__


class FaultInjector(_FaultInjector, _lp.Callback):
    __doc__ = _FaultInjector.__doc__
