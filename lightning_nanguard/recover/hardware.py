"""Faults that do not come back, counted per rank: past a limit within a window of steps, that rank's hardware is
suspect (``recovery.transient_limit``, ``recovery.transient_window``, ``recovery.on_suspect_hardware``).

A pure counter, like the ladder: the guard reports each fault of a cause that counts against the hardware (the
cause table's ``hardware_fault``: ``transient``) with its step and the rank that produced it, and gets back the
steps of that rank's faults within the window once they reach the limit.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["HardwareWatch"]


class HardwareWatch:
    """Steps of the recent faults of each rank (those within ``window`` steps of the newest).

    Attributes:
        limit: faults of one rank within ``window`` steps that make its hardware suspect.
        window: the window, in optimizer steps.
    """

    def __init__(self, limit: int, window: int) -> None:
        self.limit = int(limit)
        self.window = int(window)
        self._faults: dict[int, list[int]] = {}  # rank -> steps of its recent faults

    def fault(self, rank: int, step: int) -> Optional[list[int]]:
        """A fault of ``rank`` at ``step``: the steps of its faults within the window (this one last) when they
        reach the limit, else None."""
        steps = [s for s in self._faults.get(rank, []) if s > step - self.window] + [step]
        self._faults[rank] = steps
        return list(steps) if len(steps) >= self.limit else None

    def count(self, rank: int) -> int:
        """Faults of ``rank`` counted so far (within the window of its newest)."""
        return len(self._faults.get(rank, []))

    def state_dict(self) -> dict[str, object]:
        return {"faults": {str(rank): list(steps) for rank, steps in self._faults.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._faults = {int(rank): [int(s) for s in steps] for rank, steps in state.get("faults", {}).items()}
