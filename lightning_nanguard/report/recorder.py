"""Numbering, keeping and persisting the events of a fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from ..config import LoggingConfig
from .events import NaNEvent
from ..console import say
from .progress import ProgressStatus
from .sinks import JsonlSink, LoggerSink, ReportFiles

__all__ = ["Recorder"]


class Recorder:
    """The events of a fit and where they go (``logging.*``): ``events.jsonl``, the Trainer's loggers,
    incident reports, the progress bar and one line on screen per event (rank 0 writes, every rank keeps).

    Attributes:
        events: every event of this fit, in order (``guard.events``).
        incidents: events that count as incidents (everything but ``spike`` events).
        spikes: ``spike`` events (finite, abnormal).
        out_dir: ``<log_dir>/nanguard``, set at fit start.
    """

    def __init__(self, cfg: LoggingConfig, name: Optional[str] = None) -> None:
        self.cfg = cfg
        self.name = name  # a second guard in the same Trainer: its own folder, tags and progress-bar keys
        self.events: list[NaNEvent] = []
        self.incidents = 0
        self.spikes = 0
        self.out_dir: Optional[Path] = None
        self.status = ProgressStatus(name)
        self._index = 0  # the last event's number; numbering continues across a resumed fit
        self._jsonl: Optional[JsonlSink] = None
        self._loggers = LoggerSink([])
        self._reports: Optional[ReportFiles] = None

    def start(self, trainer: Any) -> None:
        """Fit start: the sinks, on global rank 0 only."""
        self.out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "nanguard"
        if self.name:
            self.out_dir = self.out_dir / self.name
        zero = trainer.global_rank == 0
        self._jsonl = JsonlSink(self.out_dir / "events.jsonl") if self.cfg.events_file and zero else None
        self._loggers = LoggerSink(trainer.loggers if self.cfg.loggers and zero else [],
                                   prefix=f"nanguard/{self.name}/" if self.name else "nanguard/")
        self._reports = ReportFiles(self.out_dir) if self.cfg.reports and zero else None

    def new_event(self, trainer: Any, kind: str, batch_idx: int) -> NaNEvent:
        """The next numbered event at the current step; a ``spike`` counts in :attr:`spikes`, any other kind
        in :attr:`incidents`."""
        self._index += 1
        if kind == "spike":
            self.spikes += 1
        else:
            self.incidents += 1
        return NaNEvent(step=trainer.global_step, epoch=trainer.current_epoch, batch_idx=batch_idx, kind=kind,
                        rank=trainer.global_rank, index=self._index)

    def report_path(self, event: NaNEvent) -> Path:
        return ReportFiles(self.out_dir if self.out_dir is not None else Path("nanguard")).path(event)

    def record(self, trainer: Any, event: NaNEvent, report: str, scalars: dict[str, float]) -> None:
        """Keep ``event`` and write it to every sink; ``report`` is the incident report's text, ``scalars``
        the guard's scalars after the event."""
        event.validate()
        self.events.append(event)
        if self._jsonl is not None:
            self._jsonl.write(event)
        if self._reports is not None:
            self._reports.write(event, report)
        if self._loggers:
            self._loggers.scalars(scalars, event.step)
            self._loggers.text(event)
            self._loggers.flush()
        if self.cfg.verbose:
            say(trainer, event.summary())

    def scalars(self, trainer: Any, scalars: Callable[[], dict[str, float]]) -> None:
        """The guard's scalars of a step without an event, every ``log_every_n_steps`` steps."""
        if self._loggers and trainer.global_step % max(trainer.log_every_n_steps, 1) == 0:
            self._loggers.scalars(scalars(), trainer.global_step)

    def flush(self) -> None:
        self._loggers.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"index": self._index, "incidents": self.incidents, "spikes": self.spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._index = int(state.get("index", 0))
        self.incidents = int(state.get("incidents", 0))
        self.spikes = int(state.get("spikes", 0))
