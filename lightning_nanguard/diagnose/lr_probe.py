"""The lower-LR probe of a stall (:mod:`..detect.stall`): would a smaller learning rate learn more from the batches
just seen?

:func:`lr_probe` runs, from the module's current weights and a copy of its optimizer's state, ``K`` optimizer steps
on the ``K`` steps' micro-batches it is given, once per LR factor, and measures the mean loss on those batches (eval
mode, no gradient) before and after each. It reruns ``training_step`` through the replay's machinery
(:mod:`.rerun`): every run inside :func:`~.rerun.preserved_state` (RNG, buffers, torchmetrics states, train modes,
``log``/``log_dict`` untouched), eagerly, with the precision plugin's forward context; the parameters are put back
bit for bit after each factor, and every ``.grad`` as it was. The optimizer itself is never stepped: a twin of its
class is built on the same parameters and loaded with a deep copy of its state. Incident-path only (it syncs).
"""

from __future__ import annotations

import copy
import statistics
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from .probes import public_name
from .rerun import eager, forward_context, preserved_state, run_step

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["lr_probe", "twin_optimizer"]

Steps = Sequence[Sequence[tuple[object, int]]]  # the micro-batches of each probe step


def twin_optimizer(optimizer: torch.optim.Optimizer, factor: float) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class on the same parameters, with a deep copy of its state and every
    learning rate times ``factor`` (``optimizer`` is not changed)."""
    groups = [dict(g) for g in optimizer.param_groups]
    twin = type(optimizer)(groups)  # type: ignore[call-arg]
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for g in twin.param_groups:
        g["lr"] = g["lr"] * factor
    return twin


def _mean_loss(module: "pl.LightningModule", steps: Steps, plugin: Any) -> float:
    module.eval()
    losses = []
    with torch.no_grad():
        for micro in steps:
            for batch, idx in micro:
                loss = run_step(module, batch, idx, None, forward_context(plugin))
                if loss is not None:
                    losses.append(float(loss.detach().float().mean()))
    return statistics.fmean(losses) if losses else float("nan")


def _train(module: "pl.LightningModule", twin: torch.optim.Optimizer, steps: Steps, plugin: Any) -> None:
    module.train()
    for micro in steps:
        twin.zero_grad(set_to_none=True)
        for batch, idx in micro:
            loss = run_step(module, batch, idx, None, forward_context(plugin))
            if loss is not None and loss.requires_grad:
                (loss / len(micro)).backward()
        twin.step()


def lr_probe(trainer: "pl.Trainer", module: "pl.LightningModule", optimizer: torch.optim.Optimizer, steps: Steps,
             factors: Sequence[float], before: Optional[float] = None) -> dict[str, Any]:
    """The probe (module docstring) at each of ``factors``.

    Args:
        trainer: the fit's Trainer (its precision plugin).
        module: the LightningModule (left bitwise as it was).
        optimizer: the run's optimizer (never stepped; its state is copied).
        steps: the micro-batches of each probe step.
        factors: LR factors (1.0: the run's own LR).
        before: the loss before, when a previous call measured it.

    Returns:
        ``before`` (the mean loss on the batches before), ``after`` (factor -> the mean loss after ``len(steps)``
        steps at that factor) and ``moved`` (at factor 1: parameter name -> how far the steps moved it,
        relative to its norm).
    """
    plugin = getattr(trainer, "precision_plugin", None)
    named = [(public_name(n), p) for n, p in module.named_parameters() if p.requires_grad]
    grads = [p.grad for _, p in named]
    saved = [p.detach().clone() for _, p in named]
    out: dict[str, Any] = {"after": {}, "moved": {}}
    try:
        with eager():
            if before is None:
                with preserved_state(module):
                    before = _mean_loss(module, steps, plugin)
            out["before"] = before
            for factor in factors:
                with preserved_state(module):
                    _train(module, twin_optimizer(optimizer, factor), steps, plugin)
                    out["after"][float(factor)] = _mean_loss(module, steps, plugin)
                    with torch.no_grad():
                        if factor == 1.0:
                            out["moved"] = {n: float((p - s).norm() / s.norm().clamp_min(1e-12))
                                            for (n, p), s in zip(named, saved)}
                        for (_, p), s in zip(named, saved):
                            p.copy_(s)
    finally:
        with torch.no_grad():
            for (_, p), s, g in zip(named, saved, grads):
                p.copy_(s)
                p.grad = g
    return out
