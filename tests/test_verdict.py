"""lightning_nanguard/detect/verdict.py: what one optimizer step turned out to be, on the host and on the device."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_nanguard.detect.vector import SCHEMA
from lightning_nanguard.detect.verdict import Outcome, classify, device_skipped, skip_flag


def vector(**values: float) -> torch.Tensor:
    """An evidence vector: every field 0 (grad_scale nan: no GradScaler), ``values`` set."""
    vec = torch.zeros(len(SCHEMA))
    vec[SCHEMA.index["grad_scale"]] = math.nan
    for name, v in values.items():
        vec[SCHEMA.index[name]] = v
    return vec


def flags(**values: float):
    return SCHEMA.read(vector(**values).tolist())


@pytest.mark.parametrize("field", ["param_bad", "input_bad", "activation_bad", "loss_bad"])
def test_any_flag_field_skips_the_step_and_is_an_incident(field):
    assert float(skip_flag(vector(grad_norm=1.0, **{field: 1}), gradients=False)) == 1.0
    assert float(skip_flag(vector(grad_norm=1.0, **{field: 2}), gradients=True)) == 1.0  # a rank count under DDP
    assert classify(flags(grad_norm=1.0, **{field: 1}), grads_bad=False, scaled=False,
                    overflow_persists=False) is Outcome.INCIDENT


def test_a_non_finite_norm_skips_only_where_gradients_count():
    for norm in (math.inf, math.nan):
        assert float(skip_flag(vector(grad_norm=norm), gradients=True)) == 1.0
        assert float(skip_flag(vector(grad_norm=norm), gradients=False)) == 0.0
    assert float(skip_flag(vector(grad_norm=3.0), gradients=True)) == 0.0
    assert skip_flag(vector(), gradients=True).dtype == torch.float32 and skip_flag(vector(), True).dim() == 0


def test_the_replica_check_skips_on_any_rank_s_bad_copy_or_a_disagreement():
    agree, disagree = torch.tensor(False), torch.tensor(True)
    assert float(skip_flag(vector(grad_norm=1.0), gradients=True, replicas=agree)) == 0.0
    assert float(skip_flag(vector(grad_norm=1.0), gradients=True, replicas=disagree)) == 1.0
    assert float(skip_flag(vector(grad_norm=1.0, own_grad_bad=1), gradients=True, replicas=agree)) == 1.0
    # without the replica check a rank's own copy is not read
    assert float(skip_flag(vector(grad_norm=1.0, own_grad_bad=1), gradients=True)) == 0.0


def test_classify_a_gradscaler_overflow_is_routine_until_it_persists():
    bad = flags(grad_norm=math.inf)
    assert classify(flags(grad_norm=1.0), grads_bad=False, scaled=False, overflow_persists=False) is Outcome.HEALTHY
    assert classify(bad, grads_bad=True, scaled=True, overflow_persists=False) is Outcome.ROUTINE_OVERFLOW
    assert classify(bad, grads_bad=True, scaled=True, overflow_persists=True) is Outcome.INCIDENT
    assert classify(bad, grads_bad=True, scaled=False, overflow_persists=False) is Outcome.INCIDENT
    assert classify(flags(grad_norm=1.0), grads_bad=False, scaled=False, overflow_persists=False,
                    replicas_disagree=True) is Outcome.INCIDENT


@pytest.mark.parametrize("values, gradients, scaled, disagree, spike", [
    ({"loss_bad": 1}, False, False, False, False),
    ({"grad_norm": math.inf}, True, False, False, False),
    ({"grad_norm": 1.0}, True, False, True, False),
    ({"grad_norm": 1.0}, True, False, False, True),
])
def test_device_skipped_reads_the_device_flag_the_same_way(values, gradients, scaled, disagree, spike):
    """The host's reading of a lagged step agrees with the flag the device computed (a spike the device test
    skipped is the one case the flag vector does not hold)."""
    vec = vector(**values)
    on_device = bool(skip_flag(vec, gradients, torch.tensor(disagree) if disagree else None)) or spike
    assert device_skipped(SCHEMA.read(vec.tolist()), gradients, scaled, disagree, spike) is on_device is True
    assert not device_skipped(flags(grad_norm=1.0), True, False, False, False)
    # a GradScaler's overflow is its own: the guard's device flag does not skip it
    assert not device_skipped(flags(grad_norm=math.inf), True, True, False, False)
