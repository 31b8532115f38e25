"""Detection: what is flagged and how, from the device flags and the finders to every ``check.*`` key.

The key tests run the same small setup with a key on and off (or at two values) and assert the difference
the key is documented to make, so a key that is silently ignored fails here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect import find
from lightning_nanguard.detect import kernels as flags
from lightning_nanguard.detect.weights import WeightCheck
from lightning_nanguard.testing import Fault, FaultInjector
from . import models
from .models import Regression, all_finite, regression_data

BATCH = 16


def _summary(guard: NaNGuard) -> list[tuple[int, str]]:
    return [(e.step, e.kind) for e in guard.events]


# ---------------------------------------------------------------------------------------- flags and finders


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("value,bad", [(1.0, False), (NAN, True), (INF, True), (-INF, True), (3e38, False)])
def test_nonfinite_flag(value, bad):
    assert bool(flags.nonfinite_flag(torch.tensor([0.0, value]))) is bad


def test_any_nonfinite_flag_mixed_dtypes_and_no_false_positive_on_huge_values():
    ts = [torch.full((3,), 3e38), torch.ones(2, dtype=torch.float64), torch.arange(3)]
    assert not bool(flags.any_nonfinite_flag(ts))  # a 2-norm would overflow here; the inf-norm does not
    ts.append(torch.tensor([1.0, NAN], dtype=torch.bfloat16))
    assert bool(flags.any_nonfinite_flag(ts))
    assert flags.any_nonfinite_flag([torch.arange(4)]) is None


def test_total_norm_matches_reference_and_flags_nonfinite():
    g = [torch.randn(5, 3), torch.randn(7)]
    ref = torch.sqrt(sum((t ** 2).sum() for t in g))
    assert torch.allclose(flags.total_norm(g), ref)
    assert not math.isfinite(float(flags.total_norm(g + [torch.tensor([INF])])))
    assert float(flags.total_norm([])) == 0.0


def test_total_norm_is_bitwise_get_total_norm() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(s) * 3 for s in [(16, 8), (16,), (4, 3, 3), ()]]
    for norm_type in (2.0, 1.0, math.inf):
        assert torch.equal(flags.total_norm(grads, norm_type), torch.nn.utils.get_total_norm(grads, norm_type))
    mixed = grads + [torch.randn(5, dtype=torch.float64)]  # several dtypes: torch's own path
    assert torch.equal(flags.total_norm(mixed), torch.nn.utils.get_total_norm(mixed))


def test_state_check_sees_in_place_writes_new_storage_and_huge_finite_values() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1), nn.Linear(1100, 1000))
    check = WeightCheck()
    assert not bool(check.flag(model))
    weight = model[0].weight
    with torch.no_grad():
        weight[3, 2] = float("nan")  # in place: the cached views see it
    assert bool(check.flag(model))
    with torch.no_grad():
        weight[3, 2] = 0.0
        model[1].running_var[0] = float("inf")  # a buffer
    assert bool(check.flag(model))
    with torch.no_grad():
        model[1].running_var[0] = 1.0
        model[3].weight[0, 0] = float("-inf")  # a large tensor (aminmax path)
    assert bool(check.flag(model))
    with torch.no_grad():
        model[3].weight[0, 0] = 3e38  # huge but finite: no overflow to a false alarm
    assert not bool(check.flag(model))
    model[2].bias.data = torch.full((1,), float("nan"))  # storage replaced: re-collected
    assert bool(check.flag(model))


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Item:
    feats: torch.Tensor
    label: int


def test_find_batch_nonfinite_walks_any_nesting():
    x = torch.zeros(4, 3)
    x[2, 1] = NAN
    x[3, 0] = INF
    batch = {"a": [Point(torch.ones(2), x)], "b": (Item(torch.zeros(2, 2), 1), "text"), "c": torch.arange(3)}
    found = find.find_batch_nonfinite(batch)
    assert len(found) == 1
    f = found[0]
    assert f["field"] == "batch['a'][0].y"
    assert f["samples"] == [2, 3] and f["features"] == [0, 1] and f["nan"] == 1 and f["inf"] == 1
    batch["b"][0].feats[1, 1] = -INF
    assert [f["field"] for f in find.find_batch_nonfinite(batch)] == ["batch['a'][0].y", "batch['b'][0].feats"]


def test_find_nonfinite_tensors_names_and_counts():
    named = [("ok", torch.ones(3)), ("bad", torch.tensor([NAN, INF, 1.0])), ("int", torch.arange(2))]
    assert find.find_nonfinite_tensors(named) == [
        {"name": "bad", "nan": 1, "inf": 1, "numel": 3, "shape": [3]}]


# ------------------------------------------------------------------------------------------ check.inputs


class DictData(Dataset):
    """Samples as dicts: ``x``, ``y`` and an ``aux`` field the model never reads."""

    def __init__(self, n: int = 8 * BATCH, bad_aux: Optional[int] = None, bad_x: Optional[int] = None) -> None:
        self.x, self.y = (t.clone() for t in regression_data(n).tensors)
        self.aux = torch.zeros(n, 3)
        if bad_aux is not None:
            self.aux[bad_aux, 1] = float("nan")
        if bad_x is not None:
            self.x[bad_x, 2] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "aux": self.aux[i]}


class DictRegression(Regression):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch["x"]), batch["y"])


@pytest.fixture
def fit_dict(fit: Any) -> Any:
    """``fit_dict(inputs, **data)``: one epoch of DictRegression on DictData(**data) with check.inputs=inputs."""

    def run(inputs: str, **data: Any) -> NaNGuard:
        guard = NaNGuard(check={"inputs": inputs}, logging={"verbose": False})
        fit(DictRegression(), DataLoader(DictData(**data), batch_size=BATCH), [guard], max_epochs=1)
        return guard

    return run


@pytest.mark.parametrize("inputs", ["always", "on_incident", "off"])
def test_inputs_always_flags_a_nan_in_a_field_the_model_never_reads(fit_dict: Any, inputs: str) -> None:
    """check.inputs: always checks every floating tensor of every batch; the other modes never look at a
    batch whose loss and gradients are finite."""
    guard = fit_dict(inputs, bad_aux=2 * BATCH + 5)
    if inputs != "always":
        assert guard.events == []
        return
    assert _summary(guard) == [(2, "input")]
    ev = guard.events[0]
    assert ev.cause == "input" and ev.actions[0] == "skip_step"
    assert [(f["field"], f["samples"], f["features"]) for f in ev.details["inputs"]] == [("batch['aux']", [5], [1])]


def test_inputs_always_flags_a_nan_in_any_micro_batch_of_an_accumulated_step(fit: Any) -> None:
    """check.inputs: always checks every floating tensor of the batch, every step (docs/configuration.md): with
    accumulate_grad_batches: 2, a NaN in the first micro-batch of a step, in a field the model never reads, is
    flagged like one in the last; the finding names its micro-batch."""
    guard = NaNGuard(check={"inputs": "always"}, logging={"verbose": False})
    data = DictData(bad_aux=4 * BATCH + 5)  # batch 4: the first micro-batch of step 2
    fit(DictRegression(), DataLoader(data, batch_size=BATCH), [guard], max_epochs=1, accumulate_grad_batches=2)
    assert _summary(guard) == [(2, "input")]
    (found,) = guard.events[0].details["inputs"]
    assert (found["field"], found["samples"], found["micro_batch"]) == ("batch['aux']", [5], 0)


@pytest.mark.parametrize("inputs", ["on_incident", "off"])
def test_inputs_off_does_not_attribute_an_incident_to_its_inputs(fit_dict: Any, inputs: str) -> None:
    """A NaN in a field the model reads makes the loss NaN: on_incident names the input, off leaves the
    incident a loss incident with no input evidence."""
    guard = fit_dict(inputs, bad_x=3 * BATCH + 7)
    ev = guard.events[0]
    if inputs == "on_incident":
        assert (ev.step, ev.kind, ev.cause) == (3, "input", "input")
        assert ev.details["inputs"][0]["field"] == "batch['x']" and ev.details["inputs"][0]["samples"] == [7]
    else:
        assert (ev.step, ev.kind) == (3, "loss") and ev.cause != "input" and "inputs" not in ev.details
    assert len(guard.events) == 1


# ------------------------------------------------------------------- check.loss / gradients / parameters


class NaNLossAt(Regression):
    """nn.Linear + SGD whose loss is NaN at optimizer step ``at`` (so are all its gradients)."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=0.05)
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step == self.at else loss


