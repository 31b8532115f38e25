"""Recovery: what the guard does about an incident and what it restores, from the pure pieces (the ladder,
``scale_lr``, ``BufferUndo``, ``SnapshotStore``) to real Trainer runs read back from their live objects:
skipped steps, the ladder's escalation, rollbacks, LR cuts across rollbacks and schedulers, the LR floor,
the incident window, snapshots, and giving up."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.optim import lr_scheduler as S
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.recover.lr import scale_lr
from lightning_nanguard.recover.undo import BufferUndo
from lightning_nanguard.recover.ladder import RecoveryLadder
from lightning_nanguard.store.snapshots import make_store
from lightning_nanguard.testing import Fault, FaultInjector
from . import models
from .models import Regression, regression_data

NAN = float("nan")


QUIET = {"verbose": False}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal nested state: tensors bitwise (``torch.equal``), everything else with ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


class AtBatchStart(pl.Callback):
    """The training state at the start of every optimizer step (right after the previous step's rollback)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.states[trainer.global_step] = models.training_state(trainer, pl_module)


# ------------------------------------------------------------------------------- a diverging run is rescued


def _final_mse(model: models.Regression, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def test_too_high_lr_is_rescued(tmp_path, fit):
    """Issue 13: a too-high LR is acted on as a divergence, before any value is non-finite: roll back to the
    snapshot from before it and cut the LR so one step moves the weights by less than their own size."""
    data = models.regression_data(n=2048, features=8)
    results = {}
    for name, lr, guard in (("unguarded", 1.5, None), ("guarded", 1.5, NaNGuard()), ("sane", 0.05, None)):
        pl.seed_everything(0, verbose=False)
        model = models.Regression(features=8, lr=lr)
        fit(model, data, [guard] if guard else [], subdir=name, shuffle=True, max_epochs=2)
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


def test_too_high_lr_caught_only_at_its_nan_is_rescued_with_one_cut_to_the_safe_lr(tmp_path, fit):
    """The same run with check.divergence off: it goes NaN under the guard (~step 37, the weights ~1e18 times
    their start). The relative update is measured on weights and a gradient of one step (the fit-start
    snapshot's, as the divergence path measures it), not the onset's 1e18 gradient against the start's weights
    (a 1e18-fold update, an LR cut to the floor); the cut goes to the safe LR once, and the rollback that
    follows undoes the grown weights without cutting again."""
    data = models.regression_data(n=2048, features=8)
    runs = {}
    for name, lr, guard in (("divergence", 1.5, NaNGuard()), ("nan", 1.5, NaNGuard(check={"divergence": "off"})),
                            ("sane", 0.05, None)):
        pl.seed_everything(0, verbose=False)
        model = models.Regression(features=8, lr=lr)
        fit(model, data, [guard] if guard else [], subdir=name, shuffle=True, max_epochs=2)
        runs[name] = (_final_mse(model, data), guard, model)
    loss, guard, model = runs["nan"]
    first = guard.events[0]
    assert first.kind == "loss" and first.cause == "learning_rate" and first.step > 20  # a real NaN, late
    rel, rel_div = first.details["relative_update"], runs["divergence"][1].events[0].details["relative_update"]
    assert rel["reference_step"] == rel_div["reference_step"] == 0
    assert rel["relative_update"] == pytest.approx(rel_div["relative_update"])  # the same step-0 measurement
    assert first.details["lr_after"] == [pytest.approx(rel["safe_lr"])]
    # after the cut, the growth measured before it says nothing of the edge of stability at the new LR
    assert not any("edge_lr" in e.details.get("relative_update", {}) for e in guard.events[1:])
    assert any("rollback" in e.actions for e in guard.events) and guard.counters["lr_cuts"] == 1
    assert guard.lr_scale == pytest.approx(rel["safe_lr"] / 1.5)
    assert guard.lr_scale > 100 * guard.config.recovery.min_lr_scale
    assert models.all_finite(model) and loss < 1.1 * runs["sane"][0], (loss, runs["sane"][0])


# ------------------------------------------------------------------------------------------ skipping a step


def _clone_state(opt):
    return {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state.items()}


def test_skipped_step_leaves_optimizer_state_untouched(fit):
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
    fit(model, data, [guard, Spy()])
    assert [e.step for e in guard.events] == [2]
    (state_b, params_b), (state_a, params_a) = snapshots["before"], snapshots["after"]
    for pb, pa in zip(params_b, params_a):
        assert torch.equal(pb, pa)
    for p, s in state_b.items():
        for name, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(state_a[p][name])), name  # incl. 'step'


def test_inf_input_through_batchnorm_leaves_buffers_finite(fit):
    data = models.classification_data(n=256)
    poisoned = models.poison_rows(data, [40, 41, 130], float("inf"))
    model = models.Classifier(dropout=0.0)
    guard = NaNGuard()
    fit(model, poisoned, [guard])
    bad_steps = sorted({r // 32 for r in (40, 41, 130)})
    assert [e.step for e in guard.events] == bad_steps
    bn = model.net[1]
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
    assert int(bn.num_batches_tracked) == len(data) // 32 - len(bad_steps)  # the bad forwards' updates were undone
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(data.tensors[0])).all()


def test_buffer_undo_restores_batchnorm_stats_and_skips_constant_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.ones(1000))
    undo = BufferUndo(model)
    undo.arm()
    model(torch.randn(8, 4))
    undo.disarm()
    good = {k: v.clone() for k, v in model.named_buffers()}
    undo.arm()
    model(torch.full((8, 4), NAN))
    assert not torch.isfinite(model[1].running_mean).all()
    assert sorted(undo.undo()) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for k, v in model.named_buffers():
        assert torch.equal(v, good[k]), k


# ----------------------------------------------------------------------------------------------- the ladder


def _ladder(**recovery):
    return RecoveryLadder(RecoveryConfig(**recovery), ClipConfig())


def test_ladder_skips_then_rolls_back_then_gives_up():
    ladder = _ladder(max_skips=2, max_rollbacks=2, reduce_lr_after=0)
    plans = [ladder.incident(step, "loss", can_roll_back=True) for step in range(9)]
    rollbacks = [i for i, p in enumerate(plans) if p.rollback]
    assert rollbacks == [2, 5]
    assert [p.go_further_back for p in plans if p.rollback] == [False, True]
    assert plans[8].give_up and not any(p.give_up for p in plans[:8])


def test_ladder_snapshot_confirms_recovery_and_healthy_resets_skips():
    ladder = _ladder(max_skips=1, max_rollbacks=1, reduce_lr_after=0)
    assert not ladder.incident(0, "loss", can_roll_back=True).rollback
    ladder.healthy()
    assert not ladder.incident(1, "loss", can_roll_back=True).rollback
    assert ladder.incident(2, "loss", can_roll_back=True).rollback
    ladder.snapshot_taken()  # the rollback worked: a new known-good state exists
    ladder.incident(10, "loss", can_roll_back=True)
    plan = ladder.incident(11, "loss", can_roll_back=True)
    assert plan.rollback and not plan.give_up and not plan.go_further_back


def test_ladder_lr_cuts_by_count_and_on_rollback_but_not_for_inputs():
    ladder = _ladder(max_skips=10, reduce_lr_after=2, incident_window=5)
    assert not ladder.incident(0, "loss", can_roll_back=True).reduce_lr
    assert ladder.incident(1, "gradient", can_roll_back=True).reduce_lr
    assert not ladder.incident(2, "input", can_roll_back=True, cause="input").reduce_lr
    assert not ladder.incident(3, "loss", can_roll_back=True).reduce_lr
    assert not ladder.incident(20, "loss", can_roll_back=True).reduce_lr  # step 3 left the window
    params = _ladder(reduce_lr_after=0)
    plan = params.incident(0, "parameter", can_roll_back=True)
    assert plan.rollback and not plan.reduce_lr  # a one-off bad parameter is no reason for a smaller LR
    inputs = _ladder(max_skips=1, reduce_lr_after=2)
    assert not any(inputs.incident(s, "input", can_roll_back=True, cause="input").reduce_lr for s in range(3))


def test_ladder_default_cuts_lr_only_on_evidence_of_divergence():
    ladder = _ladder(max_skips=2)
    isolated = []
    for s in (0, 5, 9, 12):
        isolated.append(ladder.incident(s, "loss", can_roll_back=True))
        ladder.healthy()
    assert not any(p.reduce_lr or p.rollback for p in isolated)  # spread-out faults: skip, never cut
    ladder = _ladder(max_skips=2)
    run = [ladder.incident(s, "loss", can_roll_back=True) for s in range(3)]
    assert [p.reduce_lr for p in run] == [False, False, True] and run[2].rollback  # skipping did not help
    ladder = _ladder(max_skips=2)
    run = [ladder.incident(s, "gradient", can_roll_back=True, cause="exploding_gradient") for s in range(2)]
    assert [p.reduce_lr for p in run] == [True, False]  # once per run of incidents, not per incident
    no_snapshots = _ladder(max_skips=1)
    run = [no_snapshots.incident(s, "loss", can_roll_back=False) for s in range(2)]
    assert run[1].reduce_lr and not run[1].rollback


def test_ladder_adaptive_clip_switches_on_after_first_non_input_incident():
    ladder = _ladder()
    assert not ladder.incident(0, "input", can_roll_back=True, cause="input").arm_clip
    assert ladder.incident(1, "loss", can_roll_back=True).arm_clip
    assert not ladder.incident(2, "loss", can_roll_back=True, clip_armed=True).arm_clip  # armed already
    off = RecoveryLadder(RecoveryConfig(), ClipConfig(adaptive="off"))
    assert not off.incident(0, "loss", can_roll_back=True).arm_clip


def test_ladder_without_snapshot_gives_up_on_bad_parameters():
    ladder = _ladder()
    assert ladder.incident(0, "parameter", can_roll_back=False).give_up


@pytest.mark.parametrize("field", [None, "consecutive", "failed_rollbacks", "recent"])
def test_ladder_loaded_from_its_state_dict_plans_like_the_original(field):
    """A ladder loaded from another's state_dict answers the same incidents with the same plans; each piece of
    the state matters (dropping any one of them from what is loaded changes the plans)."""
    cfg = dict(max_skips=2, max_rollbacks=2, reduce_lr_after=3, incident_window=50, reduce_lr_on_rollback=False)
    original = _ladder(**cfg)
    for step in (0, 1, 2, 5):  # a rollback (not confirmed), adaptive clipping armed, one incident in a row
        original.incident(step, "loss", can_roll_back=True)
    state = original.state_dict()
    assert state["consecutive"] == 1 and state["failed_rollbacks"] == 1
    assert state["recent"] == [5]  # the cut by count at step 2 cleared the older ones
    if field is not None:
        del state[field]
    loaded = _ladder(**cfg)
    loaded.load_state_dict(state)
    later = [loaded.incident(s, "loss", can_roll_back=True) for s in range(6, 12)]
    expected = [original.incident(s, "loss", can_roll_back=True) for s in range(6, 12)]
    assert (later == expected) is (field is None), (later, expected)
    if field is None:  # (rollback, further back, cut, give up): the 3rd in a row at 7 rolls back further (the
        # first rollback was not confirmed) and is the 3rd within the window (cut); the next run gives up
        assert [(p.rollback, p.go_further_back, p.reduce_lr, p.give_up) for p in expected] == [
            (False, False, False, False), (True, True, True, False), (False, False, False, False),
            (False, False, False, False), (False, False, False, True), (False, False, False, True)]


def test_incident_window_boundary_in_the_ladder():
    """An incident counts towards reduce_lr_after while it is less than incident_window steps old."""
    window = 5
    ladder = RecoveryLadder(RecoveryConfig(reduce_lr_after=2, incident_window=window, max_skips=10), ClipConfig())
    assert not ladder.incident(0, "loss", can_roll_back=True).reduce_lr
    ladder.healthy()
    assert not ladder.incident(window, "loss", can_roll_back=True).reduce_lr  # step 0 is exactly a window old
    ladder.healthy()
    assert ladder.incident(2 * window - 1, "loss", can_roll_back=True).reduce_lr  # step 5 is window - 1 old


def test_reduce_lr_on_rollback_off_rolls_back_without_a_cut():
    for on in (True, False):
        ladder = RecoveryLadder(RecoveryConfig(max_skips=1, reduce_lr_on_rollback=on), ClipConfig())
        plans = [ladder.incident(s, "loss", can_roll_back=True) for s in range(2)]
        assert [(p.rollback, p.reduce_lr) for p in plans] == [(False, False), (True, on)]


# ------------------------------------------------------------------------------------------------- rollback


def test_rollback_loads_the_newest_snapshot_then_the_one_before(fit_steps):
    """Module (incl. BatchNorm buffers), AdamW moments and step, and the scheduler are, right after each
    rollback, bitwise the state captured when the snapshot was taken: the newest snapshot first, then (the
    rollback did not help) the one before it."""
    recovery = {"snapshot_every": 4, "keep_snapshots": 2, "max_skips": 3, "reduce_lr_on_rollback": False}
    burst = range(10, 10 + 2 * (recovery["max_skips"] + 1))  # two rollbacks, the second before any new snapshot
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps, starts = models.SnapshotSpy(guard), AtBatchStart()
    model = models.Classifier(scheduler="cosine")
    fit_steps(model, [FaultInjector(Fault("loss", steps=burst)), guard, snaps, starts], steps=24,
              data=models.classification_data(n=1024), batch_size=32)
    rollbacks = [e for e in guard.events if "rollback" in e.actions]
    assert [e.step for e in rollbacks] == [burst[0] + recovery["max_skips"], burst[-1]]
    taken = sorted(s for s in snaps.states if s <= burst[0])
    expected = [taken[-1], taken[-2]]
    assert [e.details["restored_step"] for e in rollbacks] == expected
    for event, step in zip(rollbacks, expected):
        assert_same(starts.states[event.step + 1], snaps.states[step], f"rollback at {event.step}")
    # what was compared holds what the issue names
    opt_state = snaps.states[expected[0]]["optimizers"][0]["state"]
    assert opt_state and all({"exp_avg", "exp_avg_sq", "step"} <= s.keys() for s in opt_state.values())
    assert snaps.states[expected[0]]["schedulers"][0]["last_epoch"] == expected[0]
    assert "net.1.running_mean" in snaps.states[expected[0]]["module"]
    # a snapshot after the second rollback confirmed it
    assert guard.state_dict()["recovery"]["ladder"]["failed_rollbacks"] == 0


def test_rollback_goes_further_back_when_it_does_not_help(fit):
    data = models.regression_data(n=2048)

    class Poisoned(models.Regression):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_step >= 25:
                x = x * float("nan")
            return nn.functional.mse_loss(self(x), y)

    guard = NaNGuard(recovery={"snapshot_every": 10, "keep_snapshots": 3, "max_skips": 1, "max_rollbacks": 3})
    model = Poisoned()
    fit(model, data, [guard], batch_size=16, max_steps=60)
    restored = [e.details["restored_step"] for e in guard.events if "rollback" in e.actions]
    assert restored == sorted(restored, reverse=True) and len(set(restored)) == len(restored) > 1, restored
    assert guard.events[-1].actions[-1] == "stop"


class WeightsAtStart(pl.Callback):
    def __init__(self) -> None:
        self.weights: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.weights[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_skip_batches_after_rollback(fit):
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
    fit(Burst(), data, [guard, starts], max_epochs=1)
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


def test_skip_batches_undo_what_their_forward_wrote_into_buffers(fit):
    """docs/recovery.md: the steps skipped after a rollback (skip_batches) are skipped like an incident's: what
    their forward passes wrote into buffers is undone, so the BatchNorm statistics stay the restored snapshot's
    through them, and move again with the first step that trains."""
    burst = range(10, 13)
    recovery = {"max_skips": 2, "skip_batches": 3, "snapshot_every": 5}

    class Burst(models.Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx in burst:
                x = x * float("nan")
            return nn.functional.cross_entropy(self(x), y)

    guard, starts = NaNGuard(recovery=recovery, logging=QUIET), WeightsAtStart()
    fit(Burst(dropout=0.0), models.classification_data(n=32 * 20), [guard, starts], max_epochs=1)
    (rollback,) = [e for e in guard.events if "rollback" in e.actions]
    assert rollback.step == burst[-1] and "skip_batches" in rollback.actions
    w, buffers = starts.weights, ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked")
    skipped = range(rollback.step + 1, rollback.step + 1 + recovery["skip_batches"])
    for step in skipped:  # the forward of each skipped batch ran (in train mode: it updated the statistics)
        assert all(torch.equal(w[step][k], w[step + 1][k]) for k in buffers), step
    after = skipped[-1] + 1
    assert not torch.equal(w[after]["net.1.running_mean"], w[after + 1]["net.1.running_mean"])


class NaNLossRegression(Regression):
    """Healthy nn.Linear + SGD whose loss is NaN at the given optimizer steps."""

    def __init__(self, nan_steps: tuple[int, ...]) -> None:
        super().__init__(lr=0.05)
        self.nan_steps = nan_steps

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.nan_steps else loss


def test_rollback_restores_the_running_statistics_of_the_snapshot(fit: Any) -> None:
    """Statistics gathered while a run diverged would blind adaptive clipping and spike detection after the
    rollback: they are part of the known-good state."""
    import pytorch_lightning as pl

    seen: list[tuple[int, dict, dict, dict, dict]] = []
    before: list[tuple[dict, dict]] = []  # the statistics of the last step before the rollback

    class Probe(pl.Callback):  # after the guard's on_train_batch_end, i.e. after the rollback
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if not guard.counters["rollbacks"]:
                before[:] = [(copy.deepcopy(guard.state_dict()["clipper"]["zclip"]),
                              copy.deepcopy(guard.state_dict()["losses"]["spikes"]))]
            elif not seen:
                newest = guard.snapshots.newest
                seen.append((newest.step, newest.meta["zclip"], guard.state_dict()["clipper"]["zclip"],
                             newest.meta["loss_stats"], guard.state_dict()["losses"]["spikes"]))

    guard = NaNGuard()  # 4 NaN losses in a row: skip x3, then roll back
    first_nan = 70  # healthy steps after the newest snapshot change the statistics before the NaN steps
    nan_steps = tuple(range(first_nan, first_nan + guard.config.recovery.max_skips + 1))
    fit(NaNLossRegression(nan_steps=nan_steps), regression_data(), [guard, Probe()], shuffle=True, max_epochs=6)
    (snap_step, zclip_snap, zclip_now, loss_snap, loss_now), = seen
    assert first_nan - guard.config.recovery.snapshot_every < snap_step < first_nan
    (zclip_before, loss_before), = before
    assert zclip_before["count"] == zclip_snap["count"] + (first_nan - snap_step)  # learned since the snapshot
    assert loss_before != loss_snap
    assert zclip_now == zclip_snap and loss_now == loss_snap and zclip_now["count"] >= 50


# ------------------------------------------------------------------------------------------------ giving up


@pytest.mark.parametrize("poison", ["loss", "parameter"])
@pytest.mark.parametrize("on_give_up", ["stop", "raise"])
def test_every_batch_poisoned_ends_bounded_with_the_last_good_weights(make_trainer, on_give_up, poison):
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
    trainer = make_trainer([injector, guard, snaps], max_steps=200, max_epochs=-1)
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
    report = Path(guard.report_path(guard.events[-1]))
    assert report.exists() and "cause" in report.read_text()


def test_after_giving_up_the_guard_skips_the_steps_the_trainer_still_runs(make_trainer):
    """docs/recovery.md: with on_give_up: stop, 'the Trainer stops at the end of the step and the guard skips any
    remaining step'. ``Trainer(min_steps=...)`` keeps the loop going past the stop: the batches after the give-up
    are healthy, yet none of them is applied, so the weights stay the restored snapshot's to the end."""
    recovery = {"max_skips": 2, "max_rollbacks": 2, "snapshot_every": 5, "keep_snapshots": 2, "on_give_up": "stop"}
    healthy, bound = 12, 9  # (max_skips + 1) * (max_rollbacks + 1) poisoned steps reach the give-up
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps = models.SnapshotSpy(guard)
    injector = FaultInjector(Fault("loss", steps=range(healthy, healthy + bound)))  # healthy again after it
    model = models.Regression()
    trainer = make_trainer([injector, guard, snaps], max_steps=60, min_steps=40, max_epochs=-1)
    trainer.fit(model, models.loader(models.regression_data(n=256), 16))
    assert guard.stopped and guard.events[-1].actions[-1] == "stop"
    assert guard.events[-1].step == healthy + bound - 1 and len(guard.events) == bound
    assert trainer.global_step == 40  # min_steps: the loop ran 28 more steps after the give-up
    good = snaps.states[guard.events[-1].details["restored_step"]]["module"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[k]), k


# -------------------------------------------------------------------------------------------------- LR cuts


def _schedulers():
    return {
        "step": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
        "exponential": lambda o: S.ExponentialLR(o, gamma=0.9),
        "onecycle": lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=40),
        "lambda": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        "cosine_eta_min": lambda o: S.CosineAnnealingLR(o, T_max=10, eta_min=0.1),
        "warm_restarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=5, eta_min=0.05),
        "sequential": lambda o: S.SequentialLR(o, [S.LinearLR(o, 0.1, total_iters=5),
                                                   S.CosineAnnealingLR(o, T_max=20, eta_min=0.02)],
                                               milestones=[5]),
        "chained": lambda o: S.ChainedScheduler([S.ExponentialLR(o, gamma=0.95), S.StepLR(o, 4, 0.5)]),
        "cyclic": lambda o: S.CyclicLR(o, base_lr=0.1, max_lr=1.0, step_size_up=4),
        "polynomial": lambda o: S.PolynomialLR(o, total_iters=30, power=2.0),
    }


@pytest.mark.parametrize("name", sorted(_schedulers()))
def test_lr_cut_is_kept_by_every_scheduler(name):
    """After a cut by 0.5 at step 7, the LR follows exactly half of the uncut schedule."""
    make = _schedulers()[name]

    def run(cut: bool) -> list[float]:
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0, momentum=0.9)
        sched = make(opt)
        out = []
        for step in range(25):
            if cut and step == 7:
                scale_lr([opt], [sched], 0.5)
            opt.step()
            sched.step()
            out.append(opt.param_groups[0]["lr"])
        return out

    plain, cut = run(False), run(True)
    assert cut[:6] == plain[:6]
    for step in range(7, 25):
        assert cut[step] == pytest.approx(0.5 * plain[step], rel=1e-6, abs=1e-9), (name, step)


def test_reduce_lr_on_plateau_keeps_the_cut():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = S.ReduceLROnPlateau(opt, patience=0, factor=0.5, min_lr=0.01)
    scale_lr([opt], [sched], 0.5)
    for _ in range(10):
        sched.step(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.005)  # min_lr scaled too


def test_lr_cut_survives_onecycle_schedule(fit):
    data = models.classification_data(n=512)

    def poison(batch, batch_idx, module):
        x, y = batch
        return (x * float("nan"), y) if batch_idx in (3, 4) else batch

    lrs = {}
    guarded = NaNGuard(check={"inputs": "off"}, recovery={"reduce_lr_after": 2})
    for name, guard in (("plain", None), ("guarded", guarded)):
        pl.seed_everything(0, verbose=False)
        model = models.Classifier(scheduler="onecycle", batch_hook=poison if guard else None)
        fit(model, data, [guard] if guard else [], subdir=name, max_epochs=1)
        lrs[name] = (model.trainer.optimizers[0].param_groups[0]["lr"], guard)
    guard = lrs["guarded"][1]
    assert any("reduce_lr" in e.actions for e in guard.events)
    assert guard.lr_scale == 0.5
    assert lrs["guarded"][0] == pytest.approx(0.5 * lrs["plain"][0], rel=1e-6)


class Scheduled(models.Regression):
    """SGD with a step-interval scheduler."""

    def __init__(self, make: Callable[[torch.optim.Optimizer], Any]) -> None:
        super().__init__(lr=0.05)
        self.make = make

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.make(opt), "interval": "step"}}


SCHEDULES = {
    "lambda": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=30, eta_min=0.005),
}


def uncut_lr(make, base_lr: float, steps: int) -> float:
    """The LR the schedule gives after ``steps`` scheduler steps, without any cut."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base_lr)
    sched = make(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_lr_cut_made_after_the_snapshot_survives_the_rollback(fit_steps, schedule):
    """Snapshot at 10 (lr_scale 1), cut at 12, bad parameters at 15 roll back to 10: the optimizer LR and the
    scheduler's base_lrs stay at base x lr_scale, where base is the uncut schedule at the restored step."""
    factor, base_lr = 0.3, 0.05
    make = SCHEDULES[schedule]
    guard = NaNGuard(recovery={"snapshot_every": 10, "reduce_lr_after": 2, "lr_factor": factor}, logging=QUIET)
    faults = [Fault("activation", steps=[10, 12]), Fault("parameter", steps=[14])]  # (reproduced: not transient)
    starts = AtBatchStart()
    trainer = fit_steps(Scheduled(make), [FaultInjector(faults), guard, starts], steps=24)
    assert [(e.step, "reduce_lr" in e.actions, "rollback" in e.actions) for e in guard.events] == [
        (10, False, False), (12, True, False), (15, False, True)]
    assert guard.events[2].details["restored_step"] == 10 and guard.lr_scale == factor
    after = starts.states[16]
    sched, group = after["schedulers"][0], after["optimizers"][0]["param_groups"][0]
    assert sched["last_epoch"] == 10  # the scheduler was rolled back too
    assert group["lr"] == pytest.approx(factor * uncut_lr(make, base_lr, 10), rel=1e-6)
    assert sched["base_lrs"] == [pytest.approx(factor * base_lr, rel=1e-9)]
    live = trainer.lr_scheduler_configs[0].scheduler  # and the schedule goes on from there, cut
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        factor * uncut_lr(make, base_lr, live.last_epoch), rel=1e-6)


