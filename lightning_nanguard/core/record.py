"""One record per judged optimizer step, the same whether its flags are read at once or one step late.

:class:`StepRecord` holds everything the guard's judgement of a step needs, taken when the step runs: its
number, epoch and batch, its :class:`Window` (the micro-batches and the RNG state before each, for the
incident replay), the learning rates it ran at, whether its loss was checked, the optimizer, and
:class:`UpdateStage`: what can still be done about its update. Its evidence (``flags``) is filled in when
the vector is read. Everything after the read takes the record.

:class:`UpdateStage` is a small state machine, as GradScaler's ``OptState``: a step judged at once
(``check.sync: eager``) is ``ON_HOST``: the host skips its update (gradients set to None) and clips it. A step
judged one step late (``lagged``) ran already: ``ON_DEVICE`` when its optimizer honours the device skip flag
(the update of a step flagged bad was skipped on the device, its clipping was done there), ``APPLIED`` when it
cannot (a bad step was applied; only a rollback undoes it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict

import torch
from torch import Tensor

__all__ = ["StepRecord", "UpdateStage", "Window", "RngState", "rng_state", "set_rng_state"]


class _CpuRng(TypedDict):
    cpu: Tensor


class RngState(_CpuRng, total=False):
    """The RNG states a micro-batch ran with: the CPU's, and every CUDA device's once CUDA is initialised."""

    cuda: list[Tensor]


def rng_state() -> RngState:
    """The CPU and (initialised) CUDA RNG states, to replay a micro-batch with the same dropout masks."""
    state: RngState = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Optional[RngState]) -> None:
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class Window:
    """The micro-batches of one optimizer step and the RNG state before each (what an incident replays), and the
    step they belong to (a replay runs at that step's number, however late it comes), and the version counter of
    each batch tensor when its micro-batch started (host integers: an incident tells a batch the step wrote into in
    place, :mod:`~..detect.writes`)."""

    __slots__ = ("batches", "rng", "step", "versions")

    def __init__(self) -> None:
        self.batches: list[tuple[object, int]] = []  # (batch, batch_idx)
        self.rng: list[Optional[RngState]] = []  # None when replays are off
        self.versions: list[Optional[tuple[int, ...]]] = []  # None: not taken
        self.step: Optional[int] = None

    def add(self, batch: object, batch_idx: int, rng: Optional[RngState] = None,
            versions: Optional[tuple[int, ...]] = None) -> None:
        self.batches.append((batch, batch_idx))
        self.rng.append(rng)
        self.versions.append(versions)

    def clear(self) -> None:
        self.batches.clear()
        self.rng.clear()
        self.versions.clear()

    def copy(self) -> "Window":
        twin = Window()
        twin.batches, twin.rng, twin.step = list(self.batches), list(self.rng), self.step
        twin.versions = list(self.versions)
        return twin

    @property
    def batch_idx(self) -> int:
        """The batch index of the last micro-batch (-1: none)."""
        return self.batches[-1][1] if self.batches else -1

    def __len__(self) -> int:
        return len(self.batches)


class UpdateStage(enum.Enum):
    """What can still be done about a judged step's update (module docstring)."""

    ON_HOST = "on_host"  # judged at once: the host skips and clips it
    ON_DEVICE = "on_device"  # judged late: skipped on the device where its flag said so, clipped there
    APPLIED = "applied"  # judged late, by an optimizer that cannot skip on the device: applied


@dataclass
class StepRecord:
    """One optimizer step as the guard judges it (module docstring)."""

    step: int
    epoch: int
    window: Window
    lrs: list[float]  # the learning rates of the optimizer's param groups it ran at
    loss_checked: bool
    optimizer: torch.optim.Optimizer
    update: UpdateStage
    scaled: bool  # a GradScaler was active
    has_norm: bool  # its gradient norm was computed
    params: list[Tensor] = field(default_factory=list)  # ON_HOST: the parameters the host skips and clips
    norm: Optional[Tensor] = None  # ON_HOST: the norm tensor to clip with
    skip: Optional[Tensor] = None  # the device flag that skipped it (judged late; 0-dim float)
    limit: Optional[float] = None  # the clipping limit applied on the device (judged late)
    spike_limit: Optional[float] = None  # the limit applied instead to a loss spike (check.spike_action: clip)
    local: Optional[Tensor] = None  # this rank's evidence vector before the all-reduce (DDP)
    replica: Optional[dict] = None  # DDP: the ranks' copies of the reduced gradient disagree (its evidence), once read
    flags: Optional[Any] = None  # its evidence, once read (a detect.vector.StepFlags)
    log_step: Optional[int] = None  # the step Lightning logs its batch's metrics at (report.recorder.logger_step)

    @property
    def batch_idx(self) -> int:
        return self.window.batch_idx

    @property
    def read_flags(self) -> Any:
        """Its flags (:class:`~.detect.vector.StepFlags`), asserted read."""
        assert self.flags is not None, "the step's flags were not read yet"
        return self.flags

    @property
    def loss(self) -> Optional[float]:
        """The step's loss as read (None when its loss was not checked)."""
        return self.read_flags.loss if self.loss_checked else None