@pytest.fixture
def fit_checks(fit: Any) -> Any:
    """``fit_checks(model, check, faults=None, steps=8, subdir=None)``: ``steps`` steps with the given check
    section and faults; returns the guard."""

    def run(model: pl.LightningModule, check: dict, faults: Optional[list] = None, steps: int = 8,
            subdir: Optional[str] = None) -> NaNGuard:
        guard = NaNGuard(check=check, logging={"verbose": False})
        callbacks = ([FaultInjector(faults)] if faults else []) + [guard]
        fit(model, regression_data(steps * BATCH), callbacks, subdir=subdir, batch_size=BATCH, max_steps=steps)
        return guard

    return run


@pytest.mark.parametrize("check, first", [
    ({}, (3, "loss")),  # caught before backward, from the loss flag
    ({"loss": False}, (3, "gradient")),  # the same step, from the NaN gradients the loss produced
    ({"loss": False, "gradients": False}, (4, "parameter")),  # the NaN update, one step later, in the weights
])
def test_loss_and_gradient_checks_decide_what_catches_a_nan_loss(fit_checks: Any, check: dict, first: tuple) -> None:
    guard = fit_checks(NaNLossAt(3), check)
    assert _summary(guard)[0] == first
    if check.get("loss") is False:  # no loss values: no loss statistics, no spike detection
        assert guard.state_dict()["losses"]["spikes"]["count"] == 0 and not guard.state_dict()["losses"]["history"]
    else:
        losses = guard.state_dict()["losses"]
        assert losses["spikes"]["count"] == 7 and len(losses["history"]) == 7


