"""Incident records (:class:`NaNEvent`) and the sinks that persist them.

- :class:`JsonlSink` appends one JSON line per event to ``<log_dir>/nanguard/events.jsonl`` and flushes and
  fsyncs it, so a run killed right after an incident keeps the record.
- :class:`LoggerSink` writes ``nanguard/`` scalars at the event's own step (bypassing
  ``log_every_n_steps``) and, with a TensorBoard-style ``experiment``, the event as markdown text.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["NaNEvent", "KINDS", "ACTIONS", "CAUSES", "JsonlSink", "LoggerSink", "to_jsonable"]

KINDS = ("loss", "gradient", "activation", "input", "parameter", "buffer", "spike")
ACTIONS = ("skip_step", "clip", "reduce_lr", "rollback", "skip_batches", "stop", "raise", "warn")
CAUSES = ("input", "overflow", "precision", "backward_op", "exploding_gradient", "optimizer", "initialization",
          "unknown")


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

    def add_action(self, action: str) -> None:
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r}; allowed: {ACTIONS}")
        self.actions.append(action)

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(asdict(self))

    def summary(self) -> str:
        """One line for logs and error messages."""
        where = f" in {self.culprit}" if self.culprit else ""
        op = f" ({self.op})" if self.op else ""
        cause = f", cause={self.cause}" if self.cause else ""
        what = "spike (finite, abnormal)" if self.kind == "spike" else f"non-finite {self.kind}"
        return (f"[nanguard] step {self.step} (epoch {self.epoch}, batch {self.batch_idx}): "
                f"{what}{where}{op}{cause} -> {', '.join(self.actions) or 'none'}")

    def markdown(self) -> str:
        rows = [("kind", self.kind), ("actions", ", ".join(self.actions)), ("cause", self.cause),
                ("culprit", self.culprit), ("op", self.op), ("suggestion", self.suggestion)]
        lines = ["| field | value |", "|---|---|"]
        lines += [f"| {k} | {'' if v is None else str(v).replace('|', '/')} |" for k, v in rows]
        return "\n".join(lines)


def to_jsonable(obj: Any) -> Any:
    """Recursively turn tensors, numpy scalars, tuples and non-finite floats into JSON-safe values."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)  # "nan" / "inf": strict JSON has no literal for them
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "tolist"):  # torch tensors, numpy arrays and scalars
        return to_jsonable(obj.tolist())
    return str(obj)


class JsonlSink:
    """Append-only, crash-safe JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, event: NaNEvent) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(event.to_dict(), sort_keys=True, allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())


class LoggerSink:
    """Writes guard scalars and events through a Lightning logger, at explicit steps."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        experiment = getattr(logger, "experiment", None) if logger is not None else None
        # TensorBoard's SummaryWriter (and the dummy on non-zero ranks) expose add_scalar/add_text
        self._tb = experiment if hasattr(experiment, "add_scalar") and hasattr(experiment, "add_text") else None

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.logger is None:
            return
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, global_step=step)
        else:
            self.logger.log_metrics(dict(values), step=step)

    def text(self, event: NaNEvent) -> None:
        if self._tb is not None:
            self._tb.add_text(f"nanguard/incident/{event.kind}", event.markdown(), global_step=event.step)

    def flush(self) -> None:
        if self._tb is not None and hasattr(self._tb, "flush"):
            self._tb.flush()
        elif self.logger is not None and hasattr(self.logger, "save"):
            self.logger.save()
