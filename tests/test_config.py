"""Configuration: validation errors name the key, the three ways to configure agree, shipped YAML is in sync,
LightningCLI applies the sections (real subprocess runs)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis import strategies as st

from lightning_nanguard import ConfigError, NaNGuard, NaNGuardConfig
from lightning_nanguard.report.cli import main as cli_main
from lightning_nanguard.config import EVERYDAY_KEYS, SECTIONS, RecoveryConfig, iter_keys, load_yaml

from .cli_runs import run_cli_cases

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# Hypothesis caches the constants of local modules under <cwd>/.hypothesis while collecting, with or without
# an example database: keep that cache out of the checkout (set here: this module is imported before then).
if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
    set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "lightning_nanguard-hypothesis")


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ bad configs


@pytest.mark.parametrize("text, key, allowed", [
    ("recovery:\n  lr_factr: 0.5\n", "recovery.lr_factr", "did you mean 'recovery.lr_factor'"),
    ("recovry:\n  lr_factor: 0.5\n", "recovry", "did you mean 'recovery'"),
    ("recovery:\n  max_rollbacks: three\n", "recovery.max_rollbacks", "int"),
    ("recovery:\n  max_rollbacks: 2.5\n", "recovery.max_rollbacks", "int"),
    ("check:\n  loss: 'yes please'\n", "check.loss", "bool"),
    ("anomaly:\n  mode: sometimes\n", "anomaly.mode", "'on_incident'"),
    ("recovery:\n  on_give_up: explode\n", "recovery.on_give_up", "'stop' | 'raise'"),
    ("recovery:\n  lr_factor: 1.5\n", "recovery.lr_factor", "(0.0, 1.0)"),
    ("recovery:\n  lr_factor: 0\n", "recovery.lr_factor", "(0.0, 1.0)"),
    ("recovery:\n  max_rollbacks: -1\n", "recovery.max_rollbacks", "[0"),
    ("clip:\n  max_norm: -2.0\n", "clip.max_norm", "(0.0, inf"),
    ("clip:\n  max_norm: .nan\n", "clip.max_norm", "finite"),
    ("check:\n  activations: 0\n", "check.activations", "N >= 1"),
    ("check:\n  activations: often\n", "check.activations", "'always'"),
    ("recovery: 0.5\n", "recovery", "mapping"),
    ("recovery: [lr_factor, 0.5]\n", "recovery", "mapping"),
    ("- recovery\n", "cfg.yaml", "mapping"),
    ("nanguard:\n  recovery:\n    lr_factor: 3\n", "recovery.lr_factor", "(0.0, 1.0)"),
    ("nanguard:\n  clipp: {}\n", "clipp", "did you mean 'clip'"),
    ("clip:\n  max_norm: 1%s\n" % ("0" * 400), "clip.max_norm", "float"),  # beyond the float range
    ("recovery: {lr_factor: 0.5, lr_factor: 0.7}\n", "duplicate key 'lr_factor'", "line 1"),
    ("recovery: {lr_factor: 0.5}\nrecovery: {max_skips: 2}\n", "duplicate key 'recovery'", "line 2"),
])
def test_bad_config_raises_config_error_naming_the_key(tmp_path, text, key, allowed):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        NaNGuard.from_yaml(path)
    message = str(info.value)
    assert key in message and allowed in message, message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("text, where", [
    ("recovery:\n  lr_factor: [0.5\n", "line 3"),
    ("recovery:\n\tlr_factor: 0.5\n", "line 2"),
    ("recovery: {lr_factor: 0.5\n", "line 2, column 1"),
])
def test_malformed_yaml_names_file_and_line(tmp_path, text, where):
    path = write(tmp_path, text, "broken.yaml")
    with pytest.raises(ConfigError, match="malformed YAML") as info:
        NaNGuardConfig.from_yaml(path)
    assert "broken.yaml" in str(info.value) and where in str(info.value)


def test_missing_or_binary_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        NaNGuard.from_yaml(tmp_path / "nope.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ConfigError, match="binary.yaml: cannot read"):
        NaNGuard.from_yaml(binary)


def test_constructor_validates_keyword_sections():
    with pytest.raises(ConfigError, match=r"recovery\.lr_factor"):
        NaNGuard(recovery={"lr_factor": 2.0})
    with pytest.raises(ConfigError, match=r"clip\.max_nrom.*did you mean 'clip\.max_norm'"):
        NaNGuard(clip={"max_nrom": 1.0})
    with pytest.raises(ConfigError, match="check: expected a mapping"):
        NaNGuard(check="always")  # type: ignore[arg-type]



@pytest.mark.parametrize("name", ["a/b", "", "my guard", "1st", "../up", 3])
def test_name_must_be_an_identifier(name):
    """``name`` becomes a folder and a tag prefix: a path separator, a space or a non-string is refused."""
    with pytest.raises(ConfigError, match="name"):
        NaNGuard(name=name)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [None, "b", "student_2"])
def test_identifier_names_are_accepted(name):
    assert NaNGuard(name=name).name == name

# A double-quoted "\U" takes 8 hex digits: 0x10001000 is beyond U+10FFFF, PyYAML raises a plain ValueError.
BAD_ESCAPE = 'recovery:\n  lr_factor: "\\U100010000"\n'
# PyYAML recurses once per nesting level: RecursionError, not YAMLError.
DEEP_LIST = "recovery: " + "[" * 5000 + "]" * 5000 + "\n"
DEEP_MAP = "recovery: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"


@pytest.mark.parametrize("text", [BAD_ESCAPE, DEEP_LIST, DEEP_MAP], ids=["escape", "deep-list", "deep-map"])
def test_any_parse_failure_is_a_one_line_config_error_naming_the_file(tmp_path, text):
    path = write(tmp_path, text, "odd.yaml")
    with pytest.raises(ConfigError) as info:
        NaNGuardConfig.from_yaml(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        NaNGuard.from_yaml(path)


@pytest.mark.parametrize("key", ["anomaly.mode", "check.activations", "check.inputs", "clip.adaptive",
                                 "check.spike_action", "recovery.snapshot"])
def test_unquoted_off_is_refused_with_a_hint_to_quote_it(tmp_path, key):
    """YAML 1.1 reads `off` as false (in LightningCLI too): refused, and the message says what to write."""
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"^{re.escape(key)}: got False.*write 'off' in quotes"):
        NaNGuardConfig.from_yaml(write(tmp_path, f"{section}:\n  {name}: off\n"))
    quoted = NaNGuardConfig.from_yaml(write(tmp_path, f"{section}:\n  {name}: 'off'\n", "quoted.yaml"))
    assert getattr(getattr(quoted, section), name) == "off"


def test_memory_error_while_parsing_is_not_swallowed(tmp_path, monkeypatch):
    """Only errors about the file become ConfigError; running out of memory is not a config problem."""
    path = write(tmp_path, "recovery: {}\n")

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(yaml, "load", out_of_memory)  # no real way to make PyYAML run out of memory
    with pytest.raises(MemoryError):
        load_yaml(path)


def _nested(depth: int, leaf=None, wrap=list):
    value = [] if leaf is None else leaf
    for _ in range(depth):
        value = wrap([value]) if wrap is not dict else {"a": value}
    return value


@pytest.mark.parametrize("kwargs", [
    {"recovery": _nested(5000)},
    {"recovery": {"lr_factor": _nested(5000)}},
    {"check": {"activations": _nested(5000)}},  # a Union type: every arm fails
    {"clip": {"max_norm": _nested(5000, wrap=dict)}},
    {"config": {"anomaly": {"mode": _nested(5000, wrap=tuple)}}},
    {"recovery": {_nested(5000, leaf=(), wrap=tuple): 1}},  # an unknown key that is itself deep
    {"config": {_nested(5000, leaf=(), wrap=tuple): {}}},
], ids=["section", "float", "union", "optional", "literal", "section-key", "top-key"])
def test_constructor_refuses_deeply_nested_values_with_config_error(kwargs):
    with pytest.raises(ConfigError) as info:
        NaNGuard(**kwargs)
    assert "\n" not in str(info.value) and len(str(info.value)) < 1000


# --------------------------------------------------------------------------------- bounds, exactly


def _ranged_keys():
    """``(key, number type, metadata)`` of every field that declares a numeric range."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if meta.get("lo") is None and meta.get("hi") is None:
                continue
            arms = typing.get_args(hints[f.name]) or (hints[f.name],)
            number = float if float in arms else int
            assert number in arms, f"{section}.{f.name}: a range on a non-numeric field"
            yield f"{section}.{f.name}", number, meta


