"""What a user sees of NaNGuard: TensorBoard scalars and text, CSV metrics, events.jsonl, progress bar.

Real Trainers on a tiny regression model; NaN is injected into the inputs of known batches, so the
incidents happen at known global steps (a skipped step still advances ``global_step``).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from lightning_nanguard import NaNEvent, NaNGuard
from lightning_nanguard.report.progress import INCIDENTS_KEY, LR_SCALE_KEY
from lightning_nanguard.config import LoggingConfig
from lightning_nanguard.core.counters import Counters
from lightning_nanguard.report.recorder import Recorder
from lightning_nanguard.report.render import ReportText
from lightning_nanguard.report.sinks import JsonlSink
from .models import Regression, loader, regression_data

pytestmark = pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*")

BAD_BATCHES = (3, 7, 11)  # 16 batches of 32: incidents at global steps 3, 7 and 11 of epoch 0


def poisoned_loader():
    data = regression_data(512)
    for b in BAD_BATCHES:
        data.tensors[0][b * 32 + 1, 2] = float("nan")
    return loader(data, batch_size=32)


@pytest.fixture
def guarded_fit(fit):
    """``guarded_fit(subdir=None, **trainer_kwargs)``: a quiet guard on the poisoned loader; returns
    ``(guard, trainer)``."""

    def run(subdir=None, **trainer_kwargs):
        guard = NaNGuard(logging={"verbose": False})
        t = fit(Regression(lr=0.05), poisoned_loader(), [guard], subdir=subdir, **trainer_kwargs)
        assert [e.step for e in guard.events] == list(BAD_BATCHES)
        return guard, t

    return run


def test_tensorboard_scalars_at_incident_steps_despite_log_every_n_steps(tmp_path, guarded_fit):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    guard, t = guarded_fit(logger=logger, log_every_n_steps=50)
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()

    scalar_tags = set(acc.Tags()["scalars"])
    for tag in ("nanguard/incidents", "nanguard/skipped_steps", "nanguard/rollbacks", "nanguard/lr_scale",
                "nanguard/grad_norm"):
        assert tag in scalar_tags, f"{tag} missing from {sorted(scalar_tags)}"
    incidents = [(s.step, s.value) for s in acc.Scalars("nanguard/incidents")]
    # with log_every_n_steps=50 and 16 steps, the Trainer would log nothing: these are the incident steps
    assert incidents == [(3, 1.0), (7, 2.0), (11, 3.0)]
    assert [s.step for s in acc.Scalars("nanguard/lr_scale")] == list(BAD_BATCHES)
    assert all(s.value == 1.0 for s in acc.Scalars("nanguard/lr_scale"))  # input incidents do not cut the LR
    assert [s.value for s in acc.Scalars("nanguard/skipped_steps")] == [1.0, 2.0, 3.0]

    text_tags = [tag for tag in acc.Tags()["tensors"] if tag.startswith("nanguard/")]
    assert text_tags, acc.Tags()
    texts = [(ev.step, ev.tensor_proto.string_val[0].decode()) for tag in text_tags for ev in acc.Tensors(tag)]
    assert sorted(step for step, _ in texts) == list(BAD_BATCHES)
    for _, markdown in texts:
        assert "| kind | input |" in markdown
        assert "| actions | skip_step" in markdown
        for row in ("cause", "culprit", "op", "suggestion"):
            assert f"| {row} |" in markdown
    # events.jsonl sits next to the event files, under the logger's log_dir
    lines = (Path(logger.log_dir) / "nanguard" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(BAD_BATCHES)


def test_csv_logger_gets_scalars_through_log_metrics(tmp_path, guarded_fit):
    logger = CSVLogger(str(tmp_path), name="csv")
    guard, t = guarded_fit(logger=logger, log_every_n_steps=50)
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("nanguard/incidents")]
    assert [(int(r["step"]), float(r["nanguard/incidents"])) for r in rows] == [(3, 1.0), (7, 2.0), (11, 3.0)]
    assert all(float(r["nanguard/lr_scale"]) == 1.0 for r in rows)
    assert (Path(logger.log_dir) / "nanguard" / "events.jsonl").is_file()


def test_no_logger_still_writes_events_under_default_root_dir(tmp_path, guarded_fit):
    root = tmp_path / "root"
    guard, t = guarded_fit("root", logger=False)
    events = root / "nanguard" / "events.jsonl"
    assert events.is_file(), sorted(str(p) for p in tmp_path.rglob("*"))
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(r["step"], r["kind"], r["actions"][0]) for r in records] == [(s, "input", "skip_step")
                                                                         for s in BAD_BATCHES]
    assert not list(root.rglob("events.out.tfevents*"))


class _ProgressProbe(pl.Callback):
    """Reads the progress-bar metrics after the guard's own on_train_batch_end, every step."""

    def __init__(self, guard: NaNGuard) -> None:
        self.guard = guard
        self.seen: list[tuple[int, float, float, int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = trainer.progress_bar_metrics
        self.seen.append((trainer.global_step, bar.get(INCIDENTS_KEY), bar.get(LR_SCALE_KEY),
                          self.guard.counters["incidents"], self.guard.lr_scale))


def test_progress_bar_shows_guard_status_from_the_first_incident_on(fit):
    """Nothing in the bar while healthy; from the first incident on, both values, as floats logged with
    ``pl_module.log(prog_bar=True, logger=False)`` (issue 29: they were ints written into Lightning's private dict
    on every fit)."""
    # lr=6 makes nn.Linear diverge after a few steps: incidents, LR cuts and a rollback follow
    guard = NaNGuard(logging={"verbose": False})
    probe = _ProgressProbe(guard)
    t = fit(Regression(lr=6.0), regression_data(512), [guard, probe], batch_size=32, max_epochs=2, log_every_n_steps=50)
    assert len(probe.seen) == 32
    first = next(i for i, seen in enumerate(probe.seen) if seen[3] > 0 or seen[4] != 1.0)
    assert first > 0  # a few healthy steps first
    for step, shown_incidents, shown_scale, _incidents, _scale in probe.seen[:first]:
        assert (shown_incidents, shown_scale) == (None, None), step  # healthy so far: not in the bar
    for step, shown_incidents, shown_scale, incidents, scale in probe.seen[first:]:
        assert (shown_incidents, shown_scale) == (incidents, pytest.approx(scale)), step
        assert type(shown_incidents) is float and type(shown_scale) is float  # as Lightning shows its values
    assert guard.counters["incidents"] > 0 and guard.lr_scale < 1.0
    assert probe.seen[-1][1] == guard.counters["incidents"]  # still shown in the 2nd epoch
    # in the bar (and so in callback_metrics, as every progress-bar value), never sent to the loggers
    assert float(t.callback_metrics[INCIDENTS_KEY]) == guard.counters["incidents"]
    assert INCIDENTS_KEY not in t.logged_metrics


class _LossSpikes(Regression):
    """nn.Linear + SGD whose loss value jumps by 1000 (a finite spike; the gradient is unchanged) at ``steps``."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        super().__init__(lr=0.05)
        self.spike_steps = steps

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        pair = self.spike_steps.index(self.global_step) // 2 if self.global_step in self.spike_steps else None
        return loss + 1000.0 * 100.0 ** pair if pair is not None else loss  # each pair of spikes 100x the last


@pytest.mark.parametrize("spikes, check", [((30,), {"spike_action": "reduce_lr"}),
                                           ((30, 31, 33, 34, 36, 37), {"spike_action": "warn"})],
                         ids=["reduce_lr-spike", "three-spikes"])
def test_progress_bar_shows_the_lr_scale_from_an_lr_cut_without_an_incident(fit, spikes, check):
    """docs/events.md, progress bar: nothing "until the first incident or learning-rate cut". A loss spike with
    ``check.spike_action: reduce_lr``, or three counted spikes in the incident window (``spike_action: warn``; the
    second of each pair: the first is a bad batch's), cut the LR
    with no incident: from the step of the cut on the bar shows ``ng_lr_scale`` (and ``ng_incidents`` 0.0)."""
    guard = NaNGuard(logging={"verbose": False}, check={"spike_warmup": 20, **check})
    probe = _ProgressProbe(guard)
    fit(_LossSpikes(spikes), regression_data(512), [guard, probe], steps=40, log_every_n_steps=50)
    cut = spikes[-1]
    assert [e.kind for e in guard.events] == ["spike"] * len(spikes) and guard.events[-1].actions == ["reduce_lr"]
    assert guard.counters["incidents"] == 0 and guard.lr_scale == 0.5
    for step, shown_incidents, shown_scale, _incidents, _scale in probe.seen:
        if step <= cut:  # global_step has advanced at batch end: step cut + 1 is the batch of the cut
            assert (shown_incidents, shown_scale) == (None, None), step
        else:
            assert (shown_incidents, shown_scale) == (0.0, 0.5), step


def test_progress_bar_status_can_be_turned_off(fit):
    guard = NaNGuard(logging={"verbose": False, "progress_bar": False})
    t = fit(Regression(lr=0.05), poisoned_loader(), [guard], max_steps=4)
    assert INCIDENTS_KEY not in t.progress_bar_metrics and len(guard.events) == 1


# ------------------------------------------------------------------------------- logging.* switched off


class LoggingRegression(Regression):
    """Logs its own loss, so the Trainer's logger writes an event file whatever the guard does."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.fixture
def fit_logging(fit):
    """``fit_logging(logging, **trainer_kwargs)``: LoggingRegression on the poisoned loader with the given logging
    section (verbose off unless set); returns the guard."""

    def run(logging: dict, **trainer_kwargs) -> NaNGuard:
        guard = NaNGuard(logging={"verbose": False, **logging})
        fit(LoggingRegression(), poisoned_loader(), [guard], log_every_n_steps=1, **trainer_kwargs)
        assert [e.step for e in guard.events] == list(BAD_BATCHES)
        return guard

    return run


@pytest.mark.parametrize("events_file", [True, False])
def test_events_file_switch(tmp_path, fit_logging, events_file):
    fit_logging({"events_file": events_file})
    files = list(tmp_path.rglob("events.jsonl"))
    assert len(files) == int(events_file)
    assert len(list(tmp_path.rglob("incident-*.txt"))) == len(BAD_BATCHES)  # the other sinks still write


@pytest.mark.parametrize("reports", [True, False])
def test_reports_switch(tmp_path, fit_logging, reports):
    fit_logging({"reports": reports})
    reports_written = sorted(p.name for p in tmp_path.rglob("incident-*.txt"))
    assert reports_written == ([f"incident-{i:04d}-step{s}.txt" for i, s in enumerate(BAD_BATCHES, 1)]
                               if reports else [])
    assert len((tmp_path / "nanguard" / "events.jsonl").read_text().splitlines()) == len(BAD_BATCHES)


@pytest.mark.parametrize("max_reports", [2, 100])
def test_max_reports_keeps_the_first_and_the_newest_report_files(tmp_path, fit_logging, max_reports):
    """``logging.max_reports: 2`` keeps the first report and the newest (the one between is removed when the
    newest is written) while events.jsonl keeps every event; a report not kept points to events.jsonl."""
    guard = fit_logging({"max_reports": max_reports})
    names = sorted(p.name for p in tmp_path.rglob("incident-*.txt"))
    every = [f"incident-{i:04d}-step{s}.txt" for i, s in enumerate(BAD_BATCHES, 1)]
    events_file = tmp_path / "nanguard" / "events.jsonl"
    assert len(events_file.read_text().splitlines()) == len(BAD_BATCHES)
    if max_reports == 2:
        assert names == [every[0], every[-1]]
        assert guard.report_path(guard.events[1]) == events_file
    else:
        assert names == every and guard.report_path(guard.events[1]).name == every[1]


@pytest.mark.parametrize("loggers", [True, False])
def test_loggers_switch(tmp_path, fit_logging, loggers):
    """``logging.loggers`` writes the guard's scalars to every logger of the Trainer (TensorBoard: also the
    incident text), or to none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, csv = TensorBoardLogger(str(tmp_path), name="tb"), CSVLogger(str(tmp_path), name="csv")
    fit_logging({"loggers": loggers}, logger=[tb, csv])
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"] + acc.Tags()["tensors"]
    assert "train_loss" in tags  # the logger works either way
    ours = [t for t in tags if t.startswith("nanguard/")]
    columns = (Path(csv.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    if loggers:
        assert "nanguard/incidents" in ours and any(t.startswith("nanguard/incident/") for t in ours)
        assert "nanguard/incidents" in columns  # the second logger too, not only the first
    else:
        assert ours == [] and not [c for c in columns if c.startswith("nanguard/")]
    assert (Path(tb.log_dir) / "nanguard" / "events.jsonl").is_file()


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_switch(fit, caplog, verbose):
    """One line per incident through Lightning's rank-zero logger (no progress bar here), or none."""
    caplog.set_level("INFO")
    guard = NaNGuard(logging={"verbose": verbose})
    fit(Regression(), poisoned_loader(), [guard])
    assert len(guard.events) == len(BAD_BATCHES)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[nanguard] step")]
    assert lines == ([e.summary() for e in guard.events] if verbose else [])


def test_events_file_is_flushed_and_fsynced_per_event(tmp_path, fit_logging, monkeypatch):
    """SIGKILL keeps the page cache, so only counting fsync calls shows the record would survive a power loss."""
    path = tmp_path / "nanguard" / "events.jsonl"
    synced: list[list[dict]] = []
    real_fsync = os.fsync

    def fsync(fd):
        if path.exists() and os.fstat(fd).st_ino == os.stat(path).st_ino:
            text = path.read_text()  # what another reader sees now: flushed before the fsync
            assert text.endswith("\n")
            synced.append([json.loads(line) for line in text.splitlines()])
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    guard = fit_logging({})
    assert len(synced) == len(guard.events)  # one fsync of the events file per event
    assert [len(s) for s in synced] == list(range(1, len(guard.events) + 1))  # complete after every write
    assert [s[-1] for s in synced] == [e.to_dict() for e in guard.events]


# ------------------------------------------------------------------------------------- a second, named guard


def test_named_guard_writes_its_own_folder_and_tags_next_to_an_unnamed_one(tmp_path, fit):
    """``NaNGuard(name="b")``: ``<log_dir>/nanguard/b/`` and ``nanguard/b/`` tags, apart from the unnamed guard's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    first, second = NaNGuard(logging={"verbose": False}), NaNGuard(name="b", logging={"verbose": False})
    t = fit(Regression(lr=0.05), poisoned_loader(), [first, second], logger=logger, log_every_n_steps=50)
    assert [e.step for e in first.events] == list(BAD_BATCHES) == [e.step for e in second.events]
    root = Path(logger.log_dir) / "nanguard"
    for folder in (root, root / "b"):
        records = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(BAD_BATCHES), folder
        assert sorted(p.name for p in folder.glob("incident-*.txt")) == [
            f"incident-{i:04d}-step{s}.txt" for i, s in enumerate(BAD_BATCHES, 1)]
    acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for prefix in ("nanguard/", "nanguard/b/"):
        assert [(s.step, s.value) for s in acc.Scalars(prefix + "incidents")] == [
            (s, float(i)) for i, s in enumerate(BAD_BATCHES, 1)], prefix
    named_text = [tag for tag in acc.Tags()["tensors"] if tag.startswith("nanguard/b/")]
    assert sorted(ev.step for tag in named_text for ev in acc.Tensors(tag)) == list(BAD_BATCHES)
    assert t.progress_bar_metrics["ng_b_incidents"] == t.progress_bar_metrics[INCIDENTS_KEY] == float(len(BAD_BATCHES))


@pytest.mark.parametrize("field, value", [("cause", "cosmic_rays"), ("kind", "weird"), ("actions", ["pray"])])
def test_an_event_outside_the_vocabulary_is_refused_when_recorded(tmp_path, guarded_fit, field, value):
    """KINDS, ACTIONS and CAUSES are enforced at record time: nothing outside them reaches a sink."""
    guard, t = guarded_fit()
    events_file = tmp_path / "nanguard" / "events.jsonl"
    written = events_file.read_text()
    recorder = Recorder(LoggingConfig(), Counters())  # the guard's own kind of recorder, on the same file
    recorder.start(t, sinks=[JsonlSink(events_file)])
    event = NaNEvent(step=0, epoch=0, batch_idx=0, kind="loss")
    setattr(event, field, value)
    with pytest.raises(ValueError, match="unknown"):
        recorder.record(event, ReportText(), lambda: {"incidents": 4.0})
    assert recorder.events == [] and events_file.read_text() == written
    assert len(guard.events) == len(BAD_BATCHES)
