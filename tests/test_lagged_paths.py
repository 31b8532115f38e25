"""The behaviours of the guard in both ``check.sync`` modes, side by side: eager (one host read per step) and lagged
(flags read one step late, a bad step skipped on the device), lagged forced on the CPU with fused optimizers.

Each test runs the same seeded fit with ``check.sync: eager`` and ``lagged`` and asserts that the two agree where
``docs/performance.md`` (the eager/lagged table) says they must: equal events (as dicts without ``index``),
counters, ``lr_scale``, and bitwise weights and optimizer states; where the docs name a difference (a late
rollback after applied steps skips the step under way too; a spike's LR cut and a divergence act from the next
step), exactly that difference. Only the public surface is read: events, counters, ``lr_scale``, ``stopped``,
``lagged``, the module's weights and the optimizers' and schedulers' ``state_dict()``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

NAN = float("nan")
QUIET = {"verbose": False, "events_file": False, "reports": False}
MODES = ["eager", "lagged"]


# ------------------------------------------------------------------------------------------- shared parts


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """A fused optimizer that can skip on the device; weight decay and momentum make a zeroed gradient (instead
    of a skipped step) still move the weights and the moments."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.1, fused=True)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=lr, fused=True)
    if name == "adamw-foreach":  # cannot skip on the device
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    raise ValueError(name)


class Lin(models.Regression):
    """nn.Linear on regression data with a fused optimizer; the loss is multiplied by NaN on the batches ``bad``
    (NaN gradients everywhere). By batch index, not ``global_step``: a lagged incident is replayed while the next
    step runs, when ``global_step`` has moved on."""

    def __init__(self, bad: tuple[int, ...] = (), optimizer: str = "adamw", lr: float = 0.02) -> None:
        super().__init__(lr=lr)
        self.bad, self.opt_name = set(bad), optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.opt_name, self.parameters(), self.lr)


class BNNet(models.Classifier):
    """Linear-BatchNorm-ReLU-Linear classifier (no dropout) with a fused AdamW."""

    def __init__(self) -> None:
        super().__init__(dropout=0.0)

    def configure_optimizers(self) -> Any:
        return make_optimizer("adamw", self.parameters(), self.lr)


guard, record = models.sync_guard, models.event_record


def records(g: NaNGuard) -> list[dict]:
    """Its events as JSON, comparable across the two modes (:func:`models.without_samples`)."""
    return [models.without_samples(record(e)) for e in g.events]


