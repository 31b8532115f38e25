"""Typed configuration for :class:`~lightning_nanguard.NaNGuard`.

One dataclass per section (``check``, ``clip``, ``anomaly``, ``recovery``, ``logging``) and
:class:`NaNGuardConfig` holding them. Every field is validated in ``__post_init__`` so that a config
built by hand, from YAML, or by jsonargparse (LightningCLI) is checked the same way, and every error is
a :class:`ConfigError` naming the full key path and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, TypeVar, Union

from .core.jsonvalue import JSONDict
from .errors import ConfigError
from .usage_errors import usage_errors

if TYPE_CHECKING:
    import yaml

__all__ = [
    "ConfigError",
    "CheckConfig",
    "ClipConfig",
    "AnomalyConfig",
    "RecoveryConfig",
    "LoggingConfig",
    "NaNGuardConfig",
    "SECTIONS",
    "EVERYDAY_KEYS",
    "load_yaml",
    "iter_keys",
]


_T = TypeVar("_T")


def _opt(default: _T, help: str, *, lo: Optional[float] = None, hi: Optional[float] = None,
         lo_open: bool = False, hi_open: bool = False, inf_ok: bool = False) -> _T:
    """A dataclass field with a one-line ``help`` and an optional numeric range.

    Numbers must be finite unless ``inf_ok`` (an infinite clip, z-score or factor means nothing; ``null``
    or ``off`` is how a feature is turned off).
    """
    meta = {"help": help, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "inf_ok": inf_ok}
    return field(default=default, metadata=meta)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _show(value: object) -> str:
    """A bounded one-line repr for messages (a 5,000-deep list must not raise RecursionError)."""
    return _REPR.repr(value)


@dataclass
class _Section:
    """Mixin: validate and coerce every field of a section dataclass in ``__post_init__``.

    A (field-less) dataclass itself, so that every class in a section's MRO is a dataclass and
    jsonargparse (LightningCLI) treats the sections as plain nested dataclasses, not as subclass specs.
    """

    _section: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        with usage_errors():  # under LightningCLI: a one-line parser error naming the key, not a traceback
            self._check()

    def _check(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            path = f"{self._section}.{f.name}"
            value = _coerce(path, getattr(self, f.name), hints[f.name])
            _check_range(path, value, f.metadata, nullable=type(None) in typing.get_args(hints[f.name]))
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        """Cross-field checks; overridden where a section has them."""

    def to_dict(self) -> JSONDict:
        """The config as plain data.

        Returns:
            Its keys and values (a :class:`NaNGuardConfig`: one mapping per section).
        """
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------- sections


@dataclass
class CheckConfig(_Section):
    """What is checked for non-finite values, and when."""

    _section = "check"
    loss: bool = _opt(True, "check the loss of every micro-batch before backward (device flag, no sync)")
    gradients: bool = _opt(True, "check one fused total gradient norm at every optimizer step")
    inputs: Literal["off", "on_incident", "always"] = _opt(
        "on_incident", "check every floating tensor of the batch: only after an incident, every step, or never")
    parameters: bool = _opt(True, "check parameters and buffers: on every incident, before snapshots, checkpoints "
                                  "and validation, at the end of fit, and after every step while loss or "
                                  "gradients is off")
    activations: Union[Literal["off", "on_incident", "always"], int] = _opt(
        "on_incident", "module outputs: off, during the incident replay, every step, or every N steps")
    spike_action: Literal["off", "warn", "skip_step", "clip", "reduce_lr"] = _opt(
        "skip_step", "what to do when the loss jumps spike_z spreads above its running mean (skip_step: its update "
                     "never reaches the weights nor the optimizer's moments)")
    spike_z: float = _opt(6.0, "spreads above the loss's running mean that count as a spike (the spread: its standard "
                               "deviation, 1% of |mean|, or half the recent peak over the mean, the largest)",
                          lo=0.0, lo_open=True)
    spike_warmup: int = _opt(50, "healthy steps of loss statistics before spike detection starts", lo=1)
    divergence: Literal["off", "warn", "act"] = _opt(
        "act", "a finite loss or gradient norm running away (from step 1): ignore it, record an event, or also skip "
               "the step, roll back to the newest snapshot from before it and cut the LR (as its cause allows)")
    divergence_growth: float = _opt(2.0, "per-step growth factor of the loss (or gradient norm) that counts "
                                         "towards a divergence", lo=1.0, lo_open=True)
    divergence_steps: int = _opt(3, "consecutive steps, each growing by divergence_growth, that make a divergence",
                                 lo=2)
    divergence_factor: float = _opt(
        100.0, "a loss this many times its first value for divergence_steps + 2 consecutive steps is a divergence; "
               "the last value of a growth streak must also be 10x every value before the streak", lo=1.0,
        lo_open=True)
    stall: Literal["off", "warn", "act"] = _opt(
        "act", "a run that stopped learning because its steps are too large (a loss that stopped falling arms a "
               "probe: K steps at the run's LR and at 1/10 of it on the batches just seen): ignore it, record an "
               "event, or also cut the LR by the factor the probe measured best")
    stall_window: int = _opt(50, "steps of each of the two loss windows whose progress arms the stall probe", lo=2)
    stall_progress: float = _opt(
        0.5, "the stall probe is armed when the loss fell by less than this many spreads between the last two "
             "stall_window windows", lo=-1e3, hi=1e3)
    stall_probe_steps: int = _opt(20, "steps (and batches) of the stall probe", lo=1)
    stall_gain_ratio: float = _opt(
        1.2, "a stall: the loss gain of the probe at 1/10 of the LR is at least this many times the gain at the "
              "run's LR", lo=1.0, lo_open=True)
    stall_remaining: float = _opt(
        0.6, "a stall: the probe's loss is still at least this fraction of the mean loss of the fit's first "
             "stall_window steps (a run that has learned most of it is annealing, not stalled)", lo=0.0, hi=1.0)
    amp_overflow_patience: int = _opt(
        20, "consecutive GradScaler overflows (skipped steps) that count as an incident", lo=1)
    amp_min_scale: float = _opt(1e-4, "GradScaler scale below which training counts as diverged",
                                lo=0.0, lo_open=True)
    replicas: bool = _opt(
        True, "DDP: compare every rank's copy of the reduced gradient (in the step's one all-reduce) and, at "
              "every snapshot, a checksum of the weights; ranks that disagree skip the step, or roll back everywhere")
    replica_compare: Literal["exact", "tolerance"] = _opt(
        "exact", "DDP: how the ranks' copies of the reduced gradient are compared: exact (a checksum of their bits: "
                 "any changed bit is a disagreement) or tolerance (their norms, within replica_tolerance: for ranks "
                 "whose copies may legitimately differ, e.g. heterogeneous hardware or a non-deterministic reduction)")
    replica_tolerance: float = _opt(
        1e-3, "replica_compare: tolerance: relative difference between two ranks' gradient norms that counts as "
              "replicas disagreeing (raised automatically above float32 rounding at many ranks)", lo=0.0, hi=1.0,
        lo_open=True)
    sync: Literal["auto", "eager", "lagged"] = _opt(
        "auto", "when the step's flags reach the host: eager (one sync per step, exact host-side skip), lagged "
                "(read one step late, bad steps skipped on the device: no sync), auto (lagged off the CPU when "
                "every optimizer can skip on the device, e.g. fused=True, else eager)")

    def _validate(self) -> None:
        if isinstance(self.activations, int) and self.activations < 1:
            raise ConfigError(f"check.activations: got {self.activations!r}; allowed: 'off', 'on_incident', "
                              "'always' or an int N >= 1 (check every N steps)")


@dataclass
class ClipConfig(_Section):
    """Gradient-norm clipping, from the total norm the guard computes anyway."""

    _section = "clip"
    max_norm: Optional[float] = _opt(None, "fixed clip of the total gradient norm; null for none", lo=0.0,
                                     lo_open=True)
    norm_type: float = _opt(2.0, "p of the p-norm used for the total gradient norm", lo=0.0, lo_open=True,
                            inf_ok=True)
    adaptive: Literal["off", "on_incident", "always"] = _opt(
        "on_incident", "z-score clipping on an EMA of healthy gradient norms: never, after the first "
                       "incident, or from the start")
    z_threshold: float = _opt(2.5, "adaptive clip at EMA mean + z_threshold * EMA std of the norm", lo=0.0,
                              lo_open=True)
    ema_alpha: float = _opt(0.97, "EMA decay for the gradient-norm statistics", lo=0.0, hi=1.0, lo_open=True,
                            hi_open=True)
    warmup_steps: int = _opt(25, "healthy steps before adaptive clipping may act", lo=1)
    agc_clip_factor: Optional[float] = _opt(
        None, "unit-wise adaptive gradient clipping (NFNets) factor, e.g. 0.01; null for off", lo=0.0,
        lo_open=True)


@dataclass
class AnomalyConfig(_Section):
    """Diagnosis by replaying the bad batch with anomaly detection and module hooks."""

    _section = "anomaly"
    mode: Literal["off", "on_incident", "always"] = _opt(
        "on_incident", "replay the bad batch to name module, op and cause; 'always' keeps anomaly mode on")
    max_replays: int = _opt(10, "most incident replays per fit (bounds the cost of a flapping run)", lo=0)
    float64_check: bool = _opt(True, "rerun the replay in float64 to tell overflow/precision from a real NaN")
    frames: int = _opt(21, "module frames kept before the first non-finite value in the incident report",
                       lo=1)
    replay_timeout: float = _opt(
        300.0, "seconds an incident's replay may take: no pass starts after that (sharded: the ranks agree, and end it "
               "together)", lo=0.0, lo_open=True)


@dataclass
class RecoveryConfig(_Section):
    """The recovery ladder: skip, clip, cut the LR, roll back, give up."""

    _section = "recovery"
    max_skips: int = _opt(3, "consecutive skipped steps before rolling back to a snapshot", lo=1)
    lr_factor: float = _opt(0.5, "multiply every learning rate by this on a cut", lo=0.0, hi=1.0,
                            lo_open=True, hi_open=True)
    reduce_lr_after: int = _opt(
        0, "also cut the LR after this many incidents within incident_window steps (bad inputs and transients not "
           "counted; 0: only the cuts that the cause or a forced rollback calls for)", lo=0)
    incident_window: int = _opt(100, "steps over which incidents count towards reduce_lr_after (and 3 loss spikes cut "
                                         "the LR)", lo=1)
    reduce_lr_on_rollback: bool = _opt(True, "cut the LR after a rollback forced because skipping did not help "
                                             "(not where the cause rules a cut out, e.g. bad inputs, nor for a "
                                             "one-off bad parameter)")
    divergence_lr_factor: float = _opt(
        0.1, "LR factor of a cut for a divergence, or when the diagnosis names the learning rate (then smaller if "
             "one step would still move the weights too far)", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    min_lr_scale: float = _opt(1e-4, "floor of the cumulative LR scale", lo=0.0, hi=1.0, lo_open=True)
    snapshot: Literal["memory", "disk", "off"] = _opt(
        "memory", "where known-good state is kept: preallocated CPU memory, atomic files written in the background, "
                  "or nowhere (under DDP each rank keeps 1/N of it)")
    snapshot_every: int = _opt(20, "healthy optimizer steps between snapshots", lo=1)
    keep_snapshots: int = _opt(2, "snapshots kept (older ones are the targets of further rollbacks)", lo=1)
    stall_anchors: bool = _opt(
        True, "with check.stall: act (one process, one optimizer), also keep the fit's first snapshot and the last one "
              "before the LR rose (a warm restart), each for 20 stall windows: the rollback targets of a stall (up to "
              "2 snapshots beside keep_snapshots)")
    snapshot_dir: Optional[str] = _opt(None, "folder for disk snapshots (default: <log_dir>/nanguard/snapshots)")
    max_rollbacks: int = _opt(3, "rollbacks without recovery before giving up", lo=0)
    confirm_after: int = _opt(
        10, "healthy steps after a rollback before a snapshot confirms it worked (sooner than snapshot_every, "
            "so a later, unrelated incident starts a fresh ladder instead of counting as a failed rollback)", lo=1)
    skip_batches: int = _opt(0, "batches whose step is skipped right after a rollback (skip past bad data)",
                             lo=0)
    transient_limit: int = _opt(
        3, "faults that do not come back (cause transient) on one rank within transient_window steps that make its "
           "hardware suspect", lo=1)
    transient_window: int = _opt(1000, "steps over which a rank's transient faults count towards transient_limit",
                                 lo=1)
    on_suspect_hardware: Literal["warn", "stop", "raise"] = _opt(
        "warn", "when a rank's hardware is suspect: record and warn, stop the Trainer, or raise NaNGuardError naming "
                "the rank and host (for a job scheduler to exclude the node)")
    on_give_up: Literal["stop", "raise"] = _opt(
        "stop", "after restoring the last good weights: stop the Trainer, or raise NaNGuardError")
    restore_at_end: bool = _opt(
        True, "restore the newest known-good snapshot when fit ends on suspect weights: inside a streak of incidents "
              "that those weights reproduce, or while the loss runs away after an unconfirmed rollback")


@dataclass
class LoggingConfig(_Section):
    """Where incidents are recorded."""

    _section = "logging"
    events_file: bool = _opt(True, "append every event to <log_dir>/nanguard/events.jsonl (flushed, fsynced)")
    loggers: bool = _opt(True, "write nanguard/ scalars (and, to TensorBoard, incident text) to every logger of "
                               "the Trainer")
    reports: bool = _opt(True, "write a human-readable incident report next to events.jsonl")
    max_reports: int = _opt(100, "incident report files kept per fit: the first half and the newest half (every "
                                 "event stays in events.jsonl)", lo=1)
    progress_bar: bool = _opt(True, "show incidents and LR scale in the progress bar (from the first incident or LR "
                                    "cut on)")
    verbose: bool = _opt(True, "print one line per event, with its cause and actions (rank 0)")
    flow_window: int = _opt(256, "optimizer steps of per-tensor gradient norms kept on the device for the incident "
                                 "pictures and the culprit of a divergence (0: off)", lo=0)


SECTIONS: dict[str, type] = {
    "check": CheckConfig,
    "clip": ClipConfig,
    "anomaly": AnomalyConfig,
    "recovery": RecoveryConfig,
    "logging": LoggingConfig,
}

# The keys users set: what is checked, clipping, the replay, the ladder's size and LR cut, snapshots, giving up,
# the hardware policy and what is written where. docs/configuration.md and configs/default.yaml list them first
# in each section; every other key is a tuning knob (a threshold, window or bound whose default is tuned) or a
# special case, listed after them as "advanced". Both are plain keys of the same section: the tier is only the
# order of the docs (and of iter_keys), never a nesting level, so every config keeps working.
EVERYDAY_KEYS: tuple[str, ...] = (
    "check.loss", "check.gradients", "check.inputs", "check.parameters", "check.activations", "check.spike_action",
    "check.divergence", "check.sync",
    "clip.max_norm", "clip.adaptive",
    "anomaly.mode",
    "recovery.max_skips", "recovery.lr_factor", "recovery.snapshot", "recovery.snapshot_every",
    "recovery.snapshot_dir", "recovery.max_rollbacks", "recovery.on_suspect_hardware", "recovery.on_give_up",
    "logging.events_file", "logging.loggers", "logging.reports", "logging.progress_bar", "logging.verbose",
)


@dataclass
class NaNGuardConfig:
    """All sections of a NaNGuard configuration."""

    check: CheckConfig = field(default_factory=CheckConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    anomaly: AnomalyConfig = field(default_factory=AnomalyConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        with usage_errors():
            for name, cls in SECTIONS.items():
                object.__setattr__(self, name, _section(name, cls, getattr(self, name)))

    @classmethod
    def from_mapping(cls, data: object, *, where: str = "") -> "NaNGuardConfig":
        """Build from a mapping of sections (optionally nested under ``nanguard:``).

        Args:
            data: ``{section: {key: value}}`` (None: every default).
            where: what ``data`` was read from, for the error messages.

        Returns:
            The validated config.

        Raises:
            ConfigError: not a mapping, an unknown section or key, or a value outside what its key allows.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where or 'config'}: expected a mapping of sections "
                              f"{sorted(SECTIONS)}, got {type(data).__name__}")
        if set(data) == {"nanguard"}:
            return cls.from_mapping(data["nanguard"], where=(where + ": nanguard") if where else "nanguard")
        unknown = [k for k in data if k not in SECTIONS]
        if unknown:
            raise ConfigError(_unknown(unknown[0], list(SECTIONS), prefix=""))
        return cls(**{k: v for k, v in data.items()})

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "NaNGuardConfig":
        """Build from a YAML file (see :meth:`from_mapping`).

        Args:
            path: the file.

        Returns:
            The validated config.

        Raises:
            ConfigError: the file cannot be read, is malformed YAML, or holds an invalid config.
        """
        return cls.from_mapping(load_yaml(path), where=str(path))

    def to_dict(self) -> JSONDict:
        """The config as plain data.

        Returns:
            Its keys and values (a :class:`NaNGuardConfig`: one mapping per section).
        """
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------- validation


