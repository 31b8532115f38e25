"""The op that made a NaN and the domain it left (``lightning_nanguard/diagnose/domain.py``), and the diagnosis
rules that read them: issue 26's cases (a domain error, the softmax behind an intended -inf mask, a float16
overflow judged at the op, suggestions true to the dtype that ran)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lightning_nanguard import NaNGuard
from lightning_nanguard.diagnose import domain

from .test_field_traps import HandBCE


QUIET = {"verbose": False, "events_file": False, "reports": False}


# ------------------------------------------------------------------------------------------- pure functions


def test_an_infinity_given_on_purpose_is_not_made_but_a_nan_from_it_is() -> None:
    x = torch.randn(2, 3)
    filled = x.masked_fill(torch.tensor([[True, True, True], [False, True, False]]), float("-inf"))
    # masked_fill(mask, -inf): the infinity is its scalar argument's
    assert not domain.made_nonfinite([x], [filled], domain.scalars_of([x, float("-inf")]))
    assert domain.made_nonfinite([x], [filled], [])  # (without the scalar it would be taken for made)
    out = torch.softmax(filled, -1)  # the all -inf row becomes NaN: made here
    assert domain.made_nonfinite([filled], [out], [-1.0])
    assert not domain.made_nonfinite([out], [out * 2], [2.0])  # a NaN passed on is not made
    assert domain.made_nonfinite([x], [x * math.nan], [math.nan])  # one from a scalar (loss * nan) is made here
    assert domain.made_nonfinite([torch.tensor([1e30])], [torch.tensor([1e30]) * 1e30], [])  # an overflow is


@pytest.mark.parametrize("name, args, kwargs, expected", [
    ("log", (torch.tensor([0.0, 1.0, 0.0]),), {}, ("zero", 2)),
    ("log", (torch.tensor([-1.0, 1.0]),), {}, ("negative", 1)),
    ("sqrt", (torch.tensor([-1.0, -2.0, 4.0]),), {}, ("negative", 2)),
    ("truediv", (torch.tensor([0.0, 1.0]), torch.tensor([0.0, 2.0])), {}, ("zero", 1)),
    ("std", (torch.randn(1, 4), 0), {}, ("a single sample", 4)),
    ("softmax", (torch.tensor([[-math.inf, -math.inf], [0.0, -math.inf]]), -1), {}, ("an all -inf row", 1)),
    ("mean", (torch.zeros(0),), {}, ("an empty selection", 1)),
    ("cross_entropy", (torch.randn(3, 2), torch.full((3,), -100)), {}, ("every target ignored", 3)),
    ("mul", (torch.tensor([0.0, 1.0]), -math.inf), {}, ("0 x inf", 1)),
    ("sub", (torch.tensor([math.inf, 1.0]), torch.tensor([math.inf, 1.0])), {}, ("inf - inf", 1)),
    ("acos", (torch.tensor([1.0000001, 0.5]),), {}, ("outside [-1, 1]", 1)),
    ("exp", (torch.tensor([100.0]),), {}, None),
])
def test_out_of_domain_names_the_input_and_counts_its_positions(name: str, args: tuple, kwargs: dict,
                                                                 expected: Any) -> None:
    outs = [torch.ones(4)] if name == "std" else [torch.ones(1)]
    found = domain.out_of_domain(name, args, kwargs, outs)
    assert (None if found is None else (found["input"], found["positions"])) == expected
    if found is not None:  # every finding has a sentence and a fix of its own
        assert domain.describe(found) and domain.fix(found) != domain.fix({"op": "?", "input": "?"})


def test_the_fix_for_the_log_of_a_probability_follows_the_op_that_made_it() -> None:
    logits = torch.tensor([[0.0, -math.inf], [200.0, 0.0]], requires_grad=True)
    finite = torch.tensor([[0.0, -1e3], [200.0, -1e3]], requires_grad=True)
    for p, words in ((torch.softmax(logits, -1), "log_softmax"), (1 - torch.sigmoid(finite), "BCEWithLogitsLoss"),
                     (finite.exp(), "logsumexp"), ((-finite).relu() * 0, "eps")):
        found = domain.out_of_domain("log", (p,), {}, [torch.log(p)])
        assert found is not None and found["input"] == "zero", p
        assert words in domain.fix(found), (words, found)


def test_op_evidence_recomputes_the_op_in_float64_with_autocast_off() -> None:
    a = torch.full((2, 4, 64), 40.0).half()
    out = torch.bmm(a, a.transpose(1, 2))  # 64 x 1600 = 102400 > 65504
    assert torch.isinf(out).all()
    ev = domain.op_evidence(torch.bmm, (a, a.transpose(1, 2)), {}, out)
    assert ev["dtype"] == "torch.float16" and ev["float64_finite"] and ev["abs_max_float64"] == 102400.0
    assert ev["positions"] == out.numel() and "domain" not in ev
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the recompute is not cast back down
        ev = domain.op_evidence(torch.matmul, (torch.full((2, 2), 1e20), torch.full((2, 2), 1e20)), {},
                                torch.full((2, 2), math.inf))
    assert ev["float64_finite"] and ev["abs_max_float64"] == pytest.approx(2e40)
    assert "float64_finite" not in domain.op_evidence(torch.bmm, (a, a.transpose(1, 2)), {}, out, float64=False)
    big = torch.tensor([1e5, 1.0])  # a cast that overflows: float64 is its input, beyond float16's max
    ev = domain.op_evidence(torch.Tensor.half, (big,), {}, big.half())
    assert ev["float64_finite"] and ev["abs_max_float64"] == 1e5 and ev["dtype"] == "torch.float16"


def test_composites_are_named_by_the_aten_op_inside_them() -> None:
    assert domain.autograd_name("_softmax") == "SoftmaxBackward0"
    assert domain.autograd_name("bmm") == "BmmBackward0"
    assert not domain.names_itself("TransposeBackward0") and domain.names_itself("NllLossBackward0")
    x = torch.randn(1, 3, 4)
    mha = nn.MultiheadAttention(4, 1, batch_first=True)
    inner = domain.inner_op(F.multi_head_attention_forward, (
        x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), 4, 1, mha.in_proj_weight, mha.in_proj_bias, None,
        None, False, 0.0, mha.out_proj.weight, mha.out_proj.bias),
        {"key_padding_mask": torch.ones(1, 3, dtype=torch.bool)})
    assert inner is not None and domain.op_name(inner[0]) == "softmax"


# ------------------------------------------------------------------------------------- the examples


class Trap(pl.LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class GramNet(Trap):
    """Issue 26's overflow: a float16 bmm in a module that then divides by c*h*w (its output is small)."""

    class Gram(nn.Module):
        def forward(self, f: torch.Tensor) -> torch.Tensor:
            b, c, n = f.shape
            f = f.half()
            return (torch.bmm(f, f.transpose(1, 2)) / (c * n)).float()

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gram, self.head = nn.Linear(4, 8), self.Gram(), nn.Linear(64, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        g = self.gram(self.proj(x).transpose(1, 2) * 100)
        return F.mse_loss(self.head(g.reshape(len(x), -1)), y)


def test_overflow_is_judged_at_the_op_not_at_the_modules_output(fit: Any) -> None:
    x, y = torch.randn(8, 64, 4), torch.randn(8, 1)
    guard = NaNGuard(logging=QUIET)
    fit(GramNet(), TensorDataset(x, y), [guard], batch_size=8, steps=1)
    ev = guard.events[0]
    assert (ev.cause, ev.culprit, ev.op) == ("overflow", "gram", "BmmBackward0")
    assert ev.details["judged_at"] == "op" and ev.details["dtype"] == "torch.float16"
    assert ev.details["abs_max_float64"] > 65504 and ev.details["dtype_max"] == 65504.0
    assert "the sum exceeds float16's range: compute it in float32 or scale before the product" in ev.suggestion


def test_under_bf16_mixed_the_suggestion_names_the_dtype_that_ran_and_the_stable_loss(fit: Any) -> None:
    g = torch.Generator().manual_seed(0)
    guard = NaNGuard(logging=QUIET)
    fit(HandBCE(), TensorDataset(torch.randn(64, 4, generator=g), (torch.rand(64, 1, generator=g) > 0.5).float()),
        [guard], batch_size=64, steps=1, precision="bf16-mixed")
    ev = guard.events[0]
    assert (ev.cause, ev.op) == ("precision", "LogBackward0")
    assert ev.details["dtype"] == "torch.bfloat16" and ev.details["domain"]["input"] == "zero"
    assert "BCEWithLogitsLoss" in ev.suggestion and "in float32" in ev.suggestion
    assert "float64" not in ev.suggestion.split("not in float64")[-1]  # no advice to go to float64


def test_a_domain_error_names_the_op_its_input_and_the_positions(fit: Any) -> None:
    class Normalise(Trap):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.lin(x / x.norm(dim=1, keepdim=True)), y)

    x = torch.randn(16, 4)
    x[[3, 9]] = 0.0  # two all-zero samples: 0/0
    guard = NaNGuard(logging=QUIET)
    fit(Normalise(), TensorDataset(x, torch.randn(16, 1)), [guard], batch_size=16, steps=1)
    ev = guard.events[0]
    assert (ev.cause, ev.culprit, ev.op) == ("domain", "training_step", "div")
    found = ev.details["domain"]
    assert (found["op"], found["input"], found["argument"], found["positions"], found["zero_over_zero"]) == \
        ("div", "zero", "denominator", 2, True)
    assert "0/0" in ev.suggestion and "eps" in ev.suggestion and "domain" in ev.suggestion
    assert guard.counters["lr_cuts"] == 0  # a smaller LR cannot fix it