def optimizer_states(trainer: pl.Trainer) -> list[dict]:
    return copy.deepcopy([o.state_dict() for o in trainer.optimizers])


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two nested structures of tensors and plain values differ (tensors: bitwise, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return [path]
        same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
        return [] if bool(same.all()) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


class Steps(pl.Callback):
    """Listed after the guard: the module and optimizer state at the start and at the end of every optimizer step
    (keyed by the step), and the learning rates each step's update used."""

    def __init__(self) -> None:
        self.before: dict[int, dict] = {}
        self.after: dict[int, dict] = {}
        self.lrs: dict[int, list[float]] = {}
        self._step = -1

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        return {"module": module_state(pl_module), "optimizers": optimizer_states(trainer)}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step = trainer.global_step
        self.before[self._step] = self._state(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs[trainer.global_step] = [g["lr"] for g in optimizer.param_groups]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[self._step] = self._state(trainer, pl_module)


class Run:
    """One guarded fit: the model, the guard, the Trainer and the ``Steps`` probe."""

    def __init__(self, model: pl.LightningModule, g: NaNGuard, trainer: pl.Trainer, steps: Steps) -> None:
        self.model, self.guard, self.trainer, self.steps = model, g, trainer, steps


@pytest.fixture
def run(fit):
    """``run(sync, make_model, guard_kwargs=None, steps=24, data=None, before=(), after=(), **fit_kwargs)``: a seeded
    fit (batches of 16, no shuffling) with a guard in ``sync`` mode, ``before`` callbacks listed ahead of it and
    ``after`` ones (and a ``Steps`` probe) after it; returns a :class:`Run`."""

    def go(sync: str, make_model: Callable[[], pl.LightningModule], guard_kwargs: Optional[dict] = None,
           steps: int = 24, data: Any = None, before: tuple = (), after: tuple = (), subdir: Optional[str] = None,
           **kwargs: Any) -> Run:
        pl.seed_everything(0, verbose=False)
        model, g, probe = make_model(), guard(sync, **copy.deepcopy(guard_kwargs or {})), Steps()
        trainer = fit(model, data if data is not None else models.regression_data(n=512),
                      [*before, g, *after, probe], subdir=subdir or sync, batch_size=16, steps=steps, **kwargs)
        assert g.lagged is (sync == "lagged")
        return Run(model, g, trainer, probe)

    return go


@pytest.fixture
def both(run):
    """``both(make_model, guard_kwargs=None, **run_kwargs)``: the same fit in each mode, ``{"eager": Run, "lagged":
    Run}`` (``before`` callbacks are built afresh for each by passing a callable)."""

    def go(make_model: Callable[[], pl.LightningModule], guard_kwargs: Optional[dict] = None,
           before: Callable[[], tuple] = tuple, **kwargs: Any) -> dict[str, Run]:
        return {sync: run(sync, make_model, guard_kwargs, before=before(), **kwargs) for sync in MODES}

    go.run_one = run
    return go


def assert_same_runs(runs: dict[str, Run], weights: bool = True) -> None:
    """Eager and lagged agree: events, counters, LR scale and (``weights``) bitwise weights and optimizer states."""
    a, b = runs["eager"], runs["lagged"]
    assert records(a.guard) == records(b.guard)
    assert a.guard.counters == b.guard.counters
    assert a.guard.lr_scale == b.guard.lr_scale
    if weights:
        assert differences(module_state(a.model), module_state(b.model)) == []
        assert differences(optimizer_states(a.trainer), optimizer_states(b.trainer)) == []


# --------------------------------------------------------------------------- what the device skips


def trained(state: dict) -> dict:
    """What an optimizer step changes, from a ``Steps`` record: the weights and the optimizer's per-parameter state
    (moments, step counts), not its param groups (an LR cut is not a step)."""
    return {"module": state["module"], "moments": [o["state"] for o in state["optimizers"]]}


def moved(a: dict, b: dict) -> list[str]:
    """``[".module", ".moments"]``, each where it differs between two ``Steps`` records."""
    diff = differences(trained(a), trained(b))
    return [part for part in (".module", ".moments") if any(d.startswith(part) for d in diff)]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_skipped_steps_leave_weights_and_optimizer_state_bitwise_untouched_in_both_modes(both, optimizer):
    """A NaN step (alone, and two in a row) leaves the parameters, AdamW's exp_avg/exp_avg_sq/step and SGD's
    momentum buffer exactly as they were: on the host (grads set to None) or on the device (found_inf); weight
    decay and momentum would move them on a zeroed gradient. The two modes end bitwise alike."""
    bad, steps = (6, 7, 12), 20
    runs = both(lambda: Lin(bad=bad, optimizer=optimizer), steps=steps)
    for sync, r in runs.items():
        for step in range(steps):
            changed = moved(r.steps.before[step], r.steps.after[step])
            # an applied step moves the weights and the moments; a skipped one neither
            assert changed == ([] if step in bad else [".module", ".moments"]), (sync, step)
        assert [(e.step, e.kind, e.actions[0]) for e in r.guard.events] == [(s, "loss", "skip_step") for s in bad]
        assert r.guard.counters["skipped_steps"] == len(bad) and r.guard.counters["rollbacks"] == 0
        state = r.trainer.optimizers[0].state_dict()["state"]
        if optimizer == "adamw":  # the step count counts the applied updates only
            assert {float(s["step"]) for s in state.values()} == {float(steps - len(bad))}
            assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"}
        else:
            assert set(state[0]) == {"momentum_buffer"}
    assert_same_runs(runs)


def test_batchnorm_statistics_of_skipped_steps_are_undone_step_by_step_in_both_modes(both):
    """Bad inputs at steps 4 and 5 (in a row) and 9: at the end of each, the running statistics and the batch count
    are bitwise those at its start (undone on the host, or on the device by the skip flag), while every healthy
    step moves them; the lagged judgement of step 4, made while step 5's NaN statistics sit in the buffers, is
    still an input incident, not a buffer one."""
    bad = (4, 5, 9)
    data = models.poison_rows(models.classification_data(n=512), [16 * s + 3 for s in bad], NAN)
    runs = both(BNNet, data=data, steps=14)
    stats = ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked")
    for sync, r in runs.items():
        for step in range(14):
            before, after = r.steps.before[step]["module"], r.steps.after[step]["module"]
            changed = [k for k in stats if not torch.equal(before[k], after[k])]
            assert changed == ([] if step in bad else list(stats)), (sync, step)
        assert [(e.step, e.kind) for e in r.guard.events] == [(s, "input") for s in bad]
        assert int(r.model.net[1].num_batches_tracked) == 14 - len(bad)
    assert_same_runs(runs)


# ------------------------------------------------------------------ what is marked for the next read


def nan_weight_at(*steps: int) -> Callable[[], tuple]:
    """A FaultInjector (listed before the guard) writing NaN into a weight after the updates of ``steps``."""
    return lambda: (FaultInjector([Fault("parameter", steps=list(steps), target="linear.weight")]),)


def final_state(r: Run) -> dict:
    """The run's end state, as a ``Steps`` record."""
    return {"module": module_state(r.model), "optimizers": optimizer_states(r.trainer)}


def test_a_nan_weight_written_by_a_step_is_rolled_back_to_the_snapshot_bitwise_in_both_modes(both):
    """The NaN written after step 7's update spoils step 8's loss: eager reads it at step 8 and rolls back at its
    end; lagged reads it while step 9 runs, rolls back before step 9's update and skips that step too (steps were
    applied since the snapshot). Either way the weights and moments are then bitwise the snapshot's (step 5, taken
    at the end of step 4), and the same event names the weight."""
    runs = both(Lin, {"recovery": {"snapshot_every": 5}}, before=nan_weight_at(7), steps=13)
    rolled_back_at = {"eager": 8, "lagged": 9}
    for sync, r in runs.items():
        (e,) = r.guard.events
        assert (e.step, e.kind, e.culprit, e.details["restored_step"]) == (8, "parameter", "linear.weight", 5)
        assert e.actions == ["skip_step", "clip", "rollback"]  # a one-off bad weight: no LR cut
        at = rolled_back_at[sync]
        assert moved(r.steps.after[4], r.steps.after[at]) == [], sync
        assert moved(r.steps.after[at], r.steps.after[at + 1]) == [".module", ".moments"]  # training goes on
        assert models.all_finite(r.model)
    assert moved(runs["lagged"].steps.before[8], runs["lagged"].steps.after[8]) == []  # step 8 skipped on the device
    a, b = runs["eager"].guard, runs["lagged"].guard
    assert records(a) == records(b) and b.lr_scale == a.lr_scale == 1.0
    assert b.counters == dict(a.counters, skipped_steps=a.counters["skipped_steps"] + 1)  # the step under way


def test_a_nan_loss_at_the_last_step_is_judged_at_train_end_in_both_modes(both):
    """The last step's flags are read when the fit ends (lagged: no later step reads them; the epoch's end and train
    end do). The fit ends on a skipped incident: a skipped step leaves the weights as they were, so they are kept
    (issue 20: not restored to the snapshot of step 8), in both modes alike: one event, the weights after step 10."""
    runs = both(lambda: Lin(bad=(11,)), {"recovery": {"snapshot_every": 4}}, steps=12)
    for sync, r in runs.items():
        assert [(e.step, e.kind, e.actions, e.details.get("detected_at")) for e in r.guard.events] == [
            (11, "loss", ["skip_step", "clip"], None)], sync
        assert moved(r.steps.after[10], final_state(r)) == [], sync
    assert_same_runs(runs)


def test_a_nan_weight_written_by_the_last_step_is_found_at_train_end_in_both_modes(both):
    """No step reads the weight the last update left: the check at train end (after the lagged flush of the last
    step's healthy flags) finds it and rolls back, to step 8: the snapshot due at the end of step 11 was refused
    because of that weight. No NaN weight is left behind, none was kept in a snapshot."""
    runs = both(Lin, {"recovery": {"snapshot_every": 4}}, before=nan_weight_at(11), steps=12)
    for sync, r in runs.items():
        (e,) = r.guard.events
        assert (e.step, e.kind, e.actions, e.details["detected_at"], e.details["restored_step"]) == (
            12, "parameter", ["rollback"], "train_end", 8), sync
        assert r.guard.counters["snapshots"] == 3  # fit start, steps 4 and 8; not 12
        assert moved(r.steps.after[7], final_state(r)) == [], sync
        assert models.all_finite(r.model)
    assert_same_runs(runs)


def test_a_nan_loss_where_a_snapshot_falls_due_postpones_it_alike_in_both_modes(both):
    """snapshot_every 5 and a NaN loss at step 4, the step that would make the snapshot due: lagged judges a step
    before taking a due snapshot, so both modes take it one healthy step later (step 6), then at step 11; the burst
    11-14 rolls back to that step-11 snapshot, whose weights no step had moved yet: the lagged rollback keeps the
    step under way, and the runs stay bitwise alike. The healthy step after the rollback is a good step: the fit
    ends on its weights, unconfirmed rollback or not (issue 20: the end of fit keeps good steps)."""
    runs = both(lambda: Lin(bad=(4, 11, 12, 13, 14)), {"recovery": {"snapshot_every": 5, "max_skips": 3}}, steps=16)
    for sync, r in runs.items():
        rollbacks = [(e.step, e.details["restored_step"]) for e in r.guard.events if "rollback" in e.actions]
        assert rollbacks == [(14, 11)] and r.guard.counters["snapshots"] == 3, sync
        assert moved(r.steps.after[15], final_state(r)) == [], sync  # the last step's weights, kept
        assert moved(r.steps.after[5], r.steps.after[6]) == [".module", ".moments"]
    assert_same_runs(runs)


def test_a_nan_weight_written_where_a_snapshot_falls_due_is_never_kept_in_both_modes(both):
    """The NaN weight is written at step 4, whose end makes a snapshot due: the snapshot is refused in both modes
    (lagged: after reading step 4's healthy flags first), and the NaN, read by step 5, rolls back to fit start."""
    runs = both(Lin, {"recovery": {"snapshot_every": 5}}, before=nan_weight_at(4), steps=16)
    for sync, r in runs.items():
        (e,) = r.guard.events
        assert (e.step, e.kind, e.details["restored_step"]) == (5, "parameter", 0), sync
        assert moved(r.steps.before[0], r.steps.after[5]) == [], sync
    assert_same_runs(runs)


class ValLin(Lin):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", models.Regression.training_step(self, batch, batch_idx))


class AtValidation(pl.Callback):
    """Listed after the guard: the weights validation runs on, and the validation loss."""

    def __init__(self) -> None:
        self.weights: list[dict] = []
        self.val_loss: list[float] = []

    def on_validation_start(self, trainer, pl_module):
        self.weights.append(module_state(pl_module))

    def on_validation_end(self, trainer, pl_module):
        self.val_loss.append(float(trainer.callback_metrics["val_loss"]))


def test_validation_runs_on_rolled_back_weights_when_the_step_before_it_wrote_a_nan_in_both_modes(both):
    """The last training step before validation (step 7) writes a NaN weight: validation start reads it (lagged:
    after judging step 7's flags), rolls back to the step-5 snapshot, and validation, and what it logs, run on the
    restored weights."""
    runs = {}
    for sync in MODES:
        probe = AtValidation()
        runs[sync] = both.run_one(sync, ValLin, {"recovery": {"snapshot_every": 5}}, before=nan_weight_at(7)(),
                                  after=(probe,), steps=12, val=models.regression_data(n=64), val_check_interval=8,
                                  num_sanity_val_steps=0, check_val_every_n_epoch=None)
        r = runs[sync]
        (e,) = r.guard.events
        assert (e.step, e.kind, e.details["detected_at"], e.details["restored_step"]) == (
            8, "parameter", "validation_start", 5), sync
        assert len(probe.weights) == 1 and differences(probe.weights[0], r.steps.after[4]["module"]) == []
        assert probe.val_loss[0] < 10.0  # finite, and that of trained weights
        r.val_loss = probe.val_loss
    assert runs["eager"].val_loss == runs["lagged"].val_loss
    assert_same_runs(runs)


# -------------------------------------------------------------------------------- the metric undo

EPOCHS = 2


class CatMetrics(models.MetricsClassifier):
    """MetricsClassifier (self.log on_step/on_epoch, MeanMetric, MulticlassAccuracy, SumMetric) plus a CatMetric of
    the per-sample losses (a list state) and a MaxMetric, with a fused SGD."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.losses = torchmetrics.CatMetric(nan_strategy="disable")
        self.worst = torchmetrics.MaxMetric(nan_strategy="disable")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        x, y = batch
        per_sample = nn.functional.cross_entropy(self(x).detach(), y, reduction="none")
        self.losses.update(per_sample)
        self.worst.update(per_sample.max())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


def metric_record(module: nn.Module) -> dict[str, Any]:
    """Every torchmetrics state of ``module`` (tensors and list states, cloned) and each metric's update count."""
    out: dict[str, Any] = {}
    for name, m in module.named_modules():
        if hasattr(m, "metric_state"):
            out[f"{name}.update_count"] = m.update_count
            for attr, value in m.metric_state.items():
                out[f"{name}.{attr}"] = ([v.detach().clone() for v in value] if isinstance(value, list)
                                         else value.detach().clone())
    return out


class EpochEnds(pl.Callback):
    """Listed after the guard: the metric states, update counts and epoch aggregates seen at each epoch's end."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        # the user's own values: the guard's ng_* status joins the progress bar (and so callback_metrics) after an event
        seen = {f"callback:{k}": v.detach().clone() for k, v in trainer.callback_metrics.items()
                if not k.startswith("ng_")}
        self.epochs.append({**metric_record(pl_module), **seen})


@pytest.mark.parametrize("bad", [3, 7], ids=["mid_epoch", "last_batch_of_the_epoch"])
def test_metrics_and_epoch_aggregates_after_a_skipped_step_equal_in_both_modes(run, bad):
    """A NaN input at batch ``bad`` of every epoch (8 batches): the tensor states of the user's metrics (MeanMetric,
    SumMetric, MaxMetric, the accuracy), the CatMetric's list state, every update count and the epoch aggregates of
    ``self.log(on_epoch=True)`` that callbacks read at the epoch's end are, in lagged mode, those of the eager run,
    which skipped the batch on the host; the epoch's last batch, judged lagged after the epoch has ended, too."""
    x, y = (t.clone() for t in models.classification_data(n=256).tensors)
    x[bad * 32 + 5, 3] = NAN
    data = TensorDataset(x, y)
    out = {}
    for sync in MODES:
        probe = EpochEnds()
        r = run(sync, CatMetrics, data=models.loader(data), after=(probe,), steps=None, max_epochs=EPOCHS)
        assert [(e.epoch, e.batch_idx, e.kind) for e in r.guard.events] == [(ep, bad, "input") for ep in range(EPOCHS)]
        out[sync] = (r, probe)
    (a, pa), (b, pb) = out["eager"], out["lagged"]
    # the one documented difference (docs/performance.md): a step-level value the lagged step logged reaches
    # Lightning before its flags are read; here the epoch's last step's train_loss_step
    step_level = [] if bad < 7 else [".callback:train_loss_step"]
    for epoch in range(EPOCHS):
        assert differences(pa.epochs[epoch], pb.epochs[epoch]) == step_level, epoch
    first = pa.epochs[0]
    assert first["seen.sum_value"] == 7 * 32 and first["seen.update_count"] == 7  # the bad batch not counted
    assert sum(len(v) for v in first["losses.value"]) == 7 * 32 and first["losses.update_count"] == 7
    assert differences(metric_record(a.model), metric_record(b.model)) == []
    assert_same_runs({"eager": a, "lagged": b})


# ------------------------------------------------------------------------------------------ loss spikes


class SpikyLin(Lin):
    """Lin (fused SGD) whose loss spikes once, at batch ``at``: ``input``: the batch is scaled x1000 (loss and
    gradient explode, finite); ``offset``: 1000 is added to the loss value (the gradient is unchanged)."""

    def __init__(self, at: int, mode: str) -> None:
        super().__init__(optimizer="sgd", lr=0.05)
        self.at, self.mode = at, mode

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hit = batch_idx == self.at
        loss = nn.functional.mse_loss(self(x * 1000.0 if hit and self.mode == "input" else x), y)
        return loss + 1000.0 if hit and self.mode == "offset" else loss

    def configure_optimizers(self) -> Any:  # no weight decay or momentum: the offset spike changes nothing
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


SPIKE_AT = 30
SPIKES = {"check": {"spike_warmup": 20}}


@pytest.mark.parametrize("action, mode", [("warn", "offset"), ("skip_step", "input"), ("clip", "input"),
                                          ("reduce_lr", "offset")])
def test_each_spike_action_in_both_modes(both, fit, action, mode):
    """check.spike_action in both modes: the same spike event and counters. warn changes nothing (bitwise the run
    without a guard); skip_step and clip act on the spiking step itself in both modes (the lagged spike test runs on
    the device with the statistics read so far): bitwise alike; reduce_lr cuts the LR from the spiking step in
    eager mode and from the next one in lagged mode (docs/performance.md), the one difference between the runs."""
    kwargs = {"check": dict(SPIKES["check"], spike_action=action)}
    runs = both(lambda: SpikyLin(SPIKE_AT, mode), kwargs, steps=40, data=models.regression_data(n=1024))
    for sync, r in runs.items():
        (e,) = r.guard.events
        assert (e.step, e.kind, e.actions) == (SPIKE_AT, "spike", [action]), sync
        assert r.guard.counters["spikes"] == 1 and r.guard.counters["incidents"] == 0
        # the bad batch's samples: rerun on the weights after the update where it landed (judged late, not skipped)
        after = sync == "lagged" and action != "skip_step"
        assert e.details["samples"]["after_update"] is after, sync
        assert ("on the weights after its update" in e.suggestion) is after, sync
    if action == "warn":
        pl.seed_everything(0, verbose=False)
        plain = SpikyLin(SPIKE_AT, mode)
        fit(plain, models.regression_data(n=1024), [], subdir="plain", batch_size=16, steps=40)
        assert differences(module_state(plain), module_state(runs["lagged"].model)) == []
    if action == "skip_step":
        for r in runs.values():
            assert moved(r.steps.before[SPIKE_AT], r.steps.after[SPIKE_AT]) == []
    if action != "reduce_lr":
        assert_same_runs(runs)
        return
    lr = 0.05
    cut = lr * runs["eager"].guard.config.recovery.lr_factor
    assert [runs["eager"].steps.lrs[s] for s in (29, 30, 31)] == [[lr], [cut], [cut]]
    assert [runs["lagged"].steps.lrs[s] for s in (29, 30, 31)] == [[lr], [lr], [cut]]
    assert_same_runs(runs, weights=False)
    assert differences(runs["eager"].steps.after[29], runs["lagged"].steps.after[29]) == []


def test_three_spikes_cut_the_lr_whatever_the_action_in_both_modes(both):
    """Three warned spikes within recovery.incident_window steps cut the LR at the third, in both modes. (Pairs: the
    first of each is on weights healthy a step before, a bad batch's, not counted; the second is counted.)"""

    class ThreeSpikes(SpikyLin):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            pair = {30: 0, 31: 0, 34: 1, 35: 1, 38: 2, 39: 2}.get(batch_idx)  # each pair 100x the last
            return loss + 1000.0 * 100.0 ** pair if pair is not None else loss

    runs = both(lambda: ThreeSpikes(-1, "offset"), {"check": dict(SPIKES["check"], spike_action="warn")}, steps=40,
                data=models.regression_data(n=1024))
    for r in runs.values():
        assert [(e.step, e.actions) for e in r.guard.events] == [(s, ["warn"]) for s in (30, 31, 34, 35, 38)] + [
            (39, ["reduce_lr"])]
        assert r.guard.lr_scale == 0.5 and r.guard.counters["lr_cuts"] == 1
    assert_same_runs(runs, weights=False)


# --------------------------------------------------------------------------------------------- clipping


class Spiky(Lin):
    """Lin (fused SGD) whose loss, and so its gradient, is multiplied by 30 on the batches ``spikes``."""

    def __init__(self, spikes: tuple[int, ...] = (), bad: tuple[int, ...] = ()) -> None:
        super().__init__(bad=bad, optimizer="sgd", lr=0.05)
        self.spikes = set(spikes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 30.0 if batch_idx in self.spikes else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)


def test_adaptive_clipping_armed_by_an_incident_clips_alike_in_both_modes(both):
    """clip.adaptive on_incident: the NaN at step 2 arms it ("clip"), and the gradient spikes after its warm-up are
    clipped to the same limit in both modes (lagged: compared on the device with the limit from the statistics
    read so far): the same clipped steps, bitwise the same weights."""
    runs = both(lambda: Spiky(spikes=(12, 17, 22), bad=(2,)), {"clip": {"warmup_steps": 4}}, steps=26)
    for sync, r in runs.items():
        assert [(e.step, e.actions[:2]) for e in r.guard.events] == [(2, ["skip_step", "clip"])], sync
        assert r.guard.counters["clipped_steps"] >= 3
    assert_same_runs(runs)


def test_fixed_and_adaptive_limits_together_clip_alike_in_both_modes(both):
    clip = {"max_norm": 9.0, "adaptive": "always", "warmup_steps": 4, "z_threshold": 1.0, "ema_alpha": 0.8}
    runs = both(lambda: Spiky(spikes=(12, 17, 22)), {"clip": clip}, steps=30)
    assert runs["eager"].guard.events == [] and runs["eager"].guard.counters["clipped_steps"] > 3
    assert_same_runs(runs)


@pytest.mark.parametrize("every", [20, 50])
def test_persistent_adaptive_clipping_rolls_back_in_both_modes(both, every):
    """Past the SGD stability edge adaptive clipping acts on every step: after 10 in a row (step 19) the run rolls
    back to the fit-start snapshot and the LR is cut (a spike event). Eager skips step 19. Lagged clipped it on the
    device and applied it (no skip_step action), and the rollback undoes it: with snapshot_every 20 a snapshot falls
    due at the end of step 19, so step 19 is read there and rolled back at once, bitwise as eager (one skipped step
    fewer counted); with 50 it is read while step 20 runs, which is skipped instead."""
    kwargs = {"clip": {"adaptive": "always", "warmup_steps": 10}, "check": {"spike_action": "off", "divergence": "off"},
              "recovery": {"snapshot_every": every}}
    runs = both(lambda: Lin(optimizer="sgd", lr=1.5), kwargs, steps=28)
    eager, lagged = (records(runs[s].guard) for s in MODES)
    assert [(e["step"], e["kind"], e["actions"]) for e in eager] == [
        (19, "spike", ["clip", "skip_step", "rollback", "reduce_lr"])]
    assert [(e["step"], e["kind"], e["actions"]) for e in lagged] == [(19, "spike", ["clip", "rollback", "reduce_lr"])]
    assert dict(eager[0], actions=None) == dict(lagged[0], actions=None)
    assert eager[0]["details"]["restored_step"] == 0 and eager[0]["cause"] == "exploding_gradient"
    a, b = runs["eager"], runs["lagged"]
    assert a.guard.lr_scale == b.guard.lr_scale == 0.5
    assert moved(a.steps.before[0], a.steps.after[19]) == []  # eager: the snapshot, at the end of the skipped step
    if every == 20:
        assert moved(b.steps.before[0], b.steps.after[19]) == []
        assert b.guard.counters == dict(a.guard.counters, skipped_steps=0)
        assert differences(final_state(a), final_state(b)) == []
    else:
        assert moved(b.steps.before[19], b.steps.after[19]) == [".module", ".moments"]  # applied
        assert moved(b.steps.before[0], b.steps.after[20]) == []  # rolled back; the step under way skipped
        assert b.guard.counters == a.guard.counters
    assert models.all_finite(b.model)


# ------------------------------------------------------------------------------------------- divergence


@pytest.mark.parametrize("mode", ["act", "warn"])
def test_a_divergence_in_both_modes(both, fit, mode):
    """The demo's too-high LR (fused SGD at lr=1.5): the loss runs away from the first step, a divergence at step 4
    in both modes, diagnosed alike. act: eager skips step 4, rolls back to fit start and cuts the LR at its end;
    lagged reads step 4 while step 5 runs: step 4 was applied (no skip_step), the same rollback and cut undo it and
    step 5 is skipped, so the same counters. warn: the event only, both runs bitwise the run without a guard."""
    runs = both(lambda: Lin(optimizer="sgd-plain", lr=1.5), {"check": {"divergence": mode}}, steps=16)
    eager, lagged = (records(runs[s].guard) for s in MODES)
    assert [(e["step"], e["kind"], e["cause"]) for e in eager] == [(4, "divergence", "learning_rate")]
    a, b = runs["eager"], runs["lagged"]
    assert a.guard.counters == b.guard.counters and a.guard.lr_scale == b.guard.lr_scale
    if mode == "warn":
        assert eager == lagged and eager[0]["actions"] == ["warn"] and a.guard.lr_scale == 1.0
        pl.seed_everything(0, verbose=False)
        plain = Lin(optimizer="sgd-plain", lr=1.5)
        fit(plain, models.regression_data(n=512), [], subdir="plain", batch_size=16, steps=16)
        for r in runs.values():
            assert differences(module_state(plain), module_state(r.model)) == []
        return
    assert eager[0]["actions"] == ["skip_step", "clip", "rollback", "reduce_lr"]
    assert lagged[0]["actions"] == ["clip", "rollback", "reduce_lr"]
    assert dict(eager[0], actions=None) == dict(lagged[0], actions=None)
    assert eager[0]["details"]["restored_step"] == 0 and a.guard.lr_scale < 0.1
    assert moved(a.steps.before[0], a.steps.after[4]) == []
    assert moved(b.steps.before[4], b.steps.after[4]) == [".module"]  # applied (plain SGD: no moments): read late
    assert moved(b.steps.before[0], b.steps.after[5]) == []  # rolled back, the step under way skipped
    assert [a.steps.lrs[5], b.steps.lrs[6]] == [[1.5 * a.guard.lr_scale]] * 2  # the first update after the rollback
    assert models.all_finite(b.model)


# ------------------------------------------------------------------ rollback, skip_batches, give-up


def test_a_rollback_restores_weights_moments_and_schedulers_alike_in_both_modes(both):
    """A NaN burst right after a snapshot (no update applied since): the lagged rollback, read one step late, keeps
    the step under way, whose gradients were taken on the restored weights: bitwise the eager run, AdamW's moments
    and step counts included."""
    runs = both(lambda: Lin(bad=(10, 11, 12, 13)), {"recovery": {"snapshot_every": 5, "max_skips": 3}}, steps=20)
    for sync, r in runs.items():
        e = r.guard.events[-1]
        assert (e.step, e.actions, e.details["restored_step"]) == (13, ["skip_step", "rollback", "reduce_lr"], 10)
        assert moved(r.steps.after[9], r.steps.before[14]) == [], sync
    assert_same_runs(runs)


@pytest.mark.parametrize("first_bad", [10, 12], ids=["right_after_the_snapshot", "after_applied_steps"])
def test_skip_batches_after_a_rollback_in_both_modes(both, first_bad):
    """recovery.skip_batches: 2: the two batches after the rollback's batch are skipped too (no update), in both
    modes. A lagged rollback after applied steps comes while the next batch runs: that batch, skipped anyway as the
    step under way, is the first of the two; so both modes skip the same batches and stay bitwise alike."""
    bad = tuple(range(first_bad, first_bad + 4))
    kwargs = {"recovery": {"snapshot_every": 5, "max_skips": 3, "skip_batches": 2}}
    runs = both(lambda: Lin(bad=bad), kwargs, steps=24)
    skipped = [bad[-1] + 1, bad[-1] + 2]
    for sync, r in runs.items():
        e = r.guard.events[-1]
        assert (e.step, e.actions) == (bad[-1], ["skip_step", "rollback", "skip_batches", "reduce_lr"])
        assert e.details["skip_batches"] == 2 and e.details["restored_step"] == 10
        for step in skipped:  # each ends on the snapshot's weights (taken at the end of step 9)
            assert moved(r.steps.after[9], r.steps.after[step]) == [], (sync, step)
        assert moved(r.steps.before[skipped[-1] + 1], r.steps.after[skipped[-1] + 1]) == [".module", ".moments"]
        assert r.guard.counters["skipped_steps"] == len(bad) + 2
    assert_same_runs(runs)


@pytest.mark.parametrize("on_give_up", ["stop", "raise"])
def test_a_give_up_restores_the_last_good_state_in_both_modes(run, on_give_up):
    """Every step from 10 on is bad: after max_rollbacks rollbacks that did not help, the guard gives up in both
    modes with the same events, restoring the step-10 snapshot (weights and moments, bitwise); it stops the
    Trainer (lagged: the step under way is skipped too) or raises NaNGuardError with the same message."""
    from lightning_nanguard import NaNGuardError

    kwargs = {"recovery": {"snapshot_every": 5, "max_skips": 2, "max_rollbacks": 1, "on_give_up": on_give_up}}
    out: dict[str, Any] = {}
    for sync in MODES:
        if on_give_up == "raise":
            with pytest.raises(NaNGuardError, match="gave up at step") as info:
                run(sync, lambda: Lin(bad=tuple(range(10, 40))), kwargs, steps=30)
            out[sync] = str(info.value).split("Report:")[0]
            continue
        r = run(sync, lambda: Lin(bad=tuple(range(10, 40))), kwargs, steps=30)
        assert r.guard.stopped and r.guard.events[-1].actions[-1] == "stop"
        assert r.guard.events[-1].details["restored_step"] == 10
        assert moved(r.steps.after[9], final_state(r)) == [], sync
        assert r.trainer.global_step < 30  # stopped early
        out[sync] = r
    if on_give_up == "raise":
        assert out["eager"] == out["lagged"] and "step 10" in out["eager"]
        return
    a, b = out["eager"], out["lagged"]
    assert records(a.guard) == records(b.guard) and a.guard.lr_scale == b.guard.lr_scale
    assert b.guard.counters == dict(a.guard.counters, skipped_steps=a.guard.counters["skipped_steps"] + 1)
    assert differences(final_state(a), final_state(b)) == []


def test_lagged_with_an_optimizer_that_cannot_skip_applies_the_bad_step_and_rolls_it_back(run):
    """check.sync: lagged with a non-fused AdamW: the NaN step 12 is applied (NaN weights and moments), read while
    step 13 runs, and undone by a rollback to the step-10 snapshot; step 13 is skipped. At the end of step 13 the
    weights, moments and step counts are bitwise the snapshot's. The eager run just skips step 12."""
    kwargs = {"recovery": {"snapshot_every": 5}}
    eager = run("eager", lambda: Lin(bad=(12,), optimizer="adamw-foreach"), kwargs, steps=20)
    lagged = run("lagged", lambda: Lin(bad=(12,), optimizer="adamw-foreach"), kwargs, steps=20)
    assert [(e.step, e.kind, e.actions) for e in eager.guard.events] == [(12, "loss", ["skip_step", "clip"])]
    (e,) = lagged.guard.events
    assert (e.step, e.kind, e.actions, e.details["restored_step"]) == (12, "loss", ["clip", "rollback"], 10)
    after12 = lagged.steps.after[12]["module"]
    assert not all(bool(torch.isfinite(v).all()) for v in after12.values())  # the bad step was applied
    assert moved(lagged.steps.after[9], lagged.steps.after[13]) == []  # undone, and step 13 skipped
    assert moved(lagged.steps.after[13], lagged.steps.after[14]) == [".module", ".moments"]
    assert lagged.guard.counters["rollbacks"] == 1 and lagged.guard.counters["skipped_steps"] == 1
    assert eager.guard.counters["rollbacks"] == 0 and eager.guard.counters["skipped_steps"] == 1
    assert models.all_finite(lagged.model)


# ------------------------------------------------------------------------ a replay at the step's own number


class NaNAtGlobalStep(Lin):
    """Lin whose loss is multiplied by NaN at the optimizer steps ``bad`` (by ``self.global_step``, as a
    curriculum or a schedule inside ``training_step`` would read it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = models.Regression.training_step(self, batch, batch_idx)
        return loss * NAN if self.global_step in self.bad else loss


def test_a_lagged_replay_of_a_step_dependent_training_step_names_what_eager_names(both):
    """A lagged incident is replayed while the next step runs; the replay runs at the judged step's number, so a
    training_step that reads self.global_step reproduces its NaN, and the lagged event names the culprit and op
    eager names (it was not reproduced, and lost them, when the replay saw the next step's number)."""
    runs = both(lambda: NaNAtGlobalStep(bad=(12,)), steps=16)
    eager, lagged = (runs[s].guard.events for s in MODES)
    assert [(e.step, e.culprit, e.op) for e in eager] == [(12, "training_step", "MulBackward0")]
    assert records(runs["eager"].guard) == records(runs["lagged"].guard)
