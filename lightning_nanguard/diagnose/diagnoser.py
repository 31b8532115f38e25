"""The diagnosis of a fit: the incident replay within its budget, and ``anomaly.mode: always``."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ..config import AnomalyConfig
from ..core.counters import Counters
from ..core.diagnosis import Diagnosis
from ..core.dtensors import sharded
from ..core.events import NaNEvent
from .context import Evidence, History, IncidentContext
from .dynamics import InitialScales
from .lockstep import Lockstep
from .passes import parse_anomaly_error
from .rules import diagnose, diagnose_anomaly_error

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Diagnoser"]


def _lockstep(trainer: "pl.Trainer", pl_module: "pl.LightningModule", timeout: float) -> Optional[Lockstep]:
    """Sharded (DTensor parameters): a replay is a collective (FSDP2 all-gathers the weights in its forward,
    reduce-scatters in its backward; tensor parallel all-reduces), so every rank replays or none, and every rank runs
    the same passes: how they agree (:class:`~.lockstep.Lockstep`; on the incident path only). None otherwise."""
    if pl_module is None or not sharded(pl_module):
        return None
    return Lockstep(timeout=timeout, device=getattr(getattr(trainer, "strategy", None), "root_device", None))


class Diagnoser:
    """Diagnoses incidents (:func:`~.rules.diagnose`), replaying at most ``anomaly.max_replays`` per fit.

    With ``anomaly.mode: always`` it also turns torch's anomaly mode on for the fit (:meth:`start`) and
    restores the mode it found (:meth:`stop`). While an incident is replayed, the fit-long anomaly mode is
    off (the replay runs its own anomaly pass).

    Replays are counted (``counters["replays"]``); the budget is per fit.

    Attributes:
        initial: every parameter's scale at fit start (read only on an incident).
        replays_rng: keep the RNG state of each micro-batch for a replay (off with ``anomaly.mode: off``).
    """

    def __init__(self, cfg: AnomalyConfig, counters: Counters) -> None:
        self.cfg = cfg
        self.counters = counters
        self.replays_rng = cfg.mode != "off"
        self._anomaly_before: Optional[tuple[bool, bool]] = None
        self.initial = InitialScales()
        # the incidents diagnosed, each with its diagnosis (the same object the account of every rank adopts into),
        # from the newest replayed one on: what an incident of the same kind reuses once anomaly.max_replays is spent
        self._diagnosed: list[tuple[NaNEvent, Diagnosis]] = []

    def record_initial(self, module: torch.nn.Module) -> None:
        """Fit start: queue every parameter's norm on the device (read only if an incident needs it)."""
        self.initial.record(module)

    def start(self) -> None:
        if self.cfg.mode == "always" and self._anomaly_before is None:
            self._anomaly_before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
            torch.autograd.set_detect_anomaly(True, check_nan=True)

    def stop(self) -> None:
        if self._anomaly_before is not None:
            torch.autograd.set_detect_anomaly(*self._anomaly_before)
            self._anomaly_before = None

    def context(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", event: NaNEvent, evidence: Evidence,
                history: Optional[History] = None) -> IncidentContext:
        """The :class:`IncidentContext` of ``event``: what its builder gathered (``evidence``: the step's window,
        its micro-batches and their RNG states, ...), the guard's ``history`` (none: empty) and the diagnosis
        settings."""
        return IncidentContext(
            trainer=trainer, pl_module=pl_module, event=event,
            # (its own list of findings: the incident's look fills the context's in, not the incident's)
            evidence=replace(evidence, param_findings=list(evidence.param_findings)), history=history or History(),
            frames=self.cfg.frames, float64_check=self.cfg.float64_check, initial=self.initial,
            lockstep=_lockstep(trainer, pl_module, self.cfg.replay_timeout), replay_timeout=self.cfg.replay_timeout)

    # ---------------------------------------------------------------------------------------- diagnosis

    def diagnose(self, ctx: IncidentContext) -> str:
        """Diagnose the incident of ``ctx`` (the pipeline's entry point into :mod:`.rules`).

        The window is replayed when the budget (``anomaly.max_replays``) allows and the module steps its optimizers
        automatically (replaying a manual-optimization training_step would train); else an incident of the same kind
        reuses the diagnosis of the newest replayed one.

        Args:
            ctx: the incident's context (:meth:`context`); its ``diagnosis`` is filled in, and the event's cause,
                culprit, op, details and suggestion are written from it.

        Returns:
            The incident report's extra text (the module frames of a replay; may be empty).
        """
        ctx.replay = (self.cfg.mode != "off" and self.counters["replays"] < self.cfg.max_replays
                      and getattr(ctx.pl_module, "automatic_optimization", True))
        ctx.previous = self._newest_replayed()
        with self._paused():
            extra = diagnose(ctx)
        self._remember(ctx)
        return extra

    def anomaly_error(self, error: BaseException) -> Optional[dict]:
        """What the error says, if it is the one torch's anomaly mode raises in backward; else None. Whoever
        turned the mode on: ``anomaly.mode: always``, or the user (``Trainer(detect_anomaly=True)``,
        ``torch.autograd.set_detect_anomaly``)."""
        return parse_anomaly_error(error)

    def diagnose_error(self, ctx: IncidentContext, found: dict) -> str:
        """Diagnose the error of :meth:`anomaly_error` (replaying the window unless ``anomaly.mode: off``)."""
        ctx.replay = self.cfg.mode != "off" and getattr(ctx.pl_module, "automatic_optimization", True)
        extra = diagnose_anomaly_error(ctx, found)
        self._remember(ctx)
        return extra

    def _remember(self, ctx: IncidentContext) -> None:
        """Count the replay, and keep the incident's diagnosis (read by :meth:`_newest_replayed` once the account
        has been adopted: under DDP, the chosen rank's replay)."""
        self.counters.add("replays", int(ctx.replayed))
        self._diagnosed.append((ctx.event, ctx.diagnosis))

    def _newest_replayed(self) -> Optional[tuple[NaNEvent, Diagnosis]]:
        """The newest diagnosed incident whose account holds a replay, and its diagnosis (older ones are forgotten)."""
        for i in range(len(self._diagnosed) - 1, -1, -1):
            if self._diagnosed[i][1].replay is not None:
                del self._diagnosed[:i]
                return self._diagnosed[0]
        return None

    @contextmanager
    def _paused(self) -> Iterator[None]:
        before = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        torch.autograd.set_detect_anomaly(False)
        try:
            yield
        finally:
            torch.autograd.set_detect_anomaly(*before)
