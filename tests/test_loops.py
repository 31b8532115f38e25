"""Loop variants: gradient accumulation, manual optimization with two optimizers, and both packages.

Each guarded run is compared bit for bit with an unguarded reference that skips exactly the expected
optimizer steps by hand (grads set to None, which is what the guard does), so "exactly that step was
skipped, and nothing else" is what the assertions check.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from . import models


class SkipSteps(pl.Callback):
    """The reference's hand-made skip: grads of the whole optimizer set to None at the given steps."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None


def test_accumulation_poisoned_micro_batch_skips_exactly_its_step(fit):
    data = models.regression_data(n=8 * 24)
    x, y = data.tensors
    poisoned_x = x.clone()
    poisoned_x[6 * 8 + 3, 2] = float("nan")  # micro-batch 6: the 3rd of optimizer step 1 (batches 4..7)
    guarded = models.Regression(lr=0.02, optimizer="adamw")
    reference = copy.deepcopy(guarded)
    guard = NaNGuard()
    fit(guarded, TensorDataset(poisoned_x, y), [guard], batch_size=8, max_steps=6, accumulate_grad_batches=4)
    assert [(e.step, e.kind, e.batch_idx) for e in guard.events] == [(1, "input", 7)]  # decided at the step
    assert [f["micro_batch"] for f in guard.events[0].details["inputs"]] == [2]
    assert guard.counters["skipped_steps"] == 1
    # reference: clean data, optimizer step 1 skipped by hand; every other step identical
    fit(reference, TensorDataset(x, y), [SkipSteps({1})], subdir="ref", batch_size=8, max_steps=6,
        accumulate_grad_batches=4)
    assert models.same_weights(guarded, reference)


def test_accumulation_loss_fault_in_first_micro_batch_is_a_loss_incident(fit):
    """Under accumulation the step's loss flag covers every micro-batch, not only the last one."""
    from lightning_nanguard.testing import Fault, FaultInjector

    accumulate, bad_step = 4, 2
    guarded = models.Regression(lr=0.02, optimizer="adamw")
    reference = copy.deepcopy(guarded)
    guard = NaNGuard()
    injector = FaultInjector([Fault("loss", steps=[bad_step], micro_batch=0)])
    fit(guarded, models.regression_data(n=8 * 24), [injector, guard], batch_size=8, max_steps=6,
        accumulate_grad_batches=accumulate)
    assert [(r.step, r.micro_batch) for r in injector.log] == [(bad_step, 0)]
    assert [(e.step, e.kind) for e in guard.events] == [(bad_step, "loss")]
    assert guard.events[0].batch_idx == (bad_step + 1) * accumulate - 1  # decided at the step's last micro-batch
    assert guard.counters["skipped_steps"] == 1
    fit(reference, models.regression_data(n=8 * 24), [SkipSteps({bad_step})], subdir="ref", batch_size=8,
        max_steps=6, accumulate_grad_batches=accumulate)
    assert models.same_weights(guarded, reference)


class TwoOptimizers(pl.LightningModule):
    """GAN-style manual optimization: a generator and a discriminator, one optimizer each."""

    def __init__(self, poison: dict[str, set[int]], skip: dict[str, set[int]]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Linear(8, 8)
        self.disc = nn.Linear(8, 1)
        self.poison, self.skip = poison, skip

    def _step(self, name: str, opt: Any, loss: torch.Tensor, module: nn.Module, batch_idx: int) -> None:
        if batch_idx in self.poison.get(name, set()):
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        if batch_idx in self.skip.get(name, set()):  # the reference's hand-made skip
            for p in module.parameters():
                p.grad = None
        opt.step()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(x)
        self._step("gen", opt_g, -self.disc(fake).mean() + fake.pow(2).mean(), self.gen, batch_idx)
        d_loss = nn.functional.mse_loss(self.disc(self.gen(x).detach()), y) + self.disc(x).pow(2).mean()
        self._step("disc", opt_d, d_loss, self.disc, batch_idx)

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.gen.parameters(), lr=1e-2),
                torch.optim.SGD(self.disc.parameters(), lr=1e-2, momentum=0.9))


def test_manual_optimization_guards_each_optimizer_step(fit):
    data = models.regression_data(n=8 * 10)
    guarded = TwoOptimizers(poison={"gen": {3}, "disc": {6}}, skip={})
    reference = copy.deepcopy(guarded)
    reference.poison, reference.skip = {}, {"gen": {3}, "disc": {6}}
    guard = NaNGuard(recovery={"reduce_lr_after": 0}, clip={"adaptive": "off"})  # skips only: comparable
    fit(guarded, data, [guard], batch_size=8, max_epochs=1)
    # two optimizer steps per batch: gen at step 2*b, disc at step 2*b + 1
    assert [(e.step, e.batch_idx, e.kind) for e in guard.events] == [(6, 3, "loss"), (13, 6, "loss")]
    assert guard.counters["skipped_steps"] == 2
    # a NaN in the generator's loss does not leak into the discriminator's step of the same batch
    fit(reference, data, subdir="ref", batch_size=8, max_epochs=1)
    assert models.same_weights(guarded, reference)


def test_manual_optimization_reads_eagerly_when_lagged_is_asked(fit):
    """check.sync: lagged under manual optimization: each optimizer.step() is still judged when it is called
    (docs/distributed.md), so the same two loss faults are caught at their own steps and skipped on the host."""
    data = models.regression_data(n=8 * 10)
    guard = NaNGuard(check={"sync": "lagged"}, recovery={"reduce_lr_after": 0}, clip={"adaptive": "off"},
                     logging={"verbose": False, "events_file": False, "reports": False})
    fit(TwoOptimizers(poison={"gen": {3}, "disc": {6}}, skip={}), data, [guard], batch_size=8, max_epochs=1)
    assert guard.lagged is False
    assert [(e.step, e.batch_idx, e.kind, e.actions[0]) for e in guard.events] == [
        (6, 3, "loss", "skip_step"), (13, 6, "loss", "skip_step")]
    assert guard.counters["skipped_steps"] == 2 and guard.counters["rollbacks"] == 0


def _package_module(base: type) -> type:
    """The same small module, subclassing the given package's LightningModule (no cross-package classes)."""

    class Net(base):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Net


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_both_packages_run_the_same_guard(tmp_path, fit, package):
    import importlib

    pkg = importlib.import_module(package)
    data = models.regression_data(n=8 * 12)
    x, y = data.tensors[0].clone(), data.tensors[1]
    x[4 * 8, 0] = float("inf")
    pkg.seed_everything(0, verbose=False)
    model = _package_module(pkg.LightningModule)()
    expected = copy.deepcopy(model.state_dict())
    guard = NaNGuard()
    trainer = pkg.Trainer(callbacks=[guard], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    assert [(e.step, e.kind) for e in guard.events] == [(4, "input")]
    assert (tmp_path / "nanguard" / "events.jsonl").exists()
    # the same run in the classic package, step 4 skipped by hand, lands on the same weights
    reference = _package_module(pl.LightningModule)()
    reference.load_state_dict(expected)
    clean_x = x.clone()
    clean_x[4 * 8, 0] = 0.0
    fit(reference, TensorDataset(clean_x, y), [SkipSteps({4})], subdir="ref", batch_size=8, max_epochs=1,
        deterministic=False)
    assert models.same_weights(model, reference)
