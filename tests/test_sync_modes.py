"""``check.sync``: eager reads (one host read per step) and lagged reads (the flags read one step late, bad steps
skipped on the device), forced on the CPU where ``auto`` would pick eager.

Lagged and eager runs are compared side by side: the device-side skip of a fused AdamW is bitwise the host-side
skip; decisions taken one step late give the same weights and the same events for an input NaN, a loss NaN, a
rollback and a give-up; healthy runs stay bitwise identical; and the host reads happen one step late.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import MixedPrecision

import lightning_nanguard
from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.detect.vector import SCHEMA
from . import models

NAN = float("nan")
QUIET = {"verbose": False, "events_file": False, "reports": False}


class Net(models.Regression):
    """Regression with AdamW (fused or not); the loss is multiplied by NaN on the batches ``bad``."""

    def __init__(self, bad: tuple[int, ...] = (), fused: bool = True, lr: float = 0.02) -> None:
        super().__init__(lr=lr, optimizer="adamw")
        self.bad, self.fused = set(bad), fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)


guard, record = models.sync_guard, models.event_record


@pytest.fixture
def pair(fit):
    """``pair(make_model, guard_kwargs, steps=24, data=None)``: the same seeded fit with an eager and a lagged guard;
    returns ``{"eager": (model, guard), "lagged": (model, guard)}``; ``pair.fit_one(sync, ...)``: one of them
    (``extra``: callbacks before the guard)."""

    class Pair:
        @staticmethod
        def fit_one(sync: str, make_model, guard_kwargs: Optional[dict] = None, steps: int = 24, data: Any = None,
                    extra: Optional[list] = None, **kwargs: Any):
            pl.seed_everything(0, verbose=False)
            model, g = make_model(), guard(sync, **copy.deepcopy(guard_kwargs or {}))
            fit(model, data if data is not None else models.regression_data(n=512), (extra or []) + [g],
                subdir=sync, batch_size=16, steps=steps, **kwargs)
            return model, g

        def __call__(self, make_model, guard_kwargs: Optional[dict] = None, **kwargs: Any):
            return {sync: self.fit_one(sync, make_model, guard_kwargs, **kwargs) for sync in ("eager", "lagged")}

    return Pair()


def assert_same_run(runs: dict) -> None:
    (a, ga), (b, gb) = runs["eager"], runs["lagged"]
    assert models.same_weights(a, b)
    assert [models.without_samples(record(e)) for e in ga.events] == \
        [models.without_samples(record(e)) for e in gb.events]
    assert ga.counters == gb.counters
    assert ga.lr_scale == gb.lr_scale


# ----------------------------------------------------------------------------------- the device-side skip


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
], ids=["adamw", "sgd"])
def test_device_skip_of_a_fused_optimizer_is_bitwise_the_host_skip(make):
    """found_inf=1 leaves parameters, moments and step counters exactly as grads=None does."""
    from lightning_nanguard.detect.amp import clear_device_skip, reads_found_inf, skip_on_device

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    nets = [net, copy.deepcopy(net)]
    opts = [make(list(n.parameters())) for n in nets]
    assert all(reads_found_inf(o) for o in opts)
    x = torch.randn(16, 4)
    for step in range(4):
        for n, o in zip(nets, opts):
            o.zero_grad()
            n(x).pow(2).mean().backward()
        if step == 2:  # the bad step: one skipped by the host, one on the device with its gradients present
            for p in nets[0].parameters():
                p.grad = None
            skip = torch.ones(())
            assert skip_on_device(opts[1], skip, None)
        for o in opts:
            o.step()
        if step == 2:
            clear_device_skip(opts[1], skip)
            assert not hasattr(opts[1], "found_inf")
        assert models.same_weights(*nets), step
        states = [o.state_dict()["state"] for o in opts]
        assert states[0].keys() == states[1].keys()
        for k in states[0]:
            for key, value in states[0][k].items():
                assert torch.equal(value, states[1][k][key]), (step, k, key)


def test_a_non_fused_optimizer_cannot_skip_on_the_device():
    from lightning_nanguard.detect.amp import reads_found_inf, skip_on_device

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not reads_found_inf(opt) and not skip_on_device(opt, torch.ones(()), None)
    assert not hasattr(opt, "found_inf")  # a non-fused step asserts that found_inf is None


# ------------------------------------------------------------------------------------ lagged == eager


def test_lagged_equals_eager_for_a_loss_nan(pair):
    runs = pair(lambda: Net(bad=(5, 11)))
    assert [e.step for e in runs["lagged"][1].events] == [5, 11]  # recorded at the step they happened
    assert all(e.actions[0] == "skip_step" for e in runs["lagged"][1].events)
    assert_same_run(runs)


def test_lagged_equals_eager_for_an_input_nan(pair):
    data = models.poison_rows(models.regression_data(n=512), [16 * 7 + 3], NAN)  # batch 7, sample 3
    runs = pair(lambda: Net(), data=data)
    (e,) = runs["lagged"][1].events
    assert (e.step, e.kind, e.details["inputs"][0]["samples"]) == (7, "input", [3])
    assert_same_run(runs)


def test_lagged_equals_eager_for_a_rollback(pair):
    """A burst longer than max_skips right after a snapshot: the lagged rollback comes one step late, before the
    step under way is applied; no update was applied since the snapshot, so that step goes ahead as in eager."""
    runs = pair(lambda: Net(bad=(10, 11, 12, 13)), {"recovery": {"snapshot_every": 5, "max_skips": 3}})
    g = runs["lagged"][1]
    assert g.counters["rollbacks"] == 1 and g.events[-1].actions == ["skip_step", "rollback", "reduce_lr"]
    assert g.events[-1].step == 13 and g.events[-1].details["restored_step"] == 10
    assert_same_run(runs)


def test_lagged_equals_eager_for_a_give_up(pair):
    """The same events and restored weights; the lagged give-up comes while the next step is under way, and that
    step is skipped too (one more skipped step, nothing else)."""
    runs = pair(lambda: Net(bad=tuple(range(10, 40))),
                {"recovery": {"snapshot_every": 5, "max_skips": 2, "max_rollbacks": 1}}, steps=30)
    for sync in ("eager", "lagged"):
        g = runs[sync][1]
        assert g.stopped and g.events[-1].actions[-1] == "stop" and g.events[-1].details["restored_step"] == 10
        assert g.events[-1].details["reasons"] == ["1 rollback(s) did not help (recovery.max_rollbacks=1)"]  # why
        assert models.all_finite(runs[sync][0])
    (a, ga), (b, gb) = runs["eager"], runs["lagged"]
    assert models.same_weights(a, b)
    assert [record(e) for e in ga.events] == [record(e) for e in gb.events]
    assert dict(ga.counters, skipped_steps=ga.counters["skipped_steps"] + 1) == gb.counters


def test_lagged_rollback_after_applied_steps_also_skips_the_step_under_way(pair):
    """Steps were applied since the snapshot: the step under way when the late verdict arrives ran on the weights
    that are rolled back, so it is skipped too; one batch more than eager skips, nothing else differs."""
    runs = pair(lambda: Net(bad=(12, 13, 14, 15)), {"recovery": {"snapshot_every": 5, "max_skips": 3}})
    (a, ga), (b, gb) = runs["eager"], runs["lagged"]
    assert [record(e) for e in ga.events] == [record(e) for e in gb.events]
    assert gb.counters["skipped_steps"] == ga.counters["skipped_steps"] + 1 == 5
    assert not models.same_weights(a, b) and models.all_finite(b)


def test_lagged_names_a_nan_weight_like_eager(pair):
    """A NaN weight (written after step 7's update) spoils step 8's loss; the lagged judgement, while step 9 runs,
    still finds it among the parameters the skipped step 8 ran on, and rolls back (skipping step 9 too)."""
    from lightning_nanguard.testing import Fault, FaultInjector

    runs = {}
    for sync in ("eager", "lagged"):
        runs[sync] = pair.fit_one(sync, lambda: Net(), {"recovery": {"snapshot_every": 5}},
                                  extra=[FaultInjector([Fault("parameter", steps=[7])])])
    (_, ga), (b, gb) = runs["eager"], runs["lagged"]
    assert [record(e) for e in ga.events] == [record(e) for e in gb.events]
    (e,) = gb.events
    assert (e.step, e.kind, e.culprit) == (8, "parameter", e.details["nonfinite_parameters"][0]["name"])
    assert "rollback" in e.actions and e.details["restored_step"] == 5
    assert gb.counters["skipped_steps"] == ga.counters["skipped_steps"] + 1 and models.all_finite(b)


def test_lagged_with_a_non_fused_optimizer_rolls_the_applied_step_back(pair):
    """AdamW without fused=True cannot skip on the device: the bad step is applied (NaN weights), then rolled back."""
    runs = pair(lambda: Net(bad=(12,), fused=False), {"recovery": {"snapshot_every": 5}})
    (_, ga), (b, gb) = runs["eager"], runs["lagged"]
    assert ga.events[0].actions == ["skip_step", "clip"] and ga.counters["rollbacks"] == 0
    (e,) = gb.events
    assert (e.step, e.kind) == (12, "loss") and "rollback" in e.actions and "skip_step" not in e.actions
    assert e.details["restored_step"] == 10 and gb.counters["rollbacks"] == 1
    assert models.all_finite(b)


def test_lagged_non_fused_rollback_right_after_a_snapshot_skips_the_step_under_way(pair):
    """The applied bad step is the first after the snapshot of step 10 (nothing healthy since: the weights were
    the snapshot's when it ran). The step under way when its verdict is read took its gradients on the NaN
    weights that step left, so it is skipped too (docs/performance.md); had it gone ahead on the restored
    weights, its NaN gradients would be applied there and read as a second incident."""
    model, g = pair.fit_one("lagged", lambda: Net(bad=(10,), fused=False), {"recovery": {"snapshot_every": 5}})
    (e,) = g.events
    assert (e.step, e.kind) == (10, "loss") and "rollback" in e.actions and e.details["restored_step"] == 10
    assert g.counters["rollbacks"] == 1 and g.counters["incidents"] == 1
    assert models.all_finite(model)


def test_lagged_non_fused_persistent_nan_still_gives_up(pair):
    runs = pair(lambda: Net(bad=tuple(range(8, 60)), fused=False), {"recovery": {"max_rollbacks": 2}}, steps=40)
    g = runs["lagged"][1]
    assert g.stopped and g.counters["rollbacks"] == 3  # two that did not help, then the give-up restores
    assert models.all_finite(runs["lagged"][0])


# ----------------------------------------------------------------------------------------- healthy runs


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_healthy_runs_are_bitwise_identical_in_both_modes(fit, fused):
    models_ = []
    for sync in (None, "eager", "lagged"):
        pl.seed_everything(0, verbose=False)
        model = Net(fused=fused)
        fit(model, models.regression_data(n=256), [] if sync is None else [guard(sync)], subdir=str(sync),
            batch_size=16, steps=20)
        models_.append(model)
    assert models.same_weights(models_[0], models_[1]) and models.same_weights(models_[0], models_[2])


def test_device_clipping_matches_host_clipping(pair):
    """clip.max_norm without a host read: the steps over the limit are clipped exactly as in eager mode, the others
    left bitwise alone, and clipped_steps counts the same steps once their norms are read."""
    runs = pair(lambda: Net(lr=0.05), {"clip": {"max_norm": 6.0}}, steps=20)
    clipped = runs["eager"][1].counters["clipped_steps"]
    assert 0 < clipped < 20  # some steps over the limit, some under
    assert_same_run(runs)


class UnitGradient(pl.LightningModule):
    """One weight whose gradient is exactly 1.0 at every step (total norm 1.0, exact in float32); fused SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.w.sum() + 0.0 * batch[0].sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, fused=True)


@pytest.mark.parametrize("limit, clips", [(1 - 2**-30, True), (1.0, False), (1 + 2**-30, False)],
                         ids=["below", "at", "above"])
def test_a_norm_within_a_float32_rounding_of_the_limit_is_clipped_alike_in_both_modes(pair, limit, clips):
    """docs/performance.md, check.sync: lagged compares the norm on the device with the same limit, the same
    gradients bitwise. A float32 norm of exactly 1.0 against a limit that rounds to 1.0 in float32 (1 - 2**-30 just
    below it, 1 + 2**-30 just above) or is 1.0: clipped (the norm is over the limit) exactly where eager clips it,
    on the device (the weights) and on the host (clipped_steps, counted once the norm is read)."""
    assert torch.tensor(limit, dtype=torch.float32).item() == 1.0  # the limit is within a float32 rounding of it
    runs = pair(UnitGradient, {"clip": {"max_norm": limit}}, steps=6)
    assert runs["eager"][1].counters["clipped_steps"] == (6 if clips else 0)
    unclipped = torch.nn.Parameter(torch.zeros(1))  # six steps of the same SGD on a gradient 1.0 left alone
    sgd = torch.optim.SGD([unclipped], lr=0.1, fused=True)
    for _ in range(6):
        unclipped.grad = torch.ones(1)
        sgd.step()
    assert torch.equal(runs["eager"][0].w.detach(), unclipped.detach()) is not clips
    assert runs["lagged"][1].lagged and not runs["eager"][1].lagged
    assert_same_run(runs)


def test_batchnorm_statistics_of_a_skipped_step_are_undone_on_the_device(pair):
    """Bad inputs in batches 6 and 7: each step's NaN running statistics are undone on the device; step 6 is judged
    while step 7's NaN statistics are in the buffers, and is still an input incident, not a buffer one."""
    data = models.poison_rows(models.classification_data(n=512), [16 * 6 + 2, 16 * 7 + 5], NAN)

    class Fused(models.Classifier):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)

    runs = pair(lambda: Fused(), data=data, steps=12)
    assert [(e.step, e.kind) for e in runs["lagged"][1].events] == [(6, "input"), (7, "input")]
    bn = runs["lagged"][0].net[1]
    assert torch.isfinite(bn.running_mean).all() and int(bn.num_batches_tracked) == 10  # 12 steps, two undone
    assert_same_run(runs)


