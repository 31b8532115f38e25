"""The guard's own files under real faults: a full disk (a symlink to ``/dev/full``), a file where a folder must
be, a folder removed mid-run, a disk that frees up; and what a give-up or the end of fit says it restored.

The fault matrix (``test_fault_matrix``) runs each (sink, fault, when) case in both ``check.sync`` modes and
compares it with the same fit without the fault: the fit finishes, the rescue is the same (events, actions,
restored steps, counters, bitwise weights), each failing sink is warned exactly once, and the files afterwards
are what the fault left (nothing lost but the failed file). docs/recovery.md has the table.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.errors import SinkWriteWarning, SnapshotWriteWarning
from lightning_nanguard.testing import Fault, FaultInjector

from . import models

NAN = float("nan")
ROOT_OF_TESTS = Path(__file__).resolve().parent
STEPS = 16
SCENARIOS = {  # bad batches (batch index == step: 32 batches an epoch) and the recovery keys
    "rescue": ((5, 6, 7, 11), {"max_skips": 2}),
    "give_up": (tuple(range(6, 40)), {"max_skips": 1, "max_rollbacks": 1}),
}


class Net(models.Regression):
    """nn.Linear, fused AdamW (it can skip on the device: lagged runs on the CPU); NaN loss on ``bad`` batches."""

    def __init__(self, bad: tuple[int, ...] = ()) -> None:
        super().__init__(lr=0.02)
        self.bad = set(bad)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if batch_idx in self.bad else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)


class LineLogger(Logger):
    """A real logger that appends one line per ``log_metrics`` call to ``path`` (no buffering)."""

    def __init__(self, path: Path, root: Path) -> None:
        super().__init__()
        self.path, self.root, self.lines = Path(path), root, 0

    name = property(lambda self: "lines")
    version = property(lambda self: 0)
    save_dir = property(lambda self: str(self.root))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(f"{step} {sorted(metrics.items())}\n")
        self.lines += 1


class At(pl.Callback):
    """Listed ahead of the guard: ``action(root)`` at the start of step ``step`` (-1: at train start)."""

    def __init__(self, step: int, action: Callable[[Path], None], root: Path) -> None:
        self.step, self.action, self.root = step, action, root

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.step == -1:
            self.action(self.root)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self.action(self.root)


# ---------------------------------------------------------------------------------------------- the faults

def jsonl_full(root: Path) -> None:
    (root / "nanguard").mkdir(parents=True, exist_ok=True)
    (root / "nanguard" / "events.jsonl").unlink(missing_ok=True)
    os.symlink("/dev/full", root / "nanguard" / "events.jsonl")


def jsonl_freed(root: Path) -> None:
    (root / "nanguard" / "events.jsonl").unlink()


def folder_is_a_file(root: Path) -> None:
    shutil.rmtree(root / "nanguard", ignore_errors=True)
    (root / "nanguard").write_text("not a folder\n")


def folder_removed(root: Path) -> None:
    # nothing of the guard's writes into nanguard/ off the training thread (the pictures are drawn in it, issue 43),
    # so one rmtree is enough; removing until it is gone also holds if a writer thread ever comes back
    for _ in range(50):
        shutil.rmtree(root / "nanguard", ignore_errors=True)
        if not (root / "nanguard").exists():
            return
    raise AssertionError("the folder could not be removed")


def snapshots_full(root: Path) -> None:  # every temporary snapshot file of this fit lands on a full disk
    (root / "snaps").mkdir(parents=True, exist_ok=True)
    for step in range(STEPS + 1):
        tmp = root / "snaps" / f"snapshot-step{step}.pt.tmp"
        if not tmp.is_symlink():
            os.symlink("/dev/full", tmp)


def snapshot_dir_is_a_file(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "snaps").write_text("not a folder\n")


def snapshot_dir_removed(root: Path) -> None:
    shutil.rmtree(root / "snaps")


def logger_full(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/full", root / "lines.txt")


# (id, scenario, [(step, fault)], {warned sink: count}) -- step -2: before the fit, -1: at train start
CASES = [
    ("jsonl-enospc-rescue", "rescue", [(-2, jsonl_full)], {"events.jsonl": 1}),
    ("jsonl-enospc-give_up", "give_up", [(3, jsonl_full)], {"events.jsonl": 1}),
    ("jsonl-enospc-then-freed", "rescue", [(-2, jsonl_full), (9, jsonl_freed)], {"events.jsonl": 1}),
    ("folder-is-a-file-rescue", "rescue", [(2, folder_is_a_file)],
     {"events.jsonl": 1, "the incident reports": 1, "the incident pictures": 1}),
    ("folder-is-a-file-give_up", "give_up", [(3, folder_is_a_file)],
     {"events.jsonl": 1, "the incident reports": 1, "the incident pictures": 1}),
    ("folder-removed-mid-rescue", "rescue", [(7, folder_removed)], {}),
    ("snapshot-enospc-rescue", "rescue", [(-1, snapshots_full)], {"snapshot": 1}),
    ("snapshot-enospc-give_up", "give_up", [(-1, snapshots_full)], {"snapshot": 1}),
    ("snapshot-dir-is-a-file", "rescue", [(-2, snapshot_dir_is_a_file)], {"snapshot": 1}),
    ("snapshot-dir-removed-at-a-snapshot", "rescue", [(9, snapshot_dir_removed)], {}),
    ("logger-enospc-healthy-step", "rescue", [(-2, logger_full)], {"the loggers": 1}),
]


def run_fit(root: Path, sync: str, scenario: str, faults: list = ()) -> dict:
    bad, recovery = SCENARIOS[scenario]
    root.mkdir(parents=True, exist_ok=True)
    for step, fault in faults:
        if step == -2:
            fault(root)
    guard = models.sync_guard(sync, quiet={"verbose": False, "events_file": True, "reports": True},
                              recovery={"snapshot": "disk", "snapshot_dir": str(root / "snaps"), "snapshot_every": 3,
                                        "stall_anchors": False, **recovery})  # the ring alone: its files are compared
    logger = LineLogger(root / "lines.txt", root)
    callbacks = [At(step, fault, root) for step, fault in faults if step != -2] + [guard]
    pl.seed_everything(0, verbose=False)
    model = Net(bad)
    trainer = models.trainer(root, callbacks, max_steps=STEPS, max_epochs=-1, logger=logger, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, models.loader(models.regression_data(), 16))
    assert guard.lagged is (sync == "lagged")
    warned: dict[str, int] = {}
    for w in caught:
        if issubclass(w.category, SnapshotWriteWarning):
            warned["snapshot"] = warned.get("snapshot", 0) + 1
        elif issubclass(w.category, SinkWriteWarning):
            name = str(w.message).split("]", 1)[1].split(" could not", 1)[0].strip()
            warned[name] = warned.get(name, 0) + 1
    return {"guard": guard, "model": model, "warned": warned, "logger": logger, "trainer": trainer,
            "rescue": [(e.index, e.step, e.kind, e.cause, tuple(e.actions), e.details.get("restored_step"))
                       for e in guard.events],
            "counters": guard.counters}


_CLEAN: dict = {}


@pytest.fixture
def clean(tmp_path_factory):
    def get(sync: str, scenario: str) -> dict:
        if (sync, scenario) not in _CLEAN:
            _CLEAN[sync, scenario] = run_fit(tmp_path_factory.mktemp(f"clean-{sync}-{scenario}"), sync, scenario)
        return _CLEAN[sync, scenario]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("sync", models.SYNCS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fault_matrix(tmp_path, clean, sync, case):
    name, scenario, faults, expected = case
    ref = clean(sync, scenario)
    got = run_fit(tmp_path, sync, scenario, faults)
    assert ref["warned"] == {}
    assert got["rescue"] == ref["rescue"] and got["counters"] == ref["counters"], name
    assert models.same_weights(got["model"], ref["model"]) and models.all_finite(got["model"])
    assert got["warned"] == expected, name
    guard, events = got["guard"], got["guard"].events
    if scenario == "give_up":
        assert guard.stopped and events[-1].actions[-1] == "stop" and events[-1].details["restored_step"] is not None
    out, snaps = tmp_path / "nanguard", tmp_path / "snaps"
    reports = sorted(p.name for p in out.glob("incident-*.txt")) if out.is_dir() else []
    every_report = [f"incident-{e.index:04d}-step{e.step}.txt" for e in events]
    every_line = [e.to_dict() for e in events]
    if name.startswith("jsonl-enospc"):
        assert reports == every_report  # the other sinks got every event
        if name.endswith("freed"):  # the disk took the lines it had refused with the next event: complete, in order
            assert models.read_events(tmp_path) == every_line
        else:
            assert (out / "events.jsonl").is_symlink()
    elif name.startswith("folder-is-a-file"):
        assert (out.read_text() == "not a folder\n") and not (tmp_path / "snaps").is_file()  # left alone
    elif name == "folder-removed-mid-rescue":  # recreated at the next event: only the removed files are gone
        later = [e for e in events if e.step >= 7]
        assert later and models.read_events(tmp_path) == [e.to_dict() for e in later]
        assert reports == [f"incident-{e.index:04d}-step{e.step}.txt" for e in later]
    elif name.startswith("snapshot-enospc"):
        files = sorted(p.name for p in snaps.iterdir())
        assert all((snaps / f).is_symlink() for f in files)  # no snapshot file, no half file of ours
        assert guard.snapshots.failures and all(f["error"] == "No space left on device"
                                                for f in guard.snapshots.failures)
        assert reports == every_report and models.read_events(tmp_path) == every_line
    elif name == "snapshot-dir-is-a-file":
        assert snaps.read_text() == "not a folder\n"
        assert reports == every_report and models.read_events(tmp_path) == every_line
    elif name == "snapshot-dir-removed-at-a-snapshot":  # recreated by the next snapshot
        assert sorted(p.name for p in snaps.iterdir()) == [f"snapshot-step{s.step}.pt" for s in guard.snapshots.ring]
    elif name == "logger-enospc-healthy-step":
        assert got["logger"].lines == 0 and ref["logger"].lines > len(events)  # scalars of healthy steps too
        assert reports == every_report and models.read_events(tmp_path) == every_line


# ----------------------------------------------------------------------------------- what a give-up says


def _give_up_fit(root: Path, recovery: dict, before: tuple = ()) -> tuple[NaNGuard, Net]:
    guard = NaNGuard(logging={"verbose": False}, recovery={"max_skips": 1, "max_rollbacks": 1, **recovery})
    pl.seed_everything(0, verbose=False)
    model = Net(tuple(range(6, 40)))
    trainer = models.trainer(root, [*before, guard], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, models.loader(models.regression_data(), 16))
    return guard, model


def test_a_give_up_without_a_snapshot_says_nothing_was_restored(tmp_path):
    """``recovery.snapshot: off``: the give-up's message says that nothing could be restored and why, and that the
    weights left are finite (the bad steps were skipped), instead of claiming a restore."""
    guard = NaNGuard(logging={"verbose": False},
                     recovery={"snapshot": "off", "max_skips": 1, "max_rollbacks": 0, "on_give_up": "raise"})
    trainer = models.trainer(tmp_path, [guard], max_steps=STEPS, max_epochs=-1)
    with pytest.raises(NaNGuardError) as info:
        trainer.fit(Net(tuple(range(6, 40))), models.loader(models.regression_data(), 16))
    message = str(info.value)
    assert "nothing could be restored (recovery.snapshot is 'off')" in message, message
    assert "restored to the last known-good" not in message and "(finite; that step was not applied)" in message
    assert guard.events[-1].details["restored_step"] is None


@pytest.mark.slow
def test_a_give_up_that_restored_the_train_start_snapshot_says_step_0(tmp_path):
    """docs/recovery.md, give up: a give-up that restored the snapshot taken at train start (step 0) says so:
    "restored to the last known-good state, the snapshot of step 0", ``details.restored_step: 0``; step 0 is a
    snapshot like any other, never "nothing could be restored"."""
    guard = NaNGuard(logging={"verbose": False},
                     recovery={"max_skips": 1, "max_rollbacks": 1, "snapshot_every": 100, "on_give_up": "raise"})
    trainer = models.trainer(tmp_path, [guard], max_steps=STEPS, max_epochs=-1)
    model = Net(tuple(range(1, 40)))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NaNGuardError) as info:
        trainer.fit(model, models.loader(models.regression_data(), 16))
    message = str(info.value)
    assert ("the module, optimizers and LR schedulers were restored to the last known-good state, the snapshot of "
            "step 0.") in message, message
    assert "nothing could be restored" not in message
    assert guard.events[-1].details["restored_step"] == 0 and "not_restored" not in guard.events[-1].details
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())  # taken before step 0 ran


def _local_tag() -> str:
    class Tag(str):  # a class defined inside a function: pickle cannot find it by name
        pass

    return Tag("run-7")


class Unsaved(Net):
    """:class:`Net` whose optimizer's param group holds a value no snapshot file can be written with (pickling fails:
    not the disk, so its host copy is not kept in memory either): no snapshot is ever kept."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([{"params": list(self.parameters()), "tag": _local_tag()}], lr=self.lr, fused=True)


