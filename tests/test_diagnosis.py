"""Diagnosis on demand: the incident replay names the module, the op and the cause (real Trainers, CPU)."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nanguard import NaNGuard
from .models import EpsZeroEmbedding, Regression, Square, loader, read_events, regression_data

# ------------------------------------------------------------------------------------------------ models


class FeatureReadout(nn.Module):
    """Reads node features back through the reconstructed graph: ``recon.t() @ x`` (the seed case)."""

    def forward(self, recon: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(recon.t(), x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = FeatureReadout()

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        recon = z @ z.t()  # inner-product decoder
        return recon, self.features(recon, x)


class GraphAutoencoder(pl.LightningModule):
    """GCN encoder + inner-product decoder + feature read-out, on one full graph per batch."""

    def __init__(self, features: int, hidden: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Linear(features, hidden)
        self.decoder = Decoder()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        adj, x = batch[0][0], batch[1][0]
        z = adj @ self.encoder(x)
        recon, feats = self.decoder(z, x)
        self.log("train_loss", recon.mean())  # silenced during the replay
        return torch.sigmoid(recon).mean() + feats.mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class RowNorm(nn.Module):
    """Appends the row norm; ``sqrt`` at an all-zero (padding) row has an infinite derivative."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, torch.sqrt((h * h).sum(-1, keepdim=True))], dim=-1)


