"""Incident records: :class:`NaNEvent`, and the table of its ``kind`` vocabulary (causes:
:mod:`lightning_nanguard.core.causes`; actions, each a class with its name and meaning:
:mod:`lightning_nanguard.recover.actions`).

Each :class:`Kind` says how the recovery ladder treats an event of that kind (:mod:`.recover.ladder` reads
the fields and never spells a kind's name).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Optional, Protocol

from .causes import NAMES as CAUSES
from .jsonvalue import JSONDict, JSONValue
from .tree import children, keyed

__all__ = ["NaNEvent", "Kind", "KINDS", "Named", "CAUSES", "to_jsonable"]


class Named(Protocol):
    """An action (:class:`lightning_nanguard.recover.actions.Action`): what an event records of it is its name."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Kind:
    """What was non-finite or abnormal, and how the ladder treats it."""

    name: str
    meaning: str
    incident: bool = True  # counts as an incident (else a finite anomaly: counters["spikes"])
    weights: bool = False  # the weights themselves are bad: roll back at once, to the newest snapshot
    runaway: bool = False  # finite but running away: roll back to before its onset and cut the LR, whatever the cause
    advice: str = ""  # the suggestion of an event of this kind that no cause explains
    headline: str = ""  # how the one-line summary names it (default: "non-finite <name>")


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("loss", "a micro-batch loss"),
    Kind("gradient", "the total gradient norm"),
    Kind("activation", "a module output (check.activations)"),
    Kind("input", "a floating tensor of the batch"),
    Kind("parameter", "a parameter (or an optimizer state read with it)", weights=True),
    Kind("buffer", "a buffer (e.g. BatchNorm statistics)", weights=True),
    Kind("spike", "a finite loss far above its running statistics, or clipping that persists", incident=False,
         advice="The loss jumped far above its recent level: a bad batch, a learning rate that is too high for this "
                "phase (add warm-up or lower it), or missing clipping (clip.adaptive: always, clip.max_norm). Repeated "
                "spikes usually precede a divergence to NaN.", headline="spike (finite, abnormal)"),
    Kind("divergence", "a finite loss or gradient norm running away", runaway=True,
         headline="divergence (finite, running away)"),
    Kind("stall", "a finite run that stopped learning because its steps are too large (a lower-LR probe learns "
                  "more from the same batches)", incident=False,
         advice="The loss stopped falling, and the same batches learn more at a lower learning rate: the steps are "
                "too large. Lower the learning rate (the cut the guard measured is in details.stall) or add warm-up.",
         headline="stall (finite, not learning)"),
    Kind("replica", "DDP ranks disagree on a value that must be identical (their copies of the reduced gradient, or "
                    "of the weights)",
         advice="The DDP replicas disagreed: a fault in one rank's memory, its GPU or the interconnect (silent data "
                "corruption). The step was skipped on every rank, so the replicas stayed identical. If it comes back "
                "on the same rank, test that GPU or exclude the host.", headline="replicas disagree"),
)}



