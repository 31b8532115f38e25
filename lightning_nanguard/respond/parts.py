"""The parts of the guard, built together for a fit and handed as one bundle to the two that compose them
(:class:`~.step.StepFlow` and :class:`~.responder.Responder`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..config import NaNGuardConfig
from ..core.counters import Counters
from ..detect.amp import OverflowWatch, grad_scaler
from ..detect.divergence import DivergenceWatch
from ..detect.stall import StallWatch
from ..detect.evidence import StepEvidence
from ..detect.flow import Flow, FlowWindows
from ..detect.ranks import Ranks
from ..detect.spikes import LossWatch
from ..diagnose import dynamics
from ..diagnose.context import History
from ..diagnose.diagnoser import Diagnoser
from ..recover.clipping import Clipper
from ..recover.recovery import Recovery
from ..report.recorder import Recorder

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Parts"]


@dataclass
class Parts:
    """Every part of the guard, each the owner of its state (docs/architecture.md, "Owners"); ``ranks``: how
    evidence agrees across ranks, set at fit start (:meth:`.StepFlow.start`)."""

    config: NaNGuardConfig
    counters: Counters
    evidence: StepEvidence
    clipper: Clipper
    losses: LossWatch
    overflow: OverflowWatch
    divergence: DivergenceWatch
    recovery: Recovery
    diagnoser: Diagnoser
    recorder: Recorder
    ranks: Ranks = field(default_factory=Ranks)
    flow: FlowWindows = field(default_factory=lambda: FlowWindows(0))  # the gradient-flow windows
    stall: StallWatch = field(default_factory=lambda: StallWatch("off"))  # a run that stopped learning
    # the rollbacks of this fit: (the step restored, the step of the incident that rolled back), oldest first
    rollbacks: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: NaNGuardConfig, name: Optional[str]) -> "Parts":
        """The parts, fresh for a new fit (``name``: the guard's, for its report files)."""
        counters = Counters()
        clipper = Clipper(cfg.clip, counters)
        losses = LossWatch(cfg.check.spike_action, cfg.check.spike_z, cfg.check.spike_warmup)
        divergence = DivergenceWatch(cfg.check.divergence, cfg.check.divergence_growth, cfg.check.divergence_steps,
                                     cfg.check.divergence_factor)
        recovery = Recovery(cfg.recovery, cfg.clip, counters, statistics={
            "zclip": clipper.zclip, "loss_stats": losses.detector, "divergence": divergence})
        return cls(cfg, counters, StepEvidence(cfg.check, keep_rng=cfg.anomaly.mode != "off"), clipper, losses,
                   OverflowWatch(cfg.check.amp_overflow_patience, cfg.check.amp_min_scale), divergence, recovery,
                   Diagnoser(cfg.anomaly, counters), Recorder(cfg.logging, counters, name),
                   flow=FlowWindows(cfg.logging.flow_window, cfg.clip.norm_type),
                   stall=StallWatch(cfg.check.stall, cfg.check.stall_window, cfg.check.stall_progress,
                                    cfg.check.stall_probe_steps, cfg.check.stall_gain_ratio,
                                    cfg.check.stall_remaining))

    def history(self) -> History:
        """The guard's memory of the steps before an incident, for its diagnosis and report. Called on every rank at
        the same point of an incident (each trigger is agreed across ranks), so it may issue a collective: the
        snapshots' module norms, which the diagnosis reads from a sharded store (:meth:`.Recovery.prepare_reference`).
        """
        recovery = self.recovery
        recovery.prepare_reference(dynamics.norms)
        return History(list(self.clipper.history), self.clipper.history_end, recovery.lr_cut_step,
                       list(self.losses.history), lambda step: recovery.reference_norms(step, dynamics.norms),
                       self.config.clip.norm_type, self.flow_window())

    def flow_window(self) -> Optional[Flow]:
        """The gradient-flow window as it is now (:meth:`.FlowWindow.capture`: one read; sharded, one all-reduce, so
        every rank calls it at the same point of an incident), with the steps that earlier rollbacks undid marked."""
        window = self.flow.latest
        flow = window.capture(self.ranks.reduce_powers if self.ranks.sharded else None) if window else None
        if flow is None:
            return None
        marks = list(flow.marks)
        for restored, at in self.rollbacks:
            for j, step in enumerate(flow.steps):
                if restored < step <= at and marks[j] in "h?o":
                    marks[j] = "r"
        flow.marks = "".join(marks)
        return flow

    def scalars(self, trainer: "pl.Trainer") -> dict[str, float]:
        """The guard's scalars (tags below ``nanguard/``): counts, LR scale, the last gradient norm (and the
        GradScaler's scale)."""
        counts = self.counters
        values = {"incidents": float(counts["incidents"]), "skipped_steps": float(counts["skipped_steps"]),
                  "rollbacks": float(counts["rollbacks"]), "lr_scale": float(self.recovery.lr_scale),
                  "grad_norm": float(self.clipper.last_norm)}
        threshold = self.clipper.threshold()
        if threshold is not None:  # beside the gradient norm on the guard's TensorBoard dashboard
            values["clip_threshold"] = float(threshold)
        scaler = grad_scaler(trainer)
        if scaler is not None:
            scale = self.overflow.scale  # read with the step's flags: no extra sync
            values["grad_scale"] = scale if scale is not None else float(scaler.get_scale())
        return values
