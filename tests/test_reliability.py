"""Reliability: crash safety, no leaked state, repeated fits, and independence of guards (real Trainers, CPU).

- A process SIGKILLed right after its N-th incident keeps exactly N complete events in events.jsonl, and
  ``nanguard report`` reads the file even with a half-written last line.
- After ``fit`` returns or raises, every hook the guard (or the fault injector) registered is gone, anomaly
  mode is what it was, and a second fit (same guard or a new one) repeats the first exactly.
- Two guards in two Trainers, one fit nested inside the other, do not see each other's incidents.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

ROOT = Path(__file__).parents[1]
DATA = models.classification_data(n=512)


def signature(events) -> list[tuple]:
    """What must repeat exactly between identical runs (no paths, no timings)."""
    return [(e.index, e.step, e.epoch, e.batch_idx, e.kind, tuple(e.actions), e.cause, e.culprit, e.op)
            for e in events]


@pytest.fixture
def seeded_fit(fit):
    """``seeded_fit(callbacks, model=None, subdir=None, **fit_kwargs)``: seed 0, then fit ``model`` (default: a new
    Classifier) on DATA, shuffled, bounded by ``max_steps``; returns ``(model, trainer)``."""

    def run(callbacks, model=None, subdir=None, **kwargs):
        pl.seed_everything(0, verbose=False)
        model = model if model is not None else models.Classifier()
        kwargs.setdefault("max_epochs", -1)  # runs are bounded by max_steps
        return model, fit(model, DATA, callbacks, subdir=subdir, shuffle=True, **kwargs)

    return run


# ------------------------------------------------------------------------------------------- crash safety

CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import pytorch_lightning as pl
    from tests import models  # run from the repository root
    from lightning_nanguard import NaNGuard
    from lightning_nanguard.testing import Fault, FaultInjector

    root, n = sys.argv[1], int(sys.argv[2])

    class KillAfterEvents(pl.Callback):  # listed after the guard: runs once its events are recorded
        def __init__(self, guard):
            self.guard = guard

        def on_train_batch_end(self, trainer, *args):
            if len(self.guard.events) >= n:
                os.kill(os.getpid(), signal.SIGKILL)

    guard = NaNGuard(logging={"verbose": False})
    injector = FaultInjector(Fault(("loss", "gradient", "input"), steps=range(5, 400, 5),
                                   value=("nan", "inf", "-inf")), seed=0)
    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(root, [injector, guard, KillAfterEvents(guard)], max_epochs=20)
    trainer.fit(models.Classifier(), models.loader(models.classification_data(n=512), shuffle=True))
    print("NOT KILLED")
""")


