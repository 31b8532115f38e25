"""Issue 19 on one process: a fault that does not come back (cause ``transient``) is skipped and nothing else;
one that the replay reproduces keeps today's causes and ladder; no replay, no transient; repeated transients make
the rank's hardware suspect (``recovery.transient_limit``, ``transient_window``, ``on_suspect_hardware``).

Real Trainer runs in both ``check.sync`` modes (lagged forced on the CPU with a fused AdamW). Faults: a module
output non-finite once (a forward hook that fires once: the replay is clean), ``FaultInjector``'s gradient fault
(one ``.grad`` element after backward: the replay's own gradients are clean), and, for contrast, its activation
fault (the hook stays for the step: the replay reproduces it).
"""

from __future__ import annotations

import json
import socket
from typing import Any, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.recover.hardware import HardwareWatch
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

QUIET = {"verbose": False}


class Net(pl.LightningModule):
    """Linear -> tanh -> dropout -> linear, AdamW (fused: skips a flagged step on the device)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 1)
        self.fused = fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.l2(self.drop(torch.tanh(self.l1(x)))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.fused)


class OutputOnce(pl.Callback):
    """``l1``'s output holds a NaN once at each of ``steps``: the replay of the same batch is clean."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps, self.fired = set(steps), set()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        def hook(module: Any, args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
            step = trainer.global_step
            if step in self.steps and step not in self.fired:
                self.fired.add(step)
                out = out.clone()
                out[0, 0] = float("nan")
                return out
            return None

        pl_module.l1.register_forward_hook(hook)


class NaNConstantOnce(pl.Callback):
    """A NaN added to the loss value once at ``step`` (its gradients stay finite; the replay is clean)."""

    def __init__(self, step: int) -> None:
        self.step, self.fired = step, False

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step and not self.fired:
            self.fired = True
            loss.data.add_(float("nan"))


