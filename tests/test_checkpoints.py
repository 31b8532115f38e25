"""Checkpoints: no checkpoint written during a guarded run holds a non-finite tensor; a run resumed from a
checkpoint keeps the guard's own state (counters, ladder, LR scale, statistics, event numbering)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.recover.checkpoint import iter_checkpoint_tensors
from lightning_nanguard.detect.spikes import SpikeDetector
from lightning_nanguard.recover.clipping import ZClip
from lightning_nanguard.testing import Fault, FaultInjector
from . import models


def sparse_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 5, (n,), generator=g)  # rows 5..9 are never used
    return DataLoader(TensorDataset(idx, torch.randn(n, generator=g)), batch_size=8)


def nonfinite_in(path) -> list[str]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["state_dict"] and ckpt["optimizer_states"]
    return [name for name, t in iter_checkpoint_tensors(ckpt)
            if t.is_floating_point() and not torch.isfinite(t).all()]


@pytest.fixture
def fit_with_checkpoints(tmp_path, fit):
    """``fit_with_checkpoints(callbacks, model, subdir, max_steps=6)``: a checkpoint after every step, in
    ``tmp_path / subdir / "ckpts"``."""

    def run(callbacks: list, model: pl.LightningModule, subdir: str, max_steps: int = 6) -> pl.Trainer:
        ckpt = ModelCheckpoint(dirpath=tmp_path / subdir / "ckpts", every_n_train_steps=1, save_top_k=-1,
                               filename="{step}")
        return fit(model, sparse_data(), callbacks + [ckpt], subdir=subdir, max_steps=max_steps,
                   enable_checkpointing=True)

    return run


def test_no_checkpoint_holds_nonfinite_weights_or_optimizer_state(tmp_path, fit_with_checkpoints):
    model = models.EpsZeroEmbedding(rows=10)
    control = copy.deepcopy(model)
    # control: without the guard, the checkpoints are poisoned
    fit_with_checkpoints([], control, "plain")
    assert any(nonfinite_in(p) for p in (tmp_path / "plain" / "ckpts").glob("*.ckpt"))
    guard = NaNGuard()
    trainer = fit_with_checkpoints([guard], model, "guarded")
    files = sorted((tmp_path / "guarded" / "ckpts").glob("*.ckpt"))
    assert files and all(nonfinite_in(p) == [] for p in files)
    at_save = [e for e in guard.events if e.details.get("detected_at") == "checkpoint"]
    assert at_save and at_save[0].kind == "parameter" and at_save[0].cause == "optimizer"  # eps=0: Adam's fault
    assert at_save[0].culprit == "emb.weight" and "rollback" in at_save[0].actions
    assert trainer.should_stop  # nothing helps eps=0: the ladder gives up, weights restored
    assert all(torch.isfinite(p).all() for p in model.parameters())


class PoisonAdamState(pl.Callback):
    """Before NaNGuard: an Adam second moment becomes inf at one step. The update it produces is 0, so the
    weights stay finite and only the optimizer state (and every checkpoint of it) is poisoned."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            p = optimizer.param_groups[0]["params"][0]
            optimizer.state[p]["exp_avg_sq"].view(-1)[0] = float("inf")


@pytest.mark.parametrize("every, found_at", [(50, "checkpoint"), (1, "snapshot")])
def test_nonfinite_optimizer_state_never_reaches_a_checkpoint(tmp_path, fit, every, found_at):
    model = models.Regression(lr=0.01, optimizer="adamw")
    guard = NaNGuard(recovery={"snapshot_every": every})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    bad, steps = 3, 6
    trainer = fit(model, models.regression_data(n=64), [PoisonAdamState(bad), guard, ckpt], batch_size=8,
                  max_steps=steps, enable_checkpointing=True)
    files = sorted((tmp_path / "ckpts").glob("*.ckpt"))
    assert len(files) == steps and all(nonfinite_in(p) == [] for p in files)
    # seen after the step that used the poisoned state, when global_step has moved on
    assert [(e.step, e.details.get("detected_at")) for e in guard.events] == [(bad + 1, found_at)]
    assert all(torch.isfinite(v).all() for s in trainer.optimizers[0].state.values() for v in s.values())