def _section(name: str, cls: type, value: object) -> object:
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # the same section from another import of this module (e.g. jsonargparse re-import)
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected a mapping of {sorted(f.name for f in dataclasses.fields(cls))}, "
                          f"got {type(value).__name__} {_show(value)}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in known:
            raise ConfigError(_unknown(key, known, prefix=f"{name}."))
    return cls(**value)


def _unknown(key: object, known: list[str], prefix: str) -> str:
    key = key if isinstance(key, str) and key.isprintable() and len(key) <= 60 else _show(key)
    msg = f"{prefix}{key}: unknown key; allowed: {', '.join(known)}"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        msg += f" (did you mean '{prefix}{close[0]}'?)"
    return msg


def _describe(tp: object) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " | ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(path: str, value: object, tp: object) -> object:
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``path`` and the allowed values."""
    origin = typing.get_origin(tp)
    if origin is Union:
        errors = []
        for arm in typing.get_args(tp):
            try:
                return _coerce(path, value, arm)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{path}: got {_show(value)}; allowed: {_describe(tp)}{_bool_hint(value, tp)}"
                          f"{_null_hint(path, value, tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if isinstance(value, str) and value in typing.get_args(tp):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int beyond the float range
                raise ConfigError(f"{path}: got an integer too large for a float; allowed: {_describe(tp)}") from None
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{path}: got {_show(value)} ({type(value).__name__}); allowed: {_describe(tp)}"
                      f"{_bool_hint(value, tp)}")


def _null_hint(path: str, value: object, tp: object) -> str:
    """jsonargparse hands ``--trainer.callbacks.init_args.clip.max_norm=null`` over as the string 'None' (and
    drops the section's other keys): say how to write null on the command line."""
    if value not in ("None", "null") or type(None) not in typing.get_args(tp):
        return ""
    section, _, key = path.partition(".")
    return (f" (a dotted null on the LightningCLI command line arrives as the string {value!r}: set it "
            f"through its section, --trainer.callbacks.init_args.{section}='{{{key}: null}}')")


def _bool_hint(value: object, tp: object) -> str:
    """YAML 1.1 (PyYAML, jsonargparse) reads an unquoted ``off`` as false: say so where 'off' is allowed."""
    arms = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    choices = {a for arm in arms if typing.get_origin(arm) is Literal for a in typing.get_args(arm)}
    if value is False and "off" in choices:
        return " (YAML reads an unquoted off or no as false: write 'off' in quotes)"
    return ""


def _check_range(path: str, value: object, meta: Mapping[str, Any], nullable: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    lo, hi = meta.get("lo"), meta.get("hi")
    if value != value:  # NaN
        raise ConfigError(f"{path}: got nan; allowed: a finite number")
    infinite = math.isinf(value) and not meta.get("inf_ok")
    bad = infinite or (lo is not None and (value <= lo if meta.get("lo_open") else value < lo)) or (
        hi is not None and (value >= hi if meta.get("hi_open") else value > hi))
    if bad:
        left = "(" if meta.get("lo_open") else "["
        right = ")" if meta.get("hi_open") or (hi is None and not meta.get("inf_ok")) else "]"
        rng = f"{left}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{right}"
        kind = "a number" if meta.get("inf_ok") else "a finite number"
        raise ConfigError(f"{path}: got {value!r}; allowed: {kind} in {rng}{' or null' if nullable else ''}")


def load_yaml(path: Union[str, Path]) -> object:
    """Read a YAML file (duplicate keys refused), turning every failure into a ConfigError that names the file.

    Args:
        path: the file.

    Returns:
        What the YAML holds (mappings, lists and scalars).

    Raises:
        ConfigError: the file cannot be read or is malformed.
    """
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise ConfigError(f"{p}: cannot read config file ({getattr(err, 'strerror', None) or err})") from None
    try:
        return yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or _first_line(err)
        raise ConfigError(f"{p}: malformed YAML{where}: {problem}") from None
    except MemoryError:
        raise
    except RecursionError:  # PyYAML recurses once per nesting level
        raise ConfigError(f"{p}: malformed YAML: nested too deeply") from None
    except Exception as err:  # PyYAML's constructors raise plain errors, e.g. ValueError for "\U00110000"
        raise ConfigError(f"{p}: malformed YAML: cannot construct a value ({type(err).__name__}: "
                          f"{_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _strict_loader() -> "type[yaml.SafeLoader]":
    """A SafeLoader that refuses duplicate keys (plain PyYAML silently keeps the last one)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: "yaml.MappingNode", deep: bool = False) -> "dict[object, object]":
            seen: set = set()
            for key_node, _ in getattr(node, "value", []):
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: the base constructor reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"duplicate key {key!r}", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def iter_keys() -> list[tuple[str, object, str]]:
    """Every configuration key, section by section: each section's :data:`EVERYDAY_KEYS` first, then its
    advanced keys, each tier in declaration order (that of ``configs/default.yaml`` and ``docs/configuration.md``).

    Returns:
        ``(section.key, default, help)`` per key.
    """
    out = []
    for name, cls in SECTIONS.items():
        keys = [(f"{name}.{f.name}", f.default, f.metadata.get("help", "")) for f in dataclasses.fields(cls)]
        out += [k for k in keys if k[0] in EVERYDAY_KEYS] + [k for k in keys if k[0] not in EVERYDAY_KEYS]
    return out
