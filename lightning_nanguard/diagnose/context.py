"""What the diagnosis reads of an incident: the typed :class:`Evidence` its builder gathered
(:mod:`lightning_nanguard.respond.incident`), the guard's :class:`History`, and the :class:`IncidentContext` the rules
read, built from both in one place (:meth:`.Diagnoser.context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..core.diagnosis import Diagnosis
from ..core.events import NaNEvent
from ..core.record import RngState, Window
from ..detect.flow import Flow
from . import dynamics
from .lockstep import Lockstep

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Evidence", "History", "IncidentContext"]


@dataclass
class Evidence:
    """What an incident's builder gathered for the diagnosis (beside the guard's :class:`History`)."""

    window: Optional[Window] = None  # the micro-batches to replay
    grad_norm: float = float("nan")
    grads_were_finite: Optional[bool] = None  # the last judged step's gradients (None: unchecked)
    only_gradients: bool = False  # the gradients were the only non-finite evidence of the step
    # the replay runs on the weights the step ran on (not a step judged late whose update was already applied):
    # only then does a clean replay mean a fault that does not come back
    same_weights: bool = True
    param_findings: list[dict] = field(default_factory=list)
    at_fit_start: bool = False
    divergence: Optional[dict] = None  # the divergence watch's evidence (a divergence event)
    # the learning rates the step ran at, by param group (id of the group -> LR): a step judged one step late
    # finds its scheduler stepped since
    step_lrs: Optional[dict[int, float]] = None
    scaler_overflows: Optional[int] = None  # 16-mixed: consecutive GradScaler overflows up to this step
    grad_scale: Optional[float] = None  # 16-mixed: the scaler's scale at this step


@dataclass
class History:
    """The guard's memory of the steps before an incident, as the diagnosis and the report read it."""

    norm_history: list[float] = field(default_factory=list)
    norm_history_end: Optional[int] = None  # the step of the newest norm in norm_history (None: the step before)
    lr_cut_step: Optional[int] = None  # the step of the guard's latest LR cut
    loss_history: list[float] = field(default_factory=list)
    # the newest snapshot at or before a step: (its step, the 2-norms of its module tensors by name), or None
    reference: Optional[Callable[[int], Optional[tuple[int, dict[str, float]]]]] = None
    norm_type: float = 2.0  # clip.norm_type: a total gradient norm that overflows it is an incident too
    flow: Optional[Flow] = None  # the gradient-flow window up to the incident (logging.flow_window)


@dataclass
class IncidentContext:
    """Everything the diagnosis may look at; built on an incident only (:meth:`.Diagnoser.context`): the incident's
    ``evidence`` and the guard's ``history`` (both held, not copied), what was found behind it, the diagnosis
    settings, and the typed result the rules fill in (``diagnosis``)."""

    trainer: "pl.Trainer"
    pl_module: "pl.LightningModule"
    event: NaNEvent
    evidence: Evidence = field(default_factory=Evidence)
    history: History = field(default_factory=History)
    input_findings: list[dict] = field(default_factory=list)  # the non-finite inputs behind it (Responder._look)
    # the batch tensors the step itself wrote into in place, with the non-finite values found there (detect.writes)
    written: list[dict] = field(default_factory=list)
    replay: bool = False
    frames: int = 21
    float64_check: bool = True
    replayed: bool = False  # set by diagnose() when it replayed the window
    # the last replayed incident and its diagnosis, reused once anomaly.max_replays is spent (the Diagnoser's)
    previous: Optional[tuple[NaNEvent, Diagnosis]] = None
    initial: Optional[dynamics.InitialScales] = None  # parameter norms at fit start, read on demand
    # sharded (DTensor parameters): the replay is a collective, so every rank replays or none, and every rank runs
    # its passes together; this agrees on them (:class:`~.lockstep.Lockstep`: one collective per point, which every
    # rank reaches together)
    lockstep: Optional[Lockstep] = None
    replay_timeout: Optional[float] = None  # anomaly.replay_timeout: seconds
    # what the diagnosis found (the rules fill it in; written into the event's details once, at the end)
    diagnosis: Diagnosis = field(default_factory=Diagnosis)

    @property
    def batches(self) -> list[tuple[Any, int]]:
        """The micro-batches of the incident's window, (batch, batch_idx); empty without one."""
        window = self.evidence.window
        return list(window.batches) if window is not None else []

    @property
    def rng_states(self) -> list[Optional[RngState]]:
        """The RNG state before each micro-batch (None: replays are off)."""
        window = self.evidence.window
        return list(window.rng) if window is not None else []

    @property
    def replay_step(self) -> Optional[int]:
        """The step the batches belong to (a lagged step is replayed at its number)."""
        window = self.evidence.window
        return window.step if window is not None else None

    @property
    def safe_factor(self) -> Optional[float]:
        """The LR factor at which the diagnosis' relative update would be safe (a ``sized`` LR cut), or None."""
        return self.diagnosis.safe_factor