class FirstStep(pl.Callback):
    """The step and learning rates of the first optimizer step of a fit."""

    def __init__(self) -> None:
        self.seen = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.seen is None:
            self.seen = (trainer.global_step, [g["lr"] for g in optimizer.param_groups])


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_from_last_ckpt_continues_numbering_and_starts_at_the_cut_lr(tmp_path, fit):
    lr, steps_per_epoch = 0.02, 10
    model = models.NaNLossOnBatches(bad={2, 5})
    guard = NaNGuard(recovery={"reduce_lr_after": 2})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    data = models.loader(models.regression_data(n=8 * steps_per_epoch), batch_size=8)
    fit(model, data, [guard, ckpt], subdir="run1", max_epochs=1, enable_checkpointing=True)
    assert [e.index for e in guard.events] == [1, 2] and guard.lr_scale == 0.5

    resumed_model = models.NaNLossOnBatches(bad={7})  # epoch 2: batch 7
    guard2, first = NaNGuard(recovery={"reduce_lr_after": 2}), FirstStep()
    fit(resumed_model, data, [guard2, first], subdir="run2", max_epochs=2,
        ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    # the second fit's first optimizer step runs at the LR the guard had cut to
    assert first.seen == (steps_per_epoch, [pytest.approx(lr * 0.5)])
    bad_step = steps_per_epoch + 7
    assert [(e.index, e.step) for e in guard2.events] == [(3, bad_step)]  # numbering continues
    assert guard2.counters["incidents"] == 3 and guard2.counters["skipped_steps"] == 3
    # one incident in the window since the cut (which cleared the count): no further cut
    assert guard2.counters["lr_cuts"] == 1 and guard2.lr_scale == 0.5
    lines = [json.loads(x) for x in (tmp_path / "run2" / "nanguard" / "events.jsonl").read_text().splitlines()]
    assert [e["index"] for e in lines] == [3]
    assert (tmp_path / "run2" / "nanguard" / f"incident-0003-step{bad_step}.txt").exists()
    # a later, fresh fit with the same guard starts from a clean state
    fit(models.Regression(lr=0.01), data, [guard2], subdir="run3", max_epochs=1)
    assert guard2.counters["incidents"] == 0 and guard2.lr_scale == 1.0



@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_two_named_guards_keep_their_own_state_through_a_checkpoint(tmp_path, fit):
    """Named guards have distinct ``state_key``s: both states reach the checkpoint and each is restored to its
    own guard on resume."""
    steps_per_epoch = 10

    def guards():  # same incidents, different state: only "b" cuts the LR at the first one
        return (NaNGuard(name="a", logging={"verbose": False}),
                NaNGuard(name="b", logging={"verbose": False}, recovery={"reduce_lr_after": 1}))

    a, b = guards()
    assert a.state_key != b.state_key
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    data = models.loader(models.regression_data(n=8 * steps_per_epoch), batch_size=8)
    fit(models.NaNLossOnBatches(bad={2}), data, [a, b, ckpt], subdir="run1", max_epochs=1, enable_checkpointing=True)
    assert (a.lr_scale, b.lr_scale) == (1.0, 0.5) and a.counters["incidents"] == b.counters["incidents"] == 1
    saved = torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=False)["callbacks"]
    assert {a.state_key, b.state_key} <= set(saved)
    assert [saved[g.state_key]["recovery"]["lr_scale"] for g in (a, b)] == [1.0, 0.5]

    a2, b2 = guards()
    fit(models.NaNLossOnBatches(bad={4}), data, [a2, b2], subdir="run2", max_epochs=2,
        ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    assert [e.index for e in a2.events] == [e.index for e in b2.events] == [2]  # numbering continues, each
    assert a2.counters["lr_cuts"] == 0 and a2.lr_scale == 1.0
    assert b2.counters["lr_cuts"] == 2 and b2.lr_scale == 0.25  # its own cut, then one more

# -------------------------------------------------------------- non-finite weights found at checkpoint time


def _embedding_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (256,), generator=g)  # rows 32..63 are never used
    return TensorDataset(idx, torch.randn(256, generator=g))


def test_adam_eps0_parameter_incident_and_no_nan_checkpoint(tmp_path, fit):
    guard = NaNGuard()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    model = models.EpsZeroEmbedding(rows=64, dim=8)  # rows 32..63 are never used
    fit(model, _embedding_data(), [guard, ckpt], enable_checkpointing=True, max_epochs=2)
    assert guard.events, "the NaN weights went unnoticed"
    first = guard.events[0]
    assert first.kind == "parameter" and "rollback" in first.actions
    assert first.cause == "optimizer"
    assert first.culprit == "emb.weight"
    assert guard.events[-1].actions[-1] == "stop"  # rollback cannot fix eps=0: it gives up, boundedly
    assert len(guard.events) <= guard.config.recovery.max_rollbacks + 1
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert files
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=False)
        for k, v in state["state_dict"].items():
            assert torch.isfinite(v).all(), (f.name, k)
        for opt_state in state["optimizer_states"]:
            for s in opt_state["state"].values():
                for name, v in s.items():
                    assert torch.isfinite(torch.as_tensor(v)).all(), (f.name, name)
    assert models.all_finite(model)