@pytest.mark.parametrize("snapshot", ["off", "none_kept"])
def test_a_give_up_that_restored_nothing_names_the_non_finite_weights_once(tmp_path, caplog, snapshot):
    """docs/recovery.md, give up: with ``recovery.snapshot: off``, or before the first snapshot is kept (every
    write fails: :class:`Unsaved`), a parameter made NaN (written after the optimizer step, ``FaultInjector``)
    cannot be replaced: the give-up looks at the weights it leaves and says which are non-finite (never
    "finite"); the end of fit, which checks the weights once more, records no second event about them ("nothing
    new where the give-up already said so")."""
    caplog.set_level(logging.INFO)
    recovery: dict[str, Any] = ({"snapshot": "off"} if snapshot == "off" else
                                {"snapshot": "disk", "snapshot_dir": str(tmp_path / "snaps"), "snapshot_every": 2})
    guard = NaNGuard(logging={"verbose": False}, recovery={**recovery, "on_give_up": "stop"})
    injector = FaultInjector(Fault("parameter", steps=[5], target="linear.weight"))
    model = Net() if snapshot == "off" else Unsaved()
    trainer = models.trainer(tmp_path, [injector, guard], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SnapshotWriteWarning)  # (none_kept: each write fails, warned once)
        trainer.fit(model, models.loader(models.regression_data(), 16))
    said = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
    assert len(said) == 1, said
    why = guard.events[0].details["not_restored"]
    assert why == ("recovery.snapshot is 'off'" if snapshot == "off" else
                   f"no snapshot could be kept: {len(guard.snapshots.failures)} snapshot write(s) failed "
                   f"({guard.snapshots.failures[-1]['error']})"), why
    assert f"nothing could be restored ({why}): the weights are left NON-FINITE (linear.weight)" in said[0], said[0]
    assert "finite;" not in said[0]
    assert guard.stopped and not models.all_finite(model)
    assert [(e.kind, e.actions[-1]) for e in guard.events] == [("parameter", "stop")]  # none at train end
    assert guard.events[0].details["restored_step"] is None


