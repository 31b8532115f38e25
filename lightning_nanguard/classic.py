"""NaNGuard for ``pytorch_lightning``: ``lightning_nanguard.NaNGuard`` (and the fault injector of
:mod:`lightning_nanguard.testing`).

The only modules of the package that import ``pytorch_lightning`` (or, where it is not installed,
``lightning.pytorch``), and only when one of these classes is asked for: ``lightning_nanguard`` resolves
``NaNGuard`` on first access. The unified package has :mod:`lightning_nanguard.lightning`, which never imports
this one (importing ``pytorch_lightning`` rebinds the logger and deprecation category of
``lightning_utilities``' rank-zero module, which both packages share).
"""

from __future__ import annotations

try:
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover - only the unified package is installed
    import lightning.pytorch as _pl  # type: ignore[no-redef]  # the same name, the other package's module

from .callback import NaNGuardBase
from .faults import FaultInjectorBase

__all__ = ["NaNGuard", "FaultInjector"]


class NaNGuard(NaNGuardBase, _pl.Callback):
    __doc__ = NaNGuardBase.__doc__


class FaultInjector(FaultInjectorBase, _pl.Callback):
    __doc__ = FaultInjectorBase.__doc__