def test_the_op_behind_an_intended_minus_inf_mask_is_the_softmax_not_the_masked_fill(fit: Any) -> None:
    from .test_field_traps import causal_padded

    model, data = causal_padded()
    guard = NaNGuard(logging=QUIET)
    fit(model, data, [guard], batch_size=16, steps=1)
    ev = guard.events[0]
    assert (ev.cause, ev.culprit, ev.op) == ("domain", "attn", "SoftmaxBackward0")  # not MaskedFillBackward0
    assert ev.details["domain"] == {"op": "softmax", "input": "an all -inf row", "argument": "input", "positions": 2,
                                    "dim": -1}  # the two first queries of the left-padded row see no key
    assert "torch.softmax(scores, -1)" in ev.details["forward_op"]["source"]


# ------------------------------------------------------------------ an in-place op that makes the NaN (issue 46)


class InPlaceNormalise(Trap):
    """``h /= h.norm(dim=1, keepdim=True)`` on a copy of the batch's rows, in place: an all-zero row is 0/0. (A copy:
    on the batch itself the in-place op would also write into the batch the guard replays, and on an activation
    that requires grad torch's own backward refuses it: the norm saved ``h``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.clone()
        h /= h.norm(dim=1, keepdim=True)
        return F.mse_loss(self.lin(h), y)


class InPlaceLog(Trap):
    """``x.log_()`` on a copy of the inputs, two of which are negative."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x.clone()
        z.log_()
        return F.mse_loss(self.lin(z), y)


