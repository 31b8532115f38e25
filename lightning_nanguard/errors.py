"""The error NaNGuard raises when it gives up."""

from __future__ import annotations

__all__ = ["NaNGuardError"]


class NaNGuardError(RuntimeError):
    """Raised when NaNGuard gives up and ``recovery.on_give_up`` is ``"raise"``, or when it refuses to write a
    checkpoint holding non-finite tensors it has no known-good state to replace with."""
