"""What a saved NaNGuard state may hold: every section of the checkpoint's guard state checked before any part
of the guard loads it.

:func:`check_state` takes the state as read from a checkpoint (``checkpoint["callbacks"][guard.state_key]``,
already in the current layout) and returns a :class:`Checked`: the state to load, and what was reset. Two kinds
of content, two answers:

- **decisions** (what the guard did and will do: the counts, the event numbering, the LR scale, the ladder, the
  faults per rank, whether adaptive clipping is armed, the overflow streak): a value of the wrong type, out of
  range or non-finite raises :class:`~lightning_nanguard.errors.NaNGuardError` naming its full key
  (``recovery.lr_scale``) and what was found. Guessing would change the run: an LR scale reset to 1.0 while the
  optimizer runs at the cut LR, a give-up budget refilled, event numbers reused.
- **statistics** (what the guard learned from healthy steps: the adaptive clip's and the spike test's running
  statistics, the loss and gradient-norm histories, the divergence rules' state): a malformed one is dropped,
  so that its part starts from its fresh warm-up, and named in :attr:`Checked.reset`. They are re-learned in a few
  dozen steps; a NaN mean kept would switch adaptive clipping, spike detection or a divergence rule off for
  the rest of the fit, silently.

Keys this module does not know are left alone (their part ignores them); a missing key takes its part's
default. No tensors, no Lightning: plain data in, plain data out.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .core.causes import NAMES as CAUSE_NAMES
from .core.counters import NAMES as COUNTS
from .errors import NaNGuardError

__all__ = ["Checked", "check_state", "check_version", "known_keys", "DECISIONS", "STATISTICS"]

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 60, 60, 4, 4


class Malformed(Exception):
    """A value that does not fit its key: ``path`` (dotted), what was found and what is allowed."""

    def __init__(self, path: str, found: object, allowed: str) -> None:
        super().__init__(f"{path}: got {_shown(found)}; expected {allowed}")
        self.path = path


def _shown(value: object) -> str:
    """A short, one-line rendering of a found value, with its type where the repr alone hides it."""
    text = _repr.repr(value)
    if isinstance(value, (str, list, tuple, dict)) or not isinstance(value, numbers.Number):
        return f"{text} (a {type(value).__name__})"
    return text


Check = Callable[[object, str], object]  # (value, dotted path) -> the value to load; raises Malformed


# ------------------------------------------------------------------------------------------- value checks


def count(value: object, path: str) -> int:
    """An integer >= 0 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise Malformed(path, value, "an integer >= 0")
    return int(value)


