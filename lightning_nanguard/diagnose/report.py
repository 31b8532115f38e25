"""The incident report a user can read or paste into an issue."""

from __future__ import annotations

from typing import Sequence

from ..report.events import NaNEvent

__all__ = ["render_report"]


def render_report(ev: NaNEvent, norm_history: Sequence[float] = (), loss_history: Sequence[float] = (),
                  frames_text: str = "") -> str:
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
    if norm_history:
        tail = ", ".join(f"{v:.4g}" for v in norm_history[-10:])
        lines.append(f"  last healthy gradient norms: {tail}")
    if loss_history:
        tail = ", ".join(f"{v:.4g}" for v in loss_history[-10:])
        lines.append(f"  last healthy losses: {tail}")
    if frames_text:
        lines += ["", "frames before the first non-finite value:", frames_text]
    return "\n".join(lines) + "\n"