@pytest.mark.parametrize("check, first", [
    ({}, (3, "gradient")),
    ({"gradients": False}, (4, "parameter")),  # the NaN gradient reached the weights
    ({"gradients": False, "parameters": False}, (4, "loss")),  # ... and is seen only in the next loss
])
def test_gradient_check_catches_a_nan_gradient_before_it_reaches_the_weights(fit_checks: Any, check: dict,
                                                                             first: tuple) -> None:
    model = Regression(lr=0.05)
    guard = fit_checks(model, check, [Fault("gradient", steps=[3], target="linear.weight")])
    assert _summary(guard)[0] == first
    if first[1] == "parameter":  # the gradients were never checked: nothing says the optimizer did it
        assert guard.events[0].cause == "unknown"
    assert ("grad_norm" in guard.events[0].details and math.isnan(guard.events[0].details["grad_norm"])) == (
        first[1] == "gradient")
    if check.get("gradients") is False:  # the norm is computed only once adaptive clipping (armed by the
        first_step = guard.events[0].step  # first incident) needs it, on the healthy steps after it
        healthy_after = [s for s in range(first_step + 1, 8) if s not in {e.step for e in guard.events}]
        clipper = guard.state_dict()["clipper"]
        assert len(clipper["history"]) == clipper["zclip"]["count"] == len(healthy_after)
    else:
        assert len(guard.state_dict()["clipper"]["history"]) == 7


@pytest.mark.parametrize("gradients", [True, False])
def test_fixed_clip_acts_whether_or_not_gradients_are_checked(fit: Any, gradients: bool) -> None:
    """check.gradients: false switches off a detection, not clip.max_norm: the norm is computed for the clip,
    and a non-finite norm is still no incident (the bad update is caught in the weights one step later)."""
    norms: dict[int, float] = {}

    class Probe(pl.Callback):  # after the guard: the gradient the optimizer applies (none on a skipped step)
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                norms[trainer.global_step] = float(torch.nn.utils.get_total_norm(grads))

    max_norm = 0.1
    guard = NaNGuard(check={"gradients": gradients}, clip={"max_norm": max_norm}, logging={"verbose": False})
    injector = FaultInjector(Fault("gradient", steps=[3], target="linear.weight"))
    fit(Regression(lr=0.05), regression_data(6 * BATCH), [injector, guard, Probe()], batch_size=BATCH, max_steps=6)
    assert _summary(guard) == ([(3, "gradient")] if gradients else [(4, "parameter")])
    clipped = {s: n for s, n in norms.items() if math.isfinite(n)}
    assert sorted(clipped) == ([0, 1, 2, 4, 5] if gradients else [0, 1, 2, 5])  # every raw norm is > 1 here
    assert all(n == pytest.approx(max_norm, rel=1e-5) for n in clipped.values())
    assert guard.counters["clipped_steps"] == len(clipped)
    assert gradients or math.isnan(norms[3])  # unchecked: the NaN gradient went through, unclipped


