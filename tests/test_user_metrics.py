"""A rescued step leaves no trace in what the user logged: Lightning's epoch aggregates (``self.log(...,
on_epoch=True)``), every torchmetrics ``Metric`` of the module and the values sent to loggers are as if the
skipped batches never happened, with automatic and manual optimization and gradient accumulation; the
incident replay never changes metric state (real pl.Trainer, real torchmetrics, real CSVLogger)."""

from __future__ import annotations

import csv
import math
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.recover.metrics import MetricUndo, module_metrics

from . import models

EPOCHS = 3


def _data(bad: Optional[int] = None, n: int = 256) -> TensorDataset:
    """Classification data; batch ``bad`` (of 32) holds one NaN input, in every epoch (no shuffling)."""
    x, y = (t.clone() for t in models.classification_data(n=n).tensors)
    if bad is not None:
        x[bad * 32 + 5, 3] = float("nan")
    return TensorDataset(x, y)


class EpochProbe(pl.Callback):
    """Listed after the guard: at each epoch's end, every metric state and the epoch aggregates callbacks see."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # the user's own values: the guard's ng_* status joins the progress bar (and so callback_metrics) after an event
        seen = {f"callback:{k}": v.detach().clone() for k, v in trainer.callback_metrics.items()
                if not k.startswith("ng_")}
        self.epochs.append({**pl_module.metric_states(), **seen})


def _fit(tmp_path: Any, model: models.MetricsClassifier, data: TensorDataset, guard: Optional[NaNGuard],
         callbacks: tuple = (), **kwargs: Any) -> tuple[EpochProbe, pl.Trainer]:
    probe = EpochProbe()
    trainer = models.trainer(tmp_path, [c for c in (guard, *callbacks, probe) if c is not None],
                             max_epochs=EPOCHS, **kwargs)
    trainer.fit(model, models.loader(data))
    return probe, trainer


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose values differ (exactly; a NaN equals a NaN in the same place)."""
    assert a.keys() == b.keys()
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not bool(((a[k] == b[k]) | (a[k].isnan() & b[k].isnan())).all())]


@pytest.mark.parametrize("case", ["automatic", "first_batch", "accumulate", "manual"])
def test_skipped_batch_leaves_no_trace_in_metrics_and_epoch_aggregates(tmp_path, case):
    """The guarded run on data with a NaN batch equals, bitwise, a run whose training_step never saw it."""
    bad = 0 if case == "first_batch" else 3
    drop = (2, 3) if case == "accumulate" else (bad,)  # an accumulated step skips all its micro-batches
    kwargs = {"accumulate_grad_batches": 2} if case == "accumulate" else {}
    manual = case == "manual"
    guard = NaNGuard()
    pl.seed_everything(0, verbose=False)
    rescued, _ = _fit(tmp_path / "guarded", model := models.MetricsClassifier(manual=manual), _data(bad), guard,
                      **kwargs)
    pl.seed_everything(0, verbose=False)
    clean, _ = _fit(tmp_path / "reference", ref := models.MetricsClassifier(manual=manual, drop=drop), _data(), None,
                    **kwargs)
    assert [(e.epoch, e.batch_idx, e.kind) for e in guard.events] == [(ep, bad, "input") for ep in range(EPOCHS)]
    for epoch in range(EPOCHS):
        assert _same(rescued.epochs[epoch], clean.epochs[epoch]) == [], epoch
    first = rescued.epochs[0]
    assert {"train_loss_epoch", "train_acc"} <= {k.split(":")[1] for k in first if k.startswith("callback:")}
    assert math.isfinite(float(first["callback:train_loss_epoch"]))
    samples = len(_data()) - sum(len(range(b * 32, min(b * 32 + 32, 256))) for b in drop)
    assert float(first["seen.sum_value"]) == samples  # the bad batch (or accumulated step) not counted
    assert _same(model.state_dict(), ref.state_dict()) == []


def test_early_stopping_and_checkpointing_on_the_epoch_loss_see_a_rescued_run(tmp_path):
    """EarlyStopping(check_finite=True) does not stop the rescued run; ModelCheckpoint's best moves on."""
    stop = EarlyStopping(monitor="train_loss_epoch", check_finite=True, patience=EPOCHS, mode="min")
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss_epoch", mode="min", save_top_k=1,
                           filename="{epoch}")
    guard = NaNGuard()
    probe, trainer = _fit(tmp_path, models.MetricsClassifier(), _data(3), guard, (stop, best),
                          enable_checkpointing=True)
    losses = [float(e["callback:train_loss_epoch"]) for e in probe.epochs]
    assert len(losses) == EPOCHS and trainer.current_epoch == EPOCHS and not trainer.should_stop
    assert stop.stopped_epoch == 0 and len(guard.events) == EPOCHS
    assert losses == sorted(losses, reverse=True)  # learning: each epoch better than the last
    assert best.best_model_path.endswith(f"epoch={EPOCHS - 1}.ckpt")
    assert float(best.best_model_score) == losses[-1]


def test_loggers_never_receive_a_value_of_a_skipped_step(tmp_path):
    """Step-level values of the skipped step are not logged; every value the user logged is finite."""
    guard = NaNGuard()
    logger = CSVLogger(tmp_path, name="csv")
    _fit(tmp_path, models.MetricsClassifier(), _data(3), guard, logger=logger, log_every_n_steps=1)
    with open(logger.log_dir + "/metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    values = [float(v) for row in rows for k, v in row.items()  # the user's keys (the guard's own record the incident)
              if v and k not in ("epoch", "step") and not k.startswith("nanguard/")]
    assert values and all(math.isfinite(v) for v in values), [r for r in rows if "nan" in r.values()]
    skipped = {e.step for e in guard.events}
    logged_steps = {int(row["step"]) for row in rows if row.get("train_loss_step")}
    assert not skipped & logged_steps and len(logged_steps) == EPOCHS * 8 - len(skipped)


