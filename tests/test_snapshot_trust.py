"""What the guard reads back it verifies first (issue 34): a snapshot file that was replaced by a pickle that runs
code, had one byte of its weight data flipped, was cut to half its size, deleted, or swapped for an older
snapshot's file is refused at the rollback that reads it, and the rollback restores the next older snapshot that
verifies, bitwise, in both ``check.sync`` modes. A snapshot in host memory with one flipped bit is refused too.
Nothing in a snapshot file ever runs as code; the stores add no host read to a healthy fit."""

from __future__ import annotations

import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_nanguard
from lightning_nanguard import NaNGuard
from lightning_nanguard.errors import SnapshotReadWarning
from lightning_nanguard.store.verify import REASONS
from lightning_nanguard.testing import Fault, FaultInjector

from . import models
from .tampering import FAULTS, deleted
from .test_snapshot_stores import AfterRollback
from .test_snapshot_stores import _same as same_state
from .test_sync_modes import HostReads

STEPS = 24
BAD = 17  # a parameter turns NaN at this step: the rollback reads the snapshots of steps 15, 10 and 5
QUIET = {"verbose": False, "events_file": False, "reports": False, "loggers": False}


class Fused(pl.LightningModule):
    """A small MLP trained by a fused AdamW (it skips a bad step on the device: ``check.sync: lagged``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)


class Tamper(pl.Callback):
    """Listed after the guard: once the snapshot of step 15 is on disk, ``fault`` is done to the files of the newest
    ``count`` snapshots (newest first, so that a swapped file is the genuine older one)."""

    def __init__(self, guard: NaNGuard, fault: Callable[[Path, Path], None], count: int, marker: Path) -> None:
        self.guard, self.fault, self.count, self.marker, self.done = guard, fault, count, marker, False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        store = self.guard.snapshots
        if self.done or store.newest is None or store.newest.step != 15:
            return
        store.flush()  # the files are written
        for snap in list(reversed(store.ring))[: self.count]:
            self.fault(snap.path, self.marker)
        self.done = True


def guarded_fit(root: Path, sync: str, snapshot: str = "disk", fault: Optional[Fault] = None,
                tamper: Optional[Callable[[NaNGuard], pl.Callback]] = None, **recovery: Any
                ) -> tuple[NaNGuard, AfterRollback, pl.Trainer, list[str]]:
    """A fit of :data:`STEPS` steps whose parameter turns NaN at step :data:`BAD` (or with ``fault``); returns the
    guard, the spy, the Trainer and the texts of the SnapshotReadWarnings."""
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(check={"sync": sync}, logging=QUIET,
                     recovery={"snapshot": snapshot, "snapshot_every": 5, "keep_snapshots": 3,
                               "snapshot_dir": str(root / "snaps"), **recovery})
    spy = AfterRollback(guard)
    after = [tamper(guard)] if tamper is not None else []
    injector = FaultInjector(fault or Fault("parameter", steps=[BAD]))
    trainer = models.trainer(root, [injector, guard, *after, spy], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Fused(), models.loader(models.regression_data(n=512), 16))
    return guard, spy, trainer, [str(w.message) for w in caught if issubclass(w.category, SnapshotReadWarning)]


@pytest.fixture(scope="module", params=models.SYNCS)
def reference(request, tmp_path_factory):
    """The untampered fit of each mode: it restores the snapshot of step 15."""
    guard, spy, trainer, read_warnings = guarded_fit(tmp_path_factory.mktemp(f"ref-{request.param}"), request.param)
    (restored, _), = spy.restored
    assert restored == 15 and trainer.global_step == STEPS and read_warnings == []
    assert guard.snapshots.refused == [] and "refused" not in guard.events[-1].details
    return request.param, spy


@pytest.mark.slow  # 20 fits of 24 steps (~0.4 s each)
@pytest.mark.parametrize("count", [1, 2], ids=["newest", "newest-two"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_tampered_disk_snapshot_is_refused_and_the_rollback_restores_the_next_one_bitwise(
        reference, tmp_path, fault, count):
    sync, ref = reference
    tampering, reason = FAULTS[fault]
    marker = tmp_path / "code-ran"
    guard, spy, trainer, read_warnings = guarded_fit(
        tmp_path, sync, tamper=lambda g: Tamper(g, tampering, count, marker))
    assert trainer.global_step == STEPS and models.all_finite(trainer.lightning_module)  # the fit went on
    assert not marker.exists()  # no code ran
    expected = 15 - 5 * count
    (restored, state), = spy.restored
    assert restored == expected, (fault, count, restored)
    # bitwise the genuine snapshot: the untampered run's state at that step (module, AdamW moments and steps)
    assert same_state(state["module"], ref.states[expected]["module"])
    assert same_state(state["optimizers"], ref.states[expected]["optimizers"])
    event = next(e for e in guard.events if "rollback" in e.actions)
    assert event.details["restored_step"] == expected
    refused = [15, 10][:count]
    assert [(r["step"], r["reason"], r["why"]) for r in event.details["refused"]] == [
        (s, reason, REASONS[reason]) for s in refused]
    assert [r.step for r in guard.snapshots.refused] == refused
    assert len(read_warnings) == count and all(f"snapshot of step {s} is refused" in w
                                                for s, w in zip(refused, read_warnings))
    assert all(r.step not in refused for r in guard.snapshots.ring)  # never a target again
    if fault == "pickle":  # the planted file would have run its code, had it been unpickled
        pickle.loads((tmp_path / "snaps" / "snapshot-step15.pt").read_bytes())
        assert marker.exists()


def flip_one_bit(guard: NaNGuard) -> pl.Callback:
    """A test hook that reaches into the memory store: one bit of the step-15 snapshot's first weight flips in host
    memory once its seal is taken."""

    class Flip(pl.Callback):
        done = False

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            store = guard.snapshots
            if self.done or store.newest is None or store.newest.step != 15:
                return
            store.flush()  # sealed
            weight = store.newest.tensors[0]
            weight.view(-1).view(torch.int32)[3] ^= 1 << 7
            self.done = True

    return Flip()


@pytest.mark.slow
def test_a_memory_snapshot_with_one_flipped_bit_is_refused_and_the_next_one_restored(reference, tmp_path):
    sync, ref = reference
    guard, spy, trainer, read_warnings = guarded_fit(tmp_path, sync, snapshot="memory", tamper=flip_one_bit)
    (restored, state), = spy.restored
    assert restored == 10 and same_state(state["module"], ref.states[10]["module"])
    assert same_state(state["optimizers"], ref.states[10]["optimizers"])
    event = next(e for e in guard.events if "rollback" in e.actions)
    assert event.details["refused"] == [{"step": 15, "reason": "digest", "why": REASONS["digest"]}]
    assert len(read_warnings) == 1 and "(host memory)" in read_warnings[0]
    assert trainer.global_step == STEPS and models.all_finite(trainer.lightning_module)


def test_with_every_snapshot_refused_the_ladder_goes_on_and_says_why(tmp_path):
    """Every snapshot file deleted before the rollback that three NaN losses in a row call for: nothing is restored
    (``not_restored`` says why, the action is ``warn``), the weights the guard has stay (finite: the bad steps were
    skipped), and the ladder goes on: later incidents are skipped, no exception leaves fit, and the run ends on
    finite weights."""
    guard, spy, trainer, read_warnings = guarded_fit(
        tmp_path, "eager", fault=Fault("loss", steps=list(range(16, 22))), max_skips=2, stall_anchors=False,
        tamper=lambda g: Tamper(g, deleted, 3, tmp_path / "m"))
    first = next(e for e in guard.events if "restored_step" in e.details)
    assert first.step == 18 and first.details["restored_step"] is None
    assert "warn" in first.actions and "rollback" not in first.actions
    assert [r["step"] for r in first.details["refused"]] == [15, 10, 5]
    assert first.details["not_restored"].startswith("every snapshot left was refused when read back"), first.details
    assert len(read_warnings) == 3 and spy.restored == []
    assert [e.step for e in guard.events] == list(range(16, 22)) and all("skip_step" in e.actions for e in guard.events)
    assert trainer.global_step == STEPS and models.all_finite(trainer.lightning_module)


class StoreReads(HostReads):
    """:class:`~.test_sync_modes.HostReads` of the snapshot stores' own code only."""

    GUARD = str(Path(lightning_nanguard.__file__).parent / "store")

    def _wrap(self, name: str, original: Any) -> Any:
        stores = tuple(f"{self.GUARD}/{f}" for f in ("snapshots.py", "sharded.py", "verify.py", "writer.py"))

        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            value = original(t, *args, **kwargs)
            if sys._getframe(1).f_code.co_filename.startswith(stores):
                self.reads.append((self.step, name, value))
            return value

        return read


