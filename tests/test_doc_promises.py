"""Promises of README.md and docs/*.md that a one-line bug broke with the suite green (issue 46, second half).

Each test is written from the docs' words, through the public surface a user meets (a real ``pl.Trainer`` fit,
real files, TensorBoard's own reader, the real command line), and each has a mutant in scripts/mutants.py.
"""

from __future__ import annotations

import warnings

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_nanguard import ConfigError, NaNGuard
from lightning_nanguard.report.cli import main

from . import models

pytestmark = pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*")


def said(caplog) -> list[str]:
    """The guard's lines on screen (no progress bar: Lightning's rank-zero logger, at INFO)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[nanguard]")]


# ------------------------------------------------------------------------------------- recovery.md: LR cuts


def test_an_lr_cut_records_the_learning_rates_before_and_after_it_and_the_scale(tmp_path):
    """docs/recovery.md: "A cut records details.lr_before, details.lr_after and details.lr_scale" (one LR per
    param group): the LR the step ran at, the LR after the cut, and the cumulative scale."""
    pl.seed_everything(0, verbose=False)
    guard = NaNGuard(recovery={"reduce_lr_after": 1, "lr_factor": 0.5}, logging={"verbose": False, "reports": False})
    model = models.NaNLossOnBatches({3})  # AdamW at lr 0.02
    models.trainer(tmp_path, [guard], max_steps=6).fit(model, models.loader(models.regression_data()))
    [event] = guard.events
    assert "reduce_lr" in event.actions
    assert event.details["lr_before"] == [pytest.approx(0.02)]
    assert event.details["lr_after"] == [pytest.approx(0.01)]
    assert event.details["lr_scale"] == pytest.approx(0.5) == guard.lr_scale
    assert models.read_events(tmp_path)[0]["details"]["lr_before"] == [pytest.approx(0.02)]  # in the file too


# ------------------------------------------------------------------------------ events.md: loggers, screen


def test_the_clip_threshold_scalar_is_the_limit_in_force_and_absent_without_one(tmp_path):
    """docs/events.md, loggers: ``nanguard/clip_threshold`` is "the gradient-norm clip threshold in force
    (clip.max_norm, or the adaptive limit once armed); absent while there is none"."""
    def scalars(name: str, clip: dict) -> dict[str, list[float]]:
        pl.seed_everything(0, verbose=False)
        logger = TensorBoardLogger(str(tmp_path), name=name)
        guard = NaNGuard(clip=clip, logging={"verbose": False})
        models.trainer(tmp_path, [guard], logger=logger, max_steps=6, log_every_n_steps=1).fit(
            models.Regression(), models.loader(models.regression_data()))
        acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
        acc.Reload()
        return {t: [s.value for s in acc.Scalars(t)] for t in acc.Tags()["scalars"] if t.startswith("nanguard/")}

    fixed = scalars("fixed", {"max_norm": 1000.0})
    assert len(fixed["nanguard/grad_norm"]) == 6 and max(fixed["nanguard/grad_norm"]) < 1000.0  # never clipped
    assert fixed["nanguard/clip_threshold"] == [1000.0] * 6
    unclipped = scalars("none", {"max_norm": None, "adaptive": "on_incident"})
    assert "nanguard/grad_norm" in unclipped and "nanguard/clip_threshold" not in unclipped


def test_an_event_line_on_screen_names_its_step_epoch_and_batch(tmp_path, caplog):
    """docs/events.md, lines on screen: ``[nanguard] step 3 (epoch 0, batch 3): non-finite input, cause=input ->
    skip_step``; in the second epoch the batch is the epoch's own (3), not the step (19)."""
    caplog.set_level("INFO")
    data = models.poison_rows(models.regression_data(), [100], float("nan"))  # batch 3 of 16
    guard = NaNGuard(logging={"reports": False, "events_file": False})
    models.trainer(tmp_path, [guard], max_epochs=2).fit(models.Regression(), models.loader(data))
    lines = [line for line in said(caplog) if line.startswith("[nanguard] step")]
    assert lines == ["[nanguard] step 3 (epoch 0, batch 3): non-finite input, cause=input -> skip_step",
                     "[nanguard] step 19 (epoch 1, batch 3): non-finite input, cause=input -> skip_step"]


# ------------------------------------------------------------------------------ configuration: unknown keys


