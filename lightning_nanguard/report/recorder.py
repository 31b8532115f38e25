"""Numbering, keeping and persisting the events of a fit."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..config import LoggingConfig
from ..core.console import say
from ..core.counters import Counters
from ..core.events import KINDS, NaNEvent
from ..errors import SinkWriteWarning
from ..recover.actions import ACTIONS
from .picture_sink import PictureSink
from .render import ReportText
from .sinks import JsonlSink, LoggerSink, ReportSink, ScreenSink, Sink, highest_index, highest_report

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Recorder", "logger_step", "report_dir"]


def report_dir(trainer: "pl.Trainer") -> Path:
    """Where the guard writes (``events.jsonl``, incident reports, disk snapshots): ``<log_dir>/nanguard``, where
    ``<log_dir>`` is ``trainer.log_dir`` (with a logger: the first logger's folder; without one:
    ``trainer.default_root_dir``, itself the current directory when not given), unless that folder lies inside
    the folder of a checkpoint callback (a ``ModelCheckpoint(dirpath=default_root_dir)`` with ``logger=False``):
    then ``<that folder>-nanguard`` next to it, the outermost such folder, so a checkpoint folder only ever holds
    checkpoints. The same on every rank (Lightning broadcasts both folders from rank 0)."""
    folder = Path(trainer.log_dir or trainer.default_root_dir) / "nanguard"
    if "://" in str(folder):  # a remote log_dir: no local checkpoint folder to compare with
        return folder
    holders = [Path(os.path.abspath(d)) for d in _checkpoint_dirs(trainer)
               if Path(os.path.abspath(folder)).is_relative_to(os.path.abspath(d))]
    if not holders:
        return folder
    outer = min(holders, key=lambda d: len(d.parts))
    return outer.parent / f"{outer.name or 'checkpoints'}-nanguard"


def _checkpoint_dirs(trainer: "pl.Trainer") -> list[str]:
    """The ``dirpath`` of each checkpoint callback (``ModelCheckpoint`` of either package; resolved at setup)."""
    dirs = []
    for cb in getattr(trainer, "callbacks", None) or []:
        path = getattr(cb, "dirpath", None)
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path):
            dirs.append(os.fspath(path))
    return dirs


def logger_step(trainer: "pl.Trainer") -> int:
    """The step at which Lightning logs the current batch's metrics: ``fit_loop.epoch_loop._batches_that_stepped``
    (one per batch that steps the optimizers, however many they are; the Trainer's own ``log_metrics``, its
    ``LearningRateMonitor`` and ``DeviceStatsMonitor`` log at it), read before the batch ends. Where a Trainer
    has no such counter, ``trainer.global_step``."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    return step if isinstance(step, int) else int(trainer.global_step)


