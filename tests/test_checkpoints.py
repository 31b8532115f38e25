"""Checkpoint safety: no checkpoint written during a guarded run holds a non-finite tensor; resuming keeps the
guard's own state."""

from __future__ import annotations

import copy
import json

from . import models
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.recover.checkpoint import iter_checkpoint_tensors


def sparse_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 5, (n,), generator=g)  # rows 5..9 are never used
    return DataLoader(TensorDataset(idx, torch.randn(n, generator=g)), batch_size=8)


def nonfinite_in(path) -> list[str]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert ckpt["state_dict"] and ckpt["optimizer_states"]
    return [name for name, t in iter_checkpoint_tensors(ckpt)
            if t.is_floating_point() and not torch.isfinite(t).all()]


def fit_with_checkpoints(tmp_path, callbacks: list, model: pl.LightningModule, max_steps: int = 6) -> pl.Trainer:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1,
                           filename="{step}")
    trainer = models.trainer(tmp_path, callbacks + [ckpt], max_steps=max_steps, enable_checkpointing=True)
    trainer.fit(model, sparse_data())
    return trainer


def test_no_checkpoint_holds_nonfinite_weights_or_optimizer_state(tmp_path):
    model = models.EpsZeroEmbedding(rows=10)
    control = copy.deepcopy(model)
    # control: without the guard, the checkpoints are poisoned
    fit_with_checkpoints(tmp_path / "plain", [], control)
    assert any(nonfinite_in(p) for p in (tmp_path / "plain" / "ckpts").glob("*.ckpt"))
    guard = NaNGuard()
    trainer = fit_with_checkpoints(tmp_path / "guarded", [guard], model)
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
def test_nonfinite_optimizer_state_never_reaches_a_checkpoint(tmp_path, every, found_at):
    model = models.Regression(lr=0.01, optimizer="adamw")
    guard = NaNGuard(recovery={"snapshot_every": every})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    bad, steps = 3, 6
    trainer = models.trainer(tmp_path, [PoisonAdamState(bad), guard, ckpt], max_steps=steps, enable_checkpointing=True)
    trainer.fit(model, models.loader(models.regression_data(n=64), batch_size=8))
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
def test_resume_from_last_ckpt_continues_numbering_and_starts_at_the_cut_lr(tmp_path):
    lr, steps_per_epoch = 0.02, 10
    model = models.NaNLossOnBatches(bad={2, 5})
    guard = NaNGuard(recovery={"reduce_lr_after": 2})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    data = models.loader(models.regression_data(n=8 * steps_per_epoch), batch_size=8)
    trainer = models.trainer(tmp_path / "run1", [guard, ckpt], max_epochs=1, enable_checkpointing=True)
    trainer.fit(model, data)
    assert [e.index for e in guard.events] == [1, 2] and guard.lr_scale == 0.5

    resumed_model = models.NaNLossOnBatches(bad={7})  # epoch 2: batch 7
    guard2, first = NaNGuard(recovery={"reduce_lr_after": 2}), FirstStep()
    trainer2 = models.trainer(tmp_path / "run2", [guard2, first], max_epochs=2)
    trainer2.fit(resumed_model, data, ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
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
    trainer3 = models.trainer(tmp_path / "run3", [guard2], max_epochs=1)
    trainer3.fit(models.Regression(lr=0.01), data)
    assert guard2.counters["incidents"] == 0 and guard2.lr_scale == 1.0