def _inside(value, number, meta) -> bool:
    lo, hi = meta["lo"], meta["hi"]
    return (lo is None or (value > lo if meta["lo_open"] else value >= lo)) and (
        hi is None or (value < hi if meta["hi_open"] else value <= hi))


def _bound_cases():
    """At, just inside and just outside each bound, inf/nan, an int for a float, a bool for a number."""
    cases = []
    for key, number, meta in _ranged_keys():
        lo, hi = meta["lo"], meta["hi"]
        step = (lambda x, d: x + d) if number is int else (lambda x, d: math.nextafter(x, d * math.inf))
        values = []
        for bound, outward in ((lo, -1), (hi, +1)):
            if bound is not None:
                values += [number(bound), step(number(bound), outward), step(number(bound), -outward)]
        if number is float:
            values += [math.inf, -math.inf, math.nan]
            start = math.floor(lo if lo is not None else 0)
            ints = [i for i in (start, start + 1) if _inside(i, number, meta)]
            values += ints[:1]  # an int where a float is wanted: accepted and stored as a float
        for value in values:
            if number is float and math.isinf(value):
                ok = bool(meta.get("inf_ok")) and _inside(value, number, meta)
            else:
                ok = value == value and _inside(value, number, meta)
            cases.append(pytest.param(key, value, ok, number, id=f"{key}={value!r}-{'ok' if ok else 'refused'}"))
        cases.append(pytest.param(key, True, False, number, id=f"{key}=True-refused"))  # bool is not a number
    return cases