def test_an_unknown_key_is_refused_naming_its_full_path_and_the_keys_allowed(tmp_path, capsys):
    """The contract: an unknown key raises ConfigError; "the message names the full key path ... and what is
    allowed" (with no near match to suggest, the allowed keys are all the user has), from the constructor, from
    a YAML file and from ``nanguard validate`` (exit 2)."""
    with pytest.raises(ConfigError) as info:
        NaNGuard(recovery={"zzz": 1})
    message = str(info.value)
    assert message.startswith("recovery.zzz: unknown key") and "did you mean" not in message
    assert all(key in message for key in ("lr_factor", "max_rollbacks", "on_give_up", "snapshot")), message
    path = tmp_path / "bad.yaml"
    path.write_text("qqq: {}\n")
    with pytest.raises(ConfigError, match=r"^qqq: unknown key; allowed: check, clip, anomaly, recovery, logging"):
        NaNGuard.from_yaml(path)
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "qqq: unknown key; allowed: check, clip, anomaly, recovery, logging" in err


# ------------------------------------------------------------------------------ recovery.md: snapshot files


def test_the_end_of_fit_counts_the_snapshots_not_written_and_names_the_last(tmp_path, caplog):
    """docs/recovery.md, snapshots: every failure is listed in ``guard.snapshots.failures``, and the end of fit
    says how many there were: "[nanguard] 7 snapshot(s) not written this fit (the last at step 40: ...); the newest
    of them is kept in host memory instead"."""
    caplog.set_level("INFO")
    (tmp_path / "snaps").write_text("not a folder\n")  # every snapshot write refused by the OS
    guard = NaNGuard(recovery={"snapshot": "disk", "snapshot_dir": str(tmp_path / "snaps"), "snapshot_every": 2},
                     logging={"verbose": False, "reports": False, "events_file": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one SnapshotWriteWarning is pinned in test_sink_faults
        models.trainer(tmp_path, [guard], max_steps=7).fit(models.Regression(), models.loader(models.regression_data()))
    failures = guard.snapshots.failures
    assert [f["step"] for f in failures] == [0, 2, 4, 6] and all(f["in_memory"] for f in failures)
    [line] = [line for line in said(caplog) if "not written this fit" in line]
    assert line.startswith("[nanguard] 4 snapshot(s) not written this fit (the last at step 6: "), line
    assert line.endswith("; the newest of them is kept in host memory instead"), line


def test_fit_start_removes_the_snapshot_files_an_earlier_run_left_and_says_how_many(tmp_path, caplog):
    """docs/recovery.md: "At fit start the snapshot folder is cleared of the snapshot-step*.pt (and .pt.tmp) files
    an earlier run left there ... The guard says how many it removed." Other files there are not the guard's."""
    caplog.set_level("INFO")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    for name in ("snapshot-step900.pt", "snapshot-step905.pt.tmp", "notes.txt"):
        (snaps / name).write_bytes(b"an earlier run's\n")
    guard = NaNGuard(recovery={"snapshot": "disk", "snapshot_dir": str(snaps), "snapshot_every": 100},
                     logging={"verbose": False, "reports": False, "events_file": False})
    models.trainer(tmp_path, [guard], max_steps=3).fit(models.Regression(), models.loader(models.regression_data()))
    assert sorted(p.name for p in snaps.iterdir()) == ["notes.txt", "snapshot-step0.pt"]
    assert f"[nanguard] removed 2 snapshot file(s) an earlier run left in {snaps}" in said(caplog)


# --------------------------------------------------------------------------------- README: nanguard report


def test_report_heads_each_file_with_its_own_count_and_totals_every_action(tmp_path, capsys):
    """README, `nanguard report`: over a folder, each events.jsonl is headed with its own count
    (``.../events.jsonl  (4 incidents)``, ``(1 incident)``), and the totals count every action of every event
    (``actions: skip_step=5, clip=2, rollback=2, reduce_lr=2``), not one per event."""
    pl.seed_everything(0, verbose=False)
    quiet = {"verbose": False, "reports": False}
    two = NaNGuard(recovery={"reduce_lr_after": 1}, logging=quiet)
    models.trainer(tmp_path / "a", [two], max_steps=8).fit(models.NaNLossOnBatches({3, 6}),
                                                           models.loader(models.regression_data()))
    one = NaNGuard(logging=quiet)
    data = models.poison_rows(models.regression_data(), [100], float("nan"))
    models.trainer(tmp_path / "b", [one], max_steps=8).fit(models.Regression(), models.loader(data))
    assert [len(g.events) for g in (two, one)] == [2, 1]
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'a' / 'nanguard' / 'events.jsonl'}  (2 incidents)\n" in out
    assert f"{tmp_path / 'b' / 'nanguard' / 'events.jsonl'}  (1 incident)\n" in out
    actions = [a for g in (two, one) for e in g.events for a in e.actions]
    assert "reduce_lr" in actions and actions.count("skip_step") == 3
    counted = {a: actions.count(a) for a in dict.fromkeys(actions)}
    line = next(line for line in out.splitlines() if line.startswith("  actions: "))
    assert dict(kv.split("=") for kv in line.removeprefix("  actions: ").split(", ")) == \
        {a: str(n) for a, n in counted.items()}, line
    assert "total: 3 incident(s) in 2 file(s)" in out
