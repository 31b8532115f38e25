"""The incident pipeline's pure parts, mirroring lightning_nanguard/respond/incident.py (issue 36): the kind an
incident takes, the merge of what was done, and every builder (a step's on a real StepRecord, the others on plain
values; no Trainer: the end-to-end fits of the other test files stay as they are). The actions themselves:
tests/test_actions.py."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from lightning_nanguard.core.record import StepRecord, UpdateStage, Window
from lightning_nanguard.detect.vector import SCHEMA
from lightning_nanguard.respond import incident as incidents
from lightning_nanguard.recover.actions import Raise, RollBack, Rollback, SkipStep, Warn
from lightning_nanguard.respond.incident import (NOTHING_DONE, ActAtStepEnd, ActNow, At, Given, Ladder, Look,
                                                 MustRollBack, NoteNow, Response, RestoreAtEnd, StopAtStart, Told,
                                                 kind_of)

WHERE = {"rank": 1, "host": "h", "device": "cpu", "local_rank": 1}
AT = At(step=7, epoch=0, batch_idx=7, log_step=7, where=WHERE)
BAD = [{"name": "net.0.weight"}, {"name": "bn.running_mean"}]


@pytest.mark.parametrize("findings, inputs, expected", [
    ([], [], "loss"),  # nothing looked at explains it: the step's own kind
    ([], [{"path": "batch[0]"}], "input"),  # the batch holds it
    ([{"name": "bn.running_mean"}], [{"path": "batch[0]"}], "buffer"),  # buffers only: the weights come first
    (BAD, [], "parameter"),  # a parameter among them
])
def test_kind_of_names_what_was_non_finite_weights_first(findings, inputs, expected):
    assert kind_of("loss", findings, {"bn.running_mean"}, inputs) == expected


def test_a_merged_response_keeps_every_thing_done_and_the_later_rollbacks_kept_step():
    skipped = Response(skipped=True, clip_to=2.0)
    rolled = Response(rollback=Rollback(kept_step=True))
    merged = skipped.merge(rolled)
    assert merged == Response(skipped=True, rollback=Rollback(kept_step=True), clip_to=2.0)
    assert merged.rolled_back and merged.kept_step and not skipped.rolled_back and not skipped.kept_step
    # a later response that did not roll back leaves the rollback's kept_step as it was; its clip wins
    later = merged.merge(Response(stopped=True, clip_to=1.0))
    assert later == Response(True, False, Rollback(kept_step=True), True, 1.0)
    # a later rollback that did not keep the step wins over the earlier one
    assert not later.merge(Response(rollback=Rollback())).kept_step
    assert NOTHING_DONE.merge(NOTHING_DONE) is not NOTHING_DONE and NOTHING_DONE.merge(NOTHING_DONE) == NOTHING_DONE


def test_at_makes_the_event_where_the_rank_ran():
    event = AT.event("loss")
    assert (event.step, event.kind, event.rank, event.host, event.log_step) == (7, "loss", 1, "h", 7)


def test_bad_weights_outside_a_step_look_at_the_weights_and_act_now_on_every_rank():
    found = incidents.bad_weights(AT, "validation_start", grads_were_finite=True, own_evidence=True)
    assert (found.act, found.look, found.planning, found.detected_at) == (ActNow(), Look.WEIGHTS, Ladder(),
                                                                          "validation_start")
    assert found.share and found.diagnose and found.own_evidence and found.event.kind == "parameter"


def test_fit_start_stops_with_the_names_of_the_bad_parameters():
    found = incidents.fit_start(AT, BAD, "raise")
    assert found.act == StopAtStart("non-finite parameters before training (net.0.weight, bn.running_mean)")
    assert found.event.actions == ["raise"] and found.evidence.at_fit_start


def test_after_stop_restores_or_says_why_not_and_stops():
    restored = incidents.after_stop(AT, BAD, {"bn.running_mean"}, "stop")
    assert isinstance(restored.act, RestoreAtEnd) and restored.event.kind == "parameter"
    told = restored.act.conclude(5, "")
    assert not told.stop  # restored: the fit ends normally
    assert (told.action, told.details) == (RollBack(), {"restored_step": 5})
    assert "the snapshot of step 5" in told.suggestion and restored.event.actions == []  # (the pipeline writes it)
    nothing = incidents.after_stop(AT, BAD, set(), "raise")
    assert isinstance(nothing.act, RestoreAtEnd)
    told = nothing.act.conclude(None, "every snapshot left was refused when read back")
    assert told.stop and told.action == Raise() and told.details["restored_step"] is None
    assert told.details["not_restored"].startswith("every snapshot")
    assert "nothing could be restored (every snapshot left was refused" in told.suggestion


def test_unfinished_says_why_nothing_was_restored():
    source = AT.event("divergence")
    source.cause, source.culprit = "learning_rate", "net.2"
    found = incidents.unfinished(AT, "divergence", source, "the loss ran away", {}, in_a_row=2, unconfirmed=1)
    event = found.event
    assert (event.cause, event.culprit, event.details["source_step"]) == ("learning_rate", "net.2", 7)
    assert isinstance(found.act, RestoreAtEnd)
    told = found.act.conclude(None, "recovery.snapshot is 'off'")
    assert (told.stop, told.action, told.details) == (False, Warn(), {"not_restored": "recovery.snapshot is 'off'"})
    assert "to restore (recovery.snapshot is 'off')" in told.suggestion
    assert found.act.conclude(4, "") == Told(RollBack(), found.act.conclude(4, "").suggestion, {"restored_step": 4})


def test_drifted_replicas_roll_every_rank_back_with_the_odd_ranks_account():
    gathered = [{"checksum": 1, **WHERE, "rank": 0, "host": "a"}, {"checksum": 2, **WHERE, "rank": 1, "host": "b"},
                {"checksum": 1, **WHERE, "rank": 2, "host": "c"}]
    found = incidents.replicas_drifted(AT, gathered, [1], 5, "transient")
    assert found.act == ActNow() and found.planning == MustRollBack("the DDP replicas' weights differ")
    assert (found.event.rank, found.event.host, found.event.kind) == (1, "b", "replica")
    assert found.event.details["replica"]["odd_ranks"] == [1] and found.event.details["replica"]["agreed_at_step"] == 5


# ------------------------------------------------------------------------------------- a step's incidents

def flags(**values: float):
    """A step's evidence as the host reads it (every field 0 but the ones given; no GradScaler)."""
    row = [0.0] * len(SCHEMA.fields)
    row[SCHEMA.index["grad_scale"]] = math.nan
    for name, value in values.items():
        row[SCHEMA.index[name]] = value
    return SCHEMA.read(row)


