"""The incident pictures as a sink (:class:`~.sinks.Sink`): every event that keeps its gradient-flow window (the first
``logging.max_reports`` of a fit) is drawn (:mod:`.pictures`) into every TensorBoard-style logger (``add_image`` at
the event's logger step, under ``nanguard/incident/<kind>/<picture>``) and as PNG files beside its incident report
(``incident-NNNN-stepS-<picture>.png``). And at fit start, once, the guard's TensorBoard dashboard: a custom-scalars
layout (TensorBoard's own plugin) with the loss, the gradient norm against the clip threshold, the LR scale and the
incident counts on one page.

Drawing runs on a worker thread of its own (rank 0 only, like every sink), never on the training thread: an event
only queues a copy of its record; :meth:`PictureSink.flush` (the end of fit) waits for the queue. A picture that cannot
be drawn or written fails like any sink's write: the worker keeps the error and the next call from the training
thread raises it, so that the recorder warns once per fit and goes on (the event is already everywhere else; later
events try again). Without matplotlib the sink says so in one line at fit start and draws nothing; the dashboard and
everything else are unchanged.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from ..core.console import say
from ..core.events import NaNEvent
from .pictures import PLOTS_OFF, figures, plots_available, png_bytes, rgb_array
from .render import ReportText

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import Logger

__all__ = ["PictureSink", "dashboard_layout", "FLUSH_TIMEOUT"]

FLUSH_TIMEOUT = 300.0  # seconds the end of fit waits for the pictures still being drawn (then they are dropped)


def dashboard_layout(prefix: str = "nanguard/") -> dict[str, dict[str, list]]:
    """The custom-scalars layout (``SummaryWriter.add_custom_scalars``): tags are regular expressions."""
    return {"NaNGuard": {
        "loss (what the model logs)": ["Multiline", [rf"^(?!{prefix}).*loss"]],
        "gradient norm and clip threshold": ["Multiline", [rf"^{prefix}grad_norm$", rf"^{prefix}clip_threshold$"]],
        "learning-rate scale": ["Multiline", [rf"^{prefix}lr_scale$"]],
        "incidents, skipped steps, rollbacks": ["Multiline", [rf"^{prefix}incidents$", rf"^{prefix}skipped_steps$",
                                                              rf"^{prefix}rollbacks$"]],
    }}


class _ImageWriter(Protocol):
    """A TensorBoard-style ``experiment`` that takes images."""

    def add_image(self, tag: str, img_tensor: object, global_step: Optional[int] = None,
                  dataformats: str = "CHW") -> object: ...


def _image_writer(logger: Logger) -> Optional[_ImageWriter]:
    experiment = getattr(logger, "experiment", None)
    return experiment if hasattr(experiment, "add_image") else None


class PictureSink:
    """Pictures of the events into the loggers' ``add_image`` and PNG files in ``directory`` (module docstring).

    Attributes:
        written: event number -> the PNG files written for it.
        available: matplotlib can be found (the pictures are drawn).
    """

    wants_scalars = False
    name = "the incident pictures"
    retry = "later events try again"

    def __init__(self, trainer: "pl.Trainer", loggers: Sequence[Optional[Logger]], directory: Optional[Path],
                 prefix: str = "nanguard/") -> None:
        self.directory = Path(directory) if directory is not None else None
        self.prefix = prefix
        self.where = str(self.directory) if self.directory is not None else "the loggers"
        self.writers = [w for w in (_image_writer(lg) for lg in loggers if lg is not None) if w is not None]
        self.available = plots_available()
        self.written: dict[int, list[Path]] = {}
        self._jobs: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._dashboard()
        if not self.available and (self.writers or self.directory is not None):
            say(trainer, PLOTS_OFF)

    def _dashboard(self) -> None:
        """The custom-scalars layout, once per fit (a writer without the method is left alone)."""
        for writer in self.writers:
            add = getattr(writer, "add_custom_scalars", None)
            if add is not None:
                add(dashboard_layout(self.prefix))
                if hasattr(writer, "flush"):
                    writer.flush()

    # ------------------------------------------------------------------------------------------------ Sink

    def event(self, event: NaNEvent, text: ReportText, scalars: dict[str, float]) -> None:
        if self.available and event.flow is not None and (self.writers or self.directory is not None):
            step = event.step if event.log_step is None else event.log_step
            self._queue().put((event.to_dict(), step))
        self._raise_failed()

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        """Wait for the pictures queued so far (at most :data:`FLUSH_TIMEOUT`), stop the worker, raise a failure."""
        jobs, thread = self._jobs, self._thread
        if jobs is not None and thread is not None and thread.is_alive():
            done = threading.Event()
            jobs.put(done)
            done.wait(FLUSH_TIMEOUT)
            jobs.put(None)
        self._jobs = self._thread = None
        self._raise_failed()

    # ---------------------------------------------------------------------------------------------- worker

    def _queue(self) -> queue.Queue:
        if self._jobs is None or self._thread is None or not self._thread.is_alive():
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._work, args=(self._jobs,), name="nanguard-pictures",
                                            daemon=True)
            self._thread.start()
        return self._jobs

    def _raise_failed(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _work(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                self.draw(*job)
            except Exception as exc:  # noqa: BLE001  (raised on the training thread's next call: one warning)
                with self._lock:
                    self._error = self._error or exc

    def draw(self, record: Mapping[str, object], step: int) -> list[Path]:
        """Draw the pictures of one event (``record``: its ``to_dict()``) into the loggers at ``step`` and the PNG
        files; returns the files."""
        files: list[Path] = []
        for name, fig in figures(record).items():
            if self.directory is not None:
                path = self.directory / f"incident-{record.get('index', 0):04d}-step{record.get('step')}-{name}.png"
                data = png_bytes(fig)
                for attempt in (1, 2):
                    try:
                        self.directory.mkdir(parents=True, exist_ok=True)
                        path.write_bytes(data)
                        break
                    except FileNotFoundError:  # the folder was removed meanwhile: made again, once
                        if attempt == 2:
                            raise
                files.append(path)
            if self.writers:
                image = rgb_array(fig)
                for writer in self.writers:
                    writer.add_image(f"{self.prefix}incident/{record.get('kind')}/{name}", image, global_step=step,
                                     dataformats="HWC")
        for writer in self.writers:
            if hasattr(writer, "flush"):
                writer.flush()
        index = record.get("index", 0)  # (an event's: an int)
        if files and isinstance(index, int):
            self.written[index] = files
        return files
