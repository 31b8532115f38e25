"""Where events go. A :class:`Sink` receives every event (with its report text and the guard's scalars after
it) and, every ``log_every_n_steps`` healthy steps, the guard's scalars; :class:`~.recorder.Recorder` keeps a
list of them. Four implementations:

- :class:`JsonlSink` appends one JSON line per event to ``<log_dir>/nanguard/events.jsonl`` and flushes and
  fsyncs it, so a run killed right after an incident keeps the record;
- :class:`LoggerSink` writes ``nanguard/`` scalars to every logger in ``trainer.loggers`` at the event's own
  step (bypassing ``log_every_n_steps``): through a TensorBoard-style ``experiment`` (``add_scalar``, and the
  event as markdown with ``add_text``), else through ``log_metrics``;
- :class:`ReportSink` writes ``incident-NNNN-stepS.txt`` next to ``events.jsonl``;
- :class:`ScreenSink` prints the event's one-line summary (rank 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

from ..console import say
from ..events import NaNEvent
from .render import ReportText, render_report

__all__ = ["Sink", "JsonlSink", "LoggerSink", "ReportSink", "ScreenSink"]


class Sink(Protocol):
    """Where the guard's events and scalars go. ``wants_scalars``: the guard's scalars of healthy steps are
    computed only if some sink takes them."""

    wants_scalars: bool

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        """One event, its report text and the guard's scalars after it."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        """The guard's scalars at a step without an event."""

    def flush(self) -> None:
        """Make everything written so far durable (fit end)."""


class JsonlSink:
    """Append-only, crash-safe JSON-lines file."""

    wants_scalars = False

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(event.to_dict(), sort_keys=True, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


def _writer(logger: Any) -> Any:
    """A TensorBoard-style ``experiment`` (``add_scalar`` and ``add_text``; the dummy on non-zero ranks
    too), or None."""
    experiment = getattr(logger, "experiment", None)
    return experiment if hasattr(experiment, "add_scalar") and hasattr(experiment, "add_text") else None


class LoggerSink:
    """Writes guard scalars and events through every Lightning logger, at explicit steps."""

    wants_scalars = True

    def __init__(self, loggers: Sequence[Any], prefix: str = "nanguard/") -> None:
        self.prefix = prefix
        self.loggers = [lg for lg in loggers if lg is not None]
        self._writers = [_writer(lg) for lg in self.loggers]

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        step = event.step if event.log_step is None else event.log_step  # where Lightning logs the event's batch
        self.scalars(scalars, step)
        for writer in self._writers:
            if writer is not None:
                writer.add_text(f"{self.prefix}incident/{event.kind}", event.markdown(), global_step=step)
        self.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        """``values`` under ``<prefix><name>`` tags at ``step``."""
        values = {self.prefix + name: value for name, value in values.items()}
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None:
                for tag, value in values.items():
                    writer.add_scalar(tag, value, global_step=step)
            else:
                logger.log_metrics(dict(values), step=step)

    def flush(self) -> None:
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()
            elif writer is None and hasattr(logger, "save"):
                logger.save()


class ReportSink:
    """``incident-NNNN-stepS.txt`` files in one folder (:func:`~.render.render_report`)."""

    wants_scalars = False

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, event: NaNEvent) -> Path:
        return self.directory / f"incident-{event.index:04d}-step{event.step}.txt"

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        path = self.path(event)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_report(event, text), encoding="utf-8")

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class ScreenSink:
    """One line per event on screen (:meth:`~lightning_nanguard.NaNEvent.summary`), from rank 0."""

    wants_scalars = False

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        say(self.trainer, event.summary())

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass
