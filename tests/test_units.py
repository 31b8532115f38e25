"""Unit tests for the pure pieces: checks, LR scaling, the ladder, buffer undo, snapshots."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S

from lightning_nanguard.config import ClipConfig, RecoveryConfig
from lightning_nanguard.recover.ladder import RecoveryLadder
from lightning_nanguard.recover.actions import BufferUndo, scale_lr
from lightning_nanguard.recover.snapshots import SnapshotStore

NAN = float("nan")


# ---------------------------------------------------------------------------------------- learning rate


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


# --------------------------------------------------------------------------------------------- the ladder


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
    assert not ladder.incident(2, "input", can_roll_back=True).reduce_lr
    assert not ladder.incident(3, "loss", can_roll_back=True).reduce_lr
    assert not ladder.incident(20, "loss", can_roll_back=True).reduce_lr  # step 3 left the window
    params = _ladder(reduce_lr_after=0)
    plan = params.incident(0, "parameter", can_roll_back=True)
    assert plan.rollback and not plan.reduce_lr  # a one-off bad parameter is no reason for a smaller LR
    inputs = _ladder(max_skips=1, reduce_lr_after=2)
    assert not any(inputs.incident(s, "input", can_roll_back=True).reduce_lr for s in range(3))


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
    run = [ladder.incident(s, "gradient", can_roll_back=True, diverging=True) for s in range(2)]
    assert [p.reduce_lr for p in run] == [True, False]  # once per run of incidents, not per incident
    no_snapshots = _ladder(max_skips=1)
    run = [no_snapshots.incident(s, "loss", can_roll_back=False) for s in range(2)]
    assert run[1].reduce_lr and not run[1].rollback


def test_ladder_adaptive_clip_switches_on_after_first_non_input_incident():
    ladder = _ladder()
    assert not ladder.adaptive_clip
    assert not ladder.incident(0, "input", can_roll_back=True).enable_adaptive_clip
    assert ladder.incident(1, "loss", can_roll_back=True).enable_adaptive_clip
    assert not ladder.incident(2, "loss", can_roll_back=True).enable_adaptive_clip
    off = RecoveryLadder(RecoveryConfig(), ClipConfig(adaptive="off"))
    assert not off.incident(0, "loss", can_roll_back=True).enable_adaptive_clip


def test_ladder_without_snapshot_gives_up_on_bad_parameters():
    ladder = _ladder()
    assert ladder.incident(0, "parameter", can_roll_back=False).give_up


@pytest.mark.parametrize("field", [None, "consecutive", "failed_rollbacks", "adaptive_clip", "recent"])
def test_ladder_loaded_from_its_state_dict_plans_like_the_original(field):
    """A ladder loaded from another's state_dict answers the same incidents with the same plans; each piece of
    the state matters (dropping any one of them from what is loaded changes the plans)."""
    cfg = dict(max_skips=2, max_rollbacks=2, reduce_lr_after=3, incident_window=50, reduce_lr_on_rollback=False)
    original = _ladder(**cfg)
    for step in (0, 1, 2, 5):  # a rollback (not confirmed), adaptive clipping armed, one incident in a row
        original.incident(step, "loss", can_roll_back=True)
    state = original.state_dict()
    assert state["consecutive"] == 1 and state["failed_rollbacks"] == 1 and state["adaptive_clip"]
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


# ------------------------------------------------------------------------------------- buffers, snapshots


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
    store = SnapshotStore(keep=2, mode=mode, directory=tmp_path)
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
    store = SnapshotStore(keep=2)
    for step in range(4):
        store.take(step, {"module": model.state_dict(), "optimizers": [opt.state_dict()]}, {})
    assert [s.step for s in store.ring] == [2, 3]
    first_ptrs = {t.data_ptr() for s in store.ring for t in s.tensors}
    store.take(4, {"module": model.state_dict(), "optimizers": [opt.state_dict()]}, {})
    assert {t.data_ptr() for t in store.ring[-1].tensors} <= first_ptrs  # steady state: no new allocation
    store.drop_newest()
    store.drop_newest()
    assert len(store) == 1