def test_lr_cuts_stop_at_min_lr_scale(fit_steps):
    """recovery.min_lr_scale: the scale goes 1 -> lr_factor -> the floor, then stays; a cut that cannot lower
    it any more is not recorded as reduce_lr (nor counted)."""
    factor, floor = 0.4, 0.3
    guard = NaNGuard(recovery={"reduce_lr_after": 1, "lr_factor": factor, "min_lr_scale": floor}, logging=QUIET)
    steps = [3, 6, 9, 12]
    # module outputs poisoned through each step, which the replay reproduces (a one-off loss fault is a transient,
    # which never cuts the LR)
    trainer = fit_steps(models.Regression(lr=0.05), [FaultInjector(Fault("activation", steps=steps)), guard],
                        steps=16)
    scale, expected = 1.0, []
    for _ in steps:
        new = max(scale * factor, floor)
        expected.append((new < scale, new))
        scale = new
    assert expected == [(True, factor), (True, floor), (False, floor), (False, floor)]
    assert [("reduce_lr" in e.actions, e.details["lr_scale"]) for e in guard.events] == expected
    assert guard.lr_scale == floor and guard.counters["lr_cuts"] == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * floor)


class TooHighLR(Regression):
    """Regression with SGD at lr=3 (the weights move by ~40x their size per step: a divergence caught at step 3,
    diagnosed learning_rate, cut to the safe LR); its loss is multiplied by NaN on the batches ``nan_at``."""

    def __init__(self, nan_at: tuple[int, ...]) -> None:
        super().__init__(lr=3.0)
        self.nan_at = set(nan_at)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.nan_at else loss