@dataclass
class NaNEvent:
    """One incident: what was abnormal, where, why, and what the guard did about it.

    Attributes:
        step, epoch, batch_idx: the optimizer step (``trainer.global_step``), epoch and batch it happened at.
        kind: what was abnormal (:data:`KINDS`).
        rank, host, device, local_rank: the process it was seen on.
        actions: what the guard did, in order (the names of :mod:`lightning_nanguard.recover.actions`).
        cause: why (:data:`CAUSES`), None when no cause is known.
        culprit: the module or parameter where it started, if found.
        op: the first operation that produced it (anomaly replay), if found.
        details: the evidence, as ``events.jsonl`` holds it.
        suggestion: what to change.
        index: the event's number in the run (1, 2, ...).
    """

    step: int
    epoch: int
    batch_idx: int
    kind: str
    rank: int = 0
    host: Optional[str] = None  # where that rank ran: the host name,
    device: Optional[str] = None  # its device ("cuda:3", "cpu"),
    local_rank: int = 0  # and its rank on that host
    actions: list[str] = field(default_factory=list)
    cause: Optional[str] = None
    culprit: Optional[str] = None
    op: Optional[str] = None
    details: dict[str, Any] = field(default_factory=dict)
    suggestion: str = ""
    index: int = 0
    # the step Lightning logs the event's batch at (report.recorder.logger_step): where the loggers get it; not part
    # of the record (to_dict)
    log_step: Optional[int] = field(default=None, repr=False, compare=False)
    # the gradient-flow window up to the event and the replay's module outputs (detect.flow.Flow.to_dict), kept with
    # the first logging.max_reports events of a fit: what its pictures are drawn from, then and later
    flow: Optional[JSONDict] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; allowed: {tuple(KINDS)}")

    def add_action(self, action: Named) -> None:
        """Record what the guard did: ``action``'s name (an action value of :mod:`lightning_nanguard.recover.actions`,
        whose names are the vocabulary)."""
        self.actions.append(action.name)

    def validate(self, actions: Collection[str]) -> None:
        """Check the event against the documented vocabularies.

        Args:
            actions: the action names (:data:`lightning_nanguard.recover.actions.ACTIONS`).

        Raises:
            ValueError: a kind, action or cause outside :data:`KINDS`, ``actions`` or :data:`CAUSES`.
        """
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; allowed: {tuple(KINDS)}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}; allowed: {CAUSES}")
        bad = [a for a in self.actions if a not in actions]
        if bad:
            raise ValueError(f"unknown action {bad[0]!r}; allowed: {tuple(actions)}")

    def to_dict(self) -> JSONDict:
        """The event as its ``events.jsonl`` line holds it.

        Returns:
            Every field but ``log_step``, as JSON types (:func:`to_jsonable`).
        """
        record = asdict(self)
        del record["log_step"]
        return {str(k): to_jsonable(v) for k, v in record.items()}

    def summary(self) -> str:
        """One line for logs and error messages.

        Returns:
            ``[nanguard] step S (epoch E, batch B): what in culprit (op), cause=... -> actions``.
        """
        where = f" in {self.culprit}" if self.culprit else ""
        op = f" ({self.op})" if self.op else ""
        cause = f", cause={self.cause}" if self.cause else ""
        what = KINDS[self.kind].headline or f"non-finite {self.kind}"
        return (f"[nanguard] step {self.step} (epoch {self.epoch}, batch {self.batch_idx}): "
                f"{what}{where}{op}{cause} -> {', '.join(self.actions) or 'none'}")

    def markdown(self) -> str:
        """The event as a Markdown table (what the loggers' text panels show).

        Returns:
            One row per field: kind, actions, cause, culprit, op, suggestion.
        """
        rows = [("kind", self.kind), ("actions", ", ".join(self.actions)), ("cause", self.cause),
                ("culprit", self.culprit), ("op", self.op), ("suggestion", self.suggestion)]
        lines = ["| field | value |", "|---|---|"]
        lines += [f"| {k} | {'' if v is None else str(v).replace('|', '/')} |" for k, v in rows]
        return "\n".join(lines)


def _jsonable_leaf(obj: object) -> JSONValue:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)  # "nan" / "inf": strict JSON has no literal for them
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_jsonable(obj.tolist())
    if isinstance(obj, (set, frozenset)):
        return to_jsonable(sorted(obj, key=str))
    return str(obj)


def to_jsonable(obj: object) -> JSONValue:
    """A value as JSON types: mappings and dataclasses become dicts with string keys, other containers lists;
    tensors, numpy values and sets become lists, non-finite floats the strings ``"nan"``/``"inf"``.

    Args:
        obj: any value.

    Returns:
        Its JSON form (what ``json.dumps(..., allow_nan=False)`` accepts).
    """
    kids = children(obj)
    if kids is None:
        return _jsonable_leaf(obj)
    if keyed(obj):
        return {str(k): to_jsonable(v) for k, v in kids}
    return [to_jsonable(v) for _, v in kids]