@pytest.mark.parametrize("key, value, accepted, number", _bound_cases())
def test_every_ranged_key_is_checked_at_its_bounds(key, value, accepted, number):
    """Generated from the fields' lo/hi metadata: a new ranged key is covered without editing this test."""
    section, name = key.split(".")
    if not accepted:
        with pytest.raises(ConfigError):
            NaNGuardConfig.from_mapping({section: {name: value}})
        with pytest.raises(ConfigError):
            NaNGuard(**{section: {name: value}})
        return
    stored = getattr(getattr(NaNGuard(**{section: {name: value}}).config, section), name)
    assert stored == value and type(stored) is number


def test_every_number_field_declares_a_range():
    """A plain int/float field (optionally null) without lo/hi metadata would escape the generated cases."""
    numeric = set()
    for section, cls in SECTIONS.items():
        for name, tp in typing.get_type_hints(cls).items():
            if set(typing.get_args(tp) or (tp,)) - {type(None)} in ({int}, {float}):
                numeric.add(f"{section}.{name}")
    assert len(numeric) >= 20 and numeric == {key for key, _, _ in _ranged_keys()}, numeric


# The documented ranges, written out by hand so that a wrong range in the metadata is caught (the generated
# cases above follow the metadata). YAML text -> the stored value, or ConfigError. Ranges: CONTRACT.md for
# the contract keys, else the key's meaning (a count of steps/frames/snapshots >= 1, a budget >= 0, a
# factor or decay in (0, 1), a z-score or norm > 0). A finite number is needed wherever inf means nothing:
# `clip.max_norm: .inf` would never clip (null is how fixed clipping is turned off), so it is refused;
# `clip.norm_type: .inf` is the max-norm, accepted.
DOCUMENTED = [
    ("recovery.lr_factor", "0", ConfigError), ("recovery.lr_factor", "0.0", ConfigError),
    ("recovery.lr_factor", "1.0", ConfigError), ("recovery.lr_factor", "1", ConfigError),
    ("recovery.lr_factor", "0.999", 0.999), ("recovery.lr_factor", "1.0e-9", 1e-9),
    ("recovery.lr_factor", "1e-3", 0.001),  # YAML 1.1 reads 1e-3 as a string
    ("recovery.lr_factor", ".inf", ConfigError), ("recovery.lr_factor", ".nan", ConfigError),
    ("recovery.lr_factor", "true", ConfigError), ("recovery.lr_factor", "null", ConfigError),
    ("recovery.max_rollbacks", "0", 0), ("recovery.max_rollbacks", "-1", ConfigError),
    ("recovery.max_rollbacks", "1.0", ConfigError), ("recovery.max_rollbacks", "true", ConfigError),
    ("recovery.max_rollbacks", "1000000", 1000000),
    ("clip.max_norm", "0", ConfigError), ("clip.max_norm", "0.0", ConfigError),
    ("clip.max_norm", "-1.0", ConfigError),
    ("clip.max_norm", "null", None), ("clip.max_norm", "1.0e-6", 1e-6), ("clip.max_norm", "5", 5.0),
    ("clip.max_norm", ".inf", ConfigError), ("clip.max_norm", ".nan", ConfigError),
    ("clip.max_norm", "false", ConfigError),
    ("check.activations", "0", ConfigError), ("check.activations", "-3", ConfigError),
    ("check.activations", "1", 1), ("check.activations", "250", 250), ("check.activations", "'off'", "off"),
    ("check.activations", "on_incident", "on_incident"), ("check.activations", "always", "always"),
    ("check.activations", "2.0", ConfigError), ("check.activations", "true", ConfigError),
    ("check.activations", "off", ConfigError),  # YAML 1.1: unquoted off is false (the message says to quote it)
    ("check.activations", "null", ConfigError), ("check.activations", "sometimes", ConfigError),
    ("anomaly.mode", "'off'", "off"), ("anomaly.mode", "on_incident", "on_incident"),
    ("anomaly.mode", "always", "always"), ("anomaly.mode", "never", ConfigError), ("anomaly.mode", "1", ConfigError),
    ("anomaly.mode", "null", ConfigError), ("anomaly.mode", "Always", ConfigError),
    ("recovery.on_give_up", "stop", "stop"), ("recovery.on_give_up", "raise", "raise"),
    ("recovery.on_give_up", "warn", ConfigError), ("recovery.on_give_up", "null", ConfigError),
    ("clip.ema_alpha", "1.0", ConfigError), ("clip.ema_alpha", "0.0", ConfigError), ("clip.ema_alpha", "0.5", 0.5),
    ("recovery.min_lr_scale", "0", ConfigError), ("recovery.min_lr_scale", "1", 1.0),
    ("recovery.min_lr_scale", "1.0000001", ConfigError), ("recovery.min_lr_scale", "1.0e-12", 1e-12),
    ("recovery.max_skips", "0", ConfigError), ("recovery.max_skips", "1", 1),
    ("recovery.max_skips", "true", ConfigError),
    ("check.spike_z", "0", ConfigError), ("check.spike_z", "0.1", 0.1), ("check.spike_z", ".inf", ConfigError),
    ("check.spike_warmup", "0", ConfigError), ("check.spike_warmup", "1", 1),
    ("check.divergence_growth", "1", ConfigError), ("check.divergence_growth", "1.0", ConfigError),
    ("check.divergence_growth", "1.5", 1.5), ("check.divergence_growth", ".inf", ConfigError),
    ("check.divergence_steps", "1", ConfigError), ("check.divergence_steps", "2", 2),
    ("check.divergence_steps", "2.0", ConfigError),
    ("logging.max_reports", "0", ConfigError), ("logging.max_reports", "1", 1),
    ("logging.max_reports", "1.5", ConfigError), ("logging.max_reports", "true", ConfigError),
    ("logging.flow_window", "-1", ConfigError), ("logging.flow_window", "0", 0),
    ("logging.flow_window", "2.5", ConfigError),
    ("check.divergence_factor", "1.0", ConfigError), ("check.divergence_factor", "10", 10.0),
    ("check.divergence_factor", ".inf", ConfigError),
    ("check.stall_window", "1", ConfigError), ("check.stall_window", "50", 50),
    ("check.stall_progress", "2000", ConfigError), ("check.stall_progress", "-0.5", -0.5),
    ("check.stall_probe_steps", "0", ConfigError), ("check.stall_probe_steps", "20", 20),
    ("check.stall_gain_ratio", "1.0", ConfigError), ("check.stall_gain_ratio", "1.43", 1.43),
    ("check.stall_remaining", "1.5", ConfigError), ("check.stall_remaining", "-0.1", ConfigError),
    ("check.stall_remaining", "0", 0.0), ("check.stall_remaining", "0.6", 0.6),
    ("check.divergence", "'off'", "off"), ("check.divergence", "warn", "warn"), ("check.divergence", "act", "act"),
    ("check.divergence", "rollback", ConfigError),
    ("recovery.divergence_lr_factor", "0", ConfigError), ("recovery.divergence_lr_factor", "1.0", ConfigError),
    ("recovery.divergence_lr_factor", "0.1", 0.1), ("recovery.divergence_lr_factor", "1e-3", 0.001),
    ("check.amp_overflow_patience", "0", ConfigError), ("check.amp_overflow_patience", "1", 1),
    ("check.amp_min_scale", "0", ConfigError), ("check.amp_min_scale", "1.0e-30", 1e-30),
    ("clip.norm_type", "0", ConfigError), ("clip.norm_type", "1", 1.0), ("clip.norm_type", ".inf", math.inf),
    ("clip.norm_type", "-.inf", ConfigError),
    ("clip.z_threshold", "0", ConfigError), ("clip.z_threshold", "0.5", 0.5), ("clip.z_threshold", ".inf", ConfigError),
    ("clip.warmup_steps", "0", ConfigError), ("clip.warmup_steps", "1", 1),
    ("clip.agc_clip_factor", "0", ConfigError), ("clip.agc_clip_factor", "null", None),
    ("clip.agc_clip_factor", "0.01", 0.01), ("clip.agc_clip_factor", ".inf", ConfigError),
    ("anomaly.max_replays", "0", 0), ("anomaly.max_replays", "-1", ConfigError),
    ("anomaly.frames", "0", ConfigError), ("anomaly.frames", "1", 1),
    ("recovery.reduce_lr_after", "0", 0), ("recovery.reduce_lr_after", "-1", ConfigError),
    ("recovery.incident_window", "0", ConfigError), ("recovery.incident_window", "1", 1),
    ("recovery.snapshot_every", "0", ConfigError), ("recovery.snapshot_every", "1", 1),
    ("recovery.keep_snapshots", "0", ConfigError), ("recovery.keep_snapshots", "1", 1),
    ("recovery.confirm_after", "0", ConfigError), ("recovery.confirm_after", "1", 1),
    ("recovery.skip_batches", "0", 0), ("recovery.skip_batches", "-1", ConfigError),
    ("recovery.snapshot", "'off'", "off"), ("recovery.snapshot", "disk", "disk"),
    ("recovery.snapshot", "ram", ConfigError),
    ("check.loss", "false", False), ("check.loss", "0", ConfigError), ("check.loss", "'true'", ConfigError),
    ("check.replica_tolerance", "0", ConfigError), ("check.replica_tolerance", "1.0e-6", 1e-6),
    ("check.replica_tolerance", "1", 1.0), ("check.replica_tolerance", "1.5", ConfigError),
    ("check.replicas", "false", False), ("check.replicas", "'no'", ConfigError),
    ("check.replica_compare", "tolerance", "tolerance"), ("check.replica_compare", "bitwise", ConfigError),
    ("recovery.transient_limit", "0", ConfigError), ("recovery.transient_limit", "1", 1),
    ("recovery.transient_window", "0", ConfigError), ("recovery.transient_window", "1", 1),
    ("recovery.on_suspect_hardware", "raise", "raise"), ("recovery.on_suspect_hardware", "exit", ConfigError),
    ("anomaly.replay_timeout", "0", ConfigError), ("anomaly.replay_timeout", "-1.0", ConfigError),
    ("anomaly.replay_timeout", "0.5", 0.5), ("anomaly.replay_timeout", ".inf", ConfigError),
]


