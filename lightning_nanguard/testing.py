"""Fault injection: rehearse a NaN/Inf failure on your own run, reproducibly.

:class:`FaultInjector` is a Lightning callback that poisons one element of a chosen tensor with NaN, +Inf
or -Inf at given optimizer steps or at a seeded random rate, and records what it did in ``injector.log``.
It is what the chaos tests of this package use, and it works on any LightningModule (with the unified
``lightning`` package, import it from ``lightning_nanguard.lightning``: a ``lightning.pytorch.Callback``)::

    from lightning_nanguard import NaNGuard
    from lightning_nanguard.testing import Fault, FaultInjector

    injector = FaultInjector([
        Fault("input", steps=[10]),                        # one NaN in the batch of step 10
        Fault("gradient", steps=[20], value="inf"),        # one +Inf gradient element at step 20
        Fault(("loss", "activation", "parameter"), rate=0.02, value=("nan", "inf", "-inf")),
    ], seed=0)
    trainer = pl.Trainer(callbacks=[injector, NaNGuard()])  # the injector FIRST, then the guard

Where each kind is injected (``micro_batch`` selects the micro-batch of a gradient-accumulation window):

=================== =========================================================================================
``input``           ``on_train_batch_start``: one element of a floating tensor of the batch (of a sparse
                    tensor: one stored value), in place; the original value is written back one optimizer
                    step later (after a ``check.sync: lagged`` guard has judged the step and replayed its
                    batch), or as soon as a later batch shares the poisoned tensor's storage, so a dataset
                    that hands out views of its storage is not corrupted.
``loss``            ``on_before_backward``: the loss *value* becomes NaN/Inf and so does the gradient that
                    flows out of it (a tensor hook), as a real non-finite loss would; the autograd graph is
                    not modified (no in-place op on a saved tensor).
``activation``      a forward hook on module ``target`` (default: the first leaf module with parameters)
                    returns its output with one poisoned element; the hook lives from the chosen
                    micro-batch to the end of the optimizer step (so a diagnosis replay reproduces it) and is
                    then removed.
``gradient``        ``on_after_backward``: one element of one parameter's ``.grad``.
``parameter``       ``on_train_batch_end`` after the optimizer step: one element of one parameter, as a bad
                    update would leave it.
``optimizer_state`` ``on_before_optimizer_step``: one element of ``optimizer.state[param][state_key]``
                    (default ``exp_avg_sq``) before the update uses it. Not applied on the very first
                    step of a lazily initialised optimizer (there is no state yet); the log says so.
=================== =========================================================================================

Hook order: Lightning calls callbacks in list order, so put the injector **before** ``NaNGuard`` in
``callbacks=[...]``: then the guard sees the poisoned loss and batch in the same hooks, and the poisoned
parameters in its post-step check. After the guard, faults are still caught, but one step later.

Reproducibility: whether a fault fires at a step, its kind, value, tensor and element are drawn from a
``random.Random`` seeded with ``(seed, fault index, global step)``. Nothing reads or advances the global
torch/python/numpy RNGs, and the decision at a step does not depend on what happened before it, so a
clean run and a faulty run (guarded or not) consume the same random numbers and see the same faults.
Under DDP every rank draws the same decisions (restrict with ``Fault(ranks=...)``). Under sharding (FSDP2,
tensor parallel: DTensor parameters) a gradient, parameter or optimizer-state fault poisons an element of the
rank's local shard, drawn among the tensors whose shard on that rank is not empty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .faults import FAULT_KINDS, FAULT_VALUES, Fault, FaultInjectorBase, Injection

if TYPE_CHECKING:  # provided lazily by __getattr__ below: importing this module imports no Lightning package
    from .classic import FaultInjector

__all__ = ["Fault", "FaultInjector", "FaultInjectorBase", "Injection", "FAULT_KINDS", "FAULT_VALUES"]


def __getattr__(name: str) -> "type[FaultInjector]":
    """``FaultInjector``: a ``pytorch_lightning.Callback``, imported on first access (the unified package's is
    ``lightning_nanguard.lightning.FaultInjector``), so that importing this module imports no Lightning package."""
    if name == "FaultInjector":
        from .classic import FaultInjector

        return FaultInjector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
