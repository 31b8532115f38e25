"""Where events go. A :class:`Sink` receives every event (with its report text and the guard's scalars after
it) and, every ``log_every_n_steps`` healthy steps, the guard's scalars; :class:`~.recorder.Recorder` keeps a
list of them. Four implementations:

- :class:`JsonlSink` appends one JSON line per event to ``<log_dir>/nanguard/events.jsonl`` and fsyncs it, so a
  run killed right after an incident keeps the record; a line the disk refused is kept in memory and written with
  the next event (never half a line: a failed append is cut back);
- :class:`LoggerSink` writes ``nanguard/`` scalars to every logger in ``trainer.loggers`` at the event's own
  step (bypassing ``log_every_n_steps``): through a TensorBoard-style ``experiment`` (``add_scalar``, and the
  event as markdown with ``add_text``), else through ``log_metrics``;
- :class:`ReportSink` writes ``incident-NNNN-stepS.txt`` next to ``events.jsonl``, at most
  ``logging.max_reports`` per fit (the first half and the newest half);
- :class:`ScreenSink` prints the event's one-line summary (rank 0).

A sink raises when its write fails; the :class:`~.recorder.Recorder` catches it, warns once per sink per fit
(:class:`~lightning_nanguard.errors.SinkWriteWarning`: ``name``, ``where``, the OS's words and ``retry``) and
goes on with the other sinks.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from ..core.console import say
from ..core.events import NaNEvent
from .render import ReportText, render_report

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import Logger

__all__ = ["Sink", "JsonlSink", "LoggerSink", "ReportSink", "ScreenSink", "highest_index", "highest_report"]


class Sink(Protocol):
    """Where the guard's events and scalars go. ``wants_scalars``: the guard's scalars of healthy steps are
    computed only if some sink takes them. ``name``, ``where`` and ``retry`` (what happens to later writes) go
    into the warning when a write fails."""

    wants_scalars: bool
    name: str
    where: str
    retry: str

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        """One event, its report text and the guard's scalars after it."""

    def scalars(self, values: dict[str, float], step: int) -> None:
        """The guard's scalars at a step without an event."""

    def flush(self) -> None:
        """Make everything written so far durable (fit end)."""


class JsonlSink:
    """Append-only, crash-safe JSON-lines file. A write the disk refuses is cut back to the last whole line (no
    torn line) and its lines stay in :attr:`backlog` (at most ``max_backlog``, the oldest dropped first), written
    ahead of the next event's line, or at :meth:`flush`."""

    wants_scalars = False
    name = "events.jsonl"
    retry = "its lines are kept in memory and written with the next event the disk takes"

    def __init__(self, path: Path, max_backlog: int = 10_000) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self.backlog: deque[str] = deque(maxlen=max_backlog)

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        self.backlog.append(json.dumps(event.to_dict(), sort_keys=True, allow_nan=False) + "\n")
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(self.backlog).encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, start)  # never leave half a line for the next append to run into
                except OSError:
                    pass
                raise
        finally:
            os.close(fd)
        self.backlog.clear()

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        if self.backlog:
            self._write()


def highest_index(path: Path, tail: int = 1 << 20) -> int:
    """The highest event number (``index``) among the whole lines of the last ``tail`` bytes of an ``events.jsonl``
    (0: none, no file, or nothing readable). Numbers only grow along the file, so its end holds the highest."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a device or a folder in its place: no events in it
            return 0
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - tail))
            lines = fh.read(tail).split(b"\n")
    except OSError:
        return 0
    if size > tail:
        lines = lines[1:]  # the first is a piece of a line
    best = 0
    for line in lines:
        try:
            index = json.loads(line).get("index")
        except (ValueError, AttributeError):  # not JSON, or JSON that is not an object: not an event
            continue
        if isinstance(index, int) and not isinstance(index, bool):
            best = max(best, index)
    return best


class _Writer(Protocol):
    """A TensorBoard-style ``experiment`` (``SummaryWriter`` and its kin)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: Optional[int] = None) -> object: ...

    def add_text(self, tag: str, text_string: str, global_step: Optional[int] = None) -> object: ...


def _writer(logger: Logger) -> Optional[_Writer]:
    """A TensorBoard-style ``experiment`` (``add_scalar`` and ``add_text``; the dummy on non-zero ranks
    too), or None."""
    experiment = getattr(logger, "experiment", None)
    return experiment if hasattr(experiment, "add_scalar") and hasattr(experiment, "add_text") else None


