"""Configuration: validation errors name the key, the three ways to configure agree, shipped YAML is in sync,
LightningCLI applies the sections (real subprocess runs)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_nanguard import ConfigError, NaNGuard, NaNGuardConfig
from lightning_nanguard.config import SECTIONS, RecoveryConfig, iter_keys, load_yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


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
    ("recovery: {lr_factor: 0.5\n", "line"),
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


# ------------------------------------------------------------------------------ shipped YAML + README


def _yaml_default(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_default_yaml_lists_every_key_with_its_code_default_and_a_comment():
    text = (CONFIGS / "default.yaml").read_text()
    raw = yaml.safe_load(text)
    keys = iter_keys()
    listed = [f"{s}.{k}" for s, body in raw.items() for k in body]
    assert listed == [k for k, _, _ in keys], "configs/default.yaml must list every key, in order (python scripts/gen_config_docs.py)"
    for key, default, _ in keys:
        section, name = key.split(".")
        assert raw[section][name] == default, f"{key}: default.yaml has {raw[section][name]!r}, code {default!r}"
    assert NaNGuardConfig.from_yaml(CONFIGS / "default.yaml") == NaNGuardConfig()
    for line in text.splitlines():
        if re.match(r"^\s+\w+:", line):
            assert "# " in line, f"key without a one-line comment in default.yaml: {line!r}"


def test_readme_configuration_reference_lists_every_key_and_default():
    readme = (ROOT / "README.md").read_text()
    assert "## Configuration reference" in readme
    reference = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    for key, default, _ in iter_keys():
        row = next((line for line in reference.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"README configuration reference misses {key} (python scripts/gen_config_docs.py)"
        assert f"`{_yaml_default(default)}`" in row, f"README default of {key} differs from the code: {row}"


@pytest.mark.parametrize("name", ["default", "debug", "pretraining", "finetune"])
def test_presets_are_valid(name):
    config = NaNGuard.from_yaml(CONFIGS / f"{name}.yaml").config
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


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_yaml_text)
def test_generated_yaml_gives_a_valid_config_or_config_error(tmp_path, text):
    path = tmp_path / "generated.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        config = NaNGuardConfig.from_yaml(path)
    except ConfigError as err:
        assert str(err)
        return
    # a config that validated is complete and typed, and the callback accepts it unchanged
    assert NaNGuard(config=config).config == config
    for key, _, _ in iter_keys():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        assert not (isinstance(value, float) and math.isnan(value)), key


# ---------------------------------------------------------------------------------- LightningCLI

# One interpreter (a real LightningCLI, as a user runs it) for every case: starting torch and Lightning
# costs seconds per process. Each case parses its own argv; errors are captured per case.
_DRIVER = r"""
import contextlib, io, json, sys, traceback
sys.path.insert(0, {examples!r})
import cli_example
from cli_example import RegressionData, RegressionModel
from pytorch_lightning.cli import LightningCLI

def guard_config(cli):
    guard = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "NaNGuard")
    return guard.config.to_dict()

results = {{}}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    out = {{"exit": 0, "config": None}}
    try:
        with contextlib.redirect_stderr(err):
            if name == "fit":  # the example script itself, as `python examples/cli_example.py fit ...`
                sys.argv = ["cli_example.py", *argv]
                cli_example.main()
            else:
                out["config"] = guard_config(LightningCLI(RegressionModel, RegressionData, args=argv, run=False))
    except SystemExit as exc:
        out["exit"] = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        out["exit"] = 1
        err.write(traceback.format_exc())
    out["stderr"] = err.getvalue()
    results[name] = out
print("RESULTS=" + json.dumps(results))
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
    driver = write(tmp, _DRIVER.format(examples=str(ROOT / "examples")), "driver.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, str(driver), json.dumps(cases)], cwd=tmp, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "RESULTS=" in result.stdout, result.stderr[-3000:]
    return tmp, json.loads(result.stdout.split("RESULTS=", 1)[1].splitlines()[0])


def _nanguard_init_args() -> dict:
    cli = yaml.safe_load((CONFIGS / "lightning_cli.yaml").read_text())
    (entry,) = [c for c in cli["trainer"]["callbacks"] if c["class_path"] == "lightning_nanguard.NaNGuard"]
    return entry["init_args"]


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


@pytest.mark.parametrize("case", sorted(_INVALID))
def test_lightning_cli_rejects_an_invalid_value_naming_it(cli_runs, case):
    run = cli_runs[1][case]
    assert run["exit"] != 0 and run["config"] is None
    assert _INVALID[case][1] in run["stderr"], run["stderr"][-3000:]


def test_lightning_cli_example_fits_with_the_shipped_config(cli_runs):
    tmp, runs = cli_runs
    assert runs["fit"]["exit"] == 0, runs["fit"]["stderr"][-3000:]
    events = [json.loads(line) for line in (tmp / "fit" / "nanguard" / "events.jsonl").read_text().splitlines()]
    nan_batches = yaml.safe_load((CONFIGS / "lightning_cli.yaml").read_text())["data"]["nan_batches"]
    assert [e["step"] for e in events] == nan_batches
    assert all(e["kind"] == "input" and e["actions"][0] == "skip_step" for e in events)


def test_load_yaml_returns_plain_data(tmp_path):
    assert load_yaml(write(tmp_path, "a: 1\n")) == {"a": 1}