def step_record(update: UpdateStage = UpdateStage.ON_HOST, replica: Optional[dict] = None, **values: float):
    """A real StepRecord of step 7 on a real optimizer (two param groups), its flags read."""
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1},
                                 {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.01}])
    window = Window()
    window.add(("batch",), 7)
    record = StepRecord(step=7, epoch=0, window=window, lrs=[0.1, 0.01], loss_checked=True, optimizer=optimizer,
                        update=update, scaled=False, has_norm=True, log_step=7, replica=replica)
    record.flags = flags(**{"grad_norm": 3.0, "loss": 1.5, **values})
    return record


def test_a_nonfinite_loss_is_diagnosed_shared_skipped_and_its_plan_waits_for_the_step_end():
    record = step_record(loss_bad=1.0, loss=math.nan)
    found = incidents.nonfinite_step(AT, record, grads_were_finite=True, check_parameters=True, check_inputs=True,
                                     scaler=(2, 1024.0))
    assert found.event.kind == "loss" and found.event.details == {"grad_norm": 3.0, "lr": [0.1, 0.01]}
    assert (found.act, found.planning, found.look) == (ActAtStepEnd(), Ladder(), Look.WEIGHTS)
    assert found.skip == SkipStep(mirrored=True, undo_buffers=False, applied_rolls_back=True)
    assert found.diagnose and found.share and found.look_at_inputs and found.keeps_window and not found.replica
    ev = found.evidence
    assert ev.window is record.window and not ev.only_gradients and ev.same_weights
    assert (ev.scaler_overflows, ev.grad_scale) == (2, 1024.0)
    assert sorted(ev.step_lrs.values()) == [0.01, 0.1]  # by param group: a scheduler stepped since cannot change it


@pytest.mark.parametrize("update, values, checked, look", [
    (UpdateStage.ON_HOST, {"loss_bad": 1.0}, True, Look.WEIGHTS),
    (UpdateStage.ON_HOST, {"loss_bad": 1.0}, False, Look.NOTHING),  # check.parameters off: not looked at
    (UpdateStage.ON_DEVICE, {"loss_bad": 1.0}, True, Look.PARAMETERS),  # the buffers hold the next step's writes
    (UpdateStage.APPLIED, {"loss_bad": 1.0}, True, Look.NOTHING),  # other weights by now
    (UpdateStage.APPLIED, {"param_bad": 1.0}, False, Look.WEIGHTS),  # its own flag says the weights: always
])
def test_a_nonfinite_step_looks_only_at_the_weights_it_ran_on(update, values, checked, look):
    found = incidents.nonfinite_step(AT, step_record(update, **values), grads_were_finite=None,
                                     check_parameters=checked, check_inputs=False)
    assert found.look is look and found.evidence.same_weights is (update is not UpdateStage.APPLIED)


def test_ranks_whose_reduced_gradients_disagree_make_a_replica_incident():
    replica = {"grad_norms": [3.0, 4.0]}
    found = incidents.nonfinite_step(AT, step_record(replica=replica), grads_were_finite=True,
                                     check_parameters=False, check_inputs=False)
    assert found.event.kind == "replica" and found.replica and found.event.details["replica"] == replica
    assert found.evidence.only_gradients
    # a rank with evidence of its own: its own kind, not the disagreement
    own = incidents.nonfinite_step(AT, step_record(replica=replica, input_bad=1.0), grads_were_finite=True,
                                   check_parameters=False, check_inputs=False)
    assert own.event.kind == "input" and not own.replica


