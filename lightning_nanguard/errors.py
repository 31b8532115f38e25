"""The errors NaNGuard raises: a bad configuration, and giving up."""

from __future__ import annotations

__all__ = ["ConfigError", "NaNGuardError", "SnapshotWriteWarning", "SnapshotReadWarning", "SinkWriteWarning"]


class ConfigError(ValueError):
    """A NaNGuard configuration value is unknown, of the wrong type or out of range."""


class NaNGuardError(RuntimeError):
    """Raised when NaNGuard gives up and ``recovery.on_give_up`` is ``"raise"``, when it refuses to write a
    checkpoint holding non-finite tensors it has no known-good state to replace with, or when the guard state of
    the checkpoint a fit resumes from is malformed or newer than this release (naming the key)."""


class SnapshotWriteWarning(RuntimeWarning):
    """A snapshot could not be written (``recovery.snapshot: disk``): no file was left behind; the newest such
    snapshot is kept in host memory instead (a rollback target of last resort, after every snapshot on disk that
    verifies), older ones are not. Warned once per fit."""


class SnapshotReadWarning(RuntimeWarning):
    """A snapshot was refused when read back (missing, truncated, another file, not what was written, or refused by
    torch's restricted loader): it is never a rollback target again, and the rollback falls back to the next older
    snapshot that verifies. Warned once per refused snapshot."""


class SinkWriteWarning(RuntimeWarning):
    """One of the guard's sinks (``events.jsonl``, the incident reports, a logger, the screen) could not be written:
    the event stays in ``guard.events`` and the other sinks, later events try again. Warned once per sink per fit."""