@pytest.mark.parametrize("key, text, expected", DOCUMENTED, ids=[f"{k}={t}" for k, t, _ in DOCUMENTED])
def test_documented_range_of_each_key(tmp_path, key, text, expected):
    section, name = key.split(".")
    path = write(tmp_path, f"{section}:\n  {name}: {text}\n")
    if expected is ConfigError:
        with pytest.raises(ConfigError):
            NaNGuardConfig.from_yaml(path)
        return
    stored = getattr(getattr(NaNGuard.from_yaml(path).config, section), name)
    assert stored == expected and type(stored) is type(expected)


def test_documented_table_names_every_ranged_key():
    """A new ranged key needs a hand-written row too, else only its (possibly wrong) metadata is tested."""
    numeric = {key for key, _, _ in _ranged_keys()} | {"check.activations"}
    assert numeric <= {key for key, _, _ in DOCUMENTED}, sorted(numeric - {key for key, _, _ in DOCUMENTED})


# ----------------------------------------------------------------------------- equal resolutions


def test_sections_config_and_yaml_resolve_to_equal_configs(tmp_path):
    sections = {"recovery": {"lr_factor": 0.25, "max_rollbacks": 5, "on_give_up": "raise"},
                "clip": {"max_norm": 1.0}, "check": {"activations": 10}, "anomaly": {"mode": "always"}}
    by_kwargs = NaNGuard(**sections).config
    by_config = NaNGuard(config=NaNGuardConfig.from_mapping(sections)).config
    by_mapping = NaNGuard(config=sections).config  # type: ignore[arg-type]
    by_dataclass = NaNGuard(recovery=RecoveryConfig(lr_factor=0.25, max_rollbacks=5, on_give_up="raise"),
                            clip={"max_norm": 1.0}, check={"activations": 10}, anomaly={"mode": "always"}).config
    flat = write(tmp_path, yaml.safe_dump(sections), "flat.yaml")
    nested = write(tmp_path, yaml.safe_dump({"nanguard": sections}), "nested.yaml")
    assert by_kwargs == by_config == by_mapping == by_dataclass
    assert by_kwargs == NaNGuard.from_yaml(flat).config == NaNGuard.from_yaml(nested).config
    assert by_kwargs.recovery.lr_factor == 0.25 and by_kwargs.clip.max_norm == 1.0
    assert by_kwargs.logging == NaNGuardConfig().logging  # untouched sections keep their defaults
    # keyword sections override the same section of `config`
    merged = NaNGuard(config=sections, recovery={"lr_factor": 0.5}).config  # type: ignore[arg-type]
    assert merged.recovery.lr_factor == 0.5 and merged.recovery.max_rollbacks == 3
    assert merged.clip.max_norm == 1.0


