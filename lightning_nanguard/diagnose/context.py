"""What the diagnosis reads of an incident: the typed :class:`Evidence` its builder gathered
(:mod:`lightning_nanguard.respond.incident`), the guard's :class:`History`, and the :class:`IncidentContext` the rules
read, built from both in one place (:meth:`.Diagnoser.context`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..core.events import NaNEvent
from ..core.record import Window
from ..detect.flow import Flow
from . import dynamics

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
    """Everything the diagnosis may look at; built by the callback on an incident only."""

    trainer: Any
    pl_module: Any
    event: NaNEvent
    batches: list[tuple[Any, int]] = field(default_factory=list)
    rng_states: list[Any] = field(default_factory=list)
    replay_step: Optional[int] = None  # the step the batches belong to (a lagged step is replayed at its number)
    grad_norm: float = float("nan")
    norm_history: list[float] = field(default_factory=list)
    norm_history_end: Optional[int] = None  # the step of the newest norm in norm_history (None: the step before)
    lr_cut_step: Optional[int] = None  # the step of the guard's latest LR cut
    loss_history: list[float] = field(default_factory=list)
    param_findings: list[dict] = field(default_factory=list)
    input_findings: list[dict] = field(default_factory=list)
    grads_were_finite: Optional[bool] = None
    at_fit_start: bool = False
    replay: bool = False
    frames: int = 21
    float64_check: bool = True
    replayed: bool = False  # set by diagnose() when it replayed the window
    previous: Optional[NaNEvent] = None  # the last replayed incident, reused once anomaly.max_replays is spent
    scaler_overflows: Optional[int] = None  # 16-mixed: consecutive GradScaler overflows up to this step
    grad_scale: Optional[float] = None  # 16-mixed: the scaler's scale at this step
    only_gradients: bool = False  # the gradients were the only non-finite evidence of the step
    initial: Optional[dynamics.InitialScales] = None  # parameter norms at fit start, read on demand
    # the newest snapshot at or before a step: (its step, the 2-norms of its module tensors by name), or None
    reference: Optional[Callable[[int], Optional[tuple[int, dict[str, float]]]]] = None
    divergence: Optional[dict] = None  # the divergence watch's evidence (a divergence event)
    # the learning rates the step ran at, by param group (id of the group -> LR): a step judged one step late
    # finds its scheduler stepped since
    step_lrs: Optional[dict[int, float]] = None
    # the replay runs on the weights the step ran on (not a step judged late whose update was already applied):
    # only then does a clean replay mean a fault that does not come back
    same_weights: bool = True
    norm_type: float = 2.0  # clip.norm_type: a total gradient norm that overflows it is an incident too
    # sharded (DTensor parameters): the replay is a collective, so every rank replays or none, and every rank runs
    # its passes together; this agrees on them (:class:`~.lockstep.Lockstep`: one collective per point, which every
    # rank reaches together)
    lockstep: Optional[Any] = None
    replay_timeout: Optional[float] = None  # anomaly.replay_timeout: seconds
    # what the diagnosis found, beside the event's details: the relative update of the LR rule (its safe LR)
    relative_update: Optional[dict] = None
    flow: Optional[Flow] = None  # the gradient-flow window up to the incident (logging.flow_window)

    @property
    def safe_factor(self) -> Optional[float]:
        """The LR factor at which the diagnosis' relative update would be safe (a ``sized`` LR cut), or None."""
        found = self.relative_update
        return (found["safe_lr"] / found["lr"] if found and found.get("safe_lr") is not None and found["lr"] > 0
                else None)

