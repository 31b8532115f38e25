"""Torch's anomaly mode turned on by the user (``Trainer(detect_anomaly=True)``): torch raises in backward at
the first NaN; the guard records the incident (event, events.jsonl, report file) before the error propagates."""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard

from .models import loader, regression_data, trainer

BAD_BATCH = 1


class RowNorm(pl.LightningModule):
    """Appends the row norm: ``sqrt`` at an all-zero row has an infinite derivative, a NaN gradient after it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(17, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.proj(x)
        h = torch.cat([h, torch.sqrt((h * h).sum(-1, keepdim=True))], dim=-1)
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(zero_row: bool = True, nan_input: bool = False) -> TensorDataset:
    x, y = (t.clone() for t in regression_data(128).tensors)
    row = BAD_BATCH * 32 + 3
    if zero_row:
        x[row] = 0.0
    if nan_input:
        x[row, 2] = float("nan")
    return TensorDataset(x, y)


def _events_file(tmp_path: Any) -> list[dict]:
    path = tmp_path / "nanguard" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trainer_detect_anomaly_error_is_recorded_before_it_propagates(tmp_path):
    guard = NaNGuard()
    t = trainer(tmp_path, [guard], detect_anomaly=True)
    with pytest.raises(RuntimeError, match="returned nan values"):
        t.fit(RowNorm(), loader(_data()))
    (ev,) = guard.events
    assert (ev.step, ev.batch_idx, ev.kind) == (BAD_BATCH, BAD_BATCH, "gradient")
    assert ev.actions == ["raise"] and ev.details["detected_at"] == "anomaly_mode"
    assert ev.details["anomaly_error"]["op"] in ("MulBackward0", "SqrtBackward0")  # what torch raised at
    assert ev.cause == "backward_op" and ev.culprit is not None  # the replay localised it
    (line,) = _events_file(tmp_path)
    assert line["actions"] == ["raise"] and line["step"] == BAD_BATCH
    report = tmp_path / "nanguard" / f"incident-{ev.index:04d}-step{ev.step}.txt"
    assert report.is_file() and "raise" in report.read_text()
    assert not torch.is_anomaly_enabled()


@pytest.mark.parametrize("inputs, kind", [("on_incident", "input"), ("off", "loss")])
def test_trainer_detect_anomaly_with_a_nan_input_names_what_was_non_finite(tmp_path, inputs, kind):
    guard = NaNGuard(anomaly={"mode": "off"}, check={"inputs": inputs})  # still recorded, without a replay
    t = trainer(tmp_path, [guard], detect_anomaly=True)
    with pytest.raises(RuntimeError, match="returned nan values"):
        t.fit(RowNorm(), loader(_data(zero_row=False, nan_input=True)))
    (ev,) = guard.events
    assert (ev.step, ev.kind, ev.actions) == (BAD_BATCH, kind, ["raise"]) and guard.counters["replays"] == 0
    if kind == "input":
        assert ev.cause == "input" and ev.details["inputs"][0]["micro_batch"] == 0
    assert _events_file(tmp_path)[0]["kind"] == kind


def test_healthy_run_with_trainer_detect_anomaly_records_nothing(tmp_path):
    guard = NaNGuard()
    trainer(tmp_path, [guard], detect_anomaly=True).fit(RowNorm(), loader(_data(zero_row=False)))
    assert guard.events == [] and not (tmp_path / "nanguard" / "events.jsonl").exists()


class RowNormWithExtra(RowNorm):
    """RowNorm whose batches carry a field it never reads."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)


def test_the_users_anomaly_mode_stays_on_after_the_guard_handles_an_incident(tmp_path):
    """A diagnosis pauses the user's anomaly mode and puts it back: a later NaN in backward still raises."""
    unread_nan, zero_row = 1, 3  # batches: a NaN in the unread field, then an all-zero row (NaN in backward)
    x, y = (t.clone() for t in regression_data(128).tensors)
    extra = torch.zeros(128, 2)
    extra[unread_nan * 32, 0] = float("nan")
    x[zero_row * 32 + 3] = 0.0
    seen: list[bool] = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(torch.is_anomaly_enabled())

    guard = NaNGuard(check={"inputs": "always"}, logging={"verbose": False})
    t = trainer(tmp_path, [guard, Probe()], detect_anomaly=True)
    with pytest.raises(RuntimeError, match="returned nan values"):
        t.fit(RowNormWithExtra(), loader(TensorDataset(x, y, extra)))
    assert [(e.step, e.kind, e.actions) for e in guard.events] == [
        (unread_nan, "input", ["skip_step"]), (zero_row, "gradient", ["raise"])]
    assert seen == [True] * (zero_row + 1)
