"""Issue 2's must-shows: the recovery ladder on real pl.Trainer runs (CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import models
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.testing import Fault, FaultInjector


def _all_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in list(module.parameters()) + list(module.buffers())
               if t.is_floating_point())


def test_healthy_run_is_bitwise_transparent(tmp_path):
    data = models.classification_data(n=384)
    weights, guards = [], []
    for guarded in (False, True):
        pl.seed_everything(7, verbose=False)
        model = models.Classifier(scheduler="onecycle", dropout=0.2)
        guard = NaNGuard() if guarded else None
        models.trainer(tmp_path / str(guarded), [guard] if guard else [], max_epochs=2).fit(
            model, models.loader(data, shuffle=True))
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        guards.append(guard)
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k
    assert guards[1].events == []
    assert guards[1].counters["snapshots"] >= 1  # it did work while staying transparent
    assert guards[1].counters["replays"] == 0


def _final_mse(model: models.Regression, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def test_too_high_lr_is_rescued(tmp_path):
    """Issue 13: a too-high LR is acted on as a divergence, before any value is non-finite: roll back to the
    snapshot from before it and cut the LR so one step moves the weights by less than their own size."""
    data = models.regression_data(n=2048, features=8)
    results = {}
    for name, lr, guard in (("unguarded", 1.5, None), ("guarded", 1.5, NaNGuard()), ("sane", 0.05, None)):
        pl.seed_everything(0, verbose=False)
        model = models.Regression(features=8, lr=lr)
        models.trainer(tmp_path / name, [guard] if guard else [], max_epochs=2).fit(
            model, models.loader(data, shuffle=True))
        results[name] = (_final_mse(model, data), guard)
    assert not math.isfinite(results["unguarded"][0])  # the failure is real
    loss, guard = results["guarded"]
    assert math.isfinite(loss) and loss < 1.1 * results["sane"][0], (loss, results["sane"][0])  # measured: 1.01x
    # the policy: the loss grows ~10x per step from step 0, so the divergence watch fires as soon as it has
    # check.divergence_steps growth ratios; the step is skipped, the run rolls back to the fit-start snapshot
    # (from before the growth) and the LR is cut. Nothing ever went non-finite: no other event.
    check = guard.config.check
    (event,) = guard.events
    assert (event.kind, event.cause, event.step) == ("divergence", "learning_rate", check.divergence_steps)
    assert event.actions == ["skip_step", "clip", "rollback", "reduce_lr"]
    assert event.details["divergence"]["rule"] == "loss_growth"
    assert event.details["restored_step"] == event.details["divergence"]["onset_step"] == 0
    rel = event.details["relative_update"]
    assert rel["relative_update"] > 1 and rel["lr"] == 1.5  # one step moved the weights by more than their size
    assert rel["safe_lr"] == pytest.approx(1.5 / rel["relative_update"])  # SGD: where one step moves them by 1x
    assert guard.lr_scale == pytest.approx(min(guard.config.recovery.divergence_lr_factor, rel["safe_lr"] / 1.5))
    assert guard.counters["incidents"] == 1 and guard.counters["rollbacks"] == 1
    # events.jsonl holds the same events, one flushed line each
    lines = (tmp_path / "guarded" / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [e.step for e in guard.events]
    for key in ("step", "epoch", "batch_idx", "rank", "kind", "actions", "cause", "culprit", "op", "details",
                "suggestion"):
        assert key in json.loads(lines[0])


def _poison(data: TensorDataset, rows: list[int], value: float) -> TensorDataset:
    x = data.tensors[0].clone()
    for i, r in enumerate(rows):
        x[r, i % x.shape[1]] = value if i % 2 == 0 else -value
    return TensorDataset(x, data.tensors[1])


def test_bad_input_samples_skip_exactly_their_steps(tmp_path):
    data = models.classification_data(n=1024)
    batch = 32
    # ~1% of samples: 10 rows, in 10 different, non-adjacent batches
    rows = [b * batch + (7 * b) % batch for b in (1, 4, 7, 10, 13, 16, 19, 22, 25, 28)]
    poisoned = _poison(data, rows[::2], float("nan"))
    poisoned = _poison(poisoned, rows[1::2], float("inf"))
    expected_steps = {r // batch for r in rows}

    accs = {}
    for name, ds, guard in (("clean", data, None), ("guarded", poisoned, NaNGuard())):
        pl.seed_everything(0, verbose=False)
        model = models.Classifier(dropout=0.0)
        models.trainer(tmp_path / name, [guard] if guard else [], max_epochs=1).fit(model, models.loader(ds, batch))
        accs[name] = (models.accuracy(model, data), guard, model)
    guard, model = accs["guarded"][1], accs["guarded"][2]
    assert {e.step for e in guard.events} == expected_steps
    assert all(e.kind == "input" and e.cause == "input" and e.actions == ["skip_step"] for e in guard.events)
    for event in guard.events:
        row = rows[sorted(expected_steps).index(event.step)]
        samples = [s for f in event.details["inputs"] for s in f["samples"]]
        assert samples == [row % batch]
    assert _all_finite(model)
    assert abs(accs["clean"][0] - accs["guarded"][0]) <= 0.03, (accs["clean"][0], accs["guarded"][0])


def test_inf_input_through_batchnorm_leaves_buffers_finite(tmp_path):
    data = models.classification_data(n=256)
    poisoned = _poison(data, [40, 41, 130], float("inf"))
    model = models.Classifier(dropout=0.0)
    guard = NaNGuard()
    models.trainer(tmp_path, [guard]).fit(model, models.loader(poisoned, 32))
    bad_steps = sorted({r // 32 for r in (40, 41, 130)})
    assert [e.step for e in guard.events] == bad_steps
    bn = model.net[1]
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
    assert int(bn.num_batches_tracked) == len(data) // 32 - len(bad_steps)  # the bad forwards' updates were undone
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(data.tensors[0])).all()


def _clone_state(opt):
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state.items()}


def test_skipped_step_leaves_optimizer_state_untouched(tmp_path):
    data = models.classification_data(n=128)
    snapshots = {}

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                snapshots["before"] = (_clone_state(trainer.optimizers[0]),
                                       [p.detach().clone() for p in pl_module.parameters()])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                snapshots["after"] = (_clone_state(trainer.optimizers[0]),
                                      [p.detach().clone() for p in pl_module.parameters()])

    def poison(batch, batch_idx, module):
        x, y = batch
        return (x * float("nan"), y) if batch_idx == 2 else batch

    model = models.Classifier(batch_hook=poison, dropout=0.0)
    guard = NaNGuard()
    models.trainer(tmp_path, [guard, Spy()]).fit(model, models.loader(data, 32))
    assert [e.step for e in guard.events] == [2]
    (state_b, params_b), (state_a, params_a) = snapshots["before"], snapshots["after"]
    for pb, pa in zip(params_b, params_a):
        assert torch.equal(pb, pa)
    for p, s in state_b.items():
        for name, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state_a[p][name])), name  # incl. 'step'


def _embedding_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 32, (256,), generator=g)  # rows 32..63 are never used
    return TensorDataset(idx, torch.randn(256, generator=g))


def test_adam_eps0_parameter_incident_and_no_nan_checkpoint(tmp_path):
    guard = NaNGuard()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    model = models.EpsZeroEmbedding(rows=64, dim=8)  # rows 32..63 are never used
    models.trainer(tmp_path, [guard, ckpt], enable_checkpointing=True, max_epochs=2).fit(
        model, models.loader(_embedding_data(), 32))
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
    assert _all_finite(model)


@pytest.mark.parametrize("poison", ["loss", "parameter"])
@pytest.mark.parametrize("on_give_up", ["stop", "raise"])
def test_every_batch_poisoned_ends_bounded_with_the_last_good_weights(tmp_path, on_give_up, poison):
    """Healthy for a while, then every step poisoned: the run ends within the ladder's bound, and the weights
    are those of the snapshot the guard fell back to (taken during the healthy part), not the initial ones.
    With poisoned parameters the weights are NaN when it gives up: the give-up itself restores them."""
    recovery = {"max_skips": 2, "max_rollbacks": 2, "snapshot_every": 5, "keep_snapshots": 2, "on_give_up": on_give_up}
    healthy = 12
    guard = NaNGuard(recovery=recovery)
    snaps = models.SnapshotSpy(guard)
    injector = FaultInjector(Fault(poison, steps=range(healthy, 10_000)))
    model = models.Regression()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = models.trainer(tmp_path, [injector, guard, snaps], max_steps=200, max_epochs=-1)
    if on_give_up == "raise":
        with pytest.raises(NaNGuardError, match=r"gave up.*Report: .*incident-"):
            trainer.fit(model, models.loader(models.regression_data(n=256), 16))
    else:
        trainer.fit(model, models.loader(models.regression_data(n=256), 16))
    bound = (recovery["max_skips"] + 1) * (recovery["max_rollbacks"] + 1)  # policy.py's promise
    assert healthy < trainer.global_step <= healthy + bound
    assert len(guard.events) == (bound if poison == "loss" else recovery["max_rollbacks"] + 1)
    assert guard.events[-1].actions[-1] == on_give_up and guard.counters["incidents"] == len(guard.events)
    assert guard.counters["rollbacks"] == recovery["max_rollbacks"] + 1  # the failed ones, then the give-up restore
    taken = sorted(s for s in snaps.states if s <= healthy)
    assert taken == list(range(0, healthy + 1, recovery["snapshot_every"]))
    # loss: the second rollback went one snapshot further back; a bad parameter never does (the snapshot was fine)
    restored = taken[-2] if poison == "loss" else taken[-1]
    assert guard.events[-1].details["restored_step"] == restored > 0
    good = snaps.states[restored]["module"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[k]), k
    assert any(not torch.equal(v, initial[k]) for k, v in good.items())
    report = Path(guard._recorder.report_path(guard.events[-1]))
    assert report.exists() and "cause" in report.read_text()


def test_rollback_goes_further_back_when_it_does_not_help(tmp_path):
    data = models.regression_data(n=2048)

    class Poisoned(models.Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_step >= 25:
                x = x * float("nan")
            return nn.functional.mse_loss(self(x), y)

    guard = NaNGuard(recovery={"snapshot_every": 10, "keep_snapshots": 3, "max_skips": 1, "max_rollbacks": 3})
    model = Poisoned()
    models.trainer(tmp_path, [guard], max_steps=60).fit(model, models.loader(data, 16))
    restored = [e.details["restored_step"] for e in guard.events if "rollback" in e.actions]
    assert restored == sorted(restored, reverse=True) and len(set(restored)) == len(restored) > 1, restored
    assert guard.events[-1].actions[-1] == "stop"


class WeightsAtStart(pl.Callback):
    def __init__(self) -> None:
        self.weights: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_skip_batches_after_rollback(tmp_path):
    """recovery.skip_batches: the steps of exactly that many batches after the rollback do not train."""
    data = models.regression_data(n=1024)
    burst = range(10, 13)
    recovery = {"max_skips": 2, "skip_batches": 3, "snapshot_every": 5}

    class Burst(models.Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx in burst:
                x = x * float("nan")
            return nn.functional.mse_loss(self(x), y)

    guard, starts = NaNGuard(recovery=recovery), WeightsAtStart()
    models.trainer(tmp_path, [guard, starts], max_epochs=1).fit(Burst(), models.loader(data, 32))
    rollback = [e for e in guard.events if "rollback" in e.actions]
    assert [e.step for e in rollback] == [burst[0] + recovery["max_skips"]] == [burst[-1]]
    assert "skip_batches" in rollback[0].actions and guard.events[-1] is rollback[0]  # skipped quietly
    assert guard.counters["skipped_steps"] == len(burst) + recovery["skip_batches"]
    skipped = range(burst[-1] + 1, burst[-1] + 1 + recovery["skip_batches"])
    w = starts.weights
    for step in skipped:  # these steps leave the restored weights as they are...
        assert all(torch.equal(w[step][k], w[step + 1][k]) for k in w[step])
    after = skipped[-1] + 1  # ...and the next one trains again
    assert not all(torch.equal(w[after][k], w[after + 1][k]) for k in w[after])


def test_lr_cut_survives_onecycle_schedule(tmp_path):
    data = models.classification_data(n=512)

    def poison(batch, batch_idx, module):
        x, y = batch
        return (x * float("nan"), y) if batch_idx in (3, 4) else batch

    lrs = {}
    for name, guard in (("plain", None), ("guarded", NaNGuard(check={"inputs": "off"}, recovery={"reduce_lr_after": 2}))):
        pl.seed_everything(0, verbose=False)
        model = models.Classifier(scheduler="onecycle", batch_hook=poison if guard else None)
        models.trainer(tmp_path / name, [guard] if guard else [], max_epochs=1).fit(model, models.loader(data, 32))
        lrs[name] = (model.trainer.optimizers[0].param_groups[0]["lr"], guard)
    guard = lrs["guarded"][1]
    assert any("reduce_lr" in e.actions for e in guard.events)
    assert guard.lr_scale == 0.5
    assert lrs["guarded"][0] == pytest.approx(0.5 * lrs["plain"][0], rel=1e-6)


class MaskedAttention(pl.LightningModule):
    """A float causal mask of -inf, registered as a buffer, as nn.Transformer code commonly does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(6))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2) / 8 + self.mask
        return (scores.softmax(-1) @ h).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_intentional_inf_buffer_is_not_an_incident(tmp_path):
    data = TensorDataset(torch.randn(64, 6, 8))
    guard = NaNGuard()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = models.trainer(tmp_path, [guard, ckpt], enable_checkpointing=True, max_epochs=1)
    trainer.fit(MaskedAttention(), models.loader(data, 8))
    assert guard.events == [] and trainer.global_step == 8
    assert guard._evidence.state.exempt == {"mask"}
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 4  # checkpoints with the mask are written