@pytest.mark.slow
def test_a_give_up_where_every_snapshot_write_failed_says_why(tmp_path):
    """docs/recovery.md, give up: where every snapshot failed to be kept (not a full disk, whose refusals are held in
    host memory: a state the pickler cannot save, here an optimizer param group holding an instance of a class
    defined inside a function), the give-up says why nothing could be restored: "no snapshot could be kept: N
    snapshot write(s) failed (...)" in the message and in ``details.not_restored``, not "no snapshot was taken
    yet"."""
    guard = NaNGuard(logging={"verbose": False},
                     recovery={"snapshot": "disk", "snapshot_dir": str(tmp_path / "snaps"), "snapshot_every": 2,
                               "max_skips": 1, "max_rollbacks": 0, "on_give_up": "raise"})
    trainer = models.trainer(tmp_path, [guard], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(NaNGuardError) as info:
        warnings.simplefilter("always")
        trainer.fit(Unsaved(tuple(range(6, 40))), models.loader(models.regression_data(), 16))
    failures = guard.snapshots.failures
    assert failures and not any(f["in_memory"] for f in failures)
    why = f"no snapshot could be kept: {len(failures)} snapshot write(s) failed ({failures[-1]['error']})"
    assert "pickle" in failures[-1]["error"].lower(), failures[-1]
    assert f"nothing could be restored ({why})" in str(info.value), str(info.value)
    assert "no snapshot was taken yet" not in str(info.value)
    assert guard.events[-1].details["not_restored"] == why and guard.events[-1].details["restored_step"] is None
    assert len([w for w in caught if issubclass(w.category, SnapshotWriteWarning)]) == 1  # warned once per fit


def test_a_give_up_with_every_snapshot_write_failing_still_restores_from_memory(tmp_path):
    """Every snapshot write hits a full disk: the newest snapshot is kept in host memory, and the give-up restores
    it (its message names the step), the same step as with a working disk; the weights are the same."""
    disk = {"snapshot": "disk", "snapshot_every": 2}
    ok, ok_model = _give_up_fit(tmp_path / "ok", dict(disk, snapshot_dir=str(tmp_path / "ok" / "snaps")))
    root = tmp_path / "full"
    guard, model = _give_up_fit(root, dict(disk, snapshot_dir=str(root / "snaps")), (At(-1, snapshots_full, root),))
    restored = ok.events[-1].details["restored_step"]
    assert restored is not None and guard.stopped and guard.events[-1].details["restored_step"] == restored
    assert guard.snapshots.failures and all(f["in_memory"] for f in guard.snapshots.failures)
    assert models.same_weights(model, ok_model) and models.all_finite(model)
    assert not [p for p in (root / "snaps").iterdir() if not p.is_symlink()]  # nothing written: the disk is full


class HeldCopies(pl.Callback):
    """Listed ahead of the guard: at the start of step ``step``, once the writes in flight are done, records the
    snapshots the guard holds (each one's
    step, whether it holds a copy of the state, and the rollback targets); with ``flip``, then flips one bit of RAM
    in the newest copy held in host memory (its first tensor's first element, its sign), as bit rot would."""

    def __init__(self, guard: NaNGuard, step: int, flip: bool = False) -> None:
        self.guard, self.step, self.flip = guard, step, flip
        self.seen: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step:
            return
        self.guard.snapshots.flush()  # the snapshot thread's writes are done (each refused by the disk)
        ring = list(self.guard.snapshots.ring)
        self.seen = {"steps": [s.step for s in ring], "holding": [s.step for s in ring if s.tensors],
                     "in_memory": [s.step for s in ring if s.in_memory],
                     "targets": [s.step for s in self.guard.snapshots.targets()]}
        if self.flip:
            held = [s for s in ring if s.in_memory]
            held[-1].tensors[0].view(-1)[0].neg_()


def _held_fit(root: Path, flip: bool = False) -> tuple[NaNGuard, HeldCopies]:
    """Disk snapshots every 2 steps, 3 kept, each one refused by a full disk; a NaN weight at step 11 rolls back (its
    event is step 12's)."""
    from lightning_nanguard.testing import Fault, FaultInjector

    guard = NaNGuard(logging={"verbose": False}, recovery={
        "snapshot": "disk", "snapshot_every": 2, "keep_snapshots": 3, "snapshot_dir": str(root / "snaps"),
        "stall_anchors": False})
    held = HeldCopies(guard, 11, flip)
    before = [At(-1, snapshots_full, root), FaultInjector([Fault("parameter", steps=[11])], seed=0), held]
    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(root, [*before, guard], max_steps=STEPS, max_epochs=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), models.loader(models.regression_data(), 16))
    return guard, held


