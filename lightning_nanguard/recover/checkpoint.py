"""Checkpoint safety: find non-finite tensors in a checkpoint dict, and rebuild one from live state.

A checkpoint written during a guarded run must never carry a non-finite weight or optimizer state (an
Adam ``exp_avg_sq`` that overflowed to inf freezes its parameter forever, silently). The check is one
fused flag over every floating tensor; names are looked up only when it fires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch

from torch import Tensor

from ..core.layouts import checkable
from ..core.tree import iter_tensors
from ..detect.find import find_nonfinite_tensors
from ..detect.kernels import any_nonfinite_flag, dense_nonfinite_flag
from ..detect.placement import local_tensor

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["iter_checkpoint_tensors", "nonfinite_entries", "optimizer_state_nonfinite", "rebuild"]


def iter_checkpoint_tensors(checkpoint: Mapping[str, object]) -> Iterable[tuple[str, Tensor]]:
    """``(name, tensor)`` for the model weights and every optimizer state tensor of a checkpoint dict."""
    for key in ("state_dict", "optimizer_states"):
        if key in checkpoint:
            for name, t in iter_tensors(checkpoint[key], key):
                yield name, local_tensor(t)


def nonfinite_entries(checkpoint: Mapping[str, object], limit: int = 20,
                      exempt: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The non-finite tensors of ``checkpoint`` (weights and optimizer states); [] when all are finite.

    ``exempt``: state-dict names that are non-finite by design (a causal mask buffer holding -inf)."""
    skip = {f"state_dict[{name!r}]" for name in exempt}
    named = [(n, t) for n, t in iter_checkpoint_tensors(checkpoint) if n not in skip]
    flag = dense_nonfinite_flag(checkable(named))
    if flag is None or not bool(flag):
        return []
    return find_nonfinite_tensors(named, limit=limit)


def optimizer_state_nonfinite(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Does any optimizer of this rank hold a non-finite state tensor (its local shards under a sharding strategy)?
    One fused flag, one read (snapshot time only; the ranks agree on it: :meth:`.Ranks.snapshot_agreement`)."""
    tensors = [local_tensor(t) for opt in optimizers for state in opt.state.values() for t in state.values()
               if isinstance(t, Tensor)]
    flag = any_nonfinite_flag(tensors)
    return flag is not None and bool(flag)


def rebuild(checkpoint: dict[str, object], trainer: "pl.Trainer", guard_key: str,
            guard_state: Mapping[str, object]) -> None:
    """Overwrite the training state of ``checkpoint`` with the trainer's live (restored) state."""
    strategy = trainer.strategy
    checkpoint["state_dict"] = strategy.lightning_module_state_dict()
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [strategy.optimizer_state(o) for o in trainer.optimizers]
    if "lr_schedulers" in checkpoint:
        checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
    plugin = getattr(trainer, "precision_plugin", None)
    key = type(plugin).__qualname__ if plugin is not None else None
    if plugin is not None and key in checkpoint:
        checkpoint[key] = plugin.state_dict()
    callbacks = checkpoint.get("callbacks")
    if isinstance(callbacks, dict) and guard_key in callbacks:  # (Lightning's checkpoint: a dict of callback states)
        callbacks[guard_key] = guard_state