@pytest.mark.parametrize("confirm_after, nan_at, cut, reported", [
    # two forced rollbacks in the episode: only the first is spared; both report the episode's cause
    (40, (8, 9, 12, 13), [False, True], "learning_rate"),
    # a snapshot confirmed the divergence's rollback: a new episode, its rollback cuts
    (4, (14, 15), [True], "unknown"),
], ids=["same_episode", "after_a_confirming_snapshot"])
def test_a_sized_cut_spares_only_the_first_rollback_of_its_episode(fit_steps, confirm_after, nan_at, cut, reported):
    """docs/recovery.md: after a cut to the diagnosis' safe LR, 'the first rollback of the same episode (until a
    snapshot confirms it) does not cut again'. Here the divergence's own rollback and sized cut start the episode;
    NaN losses in pairs (max_skips: 1) then force rollbacks, diagnosed unknown (inside the episode they report its
    cause, learning_rate, but are planned as unknown): the first spared rollback resets the exemption, and so does
    a confirming snapshot; every other forced rollback cuts by lr_factor."""
    guard = NaNGuard(recovery={"max_skips": 1, "snapshot_every": 50, "confirm_after": confirm_after},
                     logging=QUIET)
    fit_steps(TooHighLR(nan_at), [guard], steps=30)
    first, *rest = guard.events
    assert (first.step, first.kind, first.cause) == (3, "divergence", "learning_rate")
    assert "rollback" in first.actions and "reduce_lr" in first.actions
    sized = first.details["lr_scale"]
    assert sized < guard.config.recovery.divergence_lr_factor  # cut to the safe LR, below the factor's cut
    forced = [e for e in rest if "rollback" in e.actions]
    assert [e.step for e in forced] == list(nan_at[1::2]) and all(e.cause == reported for e in forced)
    assert [("reduce_lr" in e.actions) for e in forced] == cut
    assert guard.lr_scale == pytest.approx(sized * guard.config.recovery.lr_factor)
    assert guard.counters["lr_cuts"] == 2