# --------------------------------------------------------------------------------------------------- resume


DATA = models.classification_data(n=512)


class Probe(pl.Callback):
    """Listed after the guard: what the guard holds when training (re)starts."""

    def __init__(self, guard):
        self.guard, self.at_start, self.first_step = guard, None, None

    def on_train_start(self, trainer, pl_module):
        g = self.guard
        self.at_start = (dict(g.counters), g.lr_scale, g.state_dict()["recorder"]["index"], trainer.global_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.first_step is None:  # the LR the first step of this fit really uses
            self.first_step = (trainer.global_step, [grp["lr"] for grp in optimizer.param_groups])


def test_resume_mid_run_keeps_counters_ladder_state_and_lr_scale(tmp_path, fit):
    root = tmp_path / "run"
    # first run: two incidents in a row cut the LR (reduce_lr_after=2), bad parameters roll back. (Poisoned module
    # outputs, which the replay reproduces: a one-off loss or gradient fault is a transient, outside the window.)
    first = NaNGuard(logging={"verbose": False}, recovery={"reduce_lr_after": 2})
    faults = [Fault("activation", steps=[10]), Fault("activation", steps=[11]), Fault("parameter", steps=[30])]
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=40, save_top_k=-1)
    pl.seed_everything(0, verbose=False)
    fit(models.Classifier(), DATA, [FaultInjector(faults), first, ckpt], subdir="run", shuffle=True, steps=45,
        enable_checkpointing=True)
    assert [e.step for e in first.events] == models.detected_steps(faults)
    assert first.lr_scale == 0.5 and first.counters["rollbacks"] == 1
    saved = (dict(first.counters), first.lr_scale, first.state_dict()["recorder"]["index"])
    path = tmp_path / "ckpt" / f"epoch={40 // (len(DATA) // 32)}-step=40.ckpt"
    assert path.exists(), sorted(os.listdir(tmp_path / "ckpt"))
    assert torch.load(path, weights_only=False)["callbacks"]["NaNGuard"]["recorder"]["index"] == 3

    # resumed by a new process' objects: a new guard, model and Trainer
    second = NaNGuard(logging={"verbose": False}, recovery={"reduce_lr_after": 2})
    probe = Probe(second)
    pl.seed_everything(0, verbose=False)
    injector = FaultInjector([Fault("activation", steps=[60]), Fault("input", steps=[61])])
    fit(models.Classifier(), DATA, [injector, second, probe], subdir="run", shuffle=True, steps=80,
        ckpt_path=str(path))
    counters, lr_scale, index, step = probe.at_start
    assert (counters, lr_scale, index) == saved and step == 40
    assert probe.first_step == (40, [pytest.approx(1e-2 * 0.5)])  # the resumed fit trains at the cut LR
    assert [(e.index, e.step) for e in second.events] == [(4, 60), (5, 61)]
    assert second.counters["incidents"] == 5 and second.counters["rollbacks"] == 1
    # the loss at 60 is the second non-input incident within incident_window, counting the parameter incident
    # at 31 that the ladder's state carried through the checkpoint: one more cut (the input at 61 does not count)
    assert second.lr_scale == 0.25
    # one events.jsonl across both runs: numbering continues, nothing duplicated
    assert [(e["index"], e["step"]) for e in models.read_events(root)] == [
        (1, 10), (2, 11), (3, 31), (4, 60), (5, 61)]


def test_guard_state_dict_carries_the_statistics() -> None:
    zclip, spikes = ZClip(), SpikeDetector()
    for v in range(1, 40):
        zclip.update(float(v))
        spikes.observe(float(v % 5))
    a = NaNGuard()
    state = a.state_dict()
    state["clipper"]["zclip"], state["losses"]["spikes"] = zclip.state_dict(), spikes.state_dict()
    b = NaNGuard()
    b.load_state_dict(state)
    assert b.state_dict()["clipper"]["zclip"] == zclip.state_dict()
    assert b.state_dict()["losses"]["spikes"] == spikes.state_dict()
