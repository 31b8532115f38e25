"""When the guard passes over the parameters and buffers (``check.parameters``).

A healthy step does not: with the loss and gradient checks on, a bad weight that the next forward reads spoils
that step's loss or gradients, and the incident path names the weight. A bad weight that no forward reads (Adam
with ``eps=0`` turns the embedding rows no batch uses into NaN while every loss and gradient stays finite) is found
before the next snapshot is taken, at validation, when a checkpoint is written and at the end of fit; with the
loss or gradient check off, nothing else would see it, so every step is checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.weights import WeightCheck
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

QUIET = {"verbose": False, "events_file": False, "reports": False}


def unread_rows_data() -> TensorDataset:
    """Every batch of 16 reads tokens 0..9 only: rows 10..19 of a 20-row embedding are never read."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(256) % 10, torch.randn(256, generator=g))


@pytest.mark.parametrize("check, first", [({}, 5), ({"loss": False}, 1)], ids=["default", "loss-off"])
def test_unread_nan_rows_are_found_before_a_snapshot_keeps_them(fit, check, first):
    """Default: the rows that went NaN at step 0 are found when the snapshot after 5 healthy steps is due (never
    kept); the next step rolls back. With the loss check off, every step is checked: found at step 1."""
    guard = NaNGuard(check=check, recovery={"snapshot_every": 5}, logging=QUIET)
    model = models.EpsZeroEmbedding(rows=20)
    fit(model, unread_rows_data(), [guard], batch_size=16, steps=12)
    ev = guard.events[0]
    assert (ev.step, ev.kind, ev.cause, ev.culprit) == (first, "parameter", "optimizer", "emb.weight")
    assert set(ev.details["nonfinite_parameters"][0]["rows"]) == set(range(10, 20))
    assert "rollback" in ev.actions and ev.details["restored_step"] == 0
    store = guard.snapshots
    assert all(torch.isfinite(t).all() for snap in store.ring for t in snap.tensors if t.is_floating_point())
    assert models.all_finite(model)  # the end of fit found the rows of the last steps and restored them


def test_a_healthy_step_does_not_pass_over_the_weights(fit, monkeypatch):
    """The passes over the weights of a healthy run: one per due snapshot by default, one per step with the gradient
    check off (the snapshots then read the step's flag)."""
    calls: list[int] = []
    flag = WeightCheck.flag

    def counted(self: WeightCheck, module: Any) -> Any:
        calls.append(1)
        return flag(self, module)

    monkeypatch.setattr(WeightCheck, "flag", counted)
    for check, expected in (({}, lambda snapshots: snapshots - 1), ({"gradients": False}, lambda _: 20)):
        calls.clear()
        guard = NaNGuard(check=check, recovery={"snapshot_every": 5}, logging=QUIET)
        fit(models.Regression(), models.regression_data(n=320), [guard], subdir=str(check), batch_size=16, steps=20)
        assert guard.counters["snapshots"] == 5  # fit start and every 5 steps
        assert len(calls) == expected(guard.counters["snapshots"]), check


def test_validation_finds_unread_nan_rows_before_it_runs(fit):
    class Validated(models.EpsZeroEmbedding):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.training_step(batch, batch_idx))

    guard = NaNGuard(recovery={"snapshot_every": 100}, logging=QUIET)
    model = Validated(rows=20)
    fit(model, unread_rows_data(), [guard], batch_size=16, steps=4, val=unread_rows_data(), val_check_interval=3,
        num_sanity_val_steps=0)
    ev = guard.events[0]
    assert (ev.step, ev.kind, ev.details["detected_at"]) == (3, "parameter", "validation_start")
    assert "rollback" in ev.actions


@pytest.mark.parametrize("check", [{}, {"gradients": False}], ids=["from-the-loss", "every-step"])
def test_a_nan_weight_read_by_the_next_forward_is_named_at_the_next_step(fit, check):
    """Whether the next step's loss or the pass over the weights sees it first, the event names the weight and the
    guard rolls back at once (no skips first: skipping cannot repair a weight)."""
    guard = NaNGuard(check=check, logging=QUIET)
    model = models.Regression(lr=0.05)
    fit(model, models.regression_data(n=256), [FaultInjector([Fault("parameter", steps=[3])]), guard],
        batch_size=16, steps=8)
    (ev,) = guard.events
    assert (ev.step, ev.kind, ev.details["nonfinite_parameters"][0]["name"]) == (4, "parameter", ev.culprit)
    assert ev.actions[0] == "skip_step" and "rollback" in ev.actions and models.all_finite(model)