# ------------------------------------------------------------------------------------ reads one step late


class HostReads:
    """Counts the calls that read a tensor on the host (``tolist``, ``item``, ``bool``, ``float``, ``int``) made
    from lightning_nanguard's code, with the step under way and what was read (the originals run)."""

    GUARD = os.path.dirname(lightning_nanguard.__file__)

    def __init__(self, monkeypatch: Any) -> None:
        self.step = -1
        self.reads: list[tuple[int, str, Any]] = []  # (step under way, method, value read)
        for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Any) -> Any:
        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            value = original(t, *args, **kwargs)
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(self.GUARD):
                self.reads.append((self.step, name, value))
            return value

        return read

    def probe(self, losses: dict[int, float]) -> pl.Callback:
        reads = self

        class Probe(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                reads.step = trainer.global_step

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses[reads.step] = float(outputs["loss"].detach())
                reads.step = -2  # between steps (the train-end flush reads here)

        return Probe()


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_the_flags_are_read_once_per_step_and_lagged_one_step_late(fit, monkeypatch, sync):
    steps = 12
    reads = HostReads(monkeypatch)
    losses: dict[int, float] = {}
    g = guard(sync, recovery={"snapshot_every": 100})
    fit(Net(), models.regression_data(n=512), [reads.probe(losses), g], batch_size=16, steps=steps)
    during = [(step, name, value) for step, name, value in reads.reads if step >= 0]
    assert [name for _, name, _ in during] == ["tolist"] * (steps if sync == "eager" else steps - 1)
    late = 0 if sync == "eager" else 1  # the loss read during step N is step N - late's
    for step, _, value in during:
        assert value[SCHEMA.index["loss"]] == pytest.approx(losses[step - late], rel=1e-6), step
    assert [step for step, _, _ in during] == list(range(late, steps))
    if sync == "lagged":  # the last step's flags are read at train end, after its batch
        assert [(s, v[SCHEMA.index["loss"]]) for s, n, v in reads.reads if s == -2 and n == "tolist"] == [
            (-2, pytest.approx(losses[steps - 1], rel=1e-6))]


def test_a_due_snapshot_reads_its_step_at_once(fit, monkeypatch):
    """A snapshot copies the weights to the host and waits anyway: the step before it is judged right away, so no
    snapshot ever holds state whose flags are unread."""
    reads = HostReads(monkeypatch)
    losses: dict[int, float] = {}
    g = guard("lagged", recovery={"snapshot_every": 4})
    fit(Net(), models.regression_data(n=512), [reads.probe(losses), g], batch_size=16, steps=10)
    flag_reads = [(s, v[SCHEMA.index["loss"]]) for s, n, v in reads.reads if n == "tolist"]
    at_end_of = [s for s, _ in flag_reads if s == -2]
    assert len(at_end_of) == 3  # steps 3 and 7 (snapshots due) and the last, at train end
    assert g.counters["snapshots"] == 3  # fit start, after steps 3 and 7


# -------------------------------------------------------------------------------------- flush points


def test_a_checkpoint_carries_the_verdict_of_the_step_before_it(fit, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    g = guard("lagged")
    fit(Net(bad=(5,)), models.regression_data(n=512), [g, ckpt], batch_size=16, steps=6, enable_checkpointing=True)
    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=6.ckpt", weights_only=False)["callbacks"]["NaNGuard"]
    assert state["counters"]["incidents"] == 1 and state["counters"]["skipped_steps"] == 1


def test_the_last_step_is_judged_at_train_end(fit):
    g = guard("lagged")
    model = Net(bad=(7,))
    fit(model, models.regression_data(n=512), [g], batch_size=16, steps=8)
    assert [(e.step, e.kind, e.actions[0]) for e in g.events] == [(7, "loss", "skip_step")]  # and nothing restored
    assert models.all_finite(model)


def test_validation_reads_the_step_before_it(fit):
    seen: list[int] = []

    class AtValidation(pl.Callback):
        def on_validation_start(self, trainer, pl_module):
            if not trainer.sanity_checking:
                seen.append(len(g.events))

    class Validated(Net):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", models.Regression.training_step(self, batch, batch_idx))

    g = guard("lagged")
    data = models.regression_data(n=512)
    fit(Validated(bad=(7,)), data, [g, AtValidation()], batch_size=16, steps=10, val=models.regression_data(n=64),
        val_check_interval=8, num_sanity_val_steps=0)
    assert seen == [1]  # step 7's incident was recorded before validation ran on its weights


# --------------------------------------------------------------------------------------------- 16-mixed


class NaNConstant(Net):
    """A NaN constant added to the loss: the gradients stay finite, so only the guard can tell."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = models.Regression.training_step(self, batch, batch_idx)
        return loss + torch.tensor(NAN) if batch_idx in self.bad else loss


class Scales(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_16_mixed_guard_skip_joins_the_scaler_found_inf(fit, fused):
    """Under a GradScaler the guard's flag joins the scaler's found_inf: the step is skipped like the host skip,
    and the scaler lowers its scale for it (it cannot tell why the step was skipped)."""
    out = {}
    for sync in ("eager", "lagged"):
        pl.seed_everything(0, verbose=False)
        model, g, scales = NaNConstant(bad=(9,), fused=fused, lr=0.01), guard(sync), Scales()
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000))
        fit(model, models.regression_data(n=256), [g, scales], subdir=sync, batch_size=16, steps=12, plugins=[plugin])
        out[sync] = (model, g, scales.scales)
    (a, ga, sa), (b, gb, sb) = out["eager"], out["lagged"]
    assert [record(e) for e in ga.events] == [record(e) for e in gb.events]
    assert [e.step for e in gb.events] == [9] and gb.events[0].actions[0] == "skip_step"
    assert models.same_weights(a, b)
    assert sa == [256.0] * 12  # eager: grads set to None; the scaler saw no overflow
    assert sb == [256.0] * 9 + [128.0] * 3  # lagged: the joined found_inf halved the scale at step 9


def test_16_mixed_routine_overflows_stay_routine_when_lagged(fit):
    pl.seed_everything(0, verbose=False)
    g = guard("lagged")
    plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 24))
    model = Net(fused=True, lr=0.01)
    fit(model, models.regression_data(n=256), [g], batch_size=16, steps=16, plugins=[plugin])
    assert g.events == [] and models.all_finite(model)


# ------------------------------------------------------------------------------------------ the choice


def test_auto_reads_eagerly_on_the_cpu_and_says_nothing_while_an_explicit_mode_says_why(fit, caplog):
    """Issue 29: a default fit prints no line (``check.sync: auto``); a mode the user set is confirmed once, with
    the reason."""
    from lightning_nanguard.detect.read_mode import choose_read_mode

    caplog.set_level("INFO")
    model, auto = Net(), NaNGuard(logging=QUIET)
    t = fit(model, models.regression_data(n=64), [auto], batch_size=16, steps=2)
    assert auto.lagged is False
    assert choose_read_mode("auto", t, model) == (False, "on the CPU every op has finished when it returns: "
                                                         "reading the flags waits for nothing")
    assert not [r for r in caplog.records if r.getMessage().startswith("[nanguard]")]
    fit(Net(), models.regression_data(n=64), [guard("eager")], batch_size=16, steps=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[nanguard] sync:")]
    assert lines == ["[nanguard] sync: eager (check.sync: eager: one host sync per step)"]


def test_forced_lagged_names_an_optimizer_that_cannot_skip(fit, caplog):
    caplog.set_level("INFO")
    fit(Net(fused=False), models.regression_data(n=64), [guard("lagged")], batch_size=16, steps=2)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[nanguard] sync:")]
    assert line.startswith("[nanguard] sync: lagged (") and "AdamW cannot skip" in line and "rollback" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto picks lagged only off the CPU")
def test_auto_is_lagged_on_cuda_with_a_fused_optimizer(make_trainer):
    for fused, lagged in ((True, True), (False, False)):
        g = NaNGuard(logging=QUIET)
        trainer = make_trainer([g], accelerator="cuda", devices=1, max_steps=2)
        trainer.fit(Net(fused=fused), models.loader(models.regression_data(n=64), 16))
        assert g.lagged is lagged


class FusedSpiky:
    """tests/test_prevention.py's SpikyRegression (a x1000 batch at step 30) with a fused SGD."""

    def __new__(cls, **kwargs: Any) -> Any:
        from .test_prevention import SpikyRegression

        class Fused(SpikyRegression):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)

        return Fused(**kwargs)


@pytest.mark.parametrize("action", ["skip_step", "clip"])
def test_lagged_spike_actions_act_on_the_spiking_step_like_eager(pair, action):
    """A finite loss spike: the lagged guard makes the spike test on the device, with the statistics read so far,
    and skips or clips the spiking step itself, as the eager guard does."""
    runs = pair(lambda: FusedSpiky(at=30, mode="input"), {"check": {"spike_action": action, "spike_warmup": 20}},
                steps=40)
    (e,) = runs["lagged"][1].events
    assert (e.step, e.kind, e.actions) == (30, "spike", [action])
    assert runs["lagged"][1].lagged
    assert_same_run(runs)
    # its samples are rerun at step 30 (the x1000 batch keyed on global_step): skipped on the device, on the same
    # weights as eager, so the same losses; clipped and applied, after the update
    (d,) = runs["eager"][1].events
    assert e.details["samples"]["after_update"] is (action == "clip") and d.details["samples"]["after_update"] is False
    assert e.details["samples"]["median"] > 1e4 and d.details["samples"]["median"] > 1e4
    if action == "skip_step":
        assert dict(e.details["samples"], after_update=None) == dict(d.details["samples"], after_update=None)


def test_a_divergence_read_one_step_late_rolls_the_applied_step_back(pair):
    """A warned spike lets the x1000 batch through; the next step's loss runs away (a divergence event). Eager
    skips that step; lagged reads it while the step after runs, so it was applied: the same rollback and LR cut
    undo it (no skip_step action), and that next step is skipped too."""
    runs = pair(lambda: FusedSpiky(at=30, mode="input"), {"check": {"spike_action": "warn", "spike_warmup": 20}},
                steps=40)
    (_, ga), (b, gb) = runs["eager"], runs["lagged"]
    div = [(record(e), record(f)) for e, f in zip(ga.events, gb.events) if e.kind == "divergence"]
    assert len(ga.events) == len(gb.events) and div
    eager, lagged = div[0]
    assert eager["step"] == lagged["step"] == 31
    assert eager["actions"] == ["skip_step"] + lagged["actions"] and "rollback" in lagged["actions"]
    assert models.all_finite(b)


def test_lagged_give_up_raises_from_the_next_step(fit):
    g = guard("lagged", recovery={"max_skips": 1, "max_rollbacks": 0, "on_give_up": "raise"})
    with pytest.raises(NaNGuardError, match="gave up at step 6"):
        fit(Net(bad=tuple(range(5, 30))), models.regression_data(n=512), [g], batch_size=16, steps=20)


# -------------------------------------------------------------------------------------------------- DDP


@pytest.mark.slow  # one spawned 2-process run, ~10 s
@pytest.mark.ddp
def test_lagged_ddp_agrees_on_every_rank_with_one_all_reduce_per_step(tmp_path):
    """tests/ddp_scripts/ddp_guard.py with check.sync lagged and a fused AdamW: rank 1 alone sees the bad batches;
    both ranks skip on the device and take the same late decisions, for the same one all-reduce per step."""
    import subprocess

    from .test_distributed import BAD_STEPS, SCRIPT

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "lagged"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert r0["lagged"] and r1["lagged"]
    summary = [[(e["step"], e["kind"], e["actions"]) for e in r["events"]] for r in (r0, r1)]
    assert summary[0] == summary[1] and [s for s, _, _ in summary[0]] == BAD_STEPS
    assert all(e["rank"] == 1 and e["details"]["ranks"] == [1] for r in (r0, r1) for e in r["events"])
    assert r0["counters"]["rollbacks"] == 1 == r1["counters"]["rollbacks"]
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]) and torch.isfinite(value).all(), key
    for r in (r0, r1):
        calls, start, per_step, snapshots = r["calls"], 0, [], 0
        for rec in r["steps"]:
            calls_of_step = [(n, k) for n, g, k in calls[start:rec["calls"]] if g]
            # per snapshot: the replicas' weights checksum, and whether any rank holds a non-finite weight or state
            checksums = [("all_reduce", 4)] * (rec["snapshots"] - snapshots)
            per_step.append((rec["batch_idx"], calls_of_step, checksums))
            start, snapshots = rec["calls"], rec["snapshots"]
        gathers = sum(c.count(("all_gather_object", -1)) for _, c, _ in per_step)
        assert gathers == len(BAD_STEPS) - (BAD_STEPS[-1] == per_step[-1][0])  # a last bad step: gathered at the end
        for batch_idx, step_calls, checksums in per_step[1:]:
            # an incident (judged at the next step, or at its own end when a snapshot falls due) also sums the module
            # norms of the (sharded) snapshots it has not seen: 2 tensors each
            norms = [c for c in step_calls if c[0] == "all_reduce" and c[1] != 12 and c not in checksums]
            judged = batch_idx in BAD_STEPS or batch_idx - 1 in BAD_STEPS
            assert all(c[1] in (2, 4) for c in norms) and (not norms or judged), (batch_idx, norms)
            reduces = [c for c in step_calls if c == ("all_reduce", 12)]
            assert len(reduces) <= 1, (batch_idx, step_calls)  # none: skipped by a late rollback
            if batch_idx not in BAD_STEPS and batch_idx - 1 not in BAD_STEPS:
                assert step_calls == [("all_reduce", 12)] + checksums, (batch_idx, step_calls)