class LossPoisoned(models.MetricsClassifier):
    """NaN inside the model at one batch (not in the data): an incident the guard replays."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * float("nan") if self.trainer.fit_loop.epoch_loop.batch_idx == self.bad else out


class AroundTheGuard(pl.Callback):
    """Listed after the guard: metric states before backward and after the guard's optimizer-step hook."""

    def __init__(self) -> None:
        self.before: dict[int, dict] = {}
        self.after: dict[int, dict] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.before[trainer.global_step] = pl_module.metric_states()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.after[trainer.global_step] = pl_module.metric_states()


def test_incident_replay_never_changes_metric_state(tmp_path):
    """The replay reruns training_step (forward, op and anomaly passes): no metric counts the batch again."""
    guard, around = NaNGuard(), AroundTheGuard()
    model = LossPoisoned(bad=3)
    models.trainer(tmp_path, [guard, around], max_steps=5).fit(model, models.loader(_data()))
    (event,) = guard.events
    assert event.step == 3 and guard.counters["replays"] == 1 and "replay" in event.details
    assert _same(around.before[3], around.after[3]) == []  # the replay left every state as the step had it
    assert float(around.after[3]["seen.sum_value"]) == 4 * 32  # steps 0-3 counted once each, before the undo
    assert float(model.seen.sum_value) == 4 * 32  # steps 0, 1, 2, 4: the skipped step undone at its end


def test_healthy_run_is_bitwise_transparent_with_metrics(tmp_path):
    runs = []
    for guarded in (False, True):
        pl.seed_everything(0, verbose=False)
        model, guard = models.MetricsClassifier(), NaNGuard() if guarded else None
        probe, _ = _fit(tmp_path / str(guarded), model, _data(), guard)
        runs.append((probe.epochs, model.state_dict()))
    assert all(_same(a, b) == [] for a, b in zip(runs[0][0], runs[1][0]))
    assert _same(runs[0][1], runs[1][1]) == []


def test_metric_undo_restores_every_kind_of_state():
    """Tensor states updated in place or replaced, list (cat) states, update counts and cached results."""
    import torchmetrics

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mean = torchmetrics.MeanMetric()
            self.cat = torchmetrics.CatMetric()
            self.group = torchmetrics.MetricCollection([torchmetrics.classification.MulticlassPrecision(3),
                                                        torchmetrics.classification.MulticlassRecall(3)])

    holder = Holder()
    preds, target = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])
    for _ in range(2):
        holder.mean.update(torch.tensor([1.0, 2.0]))
        holder.cat.update(torch.tensor([1.0]))
        holder.group.update(preds, target)
    assert len(module_metrics(holder)) == 4
    before = {id(m): (m._update_count, {k: (list(v) if isinstance(v, list) else v.clone())
                                        for k, v in m.metric_state.items()}) for m in module_metrics(holder)}
    expected = (holder.mean.compute().clone(), holder.group.compute())
    undo = MetricUndo(holder)
    undo.arm()
    holder.mean(torch.tensor([float("nan")]))  # forward: replaces the states
    holder.cat.update(torch.tensor([5.0]))
    holder.cat.reset()  # clears the list in place
    holder.group.update(preds, torch.tensor([2, 2, 2, 2]))
    undo.undo()
    for m in module_metrics(holder):
        count, state = before[id(m)]
        assert m._update_count == count
        for k, v in state.items():
            now = getattr(m, k)
            assert [float(t) for t in now] == [float(t) for t in v] if isinstance(v, list) else torch.equal(now, v)
    assert torch.equal(holder.mean.compute(), expected[0])
    assert all(torch.equal(holder.group.compute()[k], v) for k, v in expected[1].items())
    reference = holder.group.clone()
    reference.reset()
    for _ in range(3):
        reference.update(preds, target)
    holder.group.update(preds, target)  # a compute group updates its first metric only: states must stay shared
    assert all(torch.equal(holder.group.compute()[k], v) for k, v in reference.compute().items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to detect host-device syncs")
def test_metric_backup_never_syncs_with_the_device():
    model = models.MetricsClassifier().cuda()
    undo = MetricUndo(model)
    logits, y = torch.randn(32, 4, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    for _ in range(2):
        model.loss_mean(torch.rand((), device="cuda"))
        model.accuracy.update(logits, y)
        model.seen.update(torch.tensor(32.0, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            undo.arm()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_run_the_guard_gives_up_on_still_stops_early_stopping_cleanly(tmp_path):
    """Every step poisoned: the guard gives up; the failed steps are not hidden (the give-up step's NaN stays
    in the epoch aggregate), so a strict EarlyStopping sees the metric and stops instead of raising."""
    x, y = (t.clone() for t in models.classification_data(n=32 * 20).tensors)
    x[::32, 0] = float("nan")  # one bad sample in every batch
    stop = EarlyStopping(monitor="train_loss_epoch", strict=True, check_finite=True)
    guard = NaNGuard(recovery={"max_skips": 1, "max_rollbacks": 1})
    probe, trainer = _fit(tmp_path, models.MetricsClassifier(), TensorDataset(x, y), guard, (stop,))
    assert guard.stopped and trainer.should_stop and len(probe.epochs) == 1
    assert math.isnan(float(probe.epochs[0]["callback:train_loss_epoch"]))
