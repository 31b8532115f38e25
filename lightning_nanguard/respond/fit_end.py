"""The end of a fit: never leave a non-finite weight behind, whatever the guard's state, and restore the newest
known-good snapshot over finite weights that are suspect (``recovery.restore_at_end``)."""

from __future__ import annotations

from ..diagnose.final_weights import suspect
from . import incident as incidents
from .parts import Parts
from .responder import Responder

__all__ = ["FitEnd"]


class FitEnd:
    """What the end of a fit does about the weights it leaves (after the last lagged step was judged)."""

    def __init__(self, parts: Parts, responder: Responder) -> None:
        self.parts, self.responder = parts, responder

    def judge(self) -> None:
        """``on_train_end``, after the last lagged step was judged: read the weights the fit leaves (every rank
        decides alike). Non-finite: after the guard stopped, the newest snapshot replaces them or the guard says
        that none can (:func:`.incident.after_stop`); else an incident like any (:meth:`.Responder.bad_weights`).
        Finite: :meth:`unfinished`.

        Raises:
            NaNGuardError: non-finite weights that nothing could replace, under ``recovery.on_give_up: raise``.
        """
        p, fit = self.parts, self.responder.fit
        trainer, pl_module = fit.trainer, fit.module
        checked = p.config.check.parameters
        findings = p.evidence.weights.find(pl_module) if checked else []
        bad = bool(findings)
        if checked and trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if bad and p.recovery.stopped:
            if not self.responder.left_nonfinite:  # (nothing new where the guard said it left them non-finite)
                buffers = {n for n, _ in pl_module.named_buffers()}
                self.responder.respond(incidents.after_stop(
                    self.responder.at(), findings, buffers, p.config.recovery.on_give_up))
        elif bad:
            self.responder.bad_weights("train_end")
        elif p.config.recovery.restore_at_end:
            self.unfinished()

    def unfinished(self) -> None:
        """Recovery is unfinished at the end (the weights are finite): restore the newest known-good snapshot only if
        the final weights are suspect (:func:`.final_weights.suspect`; the divergence watch tells whether the loss
        is running away at the end). Weights that are the newest snapshot's already (no step applied since it was
        taken or restored) leave nothing to restore."""
        p, recovery, fit = self.parts, self.parts.recovery, self.responder.fit
        last = self.responder.take_last_incident()
        if not recovery.unfinished or recovery.pristine:
            return
        found = suspect(fit.trainer, fit.module, recovery, p.recorder.events, last, p.divergence.growing(),
                        p.config.anomaly.mode != "off", p.config.clip.norm_type)
        if found is not None:
            kind, source, reason, details = found
            self.responder.respond(incidents.unfinished(
                self.responder.at(), kind, source, reason, details, in_a_row=recovery.incidents_in_a_row,
                unconfirmed=recovery.unconfirmed_rollbacks))
