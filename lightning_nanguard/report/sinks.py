"""Where events go: ``events.jsonl``, every logger of the Trainer, and one report file per incident.

- :class:`JsonlSink` appends one JSON line per event to ``<log_dir>/nanguard/events.jsonl`` and flushes and
  fsyncs it, so a run killed right after an incident keeps the record.
- :class:`LoggerSink` writes ``nanguard/`` scalars to every logger in ``trainer.loggers`` at the event's own
  step (bypassing ``log_every_n_steps``): through a TensorBoard-style ``experiment`` (``add_scalar``, and the
  event as markdown with ``add_text``), else through ``log_metrics``.
- :class:`ReportFiles` writes ``incident-NNNN-stepS.txt`` next to ``events.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from .events import NaNEvent

__all__ = ["JsonlSink", "LoggerSink", "ReportFiles"]


class JsonlSink:
    """Append-only, crash-safe JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, event: NaNEvent) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(event.to_dict(), sort_keys=True, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _writer(logger: Any) -> Any:
    """A TensorBoard-style ``experiment`` (``add_scalar`` and ``add_text``; the dummy on non-zero ranks
    too), or None."""
    experiment = getattr(logger, "experiment", None)
    return experiment if hasattr(experiment, "add_scalar") and hasattr(experiment, "add_text") else None


class LoggerSink:
    """Writes guard scalars and events through every Lightning logger, at explicit steps."""

    def __init__(self, loggers: Sequence[Any], prefix: str = "nanguard/") -> None:
        self.prefix = prefix
        self.loggers = [lg for lg in loggers if lg is not None]
        self._writers = [_writer(lg) for lg in self.loggers]

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """``values`` under ``<prefix><name>`` tags at ``step``."""
        values = {self.prefix + name: value for name, value in values.items()}
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None:
                for tag, value in values.items():
                    writer.add_scalar(tag, value, global_step=step)
            else:
                logger.log_metrics(dict(values), step=step)

    def text(self, event: NaNEvent) -> None:
        for writer in self._writers:
            if writer is not None:
                writer.add_text(f"{self.prefix}incident/{event.kind}", event.markdown(), global_step=event.step)

    def flush(self) -> None:
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None and hasattr(writer, "flush"):
                writer.flush()
            elif writer is None and hasattr(logger, "save"):
                logger.save()


class ReportFiles:
    """``incident-NNNN-stepS.txt`` files in one folder."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, event: NaNEvent) -> Path:
        return self.directory / f"incident-{event.index:04d}-step{event.step}.txt"

    def write(self, event: NaNEvent, text: str) -> Path:
        path = self.path(event)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path