# ------------------------------------------------------------------------------------------ user metrics


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")  # the reference run drops the bad batch
def test_lagged_skip_leaves_no_trace_in_metrics_and_epoch_aggregates(tmp_path):
    """The user's torchmetrics states and Lightning's epoch aggregates of a step skipped on the device are undone
    there too (no host read): the rescued run's epoch values equal, bitwise, a run that never saw the bad batch."""
    from .test_user_metrics import EPOCHS, _data, _fit, _same

    class FusedSGD(models.MetricsClassifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)

    g = guard("lagged")
    pl.seed_everything(0, verbose=False)
    rescued, _ = _fit(tmp_path / "guarded", model := FusedSGD(), _data(3), g)
    pl.seed_everything(0, verbose=False)
    clean, _ = _fit(tmp_path / "reference", ref := FusedSGD(drop=(3,)), _data(), None)
    assert [(e.epoch, e.batch_idx, e.kind, e.actions[0]) for e in g.events] == [
        (ep, 3, "input", "skip_step") for ep in range(EPOCHS)]
    for epoch in range(EPOCHS):
        assert _same(rescued.epochs[epoch], clean.epochs[epoch]) == [], epoch
    assert [m._update_count for m in (model.loss_mean, model.seen)] == [m._update_count for m in (ref.loss_mean,
                                                                                                  ref.seen)]
    assert _same(model.state_dict(), ref.state_dict()) == []


class DecayingLR(models.Regression):
    """The demo's too-high LR (1.5) with a fused SGD whose LR a step-interval scheduler lowers at every step."""

    def __init__(self) -> None:
        super().__init__(lr=1.5)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, fused=True)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_step_judged_late_is_diagnosed_at_the_lr_it_ran_at(pair):
    """The lagged guard judges a step after its scheduler stepped: the event and the diagnosis' relative update
    carry the LR the step ran at (1.5 x 0.9^step), as the eager guard's do, not the LR of the step after it."""
    runs = pair(DecayingLR, {"check": {"divergence": "warn"}}, steps=8)
    first = {sync: next(e for e in g.events if e.kind == "divergence") for sync, (_, g) in runs.items()}
    eager, lagged = first["eager"], first["lagged"]
    ran_at = 1.5 * 0.9 ** eager.step
    assert lagged.step == eager.step and eager.cause == lagged.cause == "learning_rate"
    assert eager.details["lr"] == lagged.details["lr"] == [pytest.approx(ran_at)]
    assert eager.details["relative_update"]["lr"] == lagged.details["relative_update"]["lr"] == pytest.approx(ran_at)
