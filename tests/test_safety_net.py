"""What issue 24's safety net left, each on a real fit: a resumed fit says where its numbering goes on; incident
reports a full disk refuses are warned naming the file; a snapshot the disk refuses mid-run is listed and the
rollback restores the last snapshot on disk before it; a TensorBoard folder replaced by a file is one warning and no
exception; a saved guard state with no section is refused."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.errors import SinkWriteWarning, SnapshotWriteWarning
from lightning_nanguard.testing import Fault, FaultInjector

from . import models
from .test_sink_faults import STEPS, Net
from .test_snapshot_trust import AfterRollback, Fused, same_state

ROOT = Path(__file__).resolve().parent.parent


def _fit(root: Path, guard: NaNGuard, callbacks: tuple = (), bad: tuple = (3, 9, 12), **kwargs: Any
         ) -> tuple[pl.Trainer, list[warnings.WarningMessage]]:
    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(root, [guard, *callbacks], max_steps=kwargs.pop("steps", STEPS), max_epochs=-1, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(bad), models.loader(models.regression_data(), 16))
    return trainer, [w for w in caught if "[nanguard]" in str(w.message)]


# --------------------------------------------------------------------------------- numbering after a crash


def test_a_resumed_fit_says_its_numbering_goes_on_after_the_events_the_crashed_run_wrote(tmp_path, caplog):
    """The killed run (tests/killed_fit.py) wrote event 2 after its checkpoint (which says 1): the resumed fit's
    first event is 3, with no gap, and one line at fit start says why it is not 2."""
    from . import killed_fit

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    child = subprocess.run([sys.executable, "-m", "tests.killed_fit", str(tmp_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == -9, child.stderr[-3000:]
    caplog.set_level(logging.INFO)
    guard = killed_fit.guard(tmp_path)
    pl.seed_everything(0, verbose=False)
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={killed_fit.CKPT_EVERY}.ckpt"
    killed_fit.trainer(tmp_path, [guard], 12).fit(Net(killed_fit.BAD), models.loader(models.regression_data(), 16),
                                                  ckpt_path=str(ckpt))
    said = [r.getMessage() for r in caplog.records if "numbers its events from" in r.getMessage()]
    assert said == [f"[nanguard] the checkpoint's last event is number 1, and {tmp_path / 'nanguard'} already holds "
                    "events up to number 2 (written after that checkpoint by the run it resumes): this fit numbers its "
                    "events from 3"]
    assert [e.index for e in guard.events] == [3]  # the replayed step 9
    assert [e["index"] for e in models.read_events(tmp_path)] == [1, 2, 3]  # no gap


@pytest.mark.slow
@pytest.mark.parametrize("jsonl", ["off", "behind"])
def test_a_fit_numbers_its_events_after_the_report_files_when_events_jsonl_is_absent_or_behind(tmp_path, jsonl):
    """docs/events.md, numbering: a fit starts after the highest number in ``events.jsonl`` *or among the report
    files*, so no number and no report name is used twice. The first fit writes events 1-3 and their reports;
    then ``events.jsonl`` is absent (``logging.events_file: false`` in both fits) or behind (it kept only its
    first line, as when the disk refused the others). The second fit into the same folder numbers 4-6: its
    report files are new names (none ``-2``), and the first fit's reports are untouched."""
    logging_keys = {"verbose": False, "events_file": jsonl != "off"}
    _fit(tmp_path, NaNGuard(logging=logging_keys))
    folder = tmp_path / "nanguard"
    first = {p.name: p.read_text() for p in folder.glob("incident-*.txt")}
    assert sorted(first) == [f"incident-{i:04d}-step{s}.txt" for i, s in ((1, 3), (2, 9), (3, 12))]
    if jsonl == "behind":
        lines = (folder / "events.jsonl").read_text().splitlines(keepends=True)
        (folder / "events.jsonl").write_text(lines[0])
    else:
        assert not (folder / "events.jsonl").exists()
    guard = NaNGuard(logging=logging_keys)
    _fit(tmp_path, guard)
    assert [e.index for e in guard.events] == [4, 5, 6]
    names = sorted(p.name for p in folder.glob("incident-*.txt"))
    assert names == sorted([*first, *(f"incident-{i:04d}-step{s}.txt" for i, s in ((4, 3), (5, 9), (6, 12)))])
    assert {n: (folder / n).read_text() for n in first} == first  # none overwritten
    if jsonl == "behind":
        assert [e["index"] for e in models.read_events(tmp_path)] == [1, 4, 5, 6]


