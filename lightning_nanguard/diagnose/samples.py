"""Which samples of a bad batch: the loss of each sample on its own (incident path only).

A loss spike on weights that gave a healthy loss a step before is the batch's fault (``spike``, cause ``input``).
To say which samples, :func:`sample_losses` reruns ``training_step`` on each sample of the step's micro-batches
alone (every tensor of a micro-batch sliced at the same index of its first dimension), in eval mode, without
gradients, inside :func:`~.rerun.preserved_state` (RNG, buffers, metrics, ``self.log`` put back), and ranks them
against the median. A batch whose tensors do not share one first dimension, a ``training_step`` that fails on
one sample (a BatchNorm in train mode, a custom collate) or returns no scalar loss gives None: the event then
names the batch only. At most :data:`MAX_SAMPLES` samples are rerun.
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..core.tree import iter_tensors, map_tensors
from .rerun import at_step, eager, forward_context, preserved_state, quiet_hooks, run_step

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["sample_losses", "split", "MAX_SAMPLES", "WORST"]

# the most samples a bad batch's per-sample losses rerun (a forward each, at the incident only)
MAX_SAMPLES = 256
# how many of the worst samples an event names
WORST = 5


def split(batch: object) -> Optional[list[object]]:
    """``batch`` as one batch per sample (each tensor sliced at ``i:i+1`` of its first dimension, scalars kept), or
    None where its tensors do not share one first dimension."""
    sizes = {t.shape[0] for _, t in iter_tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        return None
    return [map_tensors(batch, _slice(i)) for i in range(sizes.pop())]


def _slice(i: int) -> Callable[[Tensor], Tensor]:
    return lambda t: t[i:i + 1] if t.dim() > 0 else t


def sample_losses(module: "pl.LightningModule", batches: Sequence[tuple[object, int]], plugin: Any,
                  trainer: Optional["pl.Trainer"] = None, step: Optional[int] = None) -> Optional[dict[str, Any]]:
    """Each sample's loss alone (module docstring): ``{"samples", "median", "worst": [{"micro_batch", "index",
    "loss", "x_median"}]}``, the worst :data:`WORST` first; None where the batch cannot be split or a sample's
    rerun gives no finite scalar loss. ``trainer``, ``step``: the step the batch ran at (``trainer.global_step``
    reads it during the reruns, as for the replay: a step judged one step late runs at its own number)."""
    losses: list[tuple[int, int, float]] = []
    try:
        with eager(), at_step(trainer, step), quiet_hooks(), preserved_state(module), torch.no_grad():
            module.eval()
            for m, (batch, idx) in enumerate(batches):
                parts = split(batch)
                if parts is None:
                    return None
                for i, one in enumerate(parts[:MAX_SAMPLES - len(losses)]):
                    loss = run_step(module, one, idx, None, forward_context(plugin))
                    if loss is None or loss.numel() != 1:
                        return None
                    losses.append((m, i, float(loss.detach().float())))
    except Exception:  # noqa: BLE001  (a training_step that does not take one sample: the batch is named alone)
        return None
    finite = [v for _, _, v in losses if math.isfinite(v)]
    if len(losses) < 2 or not finite:
        return None
    median = statistics.median(finite)
    worst = sorted(losses, key=lambda r: -r[2] if math.isfinite(r[2]) else -math.inf)[:WORST]
    return {"samples": len(losses), "median": median,
            "worst": [{"micro_batch": m, "index": i, "loss": v,
                       "x_median": v / median if median > 0 and math.isfinite(v) else None} for m, i, v in worst]}
