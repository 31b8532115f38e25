"""The incident pictures as a sink (:class:`~.sinks.Sink`): every event that keeps its gradient-flow window (the first
``logging.max_reports`` of a fit) is drawn (:mod:`.pictures`) into every TensorBoard-style logger (``add_image`` at
the event's logger step, under ``nanguard/incident/<kind>/<picture>``) and as PNG files beside its incident report
(``incident-NNNN-stepS-<picture>.png``). And at fit start, once, the guard's TensorBoard dashboard: a custom-scalars
layout (TensorBoard's own plugin) with the loss, the gradient norm against the clip threshold, the LR scale and the
incident counts on one page.

Drawing runs in the training thread, synchronously, when the event is recorded (rank 0 only, like every sink):
matplotlib is not thread-safe (its math-text parser above all), so a drawing thread of the guard's would race the
user's own matplotlib in the main thread, and a second guard's. Only incidents are drawn, and only those that keep
their window (at most ``logging.max_reports`` per fit): about half a second of CPU each, never on a healthy step. The
figures are built without pyplot (:mod:`.pictures`: a ``Figure`` on its own Agg canvas), so the user's pyplot figures
are never touched. A picture that cannot be drawn or written fails like any sink's write: the recorder warns once per
fit and goes on (the event is already everywhere else; later events try again). Without matplotlib the sink says so
in one line at fit start and draws nothing; the dashboard and everything else are unchanged. The sink holds no thread
nor lock: a guard that has run a fit copies and pickles.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Protocol, Sequence

from ..core.console import say
from ..core.events import NaNEvent
from .pictures import PLOTS_OFF, figures, plots_available, png_bytes, rgb_array
from .render import ReportText
from .sinks import _check_folder

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import Logger

__all__ = ["PictureSink", "dashboard_layout"]


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
        """Draw ``event``'s pictures now, in the calling (training) thread; a failure is raised to the recorder."""
        if self.available and event.flow is not None and (self.writers or self.directory is not None):
            self.draw(event.to_dict(), event.step if event.log_step is None else event.log_step)

    def scalars(self, values: dict[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        """Nothing is left to draw (each event is drawn when recorded)."""

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
                for writer in self.writers:
                    _check_folder(writer)  # never into a writer whose folder is gone (it would break the writer)
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