def test_an_in_place_op_that_makes_the_nan_is_named_with_its_domain_and_its_fix(fit: Any) -> None:
    """docs/diagnosis.md, the replay: the op named is the first torch op whose output holds a NaN its tensor inputs
    did not, an in-place op judged on its input as it was before it wrote it: ``h /= h.norm()`` on a zero row is
    the division (0/0, the fix: an eps), ``x.log_()`` on a negative is the log (negative input, its fix)."""
    x = torch.rand(16, 4) + 0.5
    x[[3, 9]] = 0.0  # two all-zero rows: their hidden rows are zero, their norms zero
    guard = NaNGuard(logging=QUIET)
    fit(InPlaceNormalise(), TensorDataset(x, torch.randn(16, 1)), [guard], subdir="div", batch_size=16, steps=1)
    ev = guard.events[0]
    assert (ev.cause, ev.op) == ("domain", "div"), (ev.cause, ev.op, ev.details.get("forward_op"))
    assert ev.details["forward_op"]["function"] == "div_"
    assert "h /= h.norm(dim=1, keepdim=True)" in ev.details["forward_op"]["source"]
    found = ev.details["domain"]
    assert (found["op"], found["input"], found["argument"], found["positions"], found["zero_over_zero"]) == \
        ("div", "zero", "denominator", 2, True)
    assert "0/0" in ev.suggestion and "eps" in ev.suggestion

    x = torch.rand(16, 4) + 0.5
    x[5, 1], x[11, 2] = -1.0, -2.0
    guard = NaNGuard(logging=QUIET)
    fit(InPlaceLog(), TensorDataset(x, torch.randn(16, 1)), [guard], subdir="log", batch_size=16, steps=1)
    ev = guard.events[0]
    assert ev.cause == "domain" and ev.details["forward_op"]["function"] == "log_", ev.details.get("forward_op")
    found = ev.details["domain"]
    assert (found["op"], found["input"], found["positions"]) == ("log", "negative", 2), found
    assert domain.fix(found) in ev.suggestion