def test_healthy_fits_read_nothing_on_the_host_for_their_snapshots(fit, monkeypatch, tmp_path):
    """Sealing runs on the snapshot thread from the host copy: the stores' code (store/snapshots.py, sharded.py,
    verify.py, writer.py) makes no host read of a tensor during a healthy fit, memory or disk, and every snapshot is
    sealed."""
    reads = StoreReads(monkeypatch)
    for mode in ("memory", "disk"):
        g = NaNGuard(logging=QUIET, recovery={"snapshot": mode, "snapshot_every": 2,
                                              "snapshot_dir": str(tmp_path / mode)})
        fit(Fused(), models.regression_data(n=512), [reads.probe({}), g], batch_size=16, steps=12, subdir=mode)
        assert g.counters["snapshots"] >= 6 and g.snapshots.refused == [] and g.events == []
        assert all(s.seal is not None and s.seal.nbytes > 0 for s in g.snapshots.ring)
    assert reads.reads == []


# ------------------------------------------------------------------------------------------- sharded (DDP)

DDP_SCRIPT = Path(__file__).parent / "ddp_scripts" / "ddp_tampered.py"


@pytest.fixture(scope="module")
def tampered_ddp(tmp_path_factory) -> list[dict]:
    """One spawned 2-rank run (~15-30 s on two cores) holding every fit of tests/ddp_scripts/ddp_tampered.py."""
    import os
    import subprocess

    out = tmp_path_factory.mktemp("tampered-ddp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, str(DDP_SCRIPT), str(out)], env=env, cwd=str(out), capture_output=True,
                          text=True, timeout=600)  # a rank left waiting in a collective fails here
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"tampered-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("fault", [*FAULTS, "memory_bit"])
def test_a_share_refused_on_rank_1_alone_makes_both_ranks_restore_the_same_older_snapshot(tampered_ddp, fault):
    """Rank 1's share of the step-15 snapshot is tampered with (or, in host memory, one bit of it flips): both ranks
    refuse step 15 (its reason and rank 1 named alike in every rank's event), restore step 10 instead, bitwise the
    state the unsharded probe kept at step 10, and stay equal; the reference fit restores step 15; no code ran."""
    reason = "digest" if fault == "memory_bit" else FAULTS[fault][1]
    ref = [r["reference"] for r in tampered_ddp]
    runs = [r[fault] for r in tampered_ddp]
    assert [a[0] for a in ref[0]["after"]] == [15] and not tampered_ddp[0]["code_ran"]
    assert runs[0]["events"] == runs[1]["events"]  # the same decisions and details on both ranks
    step, kind, actions, restored, refused = runs[0]["events"][-1]
    assert (step, restored) == (18, 10) and "rollback" in actions
    assert refused == [{"step": 15, "reason": reason, "why": REASONS[reason], "ranks": [1]}]
    for r, base in zip(runs, ref):
        assert r["sharded"] and r["global_step"] == STEPS and r["refused"] == [(15, reason, (1,))]
        (after_step, after), = r["after"]
        assert after_step == 10 and same_state(after, base["states"][10])  # bitwise the genuine snapshot of step 10
        assert len(r["warned"]) == 1 and "snapshot of step 15 is refused" in r["warned"][0]
    assert same_state(runs[0]["after"][0][1], runs[1]["after"][0][1])  # no rank holds a mix of two snapshots
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["final"], runs[1]["final"]))


@pytest.mark.slow
@pytest.mark.ddp
def test_sharded_verification_adds_no_collective_to_healthy_steps(tampered_ddp):
    """A healthy sharded fit with disk snapshots: the guard's collectives are the step's one all_reduce (12 numbers)
    and the replicas' agreement before each snapshot (4), then the train-end weight check (1): nothing for sealing
    or verifying."""
    for r in tampered_ddp:
        healthy = r["healthy"]
        sizes = [n for name, n in healthy["calls"] if name == "all_reduce"]
        assert sizes.count(12) == STEPS and sizes.count(4) == healthy["snapshots"], sizes
        assert set(sizes) == {12, 4, 1} and sizes.count(1) == 1, sizes