def test_empty_yaml_is_the_default_config(tmp_path):
    assert NaNGuard.from_yaml(write(tmp_path, "")).config == NaNGuard().config == NaNGuardConfig()


# -------------------------------------------------------------------------- shipped YAML + docs table


def _yaml_default(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_default_yaml_lists_every_key_with_its_code_default_and_a_comment():
    text = (CONFIGS / "default.yaml").read_text()
    raw = yaml.safe_load(text)
    keys = iter_keys()
    listed = [f"{s}.{k}" for s, body in raw.items() for k in body]
    assert listed == [k for k, _, _ in keys], \
        "configs/default.yaml must list every key, in order (python scripts/gen_config_docs.py)"
    for key, default, _ in keys:
        section, name = key.split(".")
        assert raw[section][name] == default, f"{key}: default.yaml has {raw[section][name]!r}, code {default!r}"
    assert NaNGuardConfig.from_yaml(CONFIGS / "default.yaml") == NaNGuardConfig()
    for line in text.splitlines():
        if re.match(r"^\s+\w+:", line):
            assert "# " in line, f"key without a one-line comment in default.yaml: {line!r}"


def test_configuration_docs_list_every_key_with_its_code_default():
    """docs/configuration.md's reference table has one row per key, in order, with the code's default, and
    is exactly what scripts/gen_config_docs.py generates (so a changed help text or range shows too); so are
    configs/default.yaml and docs/events.md's cause row (``--check`` covers every file it writes)."""
    docs = (ROOT / "docs" / "configuration.md").read_text()
    reference = docs.split("\n## Reference\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in reference.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [key for key, _, _ in iter_keys()], \
        "docs/configuration.md must list every key, in order (python scripts/gen_config_docs.py)"
    for row, (key, default, _) in zip(rows, iter_keys()):
        assert row.split(" | ")[1] == f"`{_yaml_default(default)}`", \
            f"docs default of {key} differs from the code: {row}"
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_events_docs_list_every_cause_of_the_cause_table():
    """docs/events.md's ``cause`` row names every cause of lightning_nanguard/core/causes.py, in the table's order,
    with its meaning: it is generated (scripts/gen_config_docs.py, checked above), so a new cause shows there."""
    from lightning_nanguard.core.causes import CAUSES

    row, = [line for line in (ROOT / "docs" / "events.md").read_text().splitlines() if line.startswith("| `cause` |")]
    assert re.findall(r"<br>`(\w+)`: ", row) == list(CAUSES), \
        "docs/events.md must list every cause, in order (python scripts/gen_config_docs.py)"
    assert row == _gen_config_docs().cause_row()


def _declared() -> list[str]:
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def test_every_key_is_everyday_or_advanced_exactly_once():
    """EVERYDAY_KEYS names real keys, each once; every other key is advanced; iter_keys lists each key once, a
    section's everyday keys before its advanced ones (each tier in declaration order)."""
    declared = _declared()
    assert len(set(EVERYDAY_KEYS)) == len(EVERYDAY_KEYS), "a key listed twice in EVERYDAY_KEYS"
    assert [k for k in EVERYDAY_KEYS if k not in declared] == [], "EVERYDAY_KEYS names a key that does not exist"
    advanced = [k for k in declared if k not in EVERYDAY_KEYS]
    assert sorted(list(EVERYDAY_KEYS) + advanced) == sorted(declared) and len(advanced) > 0
    expected = [k for name in SECTIONS for tier in ([k for k in declared if k in EVERYDAY_KEYS], advanced)
                for k in tier if k.split(".")[0] == name]
    assert [k for k, _, _ in iter_keys()] == expected
    # every section starts with keys users set; the keys the public contract names are among them
    assert {k.split(".")[0] for k in EVERYDAY_KEYS} == set(SECTIONS)
    assert {"check.activations", "clip.max_norm", "anomaly.mode", "recovery.lr_factor", "recovery.max_rollbacks",
            "recovery.on_give_up"} <= set(EVERYDAY_KEYS)


def test_default_yaml_and_docs_list_everyday_keys_before_advanced_ones():
    """configs/default.yaml lists every everyday key of a section before its first advanced key, with the
    advanced ones after one divider comment, as flat keys of the same section; the reference of
    docs/configuration.md puts them in a table of their own under a sub-heading."""
    lines = (CONFIGS / "default.yaml").read_text().splitlines()
    section, seen, divider = "", {}, {}
    for line in lines:
        top = re.match(r"^(\w+):", line)
        key = re.match(r"^  (\w+):", line)
        if top:
            section = top.group(1)
            seen[section] = []
        elif key:
            seen[section].append(f"{section}.{key.group(1)}")
        elif line.strip().startswith("# --- advanced"):
            assert section not in divider, f"two advanced dividers in {section}"
            divider[section] = len(seen[section])
    for name, keys in seen.items():
        everyday = [k for k in keys if k in EVERYDAY_KEYS]
        assert everyday and keys[:len(everyday)] == everyday, f"default.yaml: an advanced key of {name} comes first"
        assert divider.get(name, len(keys)) == len(everyday), f"default.yaml: the divider of {name} is misplaced"
    docs = (ROOT / "docs" / "configuration.md").read_text()
    reference = docs.split("\n## Reference\n", 1)[1].split("\n## ", 1)[0]
    for name in SECTIONS:
        body = reference.split(f"\n### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        everyday, _, advanced = body.partition(f"\n#### `{name}`: advanced\n")
        rows = [[line.split("`")[1] for line in part.splitlines() if line.startswith("| `")]
                for part in (everyday, advanced)]
        declared = [k for k in _declared() if k.split(".")[0] == name]
        assert rows[0] == [k for k in declared if k in EVERYDAY_KEYS]
        assert rows[1] == [k for k in declared if k not in EVERYDAY_KEYS]


def _gen_config_docs():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _numeric(node: ast.expr) -> bool:
    """A number, arithmetic on numbers, or a non-empty tuple, list or dict (values) of numbers."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(_numeric(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.values) and all(_numeric(v) for v in node.values)
    return False


def test_every_numeric_module_constant_is_a_documented_threshold_or_named_as_not_one():
    """Every module-level UPPER_CASE numeric constant of the package is either in the Constants table of
    docs/configuration.md (name, the value imported from its module, the module) or in the generator's
    NOT_THRESHOLDS, never both: a new threshold cannot hide in the code."""
    gen = _gen_config_docs()
    found = set()
    for path in sorted((ROOT / "lightning_nanguard").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            found |= {f"{module}.{t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id.lstrip("_").isupper() and _numeric(value)}
    documented = [f"{module}.{name}" for module, name, _, _ in gen.CONSTANTS]
    assert len(set(documented)) == len(documented)
    assert set(documented).isdisjoint(gen.NOT_THRESHOLDS)
    assert sorted(found) == sorted(documented + list(gen.NOT_THRESHOLDS)), \
        "classify each constant in scripts/gen_config_docs.py (CONSTANTS or NOT_THRESHOLDS), then run it"
    assert "lightning_nanguard.respond.incident.SPIKES_BEFORE_LR_CUT" in documented and len(documented) >= 16
    docs = (ROOT / "docs" / "configuration.md").read_text()
    table = docs.split("\n## Constants\n", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (f"| `{name}`", f"`{gen.constant_value(getattr(importlib.import_module(module), name))}`",
         f"`{module.replace('.', '/')}.py`") for module, name, _, _ in gen.CONSTANTS]
    assert all(len(row) == 5 and all(cell.strip(" |") for cell in row) for row in rows)


@pytest.mark.parametrize("name", ["default", "debug", "pretraining", "finetune"])
def test_presets_are_valid(name):
    """Every key a preset writes is applied as written (nothing dropped), and the preset is what it says."""
    config = NaNGuard.from_yaml(CONFIGS / f"{name}.yaml").config
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    raw = raw.get("nanguard", raw)
    written = [(section, key, value) for section, body in raw.items() for key, value in body.items()]
    assert len(written) >= 10
    for section, key, value in written:
        assert getattr(getattr(config, section), key) == value, f"{name}.yaml {section}.{key}"
    if name == "debug":
        assert config.check.activations == "always" and config.anomaly.mode == "always"
    if name == "pretraining":
        assert config.recovery.snapshot != "off" and config.recovery.skip_batches > 0
        assert config.clip.adaptive == "always"
    if name == "finetune":
        assert config.recovery.lr_factor > NaNGuardConfig().recovery.lr_factor


# ------------------------------------------------------------------------------------ hypothesis

_known = sorted({k.split(".")[1] for k, _, _ in iter_keys()})
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.just(10**400), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["off", "on_incident", "always", "stop", "raise", "memory", "disk", "warn", "1e-3", "x"]),
    st.text(max_size=8),
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_section_body = st.one_of(
    st.dictionaries(st.sampled_from(_known) | st.text(max_size=10), _values, max_size=5), _values)
_document = st.dictionaries(st.sampled_from(sorted(SECTIONS)) | st.text(max_size=8), _section_body, max_size=5)
_yaml_text = st.one_of(
    _document.map(lambda d: yaml.safe_dump(d)),
    _document.map(lambda d: yaml.safe_dump({"nanguard": d})),
    st.tuples(_document.map(yaml.safe_dump), st.text(max_size=12), st.integers(0, 200)).map(
        lambda t: t[0][:t[2]] + t[1] + t[0][t[2]:]),  # garbled YAML
)


# derandomize: the same 250 examples on every run (CI never fails at random); database=None: nothing is
# written to .hypothesis/. The two explicit examples are the inputs that once escaped as ValueError and
# RecursionError with a traceback.
@pytest.mark.slow
@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=_yaml_text)
@example(text=BAD_ESCAPE)
@example(text=DEEP_LIST)
def test_generated_yaml_gives_a_valid_config_or_config_error(tmp_path, text):
    path = tmp_path / "generated.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        data = load_yaml(path)
    except ConfigError as error:  # parsed once: the 5,000-deep example costs a second per parse
        assert str(error).startswith(f"{path}: ") and "\n" not in str(error)
        return
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli_main(["validate", str(path)])
    try:
        config = NaNGuardConfig.from_mapping(data, where=str(path))  # what from_yaml does after load_yaml
    except ConfigError as error:
        assert str(error) and "\n" not in str(error)
        if not (isinstance(data, dict) and "trainer" in data):  # else validate reads a LightningCLI config
            assert code == 2 and out.getvalue() == "", out.getvalue()
            assert err.getvalue() == f"nanguard validate: error: {error}\n"
        return
    # a config that validated is complete and typed, the callback accepts it unchanged, validate prints it
    assert NaNGuard(config=config).config == config
    assert code == 0 and yaml.safe_load(out.getvalue()) == config.to_dict(), err.getvalue()
    assert NaNGuardConfig.from_mapping(config.to_dict()) == config
    for key, _, _ in iter_keys():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        assert not (isinstance(value, float) and math.isnan(value)), key
        assert not (isinstance(value, float) and math.isinf(value)) or key == "clip.norm_type", key


# ---------------------------------------------------------------------------------- LightningCLI

_SETUP = r"""
sys.path.insert(0, EXAMPLES_HERE)
import cli_example
from cli_example import RegressionData, RegressionModel
from pytorch_lightning.cli import LightningCLI
"""

_CASE = """
if name == "fit":  # the example script itself, as `python examples/cli_example.py fit ...`
    sys.argv = ["cli_example.py", *args]
    cli_example.main()
else:
    cli = LightningCLI(RegressionModel, RegressionData, args=args, run=False)
    guard = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "NaNGuard")
    out["config"] = guard.config.to_dict()
"""

_INVALID = {
    "range": ("recovery.lr_factor=1.5", "recovery.lr_factor: got 1.5"),  # ConfigError from the dataclass
    "literal": ("recovery.on_give_up=explode", "on_give_up"),  # jsonargparse's own type check
    "type": ("recovery.max_rollbacks=many", "max_rollbacks"),
    "unknown": ("recovery.lr_factr=0.3", "lr_factr"),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    base = ["--config", str(CONFIGS / "lightning_cli.yaml"), f"--trainer.default_root_dir={tmp}"]
    cases = {"override": base + ["--trainer.callbacks.init_args.recovery.max_rollbacks=7"],
             "fit": ["fit", *base, f"--trainer.default_root_dir={tmp / 'fit'}", "--trainer.logger=false"]}
    cases.update({name: base + [f"--trainer.callbacks.init_args.{arg}"] for name, (arg, _) in _INVALID.items()})
    return tmp, run_cli_cases(tmp, _SETUP.replace("EXAMPLES_HERE", repr(str(ROOT / "examples"))), _CASE, cases)


def _nanguard_init_args() -> dict:
    cli = yaml.safe_load((CONFIGS / "lightning_cli.yaml").read_text())
    (entry,) = [c for c in cli["trainer"]["callbacks"] if c["class_path"] == "lightning_nanguard.NaNGuard"]
    return entry["init_args"]


@pytest.mark.slow  # a LightningCLI subprocess (torch import, a short fit)
def test_lightning_cli_applies_init_args_and_dotted_overrides(cli_runs):
    _, runs = cli_runs
    run = runs["override"]
    assert run["exit"] == 0, run["stderr"][-3000:]
    config = run["config"]
    expected = NaNGuardConfig.from_mapping(_nanguard_init_args()).to_dict()
    assert config["recovery"]["max_rollbacks"] == 7 != expected["recovery"]["max_rollbacks"]  # the override
    expected["recovery"]["max_rollbacks"] = 7
    assert config == expected  # every other init_arg from the YAML, defaults elsewhere
    assert config["recovery"]["lr_factor"] != NaNGuardConfig().recovery.lr_factor


@pytest.mark.slow  # a LightningCLI subprocess (torch import, a short fit)
@pytest.mark.parametrize("case", sorted(_INVALID))
def test_lightning_cli_rejects_an_invalid_value_naming_it(cli_runs, case):
    run = cli_runs[1][case]
    assert run["exit"] != 0 and run["config"] is None
    assert _INVALID[case][1] in run["stderr"], run["stderr"][-3000:]


@pytest.mark.slow  # a LightningCLI subprocess (torch import, a short fit)
def test_lightning_cli_example_fits_with_the_shipped_config(cli_runs):
    tmp, runs = cli_runs
    assert runs["fit"]["exit"] == 0, runs["fit"]["stderr"][-3000:]
    events = [json.loads(line) for line in (tmp / "fit" / "nanguard" / "events.jsonl").read_text().splitlines()]
    nan_batches = yaml.safe_load((CONFIGS / "lightning_cli.yaml").read_text())["data"]["nan_batches"]
    assert [e["step"] for e in events] == nan_batches
    assert all(e["kind"] == "input" and e["actions"][0] == "skip_step" for e in events)


def test_load_yaml_returns_plain_data(tmp_path):
    assert load_yaml(write(tmp_path, "a: 1\n")) == {"a": 1}