def test_a_divergence_rolls_back_to_before_its_onset_or_only_warns():
    found = {"onset_step": 3, "growth": 2.0}
    acted = incidents.divergence(AT, step_record(), found, act=True)
    assert (acted.act, acted.planning) == (ActAtStepEnd(), Ladder(rollback_before=3))
    assert acted.skip == SkipStep(mirrored=False, undo_buffers=True) and acted.event.actions == []
    assert acted.event.details["divergence"] == found and acted.event.details["loss"] == 1.5
    warned = incidents.divergence(AT, step_record(), found, act=False)
    assert (warned.act, warned.planning, warned.skip) == (NoteNow(), None, None)
    assert warned.event.actions == ["warn"] and warned.share and warned.diagnose


@pytest.mark.parametrize("action, repeated, skip, clip_to, reasons", [
    ("skip_step", False, SkipStep(mirrored=True, undo_buffers=True), None, None),
    ("clip", False, None, 2.5, None),
    ("reduce_lr", False, None, None, ["loss spike"]),
    ("warn", True, None, None, [f"{incidents.SPIKES_BEFORE_LR_CUT} loss spikes within 50 steps"]),
])
def test_a_loss_spike_acts_on_its_own_step_and_repeated_ones_cut_the_lr(action, repeated, skip, clip_to, reasons):
    found = incidents.spike(AT, step_record(), z=9.0, test={"mean": 1.0}, grad_norm_zscore=None, cause="bad_batch",
                            growth={"grad_norm_growth": 1.1}, action=action, clip_to=2.5, repeated=repeated, window=50)
    assert found.act == NoteNow() and found.skip == skip and found.clip_to == clip_to
    assert found.event.cause == "bad_batch" and found.event.details["loss_mean"] == 1.0
    assert found.event.details["grad_norm_growth"] == 1.1
    assert ("clip_to" in found.event.details) is (clip_to is not None)
    if reasons is None:
        assert found.planning is None
    else:
        assert isinstance(found.planning, Given) and found.planning.plan.reduce_lr
        assert found.planning.plan.reasons == tuple(reasons) and not found.planning.plan.rollback


@pytest.mark.parametrize("can_roll_back", [True, False])
def test_persistent_clipping_rolls_back_where_it_can_and_cuts_the_lr(can_roll_back):
    found = incidents.persistent_clipping(AT, step_record(), streak=8, threshold=1.0, cause="learning_rate",
                                          can_roll_back=can_roll_back)
    assert found.act == ActAtStepEnd() and found.skip == SkipStep(mirrored=False, undo_buffers=False)
    assert isinstance(found.planning, Given)
    assert (found.planning.plan.rollback, found.planning.plan.reduce_lr) == (can_roll_back, True)
    assert found.event.kind == "spike" and found.event.actions == ["clip"]
    assert "8 consecutive steps" in found.event.details["reason"]


def test_the_users_anomaly_error_is_recorded_without_history_and_raises():
    window = Window()
    found = incidents.anomaly_error(AT, "gradient", window, {"op": "LogBackward0"}, check_inputs=True)
    assert found.act == NoteNow() and found.event.actions == ["raise"] and found.anomaly == {"op": "LogBackward0"}
    assert not found.history and found.evidence.window is window and found.detected_at == "anomaly_mode"


def test_an_incident_is_a_frozen_value():
    found = incidents.bad_weights(AT, "checkpoint", grads_were_finite=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.look = Look.NOTHING  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        NOTHING_DONE.skipped = True  # type: ignore[misc]


@pytest.mark.parametrize("fault", ["gradient", "parameter"])
def test_an_incident_scans_its_weights_and_inputs_once(fit, fault):
    """The responder looks at the weights and inputs behind an incident once (its kind and the diagnosis read the
    same findings): one scan per incident, through a real fit."""
    import pytorch_lightning as pl

    from lightning_nanguard import NaNGuard
    from lightning_nanguard.testing import Fault, FaultInjector
    from .models import Regression, regression_data

    guard = NaNGuard(logging={"verbose": False})
    scans: list[int] = []

    class Counting(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            look = guard._parts.evidence.nonfinite_behind

            def counted(*args, **kwargs):
                scans.append(trainer.global_step)
                return look(*args, **kwargs)
            guard._parts.evidence.nonfinite_behind = counted

    fit(Regression(), regression_data(n=256), [guard, Counting(), FaultInjector([Fault(fault, steps=[4],
                                                                                      target="linear.weight")])],
        batch_size=16, steps=8)
    assert guard.counters["incidents"] >= 1
    assert len(scans) == guard.counters["incidents"], (scans, [(e.step, e.kind) for e in guard.events])
