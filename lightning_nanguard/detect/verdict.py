"""What one optimizer step turned out to be, from its evidence: the host's verdict and the device's skip flag."""

from __future__ import annotations

import enum
from typing import Optional

import torch
from torch import Tensor

from .vector import SCHEMA, StepFlags

__all__ = ["Outcome", "classify", "device_skipped", "skip_flag"]


class Outcome(enum.Enum):
    """What one optimizer step turned out to be."""

    HEALTHY = "healthy"  # everything finite: clip, learn statistics, maybe snapshot
    ROUTINE_OVERFLOW = "routine_overflow"  # a GradScaler overflow the scaler handles by itself
    INCIDENT = "incident"  # non-finite evidence: skip the step, diagnose, climb the ladder
    SKIPPED = "skipped"  # not judged: the guard has stopped, or batches are skipped after a rollback
    STAGED = "staged"  # check.sync lagged: judged when its flags reach the host, one step later


def skip_flag(vec: Tensor, gradients: bool, replicas: Optional[Tensor] = None) -> Tensor:
    """0-dim float on ``vec``'s device, 1 when the step of the evidence vector ``vec`` must be skipped: a flag
    field (a rank count under DDP), or, with ``gradients``, a non-finite gradient norm (on any rank's copy, under
    the replica check), or ``replicas`` (:meth:`.ranks.Ranks.replica_flag`: the ranks' copies disagree). No
    sync."""
    bad = vec[SCHEMA.flags].ne(0).any()
    if gradients:
        bad = bad | ~torch.isfinite(vec[SCHEMA.norm])
        if replicas is not None:
            bad = bad | vec[SCHEMA.index["own_grad_bad"]].gt(0)
    if replicas is not None:
        bad = bad | replicas
    return bad.float()


def device_skipped(flags: StepFlags, gradients: bool, scaled: bool, replicas_disagree: bool, spike: bool) -> bool:
    """The host's reading of :func:`skip_flag` once a lagged step's ``flags`` are read: was its device skip flag
    set? The same test: a flag field, with ``gradients`` (and no GradScaler, whose overflows are its own) a
    non-finite gradient norm, ranks whose copies disagree, or a loss ``spike`` it skipped
    (``check.spike_action: skip_step``)."""
    return bool(flags.local_bad or gradients and not scaled and flags.grads_bad or replicas_disagree or spike)


def classify(flags: StepFlags, grads_bad: bool, scaled: bool, overflow_persists: bool,
             replicas_disagree: bool = False) -> Outcome:
    """The step's outcome from its evidence. ``grads_bad``: a non-finite gradient norm that counts
    (``check.gradients``); ``scaled``: a GradScaler is active; ``overflow_persists``: the scaler's overflows
    went on for too long (``check.amp_overflow_patience`` / ``amp_min_scale``); ``replicas_disagree``: DDP ranks
    hold different copies of the reduced gradient."""
    if flags.local_bad or replicas_disagree:
        return Outcome.INCIDENT
    if not grads_bad:
        return Outcome.HEALTHY
    if scaled and not overflow_persists:
        return Outcome.ROUTINE_OVERFLOW
    return Outcome.INCIDENT