@pytest.mark.parametrize("parameters", [True, False])
def test_parameter_check_finds_a_bad_weight_before_it_spoils_a_loss(fit_checks: Any, parameters: bool) -> None:
    model = Regression(lr=0.05)
    guard = fit_checks(model, {"parameters": parameters}, [Fault("parameter", steps=[3])])
    ev = guard.events[0]
    if parameters:
        assert (ev.step, ev.kind, ev.culprit) == (4, "parameter", ev.details["nonfinite_parameters"][0]["name"])
        assert "rollback" in ev.actions and len(guard.events) == 1
    else:  # the NaN weight makes the next loss NaN; skipping cannot repair it, only a rollback does
        assert (ev.step, ev.kind) == (4, "loss")
        assert len(guard.events) > 1 and "rollback" in guard.events[-1].actions
    assert all_finite(model)


class PoisonWeightAndBuffer(pl.Callback):
    """Listed before the guard: after the update of step ``at``, one element of the first Linear's weight and one
    of the BatchNorm's running mean become NaN (a bad update that reached both)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at + 1:  # (the step just taken is already counted)
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = NAN
                pl_module.net[1].running_mean[0] = NAN


def test_a_bad_weight_and_a_bad_buffer_together_are_a_parameter_event(fit: Any) -> None:
    """docs/diagnosis.md (kind): ``buffer`` only when every non-finite tensor found is a buffer; a NaN weight
    found with a NaN BatchNorm statistic is a ``parameter`` event naming both, and it is rolled back."""
    model = models.Classifier(dropout=0.0)
    guard = NaNGuard(logging={"verbose": False})
    fit(model, models.classification_data(n=8 * 16), [PoisonWeightAndBuffer(3), guard], batch_size=16, max_steps=8)
    ev = guard.events[0]
    assert (ev.step, ev.kind, ev.culprit) == (4, "parameter", "net.0.weight")
    names = [f["name"] for f in ev.details["nonfinite_parameters"]]
    assert names[0] == "net.0.weight" and "net.1.running_mean" in names
    assert "rollback" in ev.actions and all_finite(model)


def test_parameter_check_at_train_end_repairs_the_last_step(tmp_path: Path, fit_checks: Any) -> None:
    """A parameter fault at the very last step (no validation, no later step to read its flag): the check at
    train end finds it, records it and restores known-good weights."""
    steps = 6
    for parameters in (True, False):
        model = Regression(lr=0.05)
        guard = fit_checks(model, {"parameters": parameters}, [Fault("parameter", steps=[steps - 1])], steps=steps,
                           subdir=str(parameters))
        if not parameters:  # the control: nothing reads the weights after the last step
            assert guard.events == [] and not all_finite(model)
            continue
        assert _summary(guard) == [(steps, "parameter")]
        ev = guard.events[0]
        assert ev.details["detected_at"] == "train_end" and "rollback" in ev.actions
        assert ev.details["restored_step"] == 0 and all_finite(model)
        assert json.loads((tmp_path / "True" / "nanguard" / "events.jsonl").read_text())["details"][
            "detected_at"] == "train_end"


# ---------------------------------------------------------------------------------- bad inputs in a Trainer


def test_bad_input_samples_skip_exactly_their_steps(fit):
    data = models.classification_data(n=1024)
    batch = 32
    # ~1% of samples: 10 rows, in 10 different, non-adjacent batches
    rows = [b * batch + (7 * b) % batch for b in (1, 4, 7, 10, 13, 16, 19, 22, 25, 28)]
    poisoned = models.poison_rows(data, rows[::2], float("nan"))
    poisoned = models.poison_rows(poisoned, rows[1::2], float("inf"))
    expected_steps = {r // batch for r in rows}

    accs = {}
    for name, ds, guard in (("clean", data, None), ("guarded", poisoned, NaNGuard())):
        pl.seed_everything(0, verbose=False)
        model = models.Classifier(dropout=0.0)
        fit(model, ds, [guard] if guard else [], subdir=name, batch_size=batch, max_epochs=1)
        accs[name] = (models.accuracy(model, data), guard, model)
    guard, model = accs["guarded"][1], accs["guarded"][2]
    assert {e.step for e in guard.events} == expected_steps
    assert all(e.kind == "input" and e.cause == "input" and e.actions == ["skip_step"] for e in guard.events)
    for event in guard.events:
        row = rows[sorted(expected_steps).index(event.step)]
        samples = [s for f in event.details["inputs"] for s in f["samples"]]
        assert samples == [row % batch]
    assert models.all_finite(model)
    assert abs(accs["clean"][0] - accs["guarded"][0]) <= 0.03, (accs["clean"][0], accs["guarded"][0])


# ---------------------------------------------------------------------------------------- check.activations


class SideBranch(pl.LightningModule):
    """A module output that never reaches the loss goes NaN: only ``check.activations`` sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.aux = nn.Sequential(nn.Linear(8, 4), LogAct())
        self.last_aux: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.last_aux = self.aux(x).detach()  # e.g. kept for logging
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LogAct(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(h)


def test_a_nan_activation_that_spoils_the_loss_is_kind_activation(fit_checks: Any) -> None:
    """docs/diagnosis.md (kind, by precedence: parameter, input, activation, loss, gradient): with
    check.activations: always, a NaN module output that makes the loss NaN too is an ``activation`` event."""
    guard = fit_checks(Regression(lr=0.05), {"activations": "always"}, [Fault("activation", steps=[2])], steps=4)
    ev = guard.events[0]
    assert (ev.step, ev.kind, ev.culprit) == (2, "activation", "linear")
    assert ev.details["replay"]["loss_finite"] is False  # the loss went NaN as well
    assert math.isfinite(ev.details["grad_norm"])  # (the gradients did not: only the two flags say so)


@pytest.mark.parametrize("activations", ["always", 2, "off"])
def test_activation_flag_catches_unused_branch(fit: Any, activations: Any) -> None:
    data = regression_data(128, 8)
    guard = NaNGuard(check={"activations": activations})
    model = SideBranch()
    with torch.no_grad():
        model.aux[0].bias.fill_(-100.0)  # log of negative pre-activations -> NaN in aux, loss stays finite
    fit(model, data, [guard], batch_size=32, max_steps=4)
    if activations == "off":
        assert guard.events == []
        return
    ev = guard.events[0]
    assert ev.kind == "activation" and ev.step == 0
    assert ev.culprit == "aux.1" and ev.op == "LogBackward0"
    assert "domain" in ev.suggestion and "torch.log(h)" in ev.suggestion  # NaN in float64 too: a domain error
    assert len(guard.events) == (4 if activations == "always" else 2)
    assert all(not m._forward_hooks for m in model.modules())


def test_the_module_output_flag_is_exact_for_every_float_dtype_and_value():
    """``outputs_nonfinite_flag`` (the CPU path of ``check.activations``): a NaN, +Inf or -Inf anywhere in any output
    (contiguous or not, float16 to float64) raises the flag; huge finite values whose sum would overflow, empty
    outputs and mixed dtypes do not."""
    from lightning_nanguard.detect.activations import outputs_nonfinite_flag

    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        big = torch.finfo(dtype).max
        healthy = [torch.full((300, 7), big, dtype=dtype), torch.full((9,), -big, dtype=dtype),
                   torch.ones(0, dtype=dtype), torch.randn(40, 30).to(dtype).t()]
        assert not outputs_nonfinite_flag(healthy), dtype
        assert not healthy[3].is_contiguous()
        for value in (math.nan, math.inf, -math.inf):
            for where, at in ((0, (150, 3)), (1, (8,)), (3, (17, 5))):
                outputs = list(healthy)
                outputs[where] = healthy[where].clone() if where != 3 else healthy[3].t().clone().t()
                outputs[where][at] = value
                assert outputs_nonfinite_flag(outputs), (dtype, value, where)
    mixed = [torch.ones(3, dtype=torch.float16), torch.tensor([1e300], dtype=torch.float64)]
    assert not outputs_nonfinite_flag(mixed) and outputs_nonfinite_flag([*mixed, torch.tensor([-math.inf])])
    assert outputs_nonfinite_flag([torch.ones(0)]) is None
