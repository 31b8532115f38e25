"""The incident report a user can read or paste into an issue."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..core.events import NaNEvent

__all__ = ["ReportText", "render_report"]


@dataclass
class ReportText:
    """What an incident report adds to its event: the recent healthy history and, after a replay, the module
    frames before the first non-finite value."""

    norm_history: Sequence[float] = field(default_factory=list)
    loss_history: Sequence[float] = field(default_factory=list)
    frames: str = ""


def render_report(ev: NaNEvent, text: ReportText) -> str:
    """The human-readable incident report (``incident-NNNN-stepS.txt``): fields, evidence, recent history
    and, after a replay, the module frames before the first non-finite value."""
    lines = [
        f"NaNGuard incident #{ev.index} at step {ev.step} (epoch {ev.epoch}, batch {ev.batch_idx}, rank {ev.rank})",
        "=" * 80,
        f"kind:       {ev.kind}",
        f"cause:      {ev.cause}",
        f"culprit:    {ev.culprit}",
        f"op:         {ev.op}",
        f"actions:    {', '.join(ev.actions)}",
        f"suggestion: {ev.suggestion}",
        "",
        "evidence:",
    ]
    for key, value in ev.details.items():
        lines.append(f"  {key}: {value}")
    if text.norm_history:
        tail = ", ".join(f"{v:.4g}" for v in text.norm_history[-10:])
        lines.append(f"  last healthy gradient norms: {tail}")
    if text.loss_history:
        tail = ", ".join(f"{v:.4g}" for v in text.loss_history[-10:])
        lines.append(f"  last healthy losses: {tail}")
    if text.frames:
        lines += ["", "frames before the first non-finite value:", text.frames]
    return "\n".join(lines) + "\n"