class DropSteps(pl.Callback):
    """The gradients of ``steps`` dropped by hand: the optimizer skips them."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = set(steps)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step in self.steps:
            for p in pl_module.parameters():
                p.grad = None


def run(fit_steps: Any, callbacks: list, steps: int = 24, fused: bool = False, subdir: Optional[str] = None):
    pl.seed_everything(0, verbose=False)
    model = Net(fused=fused)
    trainer = fit_steps(model, callbacks, steps=steps, data=models.regression_data(n=512), subdir=subdir)
    return model, trainer


# --------------------------------------------------------------------------------- a fault that does not come back


@pytest.mark.parametrize("sync", ["eager", "lagged"])
def test_one_off_output_and_gradient_faults_are_transient_and_only_skip_their_step(fit_steps, sync):
    """A module output non-finite once (step 5) and a NaN gradient element (step 11): cause transient, actions
    exactly skip_step, no clip armed, no LR cut, no rollback; the final weights are bitwise those of the same run
    with the gradients of steps 5 and 11 dropped by hand (dropout included: the replay leaves the RNG as it was)."""
    lagged = sync == "lagged"
    guard = NaNGuard(check={"sync": sync}, logging=QUIET)
    faults = [OutputOnce((5,)), FaultInjector(Fault("gradient", steps=[11]))]
    model, trainer = run(fit_steps, faults + [guard], fused=lagged, subdir="guarded")
    reference, _ = run(fit_steps, [DropSteps((5, 11))], fused=lagged, subdir="dropped")
    assert guard.lagged == lagged
    assert [(e.step, e.kind, e.cause, e.actions) for e in guard.events] == [
        (5, "loss", "transient", ["skip_step"]), (11, "gradient", "transient", ["skip_step"])]
    assert all(e.details["replay"]["reproduced"] is False for e in guard.events)
    assert guard.counters["skipped_steps"] == 2 and guard.counters["replays"] == 2
    assert guard.counters["rollbacks"] == guard.counters["lr_cuts"] == guard.counters["clipped_steps"] == 0
    assert guard.lr_scale == 1.0 and not guard.state_dict()["clipper"]["armed"] and not guard.stopped
    assert models.same_weights(model, reference)
    # where it happened, in the event and in events.jsonl
    host = socket.gethostname()
    assert all((e.rank, e.host, e.device, e.local_rank) == (0, host, "cpu", 0) for e in guard.events)
    suggestion = guard.events[0].suggestion
    assert f"rank 0 on host {host} (cpu)" in suggestion and "test that GPU" in suggestion
    lines = [json.loads(line) for line in (guard.report_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["host"], e["device"], e["local_rank"], e["cause"]) for e in lines] == [(host, "cpu", 0, "transient")] * 2


def test_a_fault_the_replay_reproduces_keeps_its_cause_and_the_ladder(fit_steps):
    """FaultInjector's activation fault stays for the whole step: the replay reproduces it, so it is not transient
    and the ladder acts as before (the first incident arms adaptive clipping)."""
    guard = NaNGuard(logging=QUIET)
    run(fit_steps, [FaultInjector(Fault("activation", steps=[5], target="l1")), guard])
    (event,) = guard.events
    assert event.details["replay"]["reproduced"] is True and event.culprit == "l1"
    assert event.cause not in ("transient", None) and event.actions == ["skip_step", "clip"]


def test_no_replay_no_transient(fit_steps):
    """Only a replay tells a fault that does not come back: with anomaly.mode off nothing is replayed (unknown),
    and once anomaly.max_replays is spent the last replayed cause is not inherited when it was transient."""
    off = NaNGuard(anomaly={"mode": "off"}, logging=QUIET)
    run(fit_steps, [FaultInjector(Fault("gradient", steps=[5])), off], subdir="off")
    assert [(e.cause, "replay" in e.details) for e in off.events] == [("unknown", False)]
    spent = NaNGuard(anomaly={"max_replays": 1}, logging=QUIET)
    run(fit_steps, [FaultInjector(Fault("gradient", steps=[5, 9])), spent], subdir="spent")
    assert [e.cause for e in spent.events] == ["transient", "unknown"]
    assert "diagnosis_from" not in spent.events[1].details and spent.counters["replays"] == 1


def test_a_lagged_step_applied_before_its_verdict_is_not_transient(fit_steps):
    """check.sync lagged with an optimizer that cannot skip on the device: the step was applied before it was
    judged, so its replay ran on other weights and a clean replay proves nothing: not transient, and the applied
    step is rolled back as before."""
    guard = NaNGuard(check={"sync": "lagged"}, logging=QUIET)
    run(fit_steps, [NaNConstantOnce(6), guard], fused=False)
    (event,) = guard.events
    assert event.cause != "transient" and "other weights" in event.details["replay"]["note"]
    assert "rollback" in event.actions and guard.counters["rollbacks"] == 1


def test_one_off_faults_back_to_back_count_towards_a_rollback(fit_steps):
    """A fault that comes back on the very next step is no one-off: transients in a row count towards
    recovery.max_skips like any incident (so a run where every step fails still ends within the ladder's bound)."""
    guard = NaNGuard(recovery={"max_skips": 2, "transient_limit": 10}, logging=QUIET)
    run(fit_steps, [FaultInjector(Fault("gradient", steps=[8, 9, 10])), guard])
    assert [(e.step, e.cause, e.actions) for e in guard.events] == [
        (8, "transient", ["skip_step"]), (9, "transient", ["skip_step"]), (10, "transient", ["skip_step", "rollback"])]
    assert guard.lr_scale == 1.0  # never the LR: a smaller one cannot help


# ------------------------------------------------------------------------------------- repeated transients


@pytest.mark.parametrize("policy, limit, window, suspect", [
    ("warn", 3, 20, True), ("warn", 4, 20, False), ("warn", 3, 10, False), ("stop", 3, 20, True),
    ("raise", 3, 20, True)])
def test_repeated_transients_make_the_rank_suspect(fit_steps, policy, limit, window, suspect):
    """One-off faults at steps 3, 8 and 13: with recovery.transient_limit 3 within transient_window 20 steps the
    third says the rank's hardware is suspect, names the rank and host, and on_suspect_hardware decides: warn (the
    run goes on), stop (the Trainer stops there), raise (NaNGuardError naming them). A limit of 4, or a window of
    10 steps (3 is out of it at 13), leaves them plain transients."""
    guard = NaNGuard(recovery={"transient_limit": limit, "transient_window": window, "on_suspect_hardware": policy},
                     logging=QUIET)
    faults = FaultInjector(Fault("gradient", steps=[3, 8, 13]))
    host = socket.gethostname()
    if policy == "raise":
        with pytest.raises(NaNGuardError, match=rf"hardware of rank 0 on host {host} \(cpu\) is suspect: 3 faults"):
            run(fit_steps, [faults, guard], steps=30)
    else:
        _, trainer = run(fit_steps, [faults, guard], steps=30)
        assert trainer.global_step == (14 if policy == "stop" else 30) and guard.stopped == (policy == "stop")
    assert [(e.step, e.cause) for e in guard.events] == [(3, "transient"), (8, "transient"), (13, "transient")]
    last = guard.events[-1]
    if not suspect:
        assert last.actions == ["skip_step"] and "suspect_hardware" not in last.details
        return
    assert last.actions == ["skip_step", policy]
    assert last.details["suspect_hardware"] == {"rank": 0, "host": host, "device": "cpu", "local_rank": 0,
                                                "faults": 3, "steps": [3, 8, 13], "window": window, "policy": policy}
    assert f"exclude host {host}" in last.suggestion
    assert all("suspect_hardware" not in e.details for e in guard.events[:-1])


def test_hardware_watch_counts_per_rank_within_the_window_and_round_trips():
    watch = HardwareWatch(limit=2, window=10)
    assert watch.fault(rank=1, step=0) is None and watch.fault(rank=0, step=5) is None
    assert watch.fault(rank=1, step=9) == [0, 9]
    assert watch.fault(rank=0, step=15) is None  # step 5 is out of (5, 15]
    twin = HardwareWatch(limit=2, window=10)
    twin.load_state_dict(json.loads(json.dumps(watch.state_dict())))  # as a checkpoint carries it
    assert twin.fault(rank=0, step=16) == [15, 16] and twin.count(1) == 2