@pytest.mark.slow
def test_sigkill_loses_no_completed_event_and_report_reads_a_truncated_line(tmp_path):
    n = 7
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(tmp_path / "run"), str(n)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    path = tmp_path / "run" / "nanguard" / "events.jsonl"
    raw = path.read_text()
    assert raw.endswith("\n")  # every record that was written is complete
    events = models.read_events(path)
    assert [e["index"] for e in events] == list(range(1, n + 1))
    assert [e["step"] for e in events] == [5 * i for i in range(1, n + 1)]
    assert all(e["actions"][0] == "skip_step" for e in events)

    # a kill in the middle of a write leaves half a line: the report skips it with a warning
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(raw.splitlines()[0][: len(raw.splitlines()[0]) // 2])
    report = subprocess.run([sys.executable, "-m", "lightning_nanguard", "report", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    assert "truncated" in report.stderr and "Traceback" not in report.stderr
    rows = json.loads(report.stdout)
    rows = rows["events"] if isinstance(rows, dict) else rows
    assert [r["step"] for r in rows] == [e["step"] for e in events]
    # a garbled line in the middle is an error, not silently skipped
    path.write_text(raw.splitlines()[0][:20] + "\n" + raw)
    bad = subprocess.run([sys.executable, "-m", "lightning_nanguard", "report", str(path)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and ":1:" in bad.stderr and "Traceback" not in bad.stderr


# -------------------------------------------------------------------------------------------- no leaks


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


def hook_counts(model: nn.Module) -> dict:
    counts = {f"{name}.{d}": len(getattr(m, d, {}) or {}) for name, m in model.named_modules() for d in HOOK_DICTS}
    counts.update({f"{name}.tensor_hooks": len(p._backward_hooks or {}) + len(
        getattr(p, "_post_accumulate_grad_hooks", None) or {}) for name, p in model.named_parameters()})
    glob = torch.nn.modules.module
    for g in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
              "_global_backward_pre_hooks"):
        counts[g] = len(getattr(glob, g, {}))
    return counts


def anomaly_state() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


FAULTS = [Fault("activation", steps=[6], target="net.1"), Fault("loss", steps=[12], value="inf"),
          Fault("parameter", steps=[20])]


class HooksDuringFit(pl.Callback):
    def __init__(self):
        self.most = 0

    def on_after_backward(self, trainer, pl_module):
        self.most = max(self.most, sum(hook_counts(pl_module).values()))


@pytest.mark.parametrize("config,faults", [
    ({}, FAULTS),
    ({"check": {"activations": "always"}}, FAULTS),
    ({"check": {"activations": 3}}, FAULTS),
    ({"anomaly": {"mode": "always"}}, []),  # a debugging mode: a NaN in backward raises (test_diagnosis)
], ids=["defaults", "activations-always", "activations-every3", "anomaly-always"])
@pytest.mark.parametrize("anomaly_before", [False, True])
def test_fit_leaves_no_hooks_and_restores_anomaly_mode(seeded_fit, config, faults, anomaly_before):
    model = models.Classifier()
    before = hook_counts(model)
    assert all(v == 0 for v in before.values())
    previous = anomaly_state()
    torch.autograd.set_detect_anomaly(anomaly_before)
    expected = anomaly_state()
    try:
        guard, during = NaNGuard(logging={"verbose": False}, **config), HooksDuringFit()
        seeded_fit([FaultInjector(faults), guard, during], model=model, max_steps=30)
        assert [e.step for e in guard.events] == models.detected_steps(faults)
        assert anomaly_state() == expected
        assert hook_counts(model) == before
        if "activations" in config.get("check", {}):
            assert during.most > 0  # the hooks were really there during the fit
    finally:
        torch.autograd.set_detect_anomaly(*previous)


@pytest.mark.parametrize("anomaly", ["on_incident", "always"])
def test_fit_that_raises_leaves_no_hooks(seeded_fit, anomaly):
    model = models.Classifier()
    before = hook_counts(model)
    previous = anomaly_state()
    guard = NaNGuard(logging={"verbose": False}, anomaly={"mode": anomaly}, check={"activations": "always"},
                     recovery={"max_skips": 1, "max_rollbacks": 1, "on_give_up": "raise"})
    injector = FaultInjector(Fault(("loss", "activation"), rate=1.0), seed=0)  # every step
    # anomaly "always" is torch's debugging mode: its own RuntimeError from backward may come first
    with pytest.raises(NaNGuardError if anomaly == "on_incident" else (NaNGuardError, RuntimeError)):
        seeded_fit([injector, guard], model=model, max_steps=50)
    assert hook_counts(model) == before
    assert anomaly_state() == previous
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())  # restored before raising


def test_second_fit_with_the_same_or_a_new_guard_repeats_the_first(seeded_fit):
    faults = [Fault("input", steps=[4]), Fault("gradient", steps=[9], value="-inf"),
              Fault("parameter", steps=[15]), Fault("loss", steps=range(22, 27))]
    runs = []
    guard = NaNGuard(logging={"verbose": False})
    injector = FaultInjector(faults, seed=3)
    for name, g in (("first", guard), ("same", guard), ("new", NaNGuard(logging={"verbose": False}))):
        model, _ = seeded_fit([injector, g], subdir=name, max_steps=40)
        runs.append((signature(g.events), {k: v.clone() for k, v in model.state_dict().items()},
                     dict(g.counters), g.lr_scale, [i.to_dict() for i in injector.log]))
    first = runs[0]
    assert [e[1] for e in first[0]] == models.detected_steps(faults) and any("rollback" in e[5] for e in first[0])
    for other in runs[1:]:
        assert other[0] == first[0]  # same events, numbered from 1 again
        assert other[2:] == first[2:]  # same counters, LR scale and injected faults
        assert first[1].keys() == other[1].keys()
        assert all(torch.equal(first[1][k], other[1][k]) for k in first[1])


# ----------------------------------------------------------------------------------------- independence


class NestedFit(pl.Callback):
    """At one step of the outer fit, run a whole other guarded fit, then restore the global RNGs."""

    def __init__(self, at_step, inner):
        self.at_step, self.inner, self.result = at_step, inner, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step and self.result is None:
            states = torch.get_rng_state(), random.getstate(), np.random.get_state()
            self.result = self.inner()
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])


def test_two_guards_in_two_trainers_do_not_interfere(tmp_path, seeded_fit):
    # faults the replay reproduces (poisoned module outputs): one-off loss or gradient faults are transients, which
    # never cut the LR
    faults_a = [Fault("activation", steps=[5, 6]), Fault("parameter", steps=[30])]
    faults_b = [Fault("activation", steps=[3, 4, 5], value="inf")]

    def run_a(root, extra=()):
        guard = NaNGuard(logging={"verbose": False}, recovery={"lr_factor": 0.5})
        injector = FaultInjector(faults_a, seed=0)
        model, _ = seeded_fit([injector, guard, *extra], subdir=root, max_steps=50)
        return guard, model

    def run_b(root):
        guard = NaNGuard(logging={"verbose": False}, recovery={"lr_factor": 0.1, "max_skips": 1},
                         check={"activations": "always"})
        injector = FaultInjector(faults_b, seed=1)
        pl.seed_everything(1, verbose=False)  # the model's initialisation, wherever this runs
        model, _ = seeded_fit([injector, guard], model=models.Classifier(hidden=8), subdir=root, max_steps=20)
        return guard, model

    solo_a, model_a = run_a("solo_a")
    solo_b, model_b = run_b("solo_b")
    nested = NestedFit(20, lambda: run_b("inner_b"))
    outer_a, outer_model = run_a("outer_a", extra=[nested])
    inner_b, inner_model = nested.result

    assert signature(outer_a.events) == signature(solo_a.events)
    assert signature(inner_b.events) == signature(solo_b.events)
    assert [e.step for e in solo_a.events] == models.detected_steps(faults_a)
    assert [e.step for e in solo_b.events] == models.detected_steps(faults_b)
    assert (outer_a.lr_scale, inner_b.lr_scale) == (solo_a.lr_scale, solo_b.lr_scale) != (1.0, 1.0)
    for a, b in ((inner_model, model_b), (outer_model, model_a)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # each guard wrote its own events file and nothing else's
    assert [e["step"] for e in models.read_events(tmp_path / "outer_a")] == [e.step for e in solo_a.events]
    assert [e["step"] for e in models.read_events(tmp_path / "inner_b")] == [e.step for e in solo_b.events]
    assert hook_counts(outer_model) == hook_counts(models.Classifier())
