"""Incident records: :class:`NaNEvent` and the vocabularies of its ``kind``, ``actions`` and ``cause``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..tree import children, keyed

__all__ = ["NaNEvent", "KINDS", "ACTIONS", "CAUSES", "to_jsonable"]

KINDS = ("loss", "gradient", "activation", "input", "parameter", "buffer", "spike", "divergence")
ACTIONS = ("skip_step", "clip", "reduce_lr", "rollback", "skip_batches", "stop", "raise", "warn")
CAUSES = ("input", "overflow", "precision", "backward_op", "exploding_gradient", "learning_rate", "optimizer",
          "initialization", "unknown")


@dataclass
class NaNEvent:
    """One incident: what was abnormal, where, why, and what the guard did about it."""

    step: int
    epoch: int
    batch_idx: int
    kind: str
    rank: int = 0
    actions: list[str] = field(default_factory=list)
    cause: Optional[str] = None
    culprit: Optional[str] = None
    op: Optional[str] = None
    details: dict[str, Any] = field(default_factory=dict)
    suggestion: str = ""
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; allowed: {KINDS}")

    def add_action(self, action: str) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; allowed: {ACTIONS}")
        self.actions.append(action)

    def validate(self) -> None:
        """Raise ``ValueError`` for a kind, action or cause outside the documented vocabularies."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}; allowed: {KINDS}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}; allowed: {CAUSES}")
        bad = [a for a in self.actions if a not in ACTIONS]
        if bad:
            raise ValueError(f"unknown action {bad[0]!r}; allowed: {ACTIONS}")

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))

    def summary(self) -> str:
        """One line for logs and error messages."""
        where = f" in {self.culprit}" if self.culprit else ""
        op = f" ({self.op})" if self.op else ""
        cause = f", cause={self.cause}" if self.cause else ""
        what = {"spike": "spike (finite, abnormal)", "divergence": "divergence (finite, running away)"}.get(
            self.kind, f"non-finite {self.kind}")
        return (f"[nanguard] step {self.step} (epoch {self.epoch}, batch {self.batch_idx}): "
                f"{what}{where}{op}{cause} -> {', '.join(self.actions) or 'none'}")

    def markdown(self) -> str:
        rows = [("kind", self.kind), ("actions", ", ".join(self.actions)), ("cause", self.cause),
                ("culprit", self.culprit), ("op", self.op), ("suggestion", self.suggestion)]
        lines = ["| field | value |", "|---|---|"]
        lines += [f"| {k} | {'' if v is None else str(v).replace('|', '/')} |" for k, v in rows]
        return "\n".join(lines)


def _jsonable_leaf(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)  # "nan" / "inf": strict JSON has no literal for them
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_jsonable(obj.tolist())
    if isinstance(obj, (set, frozenset)):
        return to_jsonable(sorted(obj, key=str))
    return str(obj)


def to_jsonable(obj: Any) -> Any:
    """``obj`` as JSON types: mappings and dataclasses become dicts with string keys, other containers lists;
    tensors, numpy values and sets become lists, non-finite floats the strings ``"nan"``/``"inf"``."""
    kids = children(obj)
    if kids is None:
        return _jsonable_leaf(obj)
    if keyed(obj):
        return {str(k): to_jsonable(v) for k, v in kids}
    return [to_jsonable(v) for _, v in kids]