@pytest.mark.slow  # two fits, ~2.5 s
def test_only_the_newest_disk_refused_snapshot_is_held_in_memory(tmp_path):
    """docs/recovery.md, snapshots: when the disk refuses snapshots one after another, only the newest is kept in
    host memory (one copy of the state), and an older one held so is no longer a rollback target once a newer one
    takes its place: the rollback restores the newest; and when that copy is refused when read back (a bit flipped
    in RAM), no older copy is restored in its place."""
    guard, held = _held_fit(tmp_path / "full")
    failures = guard.snapshots.failures
    assert len(failures) >= 6 and all(f["in_memory"] for f in failures), failures  # each refusal was kept so ...
    assert held.seen == {"steps": [6, 8, 10], "holding": [10], "in_memory": [10], "targets": [10]}, held.seen
    rollback = guard.events[0]  # the NaN weight of step 11, seen at its batch end (global step 12)
    assert (rollback.step, rollback.kind) == (12, "parameter") and "rollback" in rollback.actions
    assert rollback.details["restored_step"] == 10, rollback.details

    guard, held = _held_fit(tmp_path / "flipped", flip=True)
    assert held.seen["in_memory"] == [10]
    event = guard.events[0]
    assert (event.step, event.kind) == (12, "parameter") and "rollback" not in event.actions, event.details
    assert event.details["restored_step"] is None and "every snapshot left was refused" in event.details["not_restored"]
    assert [(r.step, r.reason) for r in guard.snapshots.refused] == [(10, "digest")]