class Recorder:
    """The events of a fit and where they go: a list of :class:`~.sinks.Sink` (``logging.*``: ``events.jsonl``,
    the Trainer's loggers, incident reports, the screen; rank 0 writes, every rank keeps the events). An event of
    a kind that counts as an incident is counted in ``counters["incidents"]``, any other in ``counters["spikes"]``.

    Numbering continues across a resumed fit (the checkpoint's count) and after the highest number already in
    ``events.jsonl`` or among the report files (a run killed after its last checkpoint keeps its numbers).

    A sink's failed write never reaches the fit: it is warned once per sink per fit
    (:class:`~lightning_nanguard.errors.SinkWriteWarning`: which sink, where, the OS's words, what the guard still
    does), the event stays in :attr:`events` and the other sinks, and the next event tries that sink again; the end
    of fit counts the refused writes of every sink (:meth:`failure_summary`).

    Attributes:
        events: every event of this fit, in order (``guard.events``).
        sinks: where they are written (set at fit start).
        out_dir: ``<log_dir>/nanguard``, set at fit start.
        failed_writes: sink name -> the writes of this fit it failed.
    """

    def __init__(self, cfg: LoggingConfig, counters: Counters, name: Optional[str] = None) -> None:
        self.cfg = cfg
        self.counters = counters
        self.name = name  # a second guard in the same Trainer: its own folder, tags and progress-bar keys
        self.events: list[NaNEvent] = []
        self.sinks: list[Sink] = []
        self.out_dir: Optional[Path] = None
        self._index = 0  # the last event's number; numbering continues across a resumed fit
        self._scalar_sinks: list[Sink] = []
        self._reports: Optional[ReportSink] = None
        self._jsonl: Optional[JsonlSink] = None
        self.failed_writes: dict[str, int] = {}

    def start(self, trainer: "pl.Trainer", sinks: Optional[Sequence[Sink]] = None) -> None:
        """Fit start: the sinks (``sinks``, or those ``logging.*`` asks for, on global rank 0 only)."""
        self.out_dir = report_dir(trainer)
        if self.name:
            self.out_dir = self.out_dir / self.name
        self.sinks = list(sinks) if sinks is not None else self.default_sinks(trainer)
        self._scalar_sinks = [s for s in self.sinks if s.wants_scalars]
        self._reports = next((s for s in self.sinks if isinstance(s, ReportSink)), None)
        self._jsonl = next((s for s in self.sinks if isinstance(s, JsonlSink)), None)
        self.failed_writes = {}
        self._continue_numbering(trainer)

    def _continue_numbering(self, trainer: "pl.Trainer") -> None:
        """Number after the highest event already on disk (rank 0 reads; every rank numbers alike). A resumed fit
        whose folder holds events numbered after its checkpoint's last (a run that went on past its checkpoint, then
        crashed) says where its numbering goes on, and why."""
        found = 0
        if self._jsonl is not None:
            found = highest_index(self._jsonl.path)
        if self._reports is not None:
            found = max(found, highest_report(self._reports.directory))
        if int(getattr(trainer, "world_size", 1) or 1) > 1:
            found = int(trainer.strategy.broadcast(found, src=0))
        saved, self._index = self._index, max(self._index, found)
        if saved and found > saved:
            say(trainer, f"[nanguard] the checkpoint's last event is number {saved}, and {self.out_dir} already holds "
                         f"events up to number {found} (written after that checkpoint by the run it resumes): this "
                         f"fit numbers its events from {found + 1}")

    def default_sinks(self, trainer: "pl.Trainer") -> list[Sink]:
        assert self.out_dir is not None
        cfg = self.cfg
        sinks: list[Sink] = []
        if trainer.global_rank != 0:
            return sinks
        if cfg.events_file:
            sinks.append(JsonlSink(self.out_dir / "events.jsonl"))
        if cfg.reports:
            sinks.append(ReportSink(self.out_dir, cfg.max_reports))
        if cfg.loggers and trainer.loggers:
            sinks.append(LoggerSink(trainer.loggers, prefix=f"nanguard/{self.name}/" if self.name else "nanguard/"))
        if cfg.verbose:
            sinks.append(ScreenSink(trainer))
        if cfg.reports or cfg.loggers and trainer.loggers:  # the incident pictures, and the TensorBoard dashboard
            sinks.append(PictureSink(trainer, trainer.loggers if cfg.loggers else [],
                                     self.out_dir if cfg.reports else None,
                                     prefix="nanguard/" + (f"{self.name}/" if self.name else "")))
        return sinks

    def report_path(self, event: NaNEvent) -> Path:
        """Where to read about ``event``: its report file if one of this fit holds it, else ``events.jsonl`` when
        that is written (a report over ``logging.max_reports``, or one that could not be written), else the
        report's name."""
        if self._reports is not None and event.index in self._reports.written:
            return self._reports.written[event.index]
        if self._jsonl is not None:
            return self._jsonl.path
        return ReportSink(self.out_dir if self.out_dir is not None else Path("nanguard")).path(event)

    def _write(self, sink: Sink, write: Callable[[], None]) -> None:
        """Run one sink's write; a failure is counted and warned once per sink per fit, never raised."""
        try:
            write()
        except Exception as exc:  # noqa: BLE001  (the guard's own I/O never ends a fit)
            name = _name(sink)
            first = name not in self.failed_writes
            self.failed_writes[name] = self.failed_writes.get(name, 0) + 1
            if first:
                self._warn(sink, exc)

    def _warn(self, sink: Sink, exc: Exception) -> None:
        where, reason = _where_and_why(sink, exc)
        others = [_name(s) for s in self.sinks if s is not sink and _name(s) not in self.failed_writes]
        also = f" and in {', '.join(others)}" if others else ""
        retry = getattr(sink, "retry", "later events try again")
        warnings.warn(f"[nanguard] {_name(sink)} could not be written ({where}: {reason}). Training and recovery go "
                      f"on: every event stays in guard.events{also}; {retry}. Said once per fit (the refused writes "
                      "are counted at its end).", SinkWriteWarning, stacklevel=2)

    def failure_summary(self) -> Optional[str]:
        """One line on the writes the sinks refused this fit (None: none)."""
        if not self.failed_writes:
            return None
        counts = ", ".join(f"{name} {n}" for name, n in self.failed_writes.items())
        return f"[nanguard] writes refused this fit: {counts} (every event is in guard.events)"

    def record(self, event: NaNEvent, text: ReportText, scalars: Callable[[], dict[str, float]]) -> None:
        """Number ``event``, count it, keep it and write it to every sink; ``text`` goes into its incident
        report, ``scalars`` gives the guard's scalars after it."""
        event.validate(ACTIONS)
        self._index += 1
        event.index = self._index
        self.counters.add("incidents" if KINDS[event.kind].incident else "spikes")
        self.events.append(event)
        values = scalars() if self.sinks else {}
        for sink in self.sinks:
            self._write(sink, lambda: sink.event(event, text, values))  # noqa: B023  (called at once)

    # trainer untyped: it reads log_every_n_steps, which Lightning sets on its Trainer without declaring it
    def scalars(self, trainer: Any, scalars: Callable[[], dict[str, float]], step: Optional[int] = None) -> None:
        """The guard's scalars of a step without an event, at the logger ``step`` of its batch (:func:`logger_step`,
        by default the current batch's), on the batches where Lightning logs (``(step + 1) % log_every_n_steps``)."""
        step = logger_step(trainer) if step is None else step
        if self._scalar_sinks and (step + 1) % max(trainer.log_every_n_steps, 1) == 0:
            values = scalars()
            for sink in self._scalar_sinks:
                self._write(sink, lambda: sink.scalars(values, step))  # noqa: B023

    def flush(self) -> None:
        for sink in self.sinks:
            self._write(sink, sink.flush)

    def state_dict(self) -> dict[str, object]:
        return {"index": self._index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._index = int(state.get("index", 0))

    def __getstate__(self) -> dict[str, object]:
        """A copy (``copy.deepcopy``, ``pickle``) keeps the events, the numbering and the folder, not the sinks: they
        are of one fit (its Trainer's loggers, whose writers hold threads and locks, the Trainer itself, its files),
        and the next fit's start makes them again."""
        state = self.__dict__.copy()
        state.update(sinks=[], _scalar_sinks=[], _reports=None, _jsonl=None)
        return state


def _name(sink: object) -> str:
    """What a sink is called in a warning (a sink of the user's own may have no ``name``)."""
    return str(getattr(sink, "name", type(sink).__name__))


def _where_and_why(sink: object, exc: BaseException) -> tuple[str, str]:
    """Where a sink's write failed (the file the OS names, else the sink's place) and why, in the OS's words."""
    where = str(getattr(sink, "where", ""))
    if isinstance(exc, OSError):
        return (os.fsdecode(exc.filename) if exc.filename else where), (exc.strerror or str(exc))
    return where, f"{type(exc).__name__}: {exc}"