@pytest.mark.parametrize("max_replays", [10, 1], ids=["replayed", "diagnosis_reused"])
def test_every_incident_of_a_too_high_lr_episode_reports_learning_rate_without_a_second_sized_cut(
        fit_steps, tmp_path, max_replays):
    """The same episode as test_a_sized_cut_spares_only_the_first_rollback_of_its_episode's: the divergence at
    step 3 is diagnosed learning_rate and cut to the safe LR; the NaN losses after it (8, 9, 12, 13), which their
    own rule calls unknown (they measure the already-cut rate), report the episode's cause in events.jsonl, and
    are planned as unknown: the first forced rollback is spared, the second cuts by lr_factor, nothing else cuts.
    With ``anomaly.max_replays: 1`` the later incidents reuse the replayed one's diagnosis (learning_rate, the
    cause it reported): still no second sized cut."""
    guard = NaNGuard(anomaly={"max_replays": max_replays},
                     recovery={"max_skips": 1, "snapshot_every": 50, "confirm_after": 40}, logging=QUIET)
    fit_steps(TooHighLR((8, 9, 12, 13)), [guard], steps=30)
    events = models.read_events(tmp_path)
    assert [(e["step"], e["cause"]) for e in events] == [(s, "learning_rate") for s in (3, 8, 9, 12, 13)]
    assert all(e["suggestion"].startswith("Part of the episode that began at step 3 (learning_rate).")
               for e in events[1:])
    assert [("reduce_lr" in e["actions"]) for e in events] == [True, False, False, False, True]
    assert [("rollback" in e["actions"]) for e in events] == [True, False, True, False, True]
    assert guard.counters["lr_cuts"] == 2
    assert guard.lr_scale == pytest.approx(events[0]["details"]["lr_scale"] * guard.config.recovery.lr_factor)