class NormaliseTheBatch(Trap):
    """``x = batch[0]; x /= x.norm(dim=1, keepdim=True)``: the division writes into the batch tensor itself. The
    first batch tensor it was given is kept (``seen``): the live step's own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = self.seen or [batch[0]]
        x = batch[0]
        x /= x.norm(dim=1, keepdim=True)
        return F.mse_loss(self.lin(x), batch[1])


class LogTheBatch(Trap):
    """``batch[0].log_()`` on inputs two of which are negative: the log writes into the batch tensor itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = self.seen or [batch[0]]
        batch[0].log_()
        return F.mse_loss(self.lin(batch[0]), batch[1])


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_a_nan_the_step_wrote_into_its_own_batch_is_not_blamed_on_the_data(fit: Any, sync: str) -> None:
    """docs/diagnosis.md, the replay: a training_step that writes into the batch tensor itself overwrites the
    values its op was fed, so the NaN found in the batch afterwards is the step's own, not bad data: the cause is
    not ``input``, the event says which batch tensor the step wrote (its version before and after) and names the
    in-place op that wrote it, and the suggestion says to clone the batch before writing into it. The replay
    writes into copies, never into the batch again."""
    for model, bad, positions, function, source in (
            (NormaliseTheBatch(), [3, 9], 8, "div_", "x /= x.norm(dim=1, keepdim=True)"),  # two rows of 4: 0/0
            (LogTheBatch(), [5, 11], 2, "log_", "batch[0].log_()")):
        x = torch.rand(16, 4) + 0.5
        if function == "div_":
            x[bad] = 0.0  # two all-zero rows: 0/0
        else:
            x[bad[0], 1], x[bad[1], 2] = -1.0, -2.0  # two negatives: log is NaN there
        guard = NaNGuard(logging=QUIET, check={"sync": sync})
        fit(model, TensorDataset(x, torch.randn(16, 1)), [guard], subdir=function, batch_size=16, steps=1)
        ev = guard.events[0]
        assert ev.kind == "loss" and ev.cause != "input", (ev.kind, ev.cause, ev.details.get("inputs"))
        assert "inputs" not in ev.details
        written = ev.details["batch_written"]
        assert [(w["field"], w["version_after"] - w["version_before"]) for w in written] == [("batch[0]", 1)], written
        assert written[0]["nonfinite"] == positions and written[0]["samples"] == bad, written
        assert written[0]["function"] == function and source in written[0]["source"], written
        assert ev.op == function.strip("_"), ev.op
        assert ev.cause == "unknown" and "in place" in ev.suggestion and "batch[0].clone()" in ev.suggestion, \
            (ev.cause, ev.suggestion)
        # the replay ran on copies: the batch holds the live step's one write, no pass of the replay wrote into it
        assert model.seen[0]._version == 1 and int(torch.isnan(model.seen[0]).sum()) == positions