def _check_folder(writer: object) -> None:
    """Raise ``NotADirectoryError`` (naming it) if the folder a TensorBoard writer writes into is no folder any more
    (removed, or a file in its place). Writing there anyway would break the writer for good: its background thread
    dies and keeps the error, which the logger's own next write or its ``finalize`` at the end of fit re-raises,
    out of ``fit``. A writer that does not say where it writes is not checked."""
    get_logdir = getattr(writer, "get_logdir", None)
    folder = get_logdir() if callable(get_logdir) else None
    if isinstance(folder, (str, os.PathLike)) and "://" not in str(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(folder))


class LoggerSink:
    """Writes guard scalars and events through every Lightning logger, at explicit steps."""

    wants_scalars = True
    name = "the loggers"
    retry = "later events and scalars try again"

    def __init__(self, loggers: Sequence[Optional[Logger]], prefix: str = "nanguard/") -> None:
        self.prefix = prefix
        self.loggers = [lg for lg in loggers if lg is not None]
        self.where = ", ".join(type(lg).__name__ for lg in self.loggers)
        self._writers = [_writer(lg) for lg in self.loggers]

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        step = event.step if event.log_step is None else event.log_step  # where Lightning logs the event's batch
        self.scalars(scalars, step)
        for writer in self._writers:
            if writer is not None:
                _check_folder(writer)
                writer.add_text(f"{self.prefix}incident/{event.kind}", event.markdown(), global_step=step)
        self.flush()

    def scalars(self, values: dict[str, float], step: int) -> None:
        """``values`` under ``<prefix><name>`` tags at ``step``."""
        values = {self.prefix + name: value for name, value in values.items()}
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None:
                _check_folder(writer)
                for tag, value in values.items():
                    writer.add_scalar(tag, value, global_step=step)
            else:
                logger.log_metrics(dict(values), step=step)

    def flush(self) -> None:
        for logger, writer in zip(self.loggers, self._writers):
            if writer is not None and hasattr(writer, "flush"):
                _check_folder(writer)
                writer.flush()
            elif writer is None and hasattr(logger, "save"):
                logger.save()


_REPORT_NAME = re.compile(r"incident-(\d+)-")


def highest_report(directory: Path) -> int:
    """The highest number among the ``incident-NNNN-*.txt`` files in ``directory`` (0: none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    found = [int(m.group(1)) for m in map(_REPORT_NAME.match, names) if m]
    return max(found, default=0)


class ReportSink:
    """``incident-NNNN-stepS.txt`` files in one folder (:func:`~.render.render_report`), never over an existing
    file (a name taken gets ``-2``, ``-3``...). At most ``keep`` per fit: the first ``(keep + 1) // 2`` stay, and of
    the later ones only the newest ``keep // 2`` (an older one is removed as a newer one is written); every event
    stays in ``events.jsonl`` whatever the cap.

    Attributes:
        written: event number -> its report file, for the files of this fit still on disk.
    """

    wants_scalars = False
    name = "the incident reports"
    retry = "later events try again"

    def __init__(self, directory: Path, keep: int = 100) -> None:
        self.directory = Path(directory)
        self.where = str(self.directory)
        self.first, self.last = (keep + 1) // 2, keep // 2
        self.written: dict[int, Path] = {}
        self._kept_first = 0
        self._newest: deque[int] = deque()  # the numbers of the files written after the first ones, oldest first

    def path(self, event: NaNEvent) -> Path:
        return self.written.get(event.index, self.directory / f"incident-{event.index:04d}-step{event.step}.txt")

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        if self._kept_first >= self.first and self.last == 0:
            return  # over the cap: the event is in events.jsonl
        self.directory.mkdir(parents=True, exist_ok=True)
        body = render_report(event, text).encode("utf-8")
        stem, n = f"incident-{event.index:04d}-step{event.step}", 1
        while True:
            path = self.directory / (f"{stem}.txt" if n == 1 else f"{stem}-{n}.txt")
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except FileExistsError:
                n += 1
        try:
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # a disk that takes the bytes and refuses them later (ENOSPC, a quota) says so here
            finally:
                os.close(fd)
        except OSError as exc:
            try:
                path.unlink(missing_ok=True)  # no empty or half report
            except OSError:
                pass
            raise OSError(exc.errno, exc.strerror, str(path)) from None  # the report it refused, by name
        self.written[event.index] = path
        if self._kept_first < self.first:
            self._kept_first += 1
            return
        self._newest.append(event.index)
        if len(self._newest) > self.last:
            old = self.written.pop(self._newest.popleft())
            old.unlink(missing_ok=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass


class ScreenSink:
    """One line per event on screen (:meth:`~lightning_nanguard.NaNEvent.summary`), from rank 0."""

    wants_scalars = False
    name = "the screen"
    where = "the console"
    retry = "later events try again"

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        say(self.trainer, event.summary())

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        pass
