"""The event record (lightning_nanguard/core/events.py): an action value is recorded by its name, the vocabularies
are checked (the actions' against the classes of recover/actions.py), and the record's JSON, line and table forms."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_nanguard.core.events import KINDS, NaNEvent, to_jsonable
from lightning_nanguard.recover.actions import ACTIONS, CutLr, RollBack, SkipStep, Stop


def _event(**fields) -> NaNEvent:
    return NaNEvent(step=19, epoch=1, batch_idx=3, kind="loss", **fields)


def test_an_action_value_is_recorded_by_its_name_and_the_vocabularies_are_checked():
    event = _event(cause="learning_rate", culprit="net.0", op="AddmmBackward0")
    for action in (SkipStep(), RollBack(before=4), CutLr(0.5), Stop()):
        event.add_action(action)
    assert event.actions == ["skip_step", "rollback", "reduce_lr", "stop"]
    event.validate(ACTIONS)  # every name is in the vocabulary
    event.actions.append("pray")
    with pytest.raises(ValueError, match="unknown action 'pray'; allowed: .*'warn'"):
        event.validate(ACTIONS)
    with pytest.raises(ValueError, match="unknown event kind 'weird'"):
        NaNEvent(step=0, epoch=0, batch_idx=0, kind="weird")
    bad_cause = _event(cause="cosmic_rays")
    with pytest.raises(ValueError, match="unknown cause 'cosmic_rays'"):
        bad_cause.validate(ACTIONS)


def test_the_record_is_strict_json_and_its_line_and_table_say_what_was_done():
    event = _event(cause="overflow", culprit="enc", op="ExpBackward0", log_step=7,
                   details={"loss": float("nan"), "grad": torch.tensor([1.0, float("inf")]), "seen": {2, 1}})
    event.add_action(SkipStep())
    record = event.to_dict()
    assert "log_step" not in record and record["actions"] == ["skip_step"]
    assert record["details"] == {"loss": "nan", "grad": [1.0, "inf"], "seen": [1, 2]}
    json.dumps(record, allow_nan=False)  # strict JSON
    assert event.summary() == ("[nanguard] step 19 (epoch 1, batch 3): non-finite loss in enc (ExpBackward0), "
                               "cause=overflow -> skip_step")
    assert "| actions | skip_step |" in event.markdown() and "| cause | overflow |" in event.markdown()
    assert _event().summary().endswith("-> none")
    spike = NaNEvent(step=2, epoch=0, batch_idx=2, kind="spike")
    assert KINDS["spike"].headline and KINDS["spike"].headline in spike.summary()
    assert to_jsonable((1, float("-inf"))) == [1, "-inf"]