class PoisonAfterStop(pl.Callback):
    """Listed after the guard: once it has stopped, writes NaN into a weight (code outside the optimizer)."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.guard.stopped:
            with torch.no_grad():
                pl_module.linear.weight[0, 0] = NAN


@pytest.mark.parametrize("snapshot", ["memory", "off"])
def test_train_end_checks_the_weights_after_the_guard_stopped(tmp_path, snapshot):
    """The weights turn NaN after the guard gave up: the check at train end runs anyway. With a snapshot the
    newest is restored (an event says from which step); without one the event says that the weights are left
    non-finite and nothing could be restored, and the fit stops as ``recovery.on_give_up`` says."""
    guard = NaNGuard(logging={"verbose": False},
                     recovery={"snapshot": snapshot, "max_skips": 1, "max_rollbacks": 1, "on_give_up": "stop"})
    trainer = models.trainer(tmp_path, [guard, PoisonAfterStop(guard)], max_steps=STEPS, max_epochs=-1,
                             min_steps=STEPS)
    model = Net(tuple(range(6, 40)))
    trainer.fit(model, models.loader(models.regression_data(), 16))
    end = guard.events[-1]
    assert end.details["detected_at"] == "train_end" and end.details["after_stop"]
    if snapshot == "memory":
        assert end.actions == ["rollback"] and end.details["restored_step"] is not None and models.all_finite(model)
    else:
        assert end.actions == ["stop"] and end.details["restored_step"] is None and not models.all_finite(model)
        assert "NON-FINITE weights (linear.weight)" in end.suggestion and "nothing could be restored" in end.suggestion


# ------------------------------------------------------------------------------------- a killed run resumed


@pytest.mark.slow
def test_a_resume_after_sigkill_keeps_event_numbers_and_leaves_no_stale_snapshot(tmp_path):
    """A child fit is SIGKILLed after its last checkpoint (step 6), with event 2 (step 9) already in events.jsonl
    and its snapshot files on disk. The resumed fit (``ckpt_path``) numbers its events after event 2 (the
    checkpoint says 1), no report file is overwritten, and the killed run's snapshot files are removed at fit
    start: afterwards the folder holds exactly this fit's snapshots."""
    import subprocess
    import sys

    from . import killed_fit

    root = ROOT_OF_TESTS.parent
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    child = subprocess.run([sys.executable, "-m", "tests.killed_fit", str(tmp_path)], cwd=root, env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == -9, child.stderr[-3000:]
    killed = models.read_events(tmp_path)
    assert [(e["index"], e["step"]) for e in killed] == [(1, 3), (2, 9)]
    left = sorted(p.name for p in (tmp_path / "snaps").iterdir())
    assert left and all(name.startswith("snapshot-step") for name in left)
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={killed_fit.CKPT_EVERY}.ckpt"
    assert ckpt.is_file()
    guard = killed_fit.guard(tmp_path)
    pl.seed_everything(0, verbose=False)
    killed_fit.trainer(tmp_path, [guard], 16).fit(Net(killed_fit.BAD), models.loader(models.regression_data(), 16),
                                                  ckpt_path=str(ckpt))
    assert guard.events and guard.events[0].index == 3  # after the killed run's event 2, not the checkpoint's 1
    lines = models.read_events(tmp_path)
    assert lines[:2] == killed and [e["index"] for e in lines] == list(range(1, len(lines) + 1))
    reports = sorted(p.name for p in (tmp_path / "nanguard").glob("incident-*.txt"))
    assert len(reports) == len(lines) == len(set(reports))  # one file per event: none overwritten
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == \
        sorted(f"snapshot-step{s.step}.pt" for s in guard.snapshots.ring)  # no leak from the killed run


def test_an_append_the_disk_cuts_halfway_leaves_no_half_line(tmp_path):
    """A real partial write: the file-size limit (RLIMIT_FSIZE) lets the OS write part of the second event's line,
    then refuses the rest (EFBIG). The sink cuts the file back to its last whole line and keeps the refused line,
    so that when the disk takes writes again the file is every event, whole and in order."""
    import json
    import resource
    import signal

    from lightning_nanguard import NaNEvent
    from lightning_nanguard.report.render import ReportText
    from lightning_nanguard.report.sinks import JsonlSink

    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    events = [NaNEvent(step=s, epoch=0, batch_idx=s, kind="loss", index=i) for i, s in enumerate((3, 7, 9), 1)]
    sink.event(events[0], ReportText(), {})
    size = path.stat().st_size
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, limits[1]))  # room for 10 bytes of the next line
        with pytest.raises(OSError):
            sink.event(events[1], ReportText(), {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert path.stat().st_size == size and len(sink.backlog) == 1  # cut back to the first line; the second kept
    sink.event(events[2], ReportText(), {})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 7, 9]