class PaddedNorm(pl.LightningModule):
    """Finite forward on a zero padding row, NaN backward; BatchNorm and dropout make replay side effects visible."""

    def __init__(self, features: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(features, hidden, bias=False)
        self.rownorm = RowNorm()
        self.bn = nn.BatchNorm1d(hidden + 1)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(hidden + 1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.head(self.drop(self.bn(self.rownorm(self.proj(x)))))
        self.log_dict({"loss": out.mean()})
        return {"loss": nn.functional.mse_loss(out, y)}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _padded_data(n: int = 256, features: int = 8, zero_rows: tuple[int, ...] = (40,)) -> TensorDataset:
    data = regression_data(n, features)
    x, y = data.tensors
    x = x.clone()
    x[list(zero_rows)] = 0.0
    return TensorDataset(x, y)


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_seed_case_overflow_in_submodule_matmul(tmp_path: Any, fit: Any) -> None:
    nodes, features = 2708, 64  # Cora's node count; fewer features than 1433 keep the test fast
    g = torch.Generator().manual_seed(0)
    x = torch.rand(nodes, features, generator=g)
    x[:, 7] = 1e18 * (1 + torch.rand(nodes, generator=g))  # one un-normalised feature column
    adj = (torch.rand(nodes, nodes, generator=g) < 0.002).float() + torch.eye(nodes)
    adj = adj / adj.sum(1, keepdim=True)
    data = DataLoader(TensorDataset(adj[None], x[None]), batch_size=1)
    guard = NaNGuard(recovery={"max_skips": 1, "max_rollbacks": 1}, anomaly={"max_replays": 2})
    t = fit(GraphAutoencoder(features), data, [guard], max_steps=50, max_epochs=50)

    first = guard.events[0]
    assert first.kind == "loss"
    assert first.culprit == "decoder.features"
    assert first.op == "MmBackward0"
    assert first.cause in ("overflow", "precision")
    assert first.cause == "overflow" and first.details["abs_max_float64"] > torch.finfo(torch.float32).max
    assert "matmul(recon.t(), x)" in first.details["forward_op"]["source"]
    assert first.details["extreme_features"][0]["features"] == [7]
    assert "feature" in first.suggestion and ("normalise" in first.suggestion or "float64" in first.suggestion)
    # gives up cleanly: bounded steps, weights restored and finite, at most max_replays replays
    assert guard.events[-1].actions[-1] == "stop" and t.should_stop
    assert t.global_step < 10 and len(guard.events) < 10
    assert guard.counters["replays"] == 2
    assert all(math.isfinite(float(p.detach().abs().max())) for p in t.lightning_module.parameters())
    report = next(tmp_path.rglob("incident-0001-*.txt")).read_text()
    assert "frames before the first non-finite value" in report and "decoder.features (0)" in report
    assert read_events(tmp_path)[0]["culprit"] == "decoder.features"


def test_backward_singularity_names_module_and_op(tmp_path: Any, make_trainer: Any) -> None:
    guard = NaNGuard()
    t = make_trainer([guard], max_epochs=1)
    model = PaddedNorm()
    t.fit(model, loader(_padded_data(), batch_size=32))

    assert len(guard.events) == 1, [e.summary() for e in guard.events]
    ev = guard.events[0]
    assert ev.kind == "gradient" and ev.batch_idx == 1
    assert ev.culprit == "rownorm"
    assert ev.op == "SqrtBackward0"  # the Inf at sqrt(0), which anomaly mode alone does not flag
    assert ev.details["anomaly"]["op"] in ("MulBackward0", "SqrtBackward0")  # the first NaN anomaly mode saw
    assert "sqrt" in ev.details["backward_op"]["traceback"]
    assert ev.cause == "backward_op" and "epsilon" in ev.suggestion
    assert ev.actions[0] == "skip_step" and "rollback" not in ev.actions  # skipped (then clipping armed)
    assert t.global_step == 8 and not t.should_stop  # training continued
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    report = next(tmp_path.rglob("incident-0001-*.txt")).read_text()
    assert "backward (module, grad wrt outputs -> grad wrt inputs)" in report and "rownorm" in report


def test_replay_does_not_change_training(fit: Any) -> None:
    weights = {}
    for mode in ("on_incident", "off"):
        pl.seed_everything(0, verbose=False)
        guard = NaNGuard(anomaly={"mode": mode})
        model = PaddedNorm()
        fit(model, _padded_data(), [guard], subdir=mode, batch_size=32, shuffle=True, max_epochs=2)
        assert len(guard.events) == 2 and guard.counters["replays"] == (2 if mode == "on_incident" else 0)
        weights[mode] = {k: v.clone() for k, v in model.state_dict().items()}
    assert weights["on_incident"].keys() == weights["off"].keys()
    for k in weights["off"]:
        assert torch.equal(weights["on_incident"][k], weights["off"][k]), k
    assert guard.events[0].culprit is None  # mode off: no replay, no module


def test_nan_inputs_report_sample_indices(fit: Any) -> None:
    data = regression_data(128, 8)
    x, y = data.tensors
    x = x.clone()
    x[5, 2] = float("nan")
    x[9, 6] = float("inf")
    guard = NaNGuard()
    t = fit(Regression(), TensorDataset(x, y), [guard], batch_size=32, max_epochs=1)
    ev = guard.events[0]
    assert ev.kind == "input" and ev.cause == "input" and ev.batch_idx == 0
    assert ev.details["inputs"][0]["samples"] == [5, 9]
    assert ev.details["inputs"][0]["features"] == [2, 6]
    assert "[5, 9]" in ev.suggestion
    assert len(guard.events) == 1 and t.global_step == 4


def test_adam_eps_zero_names_parameter_and_optimizer(fit: Any) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (64,), generator=g)  # rows 10..19 are never used
    data = TensorDataset(tokens, torch.randn(64, generator=g))
    guard = NaNGuard()
    fit(EpsZeroEmbedding(rows=20), data, [guard], batch_size=16, max_steps=3)
    ev = guard.events[0]
    assert ev.kind == "parameter" and ev.cause == "optimizer"
    assert ev.culprit == "emb.weight"
    rows = ev.details["nonfinite_parameters"][0]["rows"]
    assert set(rows) == set(range(20)) - set(tokens[:16].tolist())  # the rows the first step did not use
    assert "eps" in ev.suggestion


def test_inf_weight_before_fit_is_initialization(fit: Any) -> None:
    model = Regression()
    with torch.no_grad():
        model.linear.weight[0, 3] = float("inf")
    guard = NaNGuard()
    t = fit(model, regression_data(64), [guard], batch_size=32, max_epochs=1)
    ev = guard.events[0]
    assert ev.cause == "initialization" and ev.culprit == "linear.weight"
    assert ev.details["detected_at"] == "fit_start"
    assert "Xavier" in ev.suggestion and t.global_step == 0


def test_anomaly_always_stops_at_the_op_and_cleans_up_on_exception(tmp_path: Any, make_trainer: Any) -> None:
    """``anomaly.mode: always`` is a debugging mode: torch raises at the op; hooks and mode are restored."""
    guard = NaNGuard(anomaly={"mode": "always"}, check={"activations": "always"})
    model = PaddedNorm()
    t = make_trainer([guard], max_epochs=1)
    with pytest.raises(RuntimeError, match="returned nan values"):
        t.fit(model, loader(_padded_data(), batch_size=32))
    assert not torch.is_anomaly_enabled()
    ev = guard.events[-1]  # the error is recorded (and diagnosed by a replay) before it propagates
    assert ev.actions == ["raise"] and ev.batch_idx == 1
    assert (ev.culprit, ev.op, ev.cause) == ("rownorm", "SqrtBackward0", "backward_op")
    assert ev.details["anomaly_error"]["op"] == "MulBackward0"
    assert read_events(tmp_path)[-1]["actions"] == ["raise"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ---------------------------------------------------------------- anomaly.float64_check, max_replays, frames


class OverflowNet(pl.LightningModule):
    """``depth`` identity Linears, then ``Square``: a feature of 1e20 reaches 1e40, beyond float32 (not float64)."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
        for layer in self.body:
            nn.init.eye_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.square = Square()
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.square(self.body(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.fixture
def fit_overflow(fit: Any) -> Any:
    """``fit_overflow(bad_steps, depth=4, **sections)``: an epoch of OverflowNet whose ``bad_steps`` overflow."""

    def run(bad_steps: tuple[int, ...], depth: int = 4, **sections: Any) -> NaNGuard:
        x, y = (t.clone() for t in regression_data(8 * 16).tensors)
        for s in bad_steps:
            x[16 * s + 3, 5] = 1e20
        guard = NaNGuard(logging={"verbose": False}, **sections)
        fit(OverflowNet(depth), TensorDataset(x, y), [guard], batch_size=16, max_epochs=1)
        assert [(e.step, e.kind) for e in guard.events] == [(s, "loss") for s in bad_steps]
        return guard

    return run


@pytest.mark.parametrize("float64_check", [True, False])
def test_float64_check_tells_overflow_from_a_real_nan(fit_overflow: Any, float64_check: bool) -> None:
    guard = fit_overflow((2,), anomaly={"float64_check": float64_check})
    ev = guard.events[0]
    assert (ev.culprit, ev.details["replay"]["reproduced"]) == ("square", True)
    if float64_check:
        assert ev.cause == "overflow" and ev.details["float64"]["module_out_abs_max"] == pytest.approx(1e40, rel=1e-2)
        assert ev.details["abs_max_float64"] > torch.finfo(torch.float32).max
    else:  # no float64 rerun: the replay names the module but cannot tell overflow from a domain error
        assert "float64" not in ev.details and "abs_max_float64" not in ev.details
        assert ev.cause not in ("overflow", "precision")


@pytest.mark.parametrize("timeout", [1e-9, 300.0])
def test_replay_timeout_ends_the_replay_and_says_so_never_as_transient(fit_overflow: Any, timeout: float) -> None:
    """``anomaly.replay_timeout``: no pass of a replay starts after it. Past it, the incident is not `transient` (the
    replay did not complete: nothing is known) and ``details.replay.timeout`` says where it ended; within it, the
    replay names the module and the cause."""
    guard = fit_overflow((2,), anomaly={"replay_timeout": timeout})
    ev = guard.events[0]
    if timeout < 1:
        assert ev.details["replay"]["timeout"] == "before micro-batch 0" and not ev.details["replay"]["reproduced"]
        assert ev.cause not in ("transient", "overflow") and "did not complete" in ev.details["replay"]["note"]
    else:
        assert "timeout" not in ev.details["replay"] and (ev.culprit, ev.cause) == ("square", "overflow")


@pytest.mark.parametrize("max_replays", [0, 1, 10])
def test_max_replays_bounds_the_replays_and_reuses_the_last_diagnosis(fit_overflow: Any, max_replays: int) -> None:
    bad = (1, 3, 5)
    guard = fit_overflow(bad, anomaly={"max_replays": max_replays})
    replayed = min(max_replays, len(bad))
    assert guard.counters["replays"] == replayed
    for i, ev in enumerate(guard.events):
        assert ("replay" in ev.details) == (i < replayed)
        if i < replayed:
            assert (ev.culprit, ev.cause) == ("square", "overflow")
        elif replayed:  # no replay: the diagnosis of the last replayed incident of the same kind
            assert (ev.culprit, ev.cause) == ("square", "overflow")
            assert ev.details["diagnosis_from"].startswith(f"incident #{replayed} ")
        else:
            assert ev.culprit is None and "diagnosis_from" not in ev.details


def _frame_rows(tmp_path: Any) -> list[str]:
    report = next(tmp_path.rglob("incident-0001-*.txt")).read_text()
    rows = report.split("frames before the first non-finite value:\n", 1)[1].splitlines()
    return rows[rows.index(next(r for r in rows if r.startswith("----"))) + 1:]


@pytest.mark.parametrize("frames", [2, 21])
def test_frames_is_the_number_of_module_frames_in_the_report(tmp_path: Any, fit_overflow: Any, frames: int) -> None:
    depth = 6
    fit_overflow((1,), depth=depth, anomaly={"frames": frames})
    rows = _frame_rows(tmp_path)
    calls = depth + 2  # body.0 .. body.5, body (post-order), square: the first call with a non-finite output
    assert len(rows) == min(frames, calls)
    assert rows[-1].split()[1:3] == ["square", "(0)"]
    assert rows[0].split()[1] == ("body" if frames == 2 else "body.0")


# ------------------------------------------------------------------- precision, data-explained overflow, optimizer


class FractionalPower(pl.LightningModule):
    """``|w.x| ** 0.01`` (no bias): finite forward; its backward ``0.01 |u| ** -0.99`` overflows float32 for a
    tiny ``u`` (a sample of 1e-44, subnormal) but not float64."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(features, 1, bias=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x).abs().pow(0.01), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_backward_only_overflow_finite_in_float64_is_precision(fit: Any) -> None:
    """A NaN/Inf that first appears in backward is ``precision`` when the float64 backward is finite."""
    x, y = (t.clone() for t in regression_data(8 * 16).tensors)
    bad_step = 2
    x[16 * bad_step + 3] = 1e-44
    assert 0 < float(x[16 * bad_step + 3, 0]) < torch.finfo(torch.float32).tiny  # subnormal, not zero
    guard = NaNGuard(logging={"verbose": False})
    fit(FractionalPower(), TensorDataset(x, y), [guard], batch_size=16, max_epochs=1)
    (ev,) = guard.events
    assert (ev.step, ev.kind) == (bad_step, "gradient") and math.isinf(ev.details["grad_norm"])
    assert ev.details["replay"]["reproduced"] and ev.details["replay"]["loss_finite"]
    assert ev.details["float64"]["grads_finite"]
    assert ev.cause == "precision" and ev.op == "PowBackward0"


def test_overflow_explained_by_an_extreme_feature_stays_overflow_while_the_norm_history_grows(fit: Any) -> None:
    """Rule 4b: extreme input features explain the overflow, even after a growing gradient-norm history (which,
    alone, would be read as exploding gradients)."""
    from lightning_nanguard.diagnose import dynamics
    from .test_causes import FeatureSquare

    x, y = (t.clone() for t in regression_data(n=16 * 8, features=8).tensors)
    bad_step = 6
    for k in range(bad_step):  # feature 5 grows 3x per batch: the gradient norm (~ x**4) grows with it
        x[16 * k:16 * (k + 1), 5] *= 3.0 ** k
    x[16 * bad_step:16 * (bad_step + 1), 5] = 1e20  # squared: 1e40, beyond float32
    guard = NaNGuard(check={"divergence": "off"}, logging={"verbose": False})
    fit(FeatureSquare(), TensorDataset(x, y), [guard], batch_size=16, max_epochs=1)
    ev = guard.events[0]
    assert (ev.step, ev.kind) == (bad_step, "loss")
    history = list(guard.state_dict()["clipper"]["history"])[:bad_step]
    assert dynamics.short_growth(history) is not None  # the history alone says exploding_gradient
    assert ev.details["extreme_features"][0]["features"] == [5]
    assert ev.cause == "overflow" and ev.details["abs_max_float64"] > torch.finfo(torch.float32).max
    assert "symptom" not in ev.details and "reduce_lr" not in ev.actions


def test_nonfinite_parameters_after_nonfinite_gradients_are_unknown_not_optimizer(fit: Any) -> None:
    """Rule 3 blames the optimizer only when the gradients of the step that wrote the weights were finite."""
    from lightning_nanguard.testing import Fault, FaultInjector

    bad_step = 3
    injector = FaultInjector([Fault("gradient", steps=[bad_step], value="inf"),
                              Fault("parameter", steps=[bad_step], target="linear.weight")])
    guard = NaNGuard(logging={"verbose": False})
    fit(Regression(), regression_data(128), [injector, guard], batch_size=16, max_steps=6)
    assert [(e.step, e.kind) for e in guard.events[:2]] == [(bad_step, "gradient"), (bad_step + 1, "parameter")]
    assert math.isinf(guard.events[0].details["grad_norm"])
    ev = guard.events[1]
    assert ev.culprit == "linear.weight" and ev.cause == "unknown"