def test_incident_window_boundary_in_a_trainer(fit_steps):
    window = 5
    guard = NaNGuard(recovery={"reduce_lr_after": 2, "incident_window": window}, logging=QUIET)
    steps = [3, 3 + window, 3 + 2 * window - 1]
    fit_steps(models.Regression(), [FaultInjector(Fault("activation", steps=steps)), guard], steps=16)  # reproduced
    assert [(e.step, "reduce_lr" in e.actions) for e in guard.events] == [
        (steps[0], False), (steps[1], False), (steps[2], True)]
    assert guard.lr_scale == guard.config.recovery.lr_factor


# ------------------------------------------------------------------------------------------------ snapshots


def _adam_state():
    model = nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = S.StepLR(opt, 2)
    for _ in range(3):
        model(torch.randn(5, 6)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_snapshot_restore_is_exact_and_never_aliases(tmp_path, mode):
    model, opt, sched = _adam_state()
    store = make_store(mode, keep=2, directory=tmp_path)
    store.take(3, {"module": model.state_dict(), "optimizers": [opt.state_dict()],
                   "schedulers": [sched.state_dict()]}, {"lr_scale": 1.0})
    ref_model = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = {k: v["exp_avg"].clone() for k, v in opt.state.items()}
    for _ in range(2):  # training moves on
        model(torch.randn(5, 6)).sum().backward()
        opt.step()
        sched.step()
    state = store.load(store.newest)
    model.load_state_dict(state["module"])
    opt.load_state_dict(state["optimizers"][0])
    sched.load_state_dict(state["schedulers"][0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_model[k])
    for k, v in opt.state.items():
        assert torch.equal(v["exp_avg"], ref_opt[k])
    assert sched.last_epoch == 3
    # a step after the restore must not write into the snapshot
    model(torch.randn(5, 6)).sum().backward()
    opt.step()
    again = store.load(store.newest)
    assert torch.equal(again["module"]["weight"], ref_model["weight"])
    assert all(torch.equal(again["optimizers"][0]["state"][i]["exp_avg"], ref_opt[p])
               for i, p in enumerate(opt.state))


def test_snapshot_ring_reuses_buffers_and_drop_newest_keeps_one():
    model, opt, _ = _adam_state()
    store = make_store("memory", keep=2)
    for step in range(4):
        store.take(step, {"module": model.state_dict(), "optimizers": [opt.state_dict()]}, {})
    assert [s.step for s in store.ring] == [2, 3]
    first_ptrs = {t.data_ptr() for s in store.ring for t in s.tensors}
    store.take(4, {"module": model.state_dict(), "optimizers": [opt.state_dict()]}, {})
    assert {t.data_ptr() for t in store.ring[-1].tensors} <= first_ptrs  # steady state: no new allocation
    store.drop_newest()
    store.drop_newest()
    assert len(store) == 1


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_snapshot_every_and_keep_snapshots_in_a_healthy_run(tmp_path, fit_steps, mode):
    """One snapshot at train start, then one every snapshot_every healthy steps; the newest keep_snapshots
    are kept (disk: as files in snapshot_dir, nothing in the default folder)."""
    every, keep, steps = 3, 3, 20
    folder = tmp_path / "my-snapshots"
    recovery = {"snapshot": mode, "snapshot_every": every, "keep_snapshots": keep, "snapshot_dir": str(folder),
                "stall_anchors": False}  # (the default also keeps the fit's first one: test_stall.py)
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps = models.SnapshotSpy(guard)
    fit_steps(models.Regression(), [guard, snaps], steps=steps)
    expected = list(range(0, steps + 1, every))
    assert sorted(snaps.states) == expected and guard.counters["snapshots"] == len(expected)
    assert [s.step for s in guard.snapshots.ring] == expected[-keep:]
    if mode == "disk":
        assert sorted(p.name for p in folder.iterdir()) == sorted(f"snapshot-step{s}.pt" for s in expected[-keep:])
        assert not (tmp_path / "nanguard" / "snapshots").exists()
    else:
        assert not folder.exists()


class GrowingLoss(models.Regression):
    """The loss value times ``factors[step]`` (a detached offset: the gradients, and so the gradient norm, are
    those of the plain loss)."""

    def __init__(self, factors: dict[int, float]) -> None:
        super().__init__()
        self.factors = factors

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + (self.factors.get(self.global_step, 1.0) - 1.0) * loss.detach()


def test_no_snapshot_while_the_loss_grows_towards_a_divergence(fit_steps):
    """A snapshot that falls due while the loss grows (divergence_steps - 1 growth ratios, no event yet) waits:
    the NaN that follows rolls back to the snapshot from before the growth."""
    every = 5
    guard = NaNGuard(recovery={"snapshot_every": every}, logging=QUIET)
    growth = 2.5 * guard.config.check.divergence_growth  # well above the growth threshold despite batch noise
    due = 2 * every - 1  # the step at whose end the second periodic snapshot falls due
    steps = guard.config.check.divergence_steps - 1
    factors = {due - steps + 1 + i: growth ** (i + 1) for i in range(steps)}  # the growth ends at the due step
    nan_steps = list(range(due + 1, due + 2 + guard.config.recovery.max_skips))
    snaps = models.SnapshotSpy(guard)
    fit_steps(GrowingLoss(factors), [FaultInjector(Fault("loss", steps=nan_steps)), guard, snaps], steps=due + 8)
    assert guard.config.check.divergence == "act" and not any(e.kind == "divergence" for e in guard.events)
    assert due + 1 not in snaps.states  # deferred while the loss grew
    rollback = next(e for e in guard.events if "rollback" in e.actions)
    assert rollback.step == nan_steps[-1] and rollback.details["restored_step"] == every

def test_confirm_after_takes_the_confirming_snapshot_sooner(fit_steps):
    """After a rollback, a snapshot confirms it after confirm_after healthy steps (not snapshot_every)."""
    recovery = {"snapshot_every": 20, "confirm_after": 3, "max_skips": 1}
    guard = NaNGuard(recovery=recovery, logging=QUIET)
    snaps = models.SnapshotSpy(guard)
    burst = [25, 26]
    fit_steps(models.Regression(), [FaultInjector(Fault("loss", steps=burst)), guard, snaps], steps=52)
    rollback = burst[-1]
    assert [e.step for e in guard.events if "rollback" in e.actions] == [rollback]
    confirming = rollback + 1 + recovery["confirm_after"]
    after = [s for s in sorted(snaps.states) if s > rollback]
    assert after[:2] == [confirming, confirming + recovery["snapshot_every"]]  # then the usual interval again
    assert guard.state_dict()["recovery"]["ladder"]["failed_rollbacks"] == 0


def test_snapshot_off_takes_none_and_refuses_a_nonfinite_checkpoint(tmp_path, fit_steps):
    """recovery.snapshot: off keeps nothing to roll back to: a checkpoint that would hold a non-finite weight
    is refused with NaNGuardError and never written (with snapshots it is replaced by known-good state)."""
    bad = 3
    for mode in ("memory", "off"):
        guard = NaNGuard(recovery={"snapshot": mode}, logging=QUIET)
        ckpt = ModelCheckpoint(dirpath=tmp_path / mode, every_n_train_steps=1, save_top_k=-1, filename="{step}")
        callbacks = [FaultInjector(Fault("parameter", steps=[bad])), guard, ckpt]
        run = lambda cbs=callbacks, m=mode: fit_steps(models.Regression(), cbs, steps=6,  # noqa: E731
                                                     subdir=f"{m}-run", enable_checkpointing=True)
        if mode == "off":
            with pytest.raises(NaNGuardError):
                run()
            assert guard.counters["snapshots"] == 0 and guard.snapshots is None
        else:
            run()
            assert guard.counters["rollbacks"] == 1
        files = sorted(p.name for p in (tmp_path / mode).glob("*.ckpt"))
        written = range(1, bad + 1) if mode == "off" else range(1, 7)
        assert files == sorted(f"step={s}.ckpt" for s in written), (mode, files)
        for f in files:
            state = torch.load(tmp_path / mode / f, map_location="cpu", weights_only=False)["state_dict"]
            assert all(torch.isfinite(v).all() for v in state.values()), f


def test_disk_snapshots_roll_back_like_memory_ones(tmp_path, fit):
    runs = {}
    for mode in ("memory", "disk"):
        pl.seed_everything(0, verbose=False)
        model = models.NaNLossOnBatches(bad={5, 6, 7, 8})
        guard = NaNGuard(recovery={"snapshot": mode, "snapshot_every": 2, "max_skips": 3, "stall_anchors": False})
        fit(model, models.regression_data(n=96), [guard], subdir=mode, batch_size=8, max_steps=12)
        assert guard.counters["rollbacks"] == 1 and "rollback" in guard.events[-1].actions
        runs[mode] = (model, guard)
    assert all(torch.equal(a, b) for a, b in zip(runs["memory"][0].state_dict().values(),
                                                  runs["disk"][0].state_dict().values()))
    folder = tmp_path / "disk" / "nanguard" / "snapshots"
    files = sorted(p.name for p in folder.iterdir())
    assert files and all(f.startswith("snapshot-step") and f.endswith(".pt") for f in files)  # no *.tmp left
    assert len(files) <= runs["disk"][1].config.recovery.keep_snapshots
