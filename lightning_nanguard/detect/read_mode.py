"""``check.sync``, the host read mode of a fit: eager (the evidence vector is read on the host before the optimizer
steps, one host-device sync per step) or lagged (read one step late, a bad step skipped on the device).

Chosen once, at fit start, from the key, the device and what the optimizers can do (:func:`choose_read_mode`).
Nothing to do with how the ranks agree under DDP (:mod:`.ranks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .amp import grad_scaler, reads_found_inf

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["choose_read_mode"]


def choose_read_mode(mode: str, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> tuple[bool, str]:
    """``check.sync`` for this fit: (read the flags lagged?, why, in words for the user).

    ``auto`` is lagged when the device is not the CPU (where every op has finished when it returns, so a
    read waits for nothing) and every optimizer can skip a bad step on the device: a fused torch optimizer
    (``found_inf``), or any optimizer under a GradScaler (its ``found_inf``). Manual optimization always reads
    eagerly.
    """
    optimizers = list(getattr(trainer, "optimizers", None) or [])
    scaled = grad_scaler(trainer) is not None
    cannot = [type(o).__name__ for o in optimizers if not scaled and not reads_found_inf(o)]
    if mode == "eager":
        return False, "check.sync: eager: one host sync per step"
    if not getattr(pl_module, "automatic_optimization", True):
        return False, "manual optimization: each optimizer.step() is judged when it is called, one host sync each"
    if mode == "lagged":
        if cannot:
            return True, (f"check.sync: lagged; optimizer {cannot[0]} cannot skip a step on the device: a bad step is "
                          "applied, then undone one step later by a rollback to the newest snapshot")
        return True, "check.sync: lagged: bad steps are skipped on the device, the flags are read one step late"
    device = getattr(getattr(trainer, "strategy", None), "root_device", None)
    if device is None or torch.device(device).type == "cpu":
        return False, "on the CPU every op has finished when it returns: reading the flags waits for nothing"
    if cannot or not optimizers:
        name = cannot[0] if cannot else "(none)"
        return False, (f"optimizer {name} is not fused: one host sync per step; use {name}(fused=True) to "
                       "remove it")
    if scaled and any(not reads_found_inf(o) for o in optimizers):
        return True, ("16-mixed: the GradScaler skips bad steps; its own check of a non-fused optimizer still reads "
                      "once per step (fused=True removes it)")
    return True, "every optimizer skips bad steps on the device (fused): no host sync on a healthy step"