class ScaleTheBatchOnce(Trap):
    """Halves the batch in place (``batch[0].mul_(0.5)``: finite), and its first call alone multiplies the loss by
    NaN (a call counter of its own: the replay of the same batch is clean)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        batch[0].mul_(0.5)
        loss = F.mse_loss(self.lin(batch[0]), batch[1])
        return loss * math.nan if self.calls == 1 else loss


def test_a_clean_replay_of_a_batch_the_step_wrote_into_is_not_transient(fit: Any) -> None:
    """docs/diagnosis.md: a replay of a batch the step wrote into in place runs on the values the step wrote, not
    on those it was given, so a clean replay there says nothing of a fault that does not come back: not
    ``transient``, and the replay's note says why."""
    guard = NaNGuard(logging=QUIET)
    fit(ScaleTheBatchOnce(), TensorDataset(torch.rand(16, 4), torch.randn(16, 1)), [guard], batch_size=16, steps=1)
    ev = guard.events[0]
    assert ev.details["replay"]["reproduced"] is False
    assert ev.cause != "transient" and "wrote into in place" in ev.details["replay"]["note"], ev.details["replay"]
    assert [(w["field"], w["nonfinite"]) for w in ev.details["batch_written"]] == [("batch[0]", 0)]


def test_the_batch_tensors_written_in_place_are_told_by_their_versions() -> None:
    """detect/writes.py: a tensor written in place since its micro-batch's versions were taken is named, with its
    versions; the NaN found in it is set apart from bad data."""
    from lightning_nanguard.detect.writes import batch_versions, split_written, written_in_place

    batch = {"x": torch.ones(3, 2), "y": torch.zeros(3), "ids": [torch.arange(3)]}
    before = batch_versions(batch)
    batch["x"][1].div_(0.0).mul_(0.0)  # two writes through a view: NaN in row 1
    written = written_in_place([(batch, 0)], [before])
    assert written == [{"micro_batch": 0, "field": "batch['x']", "version_before": before[0],
                        "version_after": before[0] + 2}]
    assert written_in_place([(batch, 0)], [None]) == []  # versions not taken: nothing known
    findings = [{"micro_batch": 0, "field": "batch['x']", "nan": 2, "inf": 0, "samples": [1]},
                {"micro_batch": 0, "field": "batch['y']", "nan": 1, "inf": 0, "samples": [0]}]
    data, wrote = split_written(findings, written)
    assert data == findings[1:] and wrote[0]["nonfinite"] == 2 and wrote[0]["samples"] == [1]


def test_batch_versions_walk_every_container_in_iter_tensors_order() -> None:
    """The batch start's fast walk (detect/writes.py) gives iter_tensors' order for every container the tree knows:
    a tensor written in place is found at its own position."""
    import collections
    import dataclasses

    from lightning_nanguard.core.tree import iter_tensors
    from lightning_nanguard.detect.writes import _version, batch_versions

    pair = collections.namedtuple("pair", "a b")

    @dataclasses.dataclass
    class Sample:
        x: torch.Tensor
        rest: list

    t = [torch.zeros(2) for _ in range(6)]
    for i in (1, 4):
        t[i].add_(1.0)  # version 1: the others 0
    cases = [(t[0], t[1]), {"x": t[0], "y": [t[1], (t[2],)], "n": 3}, pair(t[3], {"q": t[4]}),
             Sample(t[5], [t[4], "s"]), t[1], "text", collections.OrderedDict(a=t[1], b=t[0])]
    for case in cases:
        assert batch_versions(case) == tuple(_version(v) for _, v in iter_tensors(case)), case
    assert batch_versions(pair(t[3], {"q": t[4]})) == (0, 1) and batch_versions(Sample(t[5], [t[4], "s"])) == (0, 1)