def flag(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise Malformed(path, value, "true or false")
    return value


def real(*, nan: bool = False, neg_inf: bool = False, pos_inf: bool = False, lo: Optional[float] = None,
         lo_open: bool = False, hi: Optional[float] = None) -> Check:
    """A real number (a bool is not one): finite unless ``nan``/``neg_inf``/``pos_inf`` allow otherwise, within
    ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    allowed = ["a finite number" if not (nan or neg_inf or pos_inf) else "a number"]
    if lo is not None or hi is not None:
        allowed.append(f"in {'(' if lo_open else '['}{lo if lo is not None else '-inf'}, "
                       f"{hi if hi is not None else 'inf'}]")
    extra = [name for ok, name in ((nan, "nan"), (neg_inf, "-inf"), (pos_inf, "inf")) if ok]
    text = " ".join(allowed) + (f" (or {', '.join(extra)})" if extra else "")

    def check(value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise Malformed(path, value, text)
        v = float(value)
        if math.isnan(v):
            if nan:
                return v
            raise Malformed(path, value, text)
        if math.isinf(v):
            if (v < 0 and neg_inf) or (v > 0 and pos_inf):
                return v
            raise Malformed(path, value, text)
        if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            raise Malformed(path, value, text)
        return v

    return check


def optional(inner: Check) -> Check:
    """``None`` or what ``inner`` allows."""

    def check(value: object, path: str) -> object:
        return None if value is None else inner(value, path)

    return check


def list_of(item: Check) -> Check:
    """A list (or tuple) whose every item passes ``item`` (named ``path[i]``)."""

    def check(value: object, path: str) -> list[object]:
        if not isinstance(value, (list, tuple)):
            raise Malformed(path, value, "a list")
        return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return check


def row(*items: Check) -> Check:
    """A list (or tuple) of exactly ``len(items)`` values, each passing its check."""

    def check(value: object, path: str) -> list[object]:
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise Malformed(path, value, f"a list of {len(items)} values")
        return [c(v, f"{path}[{i}]") for i, (c, v) in enumerate(zip(items, value))]

    return check


class section:
    """A mapping whose known keys (``fields``) pass their checks; unknown keys are kept as they are (their part
    ignores them)."""

    def __init__(self, fields: Mapping[str, Check]) -> None:
        self.fields = dict(fields)

    def __call__(self, value: object, path: str) -> dict[str, object]:
        if not isinstance(value, Mapping):
            raise Malformed(path, value, "a mapping")
        out = dict(value)
        for key, check in self.fields.items():
            if key in value:
                out[key] = check(value[key], f"{path}.{key}")
        return out


def _rank_faults(value: object, path: str) -> dict[str, object]:
    """``recovery.hardware.faults``: global rank (a decimal string, or an int) -> steps of its recent faults."""
    if not isinstance(value, Mapping):
        raise Malformed(path, value, "a mapping of rank -> list of steps")
    out: dict[str, object] = {}
    for rank, steps in value.items():
        if isinstance(rank, bool) or not (isinstance(rank, numbers.Integral) and int(rank) >= 0
                                          or isinstance(rank, str) and rank.isdecimal()):
            raise Malformed(f"{path}[{rank!r}]", rank, "a rank: an integer >= 0")
        out[str(int(rank))] = list_of(count)(steps, f"{path}[{rank!r}]")
    return out


step = count


def cause_name(value: Any, path: str) -> str:
    """One of :data:`~lightning_nanguard.core.causes.NAMES`."""
    if not isinstance(value, str) or value not in CAUSE_NAMES:
        raise Malformed(path, value, f"a cause, one of {', '.join(CAUSE_NAMES)}")
    return value

finite = real()
norm = real(nan=True, neg_inf=True, pos_inf=True)  # a gradient norm as read (NaN: not computed)
maximum = real(neg_inf=True, pos_inf=True)  # a running maximum (-inf: nothing seen yet)

RUNNING_STATS = {"count": count, "mean": finite, "var": real(lo=0.0), "m2": real(lo=0.0)}

# ------------------------------------------------------------------------------------------------ the schema

# what the guard decided: a malformed value raises (section -> its fields)
DECISIONS: dict[str, Check] = {
    "counters": section({name: count for name in COUNTS}),
    "recorder": section({"index": count}),
    "recovery": section({
        "lr_scale": real(lo=0.0, lo_open=True, hi=1.0),
        "ladder": section({"consecutive": count, "uncounted": count, "failed_rollbacks": count,
                           "recent": list_of(step), "sized_cut": flag, "episode_cause": optional(cause_name),
                           "episode_since": optional(step), "episode_last": optional(step)}),
        "healthy_since_snapshot": count,
        "lr_cut_step": optional(step),
        "hardware": section({"faults": _rank_faults}),
    }),
    "clipper": section({"armed": flag}),
    "overflow": section({"overflows": count}),
}

# what the guard learned: a malformed one is reset (section -> key -> its check; "" is the whole section, whose
# fields depend on each other). Each entry is one unit, reset as a whole
STATISTICS: dict[str, dict[str, Check]] = {
    "clipper": {"zclip": section(RUNNING_STATS), "history": list_of(finite), "history_end": optional(step),
                "last_norm": norm},
    "losses": {"spikes": section({**RUNNING_STATS, "recent": list_of(step), "peak": real(lo=0.0), "held": count,
                                   "tests": count, "starts": list_of(count)}),
               "history": list_of(finite)},
    "divergence": {"": section({
        "first_loss": optional(finite), "window": list_of(row(step, optional(finite), norm)),
        "loss_max": maximum, "norm_max": maximum, "above": list_of(row(step, finite, norm)), "latched": flag,
        "onset": row(step, optional(finite), norm), "seen_max": maximum, "above_floor": maximum,
        "streak_latched": flag, "seen": count, "positive": flag})},
    "stall": {"": section({"losses": list_of(finite), "cooldown": count, "wait": count, "probes": count,
                           "start_sum": finite, "start_count": count})},
}
# a history and the step of its newest value are reset together
_TOGETHER = {("clipper", "history"): ("history_end",), ("clipper", "history_end"): ("history",)}


@dataclass
class Checked:
    """The state to load, and the statistics that were reset (``"clipper.zclip: got {...}; expected ..."``)."""

    state: dict[str, Any]  # each section as its part's load_state_dict reads it
    reset: list[str] = field(default_factory=list)


def _where(source: str) -> str:
    return f"NaNGuard cannot resume from the guard state saved in the checkpoint ({source})"


_PRE_RELEASE_VERSIONS = (1, 2)  # the layouts of the development builds before 0.1.0: not read, no upgrade path


def check_version(state: object, current: int, source: str = "checkpoint['callbacks']['NaNGuard']") -> int:
    """The state's ``version``, which must be ``current``; raises :class:`~lightning_nanguard.errors.NaNGuardError`
    for a state that is not a mapping, a version that is absent or not an integer, an older one (versions 1 and 2
    were layouts of the development builds before 0.1.0, and are not read) or a newer one (written by a later
    release, whose layout this one cannot read)."""
    if not isinstance(state, Mapping):
        raise NaNGuardError(f"{_where(source)}: got {_shown(state)}; expected a mapping of sections. "
                            + _REMEDY.format(source=source, first=""))
    reads = f"this lightning_nanguard reads version {current} only"
    version = state.get("version")
    if version is None:  # the version-1 layout had no version key
        raise NaNGuardError(f"{_where(source)}: version: absent (version 1, a development build's layout from "
                            f"before 0.1.0); {reads}. " + _REMEDY.format(source=source, first=""))
    if isinstance(version, bool) or not isinstance(version, numbers.Integral) or int(version) < 1:
        raise NaNGuardError(f"{_where(source)}: version: got {_shown(version)}; expected the integer {current}. "
                            + _REMEDY.format(source=source, first=""))
    if int(version) > current:
        raise NaNGuardError(f"{_where(source)}: version: got {version}; {reads} (the checkpoint was written by a "
                            f"newer release). " + _REMEDY.format(source=source, first="upgrade lightning_nanguard, "))
    if int(version) < current:
        why = ("a development build's layout from before 0.1.0" if int(version) in _PRE_RELEASE_VERSIONS
               else "an older layout")
        raise NaNGuardError(f"{_where(source)}: version: got {version}; {reads} (version {version} is {why}, and "
                            f"is not read). " + _REMEDY.format(source=source, first=""))
    return int(version)


_REMEDY = ("To go on: {first}resume from another checkpoint, or delete {source} from this one to resume with a "
           "fresh guard state (counters, event numbering and LR scale start over).")


def check_state(state: Mapping[str, object], source: str = "checkpoint['callbacks']['NaNGuard']") -> Checked:
    """Check every known section of ``state`` (the current layout; :func:`check_version` first); see the module
    docstring for which keys raise and which are reset. A state holding none of them (a version key alone) is no
    state a guard wrote: it raises too, rather than resume every decision from its default."""
    out = dict(state)
    if not any(name in out for name in (*DECISIONS, *STATISTICS)):
        held = ", ".join(sorted(map(str, out))) or "nothing"
        raise NaNGuardError(f"{_where(source)}: holds no section of a guard state (only {held}); expected "
                            f"{', '.join(dict.fromkeys((*DECISIONS, *STATISTICS)))}. "
                            + _REMEDY.format(source=source, first=""))
    for name, check in DECISIONS.items():
        if name in out:
            try:
                out[name] = check(out[name], name)
            except Malformed as bad:
                raise NaNGuardError(f"{_where(source)}: {bad}. " + _REMEDY.format(source=source, first="")) from None
    reset: list[str] = []
    for name, units in STATISTICS.items():
        if name not in out:
            continue
        found = out[name]
        if not isinstance(found, Mapping):
            reset.append(str(Malformed(name, found, "a mapping")))
            out[name] = {}
            continue
        sec: dict[str, object] = dict(found)
        for key, check in units.items():
            value = sec if key == "" else sec.get(key, _ABSENT)
            if value is _ABSENT:
                continue
            try:
                checked = check(value, f"{name}.{key}" if key else name)
            except Malformed as bad:
                reset.append(str(bad))
                if key == "":
                    sec = {}
                    break
                for k in (key, *_TOGETHER.get((name, key), ())):
                    sec.pop(k, None)
                continue
            if key == "":
                if isinstance(checked, dict):  # (a section's check returns a dict)
                    sec = checked
            else:
                sec[key] = checked
        out[name] = sec
    return Checked(out, reset)


_ABSENT = object()


def known_keys() -> set[str]:
    """Every dotted key the schema checks (down to the fields of nested sections), for the test that keeps it
    complete: a key a part saves but no check knows would load unchecked."""
    keys: set[str] = set()

    def walk(check: Check, path: str) -> None:
        keys.add(path)
        for key, inner in getattr(check, "fields", {}).items():
            walk(inner, f"{path}.{key}")

    for name, check in DECISIONS.items():
        walk(check, name)
    for name, units in STATISTICS.items():
        keys.add(name)
        for key, check in units.items():
            walk(check, f"{name}.{key}" if key else name)
    return keys
