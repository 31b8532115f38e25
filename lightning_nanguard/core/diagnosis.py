"""What the diagnosis found, as a typed value: :class:`Diagnosis`, filled by the rules
(:mod:`lightning_nanguard.diagnose.rules`) as they run, read by the suggestions (:mod:`.causes`), the account of
an incident across ranks and the gradient-flow window, and written into the event's ``details`` once, for the
user (:meth:`Diagnosis.to_details`), with the keys the events have always had.

The fields hold the evidence as the finders return it (plain dicts and lists, the same values ``details`` shows);
the point is that no stage reads another's result out of ``event.details``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Protocol

__all__ = ["Diagnosis", "ReplayNote", "Where"]


class Where(Protocol):
    """What a suggestion reads of the event it is about (a :class:`~.events.NaNEvent`; a protocol, because
    :mod:`.events` imports :mod:`.causes`)."""

    @property
    def kind(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> Optional[str]: ...
    @property
    def device(self) -> Optional[str]: ...
    @property
    def culprit(self) -> Optional[str]: ...
    @property
    def op(self) -> Optional[str]: ...


@dataclass
class ReplayNote:
    """What the replay of an incident's micro-batches did (``details.replay``)."""

    micro_batch: Optional[int]
    reproduced: bool
    loss_finite: Optional[bool]
    nonfinite_grads: list[str]
    norm_overflow: bool = False  # every gradient finite, their total norm not
    errors: list[str] = field(default_factory=list)
    sharded: Optional[str] = None  # sharded: every rank ran the same passes (lockstep.LOCKSTEP)
    received: Optional[str] = None  # sharded: the collective through which the non-finite values came
    timeout: Optional[str] = None  # anomaly.replay_timeout ended it: where
    float64: Optional[str] = None  # why the float64 pass did not run
    note: Optional[str] = None  # what a finite replay means

    def to_dict(self) -> dict:
        out: dict = {"micro_batch": self.micro_batch, "reproduced": self.reproduced, "loss_finite": self.loss_finite,
                     "nonfinite_grads": self.nonfinite_grads}
        if self.norm_overflow:
            out["norm_overflow"] = True
        if self.errors:
            out["errors"] = self.errors
        for key in ("sharded", "received", "timeout", "float64", "note"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


# the fields the user never sees here: replay_outputs travels from the diagnosis to the gradient-flow window;
# ranks are the account's
_PRIVATE = ("replay_outputs", "ranks")


@dataclass
class Diagnosis:
    """Everything the rules found about one incident, in the order :meth:`to_details` writes it; None (or empty):
    not found. Each field is the ``details`` key of the same name (rules docstring, the names in brackets)."""

    grad_norm_zscore: Optional[float] = None
    replay_skipped: Optional[str] = None  # sharded: why no rank replayed
    nonfinite_parameters: Optional[list[dict]] = None  # the non-finite weights, with their rows
    inputs: Optional[list[dict]] = None  # the non-finite inputs: fields, samples, features
    # the batch tensors the step wrote into in place: field, versions, non-finite count, samples; the op that wrote
    batch_written: Optional[list[dict]] = None
    diagnosis_from: Optional[str] = None  # reused from an earlier incident (anomaly.max_replays spent)
    replay: Optional[ReplayNote] = None
    float64: Optional[dict] = None  # the float64 rerun of the replay
    forward: Optional[dict] = None  # the first module call that went non-finite in forward
    culprit_call: Optional[str] = None
    forward_op: Optional[dict] = None  # the op that made it (domain.op_evidence)
    backward: Optional[dict] = None  # the first module that went non-finite in backward
    backward_op: Optional[dict] = None
    anomaly: Optional[dict] = None  # what anomaly mode reported in the replay
    extreme_features: Optional[list[dict]] = None  # badly scaled input columns
    abs_max_float64: Optional[float] = None  # overflow/precision: the value reached in float64,
    dtype: Optional[str] = None  # the working dtype
    dtype_max: Optional[float] = None  # and its max
    judged_at: Optional[str] = None  # "op": judged at the op that made the value
    domain: Optional[dict] = None  # the op's input outside its domain
    initialization: Optional[dict] = None  # rule 4a: the weight initialised too large
    relative_update: Optional[dict] = None  # rule 4c: lr x |update| / |w| at the onset, its safe LR
    layer_growth: Optional[dict] = None  # rule 4d: gradients growing through depth
    activation_growth: Optional[dict] = None
    grad_norm_growth: Optional[list[float]] = None
    grad_norm_trend: Optional[dict] = None
    symptom: Optional[str] = None  # the overflow/precision finding the dynamics explain
    runaway: Optional[dict] = None  # the module that ran away
    grad_scale: Optional[float] = None  # 16-mixed
    scaler_overflows: Optional[int] = None
    anomaly_error: Optional[dict] = None  # the error anomaly mode raised in the real backward
    # the replay's outputs per module, for the gradient-flow window of the account every rank adopted (not in details)
    replay_outputs: list[dict] = field(default_factory=list)
    # the ranks with evidence of their own, as the account agreed them (None: one process, or not agreed yet; empty:
    # several ranks and none knows); the account writes them to details.ranks itself
    ranks: Optional[list[int]] = None

    @property
    def safe_factor(self) -> Optional[float]:
        """The LR factor at which the relative update would be safe (a ``sized`` LR cut), or None."""
        found = self.relative_update
        return (found["safe_lr"] / found["lr"] if found and found.get("safe_lr") is not None and found["lr"] > 0
                else None)

    def to_details(self) -> dict:
        """What the user sees of it in the event's ``details``: every field found, under its own name."""
        out: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _PRIVATE or value is None:
                continue
            out[f.name] = value.to_dict() if isinstance(value, ReplayNote) else value
        return out
