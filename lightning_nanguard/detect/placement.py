"""Where this rank runs and what its strategy does with the training state, read from the trainer.

Duck-typed on the strategy's class names (no isinstance: no import of a Lightning package or of a strategy's
module): does it shard gradients (``FSDP``, ``ModelParallel``: :func:`shards_gradients`), does every rank hold the
same whole state (DDP: :func:`replicates`), and this process's rank, host and device (:func:`whereabouts`).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Union

from torch import Tensor

from ..core.dtensors import local

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["whereabouts", "replicates", "shards_gradients", "local_tensor"]



_SHARDING_NAMES = ("FSDP", "FullyShardedDataParallel", "ModelParallel")


def whereabouts(trainer: "pl.Trainer") -> dict[str, Union[int, str]]:
    """Where this process runs: ``rank`` (global), ``host``, ``device`` (``cuda:3``, ``cpu``), ``local_rank``."""
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    return {"rank": int(getattr(trainer, "global_rank", 0) or 0), "host": socket.gethostname(),
            "device": str(device) if device is not None else "cpu",
            "local_rank": int(getattr(trainer, "local_rank", 0) or 0)}


def replicates(strategy: object, module: object = None) -> bool:
    """Does every rank of ``strategy`` hold the same whole training state, with gradients all-reduced over every
    parameter (DDP and its start methods)? Not a sharding strategy, not DeepSpeed (whose ZeRO stages partition the
    optimizer state), and no parameter of ``module`` left out of the all-reduce. Duck-typed on the class names."""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    if shards_gradients(strategy) or any("DeepSpeed" in n for n in names) or not any("DDP" in n for n in names):
        return False
    return not getattr(module, "_ddp_params_and_buffers_to_ignore", None)


def shards_gradients(strategy: object) -> bool:
    """Does ``strategy`` shard gradients across ranks? (duck-typed on the class names, no isinstance)"""
    names = [cls.__name__ for cls in type(strategy).__mro__]
    return any(key in name for name in names for key in _SHARDING_NAMES)


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a tensor (a DTensor's local tensor; a plain tensor as it is)."""
    return local(t)
