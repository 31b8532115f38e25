"""The incident pipeline's pure parts, mirroring lightning_nanguard/respond/incident.py (issue 36): the kind an
incident takes, the merge of what was done, and the builders of the incidents outside a step, each on plain values
(no Trainer; the end-to-end fits of the other test files stay as they are)."""

from __future__ import annotations

import pytest

from lightning_nanguard.respond import incident as incidents
from lightning_nanguard.respond.incident import NOTHING_DONE, Act, At, Look, Planning, Response, kind_of

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
    rolled = Response(rolled_back=True, kept_step=True)
    merged = skipped.merge(rolled)
    assert merged == Response(skipped=True, rolled_back=True, kept_step=True, clip_to=2.0)
    # a later response that did not roll back leaves the rollback's kept_step as it was; its clip wins
    assert merged.merge(Response(stopped=True, clip_to=1.0)) == Response(True, False, True, True, True, 1.0)
    assert NOTHING_DONE.merge(NOTHING_DONE) is not NOTHING_DONE and NOTHING_DONE.merge(NOTHING_DONE) == NOTHING_DONE


def test_at_makes_the_event_where_the_rank_ran():
    event = AT.event("loss")
    assert (event.step, event.kind, event.rank, event.host, event.log_step) == (7, "loss", 1, "h", 7)


def test_bad_weights_outside_a_step_look_at_the_weights_and_act_now_on_every_rank():
    found = incidents.bad_weights(AT, "validation_start", grads_were_finite=True, own_evidence=True)
    assert (found.act, found.look, found.planning, found.detected_at) == (Act.NOW, Look.WEIGHTS, Planning.LADDER,
                                                                          "validation_start")
    assert found.share and found.diagnose and found.own_evidence and found.event.kind == "parameter"


def test_fit_start_stops_with_the_names_of_the_bad_parameters():
    found = incidents.fit_start(AT, BAD, "raise")
    assert found.act is Act.STOP and found.event.actions == ["raise"] and found.evidence.at_fit_start
    assert found.stop_message == "non-finite parameters before training (net.0.weight, bn.running_mean)"


def test_after_stop_restores_or_says_why_not_and_stops():
    restored = incidents.after_stop(AT, BAD, {"bn.running_mean"}, "stop")
    assert restored.act is Act.RESTORE and restored.event.kind == "parameter"
    assert restored.conclude(restored.event, 5, "") is False  # restored: the fit ends normally
    assert restored.event.actions == ["rollback"] and restored.event.details["restored_step"] == 5
    nothing = incidents.after_stop(AT, BAD, set(), "raise")
    assert nothing.conclude(nothing.event, None, "every snapshot left was refused when read back") is True
    assert nothing.event.actions == ["raise"] and nothing.event.details["not_restored"].startswith("every snapshot")
    assert "nothing could be restored (every snapshot left was refused" in nothing.event.suggestion


def test_unfinished_says_why_nothing_was_restored():
    source = AT.event("divergence")
    source.cause, source.culprit = "learning_rate", "net.2"
    found = incidents.unfinished(AT, "divergence", source, "the loss ran away", {}, in_a_row=2, unconfirmed=1)
    event = found.event
    assert (event.cause, event.culprit, event.details["source_step"]) == ("learning_rate", "net.2", 7)
    assert found.conclude(event, None, "recovery.snapshot is 'off'") is False and event.actions == ["warn"]
    assert event.details["not_restored"] == "recovery.snapshot is 'off'"
    assert "to restore (recovery.snapshot is 'off')" in event.suggestion
    again = incidents.unfinished(AT, "divergence", source, "the loss ran away", {}, in_a_row=2, unconfirmed=1)
    assert again.conclude(again.event, 4, "") is False
    assert again.event.actions == ["rollback"] and again.event.details["restored_step"] == 4


def test_drifted_replicas_roll_every_rank_back_with_the_odd_ranks_account():
    gathered = [{"checksum": 1, **WHERE, "rank": 0, "host": "a"}, {"checksum": 2, **WHERE, "rank": 1, "host": "b"},
                {"checksum": 1, **WHERE, "rank": 2, "host": "c"}]
    found = incidents.replicas_drifted(AT, gathered, [1], 5, "transient")
    assert found.act is Act.NOW and found.planning is Planning.ROLL_BACK
    assert (found.event.rank, found.event.host, found.event.kind) == (1, "b", "replica")
    assert found.event.details["replica"]["odd_ranks"] == [1] and found.event.details["replica"]["agreed_at_step"] == 5