# ------------------------------------------------------------------------------------------- a full disk


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A real 256 KiB tmpfs, to be filled by the test (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / f"full-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


class FillAt(pl.Callback):
    def __init__(self, disk: Path, step: int) -> None:
        self.disk, self.step = disk, step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            fill(self.disk)


@pytest.mark.slow
def test_incident_reports_a_full_disk_refuses_are_warned_naming_the_report(full_disk):
    """The disk fills up after the first incident: the reports of the later ones are refused (ENOSPC, a real
    tmpfs), warned once naming the refused report file, no empty file is left, and the end of fit counts them."""
    guard = NaNGuard(logging={"verbose": False}, recovery={"snapshot": "memory"})
    trainer, said = _fit(full_disk / "run", guard, (FillAt(full_disk, 5),))
    assert [e.index for e in guard.events] == [1, 2, 3] and trainer.global_step == STEPS
    folder = full_disk / "run" / "nanguard"
    reports = [s for s in said if "the incident reports could not be written" in str(s.message)]
    assert len(reports) == 1 and issubclass(reports[0].category, SinkWriteWarning)
    assert f"({folder / 'incident-0002-step9.txt'}: No space left on device)" in str(reports[0].message)
    assert sorted(p.name for p in folder.glob("incident-*.txt")) == ["incident-0001-step3.txt"]  # no empty report
    assert guard._recorder.failed_writes["the incident reports"] == 2


def test_a_snapshot_the_disk_refuses_mid_run_is_listed_and_never_restored_before_an_older_good_one(tmp_path):
    """Disk snapshots every 5 steps; the temporary file of step 15's lands on a full device (/dev/full): the write
    fails (ENOSPC), is listed in ``snapshots.failures`` and warned, and the rollback of step 17 restores step 10,
    the last snapshot on disk, bitwise, not step 15's host copy."""
    snaps = tmp_path / "snaps"
    guard = NaNGuard(logging=models.QUIET, recovery={"snapshot": "disk", "snapshot_every": 5, "keep_snapshots": 3,
                                                     "snapshot_dir": str(snaps)})
    spy = AfterRollback(guard)

    class FullAt15(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.global_step == 14:  # the next snapshot's temporary file goes to a full device
                os.symlink("/dev/full", snaps / "snapshot-step15.pt.tmp")

    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(tmp_path, [FaultInjector(Fault("parameter", steps=[17])), FullAt15(), guard, spy],
                             max_steps=24, max_epochs=-1)
    with pytest.warns(SnapshotWriteWarning, match="snapshot at step 15 not written: No space left on device"):
        trainer.fit(Fused(), models.loader(models.regression_data(n=512), 16))
    assert [(f["step"], f["error"]) for f in guard.snapshots.failures] == [(15, "No space left on device")]
    (restored, state), = spy.restored
    assert restored == 10 and same_state(state["module"], spy.states[10]["module"])
    assert same_state(state["optimizers"], spy.states[10]["optimizers"])
    assert trainer.global_step == 24 and models.all_finite(trainer.lightning_module)


# ------------------------------------------------------------------------------ a folder replaced by a file


def test_a_tensorboard_folder_replaced_by_a_file_is_one_warning_per_sink_and_no_exception(tmp_path):
    """At step 5 the TensorBoard run folder (``version_0``, which holds ``nanguard/`` too) becomes a file: the fit
    ends normally (Lightning's own logger never trips over an error the guard caused: the guard does not write into
    a writer whose folder is gone), each of the four sinks it stops (the pictures too) warns once, naming where, and
    the end of fit counts each sink's refused writes."""
    guard = NaNGuard(logging={"verbose": False}, recovery={"snapshot": "memory"})

    class Replace(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 5:
                folder = Path(trainer.logger.log_dir)
                shutil.rmtree(folder)
                folder.write_text("not a folder\n")

    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer, said = _fit(tmp_path, guard, (Replace(),), logger=logger, log_every_n_steps=1)
    assert trainer.global_step == STEPS and [e.step for e in guard.events] == [3, 9, 12]
    names = [str(w.message).split("]", 1)[1].split(" could not", 1)[0].strip() for w in said]
    assert sorted(names) == ["events.jsonl", "the incident pictures", "the incident reports", "the loggers"], names
    logger_warning = next(str(w.message) for w in said if "the loggers could not" in str(w.message))
    assert f"({tmp_path / 'tb' / 'version_0'}: Not a directory)" in logger_warning
    assert set(guard._recorder.failed_writes) == {"events.jsonl", "the incident pictures", "the incident reports",
                                                  "the loggers"}
    assert guard._recorder.failure_summary().startswith("[nanguard] writes refused this fit: ")


# ----------------------------------------------------------------------------------- a saved state, empty


def test_a_saved_guard_state_with_no_section_ends_the_resume_saying_so(tmp_path):
    """A checkpoint whose guard state is the version key alone is refused like the other hostile states: a
    NaNGuardError naming what it holds and what a guard state has, and how to go on."""
    first = NaNGuard(logging=models.QUIET)
    trainer, _ = _fit(tmp_path / "first", first, bad=(3,), steps=6)
    path = tmp_path / "saved.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    ckpt["callbacks"]["NaNGuard"] = {"version": ckpt["callbacks"]["NaNGuard"]["version"]}
    torch.save(ckpt, path)
    with pytest.raises(NaNGuardError, match=r"holds no section of a guard state \(only version\); expected counters, "
                                            r"recorder, recovery.*delete checkpoint\['callbacks'\]\['NaNGuard'\]"):
        models.trainer(tmp_path / "second", [NaNGuard(logging=models.QUIET)], max_steps=8, max_epochs=-1).fit(
            Net(()), models.loader(models.regression_data(), 16), ckpt_path=str(path))
