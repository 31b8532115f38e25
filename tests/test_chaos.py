"""Chaos suite: NaN/+Inf/-Inf injected into every kind of tensor, at several rates and in bursts.

A small classifier (tests/models.py ``Classifier``: Linear-BatchNorm-ReLU-Dropout-Linear, AdamW and a cosine
schedule) is trained for 256 steps on a noisy 4-class problem (the validation loss plateaus well above 0, so
"within 10%" is a real tolerance). Every faulty run is compared with the clean run of the same seed; the
injector draws its faults from its own seeded RNG, so guarded and unguarded runs see the same faults.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.testing import FAULT_KINDS, Fault, FaultInjector
from . import models

STEPS_PER_EPOCH, EPOCHS = 32, 8  # 256 optimizer steps
# Transient faults are not a too-high learning rate: the defaults' LR cuts (after every rollback and after
# two incidents in 100 steps) would only slow this run down, and a rollback to a snapshot 50 steps old costs
# more than a snapshot every 10 steps. This is the profile the README recommends for such runs.
NO_LR_CUTS = {"recovery": {"reduce_lr_after": 0, "reduce_lr_on_rollback": False}}
SEED = 3  # draws 2, 14 and 23 faults in 256 steps at 1%, 5% and 10% (the nominal 2.6, 12.8, 25.6)


def _data() -> tuple[TensorDataset, TensorDataset]:
    full = models.classification_data(n=1536, seed=0)
    g = torch.Generator().manual_seed(5)
    x = full.tensors[0] + 2.5 * torch.randn(full.tensors[0].shape, generator=g)  # overlapping classes
    y = full.tensors[1]
    return TensorDataset(x[:1024], y[:1024]), TensorDataset(x[1024:], y[1024:])


TRAIN, VAL = _data()


def val_loss(model: nn.Module) -> float:
    model.eval()
    x, y = VAL.tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def fit(tmp_path, callbacks, model=None, **trainer_kwargs):
    """Seed 0, then train ``model`` (default: the cosine Classifier) on TRAIN for EPOCHS, under ``tmp_path``
    (a plain function, not the ``fit`` fixture: the module-scoped clean run uses it too)."""
    pl.seed_everything(0, verbose=False)
    model = model or models.Classifier(scheduler="cosine")
    kwargs = dict(max_epochs=EPOCHS)
    kwargs.update(trainer_kwargs)
    trainer = models.trainer(tmp_path, callbacks, **kwargs)
    trainer.fit(model, models.loader(TRAIN, batch_size=32, shuffle=True))
    return model, trainer


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    model, trainer = fit(tmp_path_factory.mktemp("clean"), [])
    assert trainer.global_step == STEPS_PER_EPOCH * EPOCHS
    return val_loss(model)


def assert_recovered(model, trainer, guard, clean_loss, steps=STEPS_PER_EPOCH * EPOCHS, tol=0.10):
    assert trainer.global_step == steps and not trainer.should_stop  # finished, did not give up
    assert not any(a in ("stop", "raise") for e in guard.events for a in e.actions)
    assert models.all_finite(model)
    loss = val_loss(model)
    assert abs(loss - clean_loss) <= tol * clean_loss, (loss, clean_loss)
    return loss


def detected(injection, guard) -> bool:
    """A fault is caught at its own step, or (parameters, optimizer state) at the next one."""
    steps = {e.step for e in guard.events}
    return injection.step in steps or injection.step + 1 in steps


# ------------------------------------------------------------------------------------------- fault rates


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.01, 0.05, 0.10])
def test_random_faults_of_every_kind(tmp_path, clean, rate):
    guard = NaNGuard()  # the defaults: LR cuts only on evidence of divergence, so isolated faults cost nothing
    injector = FaultInjector.at_rate(rate, seed=SEED)
    model, trainer = fit(tmp_path / "guarded", [injector, guard])
    loss = assert_recovered(model, trainer, guard, clean)
    applied = [i for i in injector.log if i.applied]
    assert len(applied) >= max(1, int(0.5 * rate * trainer.global_step))
    if rate >= 0.05:
        assert set(Counter(i.kind for i in applied)) == set(FAULT_KINDS)
        # isolated rollbacks are confirmed by a snapshot recovery.confirm_after healthy steps later, so they
        # do not add up to a give-up that restores the step-0 weights (what this suite found)
        restored = [e.details["restored_step"] for e in guard.events if "rollback" in e.actions]
        assert len(restored) >= 2 and max(restored) > 0
    # every fault that makes anything non-finite is caught; +Inf in exp_avg_sq only freezes an element
    # (sqrt(inf) in the denominator gives a zero update), which is not a NaN/Inf the guard can see
    silent = [i for i in applied if i.kind == "optimizer_state" and i.value == "inf"]
    missed = [i for i in applied if i not in silent and not detected(i, guard)]
    assert not missed, missed

    # the same faults without the guard destroy the run
    unguarded = FaultInjector.at_rate(rate, seed=SEED)
    bare, _ = fit(tmp_path / "unguarded", [unguarded])
    assert [i.to_dict() for i in unguarded.log][:3] == [i.to_dict() for i in injector.log][:3]
    assert not models.all_finite(bare) and not math.isfinite(val_loss(bare))
    print(f"\nchaos rate={rate:.0%}: clean={clean:.4f} guarded={loss:.4f} ({loss / clean:.3f}x) "
          f"unguarded={val_loss(bare)} faults={dict(Counter(i.kind for i in applied))} "
          f"incidents={guard.counters['incidents']} rollbacks={guard.counters['rollbacks']}")


# ------------------------------------------------------------------------------------------------ bursts


def test_burst_of_five_poisoned_steps(tmp_path, clean):
    """Faults that come back on the replay (a poisoned batch, a poisoned module output): a one-off loss or gradient
    fault is a transient, which never forces a rollback (tests/test_transient.py)."""
    burst = list(range(100, 105))
    injector = FaultInjector(Fault(("input", "activation"), steps=burst, value=("nan", "inf", "-inf")), seed=1)
    guard = NaNGuard()
    model, trainer = fit(tmp_path, [injector, guard])
    assert_recovered(model, trainer, guard, clean)
    assert [e.step for e in guard.events] == burst and "transient" not in [e.cause for e in guard.events]
    # max_skips skipped steps, then a rollback to the newest snapshot (the last one of the healthy run: every
    # snapshot_every steps), then plain skips
    recovery = guard.config.recovery
    assert ["rollback" in e.actions for e in guard.events] == [i == recovery.max_skips for i in range(len(burst))]
    newest = burst[0] // recovery.snapshot_every * recovery.snapshot_every
    assert guard.events[recovery.max_skips].details["restored_step"] == newest


def test_fault_in_the_very_first_step(tmp_path, clean):
    """Step 0: only the snapshot taken at train start exists. A loss fault is skipped; a parameter fault
    after the first update rolls back to the initial weights."""
    injector = FaultInjector([Fault("loss", steps=[0]), Fault("parameter", steps=[0], value="-inf")], seed=0)
    guard = NaNGuard()
    model, trainer = fit(tmp_path, [injector, guard])
    assert_recovered(model, trainer, guard, clean)
    assert [e.step for e in guard.events] == [0, 1]
    assert guard.events[0].kind == "loss" and guard.events[0].actions[0] == "skip_step"
    assert guard.events[1].kind == "parameter" and "rollback" in guard.events[1].actions
    assert guard.events[1].details["restored_step"] == 0


def test_fault_in_the_first_step_with_bad_input(tmp_path, clean):
    injector = FaultInjector(Fault("input", steps=[0], value="inf"), seed=0)
    guard = NaNGuard()
    model, trainer = fit(tmp_path, [injector, guard])
    assert_recovered(model, trainer, guard, clean)
    assert [(e.step, e.kind, e.cause) for e in guard.events] == [(0, "input", "input")]
    assert guard.events[0].details["inputs"][0]["samples"] == [injector.log[0].index[0]]
    assert torch.isfinite(TRAIN.tensors[0]).all()  # the poisoned element was written back


def test_fault_during_a_rollbacks_recovery_window(tmp_path, clean):
    """A rollback after max_skips skipped steps, then another burst before that rollback was confirmed: the
    snapshot itself is suspect, so the guard goes one snapshot further back. Bad parameters right after that
    are a one-off: back to the same snapshot, not further (it was fine). It still recovers.
    (NO_LR_CUTS: this test is about the rollback path, not the LR. The bursts poison a module output, which the
    replay reproduces: a one-off loss fault is a transient and never forces a rollback.)"""
    guard = NaNGuard(**NO_LR_CUTS)
    recovery = guard.config.recovery
    every, n = recovery.snapshot_every, recovery.max_skips + 1  # n incidents in a row force a rollback
    first = range(5 * every, 5 * every + n)
    second = range(first[-1] + 3, first[-1] + 3 + n)  # fewer than confirm_after healthy steps in between
    bad_param = second[-1] + 2
    assert second[0] - first[-1] - 1 < recovery.confirm_after
    injector = FaultInjector([Fault("activation", steps=first), Fault("activation", steps=second),
                              Fault("parameter", steps=[bad_param])], seed=0)
    model, trainer = fit(tmp_path, [injector, guard])
    assert_recovered(model, trainer, guard, clean)
    rollbacks = [(e.step, e.details["restored_step"]) for e in guard.events if "rollback" in e.actions]
    newest = first[0]  # a multiple of snapshot_every: the newest snapshot when the first burst starts
    assert rollbacks == [(first[-1], newest), (second[-1], newest - every), (bad_param + 1, newest - every)]
    assert guard.state_dict()["recovery"]["ladder"]["failed_rollbacks"] == 0  # confirmed later by a new snapshot


class WithValidation(models.Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))


class RecordVal(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val_loss"]))


@pytest.mark.parametrize("kind", ["parameter", "loss", "input"])
def test_fault_in_the_last_step_of_an_epoch(make_trainer, clean, kind):
    """The epoch's validation must not run on weights poisoned by its last step: they are checked (one
    host read per validation) and rolled back before it starts."""
    last = [STEPS_PER_EPOCH * e - 1 for e in (1, 2, 3)]
    injector = FaultInjector(Fault(kind, steps=last), seed=0)
    guard, record = NaNGuard(**NO_LR_CUTS), RecordVal()
    model = WithValidation(scheduler="cosine")
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer([injector, guard, record], max_epochs=EPOCHS, num_sanity_val_steps=0)
    trainer.fit(model, models.loader(TRAIN, shuffle=True), models.loader(VAL, batch_size=256))
    assert_recovered(model, trainer, guard, clean)
    assert len(record.losses) == EPOCHS and all(math.isfinite(v) for v in record.losses), record.losses
    if kind == "parameter":  # found at validation start, after the step counter moved on
        assert [e.step for e in guard.events] == [s + 1 for s in last]
        assert all(e.details["detected_at"] == "validation_start" and "rollback" in e.actions
                   for e in guard.events)
    else:
        assert [e.step for e in guard.events] == last
        assert all(e.batch_idx == STEPS_PER_EPOCH - 1 for e in guard.events)


def test_faults_with_gradient_accumulation(tmp_path, clean):
    """4 micro-batches per step (64 steps); faults in different micro-batches of steps 10, 20, 30, 40."""
    faults = [Fault("input", steps=[10], micro_batch=1), Fault("loss", steps=[20], micro_batch=3),
              Fault("activation", steps=[30], micro_batch=2, value="-inf"),
              Fault("gradient", steps=[40], micro_batch=0, value="inf")]
    injector = FaultInjector(faults, seed=0)
    guard = NaNGuard(**NO_LR_CUTS)
    steps = STEPS_PER_EPOCH * EPOCHS // 4
    clean_model, _ = fit(tmp_path / "clean", [], accumulate_grad_batches=4)
    model, trainer = fit(tmp_path / "faulty", [injector, guard], accumulate_grad_batches=4)
    assert_recovered(model, trainer, guard, val_loss(clean_model), steps=steps)
    assert all(i.applied for i in injector.log)
    assert [i.micro_batch for i in injector.log] == [1, 3, 2, 0]
    assert [e.step for e in guard.events] == [10, 20, 30, 40]
    assert guard.events[0].kind == "input" and guard.events[0].details["inputs"][0]["micro_batch"] == 1
    assert guard.counters["rollbacks"] == 0  # a poisoned micro-batch costs one skipped step, nothing more


# ------------------------------------------------------------------------------------ the injector itself


def test_injector_is_reproducible_and_never_touches_the_global_rng(tmp_path):
    a, b, c = (FaultInjector.at_rate(0.1, seed=s) for s in (0, 0, 1))
    state = torch.get_rng_state()
    plans = [a.fires_at(s) for s in range(500)]
    assert torch.equal(state, torch.get_rng_state())
    assert plans == [b.fires_at(s) for s in range(500)] != [c.fires_at(s) for s in range(500)]
    assert 30 <= sum(map(len, plans)) <= 70  # ~10% of 500 steps
    assert a.fires_at(123) == plans[123]  # a pure function of (seed, step), whatever was asked before

    # a run whose injector draws at every step but can apply nothing is bitwise the clean run
    clean_model, _ = fit(tmp_path / "clean", [], max_epochs=1)
    idle = FaultInjector([Fault("gradient", rate=1.0, target="no.such.parameter"),
                          Fault("optimizer_state", steps=[0])], seed=0)
    model, trainer = fit(tmp_path / "idle", [idle], max_epochs=1)
    assert len(idle.log) == STEPS_PER_EPOCH + 1 and not any(i.applied for i in idle.log)
    notes = {i.kind: i.note for i in idle.log}
    assert notes == {"gradient": "no parameter with a gradient for 'no.such.parameter'",
                     "optimizer_state": "optimizer has no 'exp_avg_sq' state yet"}
    for k, v in clean_model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_input_fault_writes_back_a_dataset_that_hands_out_views(make_trainer):
    x, y = (t.clone() for t in TRAIN.tensors)
    original = x.clone()
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]  # views into x, no collate copy

    class Views:  # a plain iterable of batches (a list would be read as several dataloaders)
        def __iter__(self):
            return iter(batches)

        def __len__(self):
            return len(batches)
    class Probe(pl.Callback):
        poisoned_steps = []

        def on_before_backward(self, trainer, pl_module, loss):
            if not torch.isfinite(x).all():
                self.poisoned_steps.append(trainer.global_step)

    injector = FaultInjector(Fault("input", steps=[3], value="-inf"), seed=0)
    guard = NaNGuard(logging={"verbose": False})
    pl.seed_everything(0, verbose=False)
    make_trainer([injector, guard, Probe()], max_epochs=1).fit(models.Classifier(), Views())
    assert Probe.poisoned_steps == [3]  # the poison really went through the view into x...
    assert [(e.step, e.kind) for e in guard.events] == [(3, "input")]  # ...the guard saw it...
    assert torch.equal(x, original)  # ...and the data are intact afterwards


def test_fault_arguments_are_validated():
    with pytest.raises(ValueError, match="Fault.kind"):
        Fault("weights")
    with pytest.raises(ValueError, match="Fault.value"):
        Fault("loss", value="zero")
    with pytest.raises(ValueError, match="Fault.rate"):
        Fault("loss", rate=1.5)
    with pytest.raises(ValueError, match="Fault.steps"):
        Fault("loss", steps=[-1])
