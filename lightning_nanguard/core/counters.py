"""The counts of a fit, in one place: every part that counts adds here, and ``guard.counters`` reads it."""

from __future__ import annotations

from typing import Any

__all__ = ["Counters", "NAMES"]

NAMES = ("incidents", "skipped_steps", "rollbacks", "lr_cuts", "clipped_steps", "replays", "snapshots", "spikes")


class Counters:
    """Counts of this fit: incidents, skipped steps, rollbacks, LR cuts, clipped steps, replays, snapshots and
    spikes (finite anomalies). Continued across a resumed fit (``state_dict``)."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        self._counts[name] += int(n)

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def as_dict(self) -> dict[str, int]:
        return dict(self._counts)

    def state_dict(self) -> dict[str, object]:
        return dict(self._counts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._counts = {name: int(state.get(name, 0)) for name in NAMES}
