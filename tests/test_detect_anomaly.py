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
