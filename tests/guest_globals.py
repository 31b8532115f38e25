"""What a good guest must leave as it found it (tests/test_good_guest.py): the globals of Lightning,
lightning_utilities, logging and warnings, and torch's global settings.

:func:`snapshot` takes them (plain data, JSON-able, so a subprocess can print it); :func:`changed` names what
differs between two snapshots. Module globals are compared by identity for every module of those packages that
was loaded at the first snapshot (a rebinding such as ``lightning_utilities.core.rank_zero.log = ...`` shows);
submodules imported in between are not a change. The warnings module is compared by content (its filters, the
names of its hooks).
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
from typing import Any

PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics", "logging")


def _torch_settings() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    backends = torch.backends
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "num_threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn": (backends.cudnn.enabled, backends.cudnn.benchmark, backends.cudnn.deterministic,
                  backends.cudnn.allow_tf32),
        "cuda_matmul_tf32": backends.cuda.matmul.allow_tf32,
        "autocast": (torch.is_autocast_enabled("cpu"),),
    }


def _loggers() -> dict[str, Any]:
    manager = logging.root.manager
    found = {"": logging.root, **{n: lg for n, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}}
    return {name: [lg.level, [id(h) for h in lg.handlers], lg.propagate, lg.disabled] for name, lg in found.items()}


def _module_globals() -> dict[str, dict[str, int]]:
    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] not in PACKAGES:
            continue
        out[name] = {k: id(v) for k, v in vars(module).items() if not isinstance(v, types.ModuleType)}
    return out


def snapshot() -> dict[str, Any]:
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    return {
        "modules": _module_globals(),
        "loggers": _loggers(),
        # by content: warnings.catch_warnings swaps in a new list and hooks of the same kind each time
        "warnings": [repr(f) for f in warnings.filters] + [
            getattr(f, "__qualname__", repr(f)) for f in (warnings.showwarning, warnings.formatwarning,
                                                          getattr(warnings, "_showwarnmsg_impl", None))],
        "torch": _torch_settings(),
        "rank_zero": None if rank_zero is None else [rank_zero.log.name,
                                                     rank_zero.rank_zero_deprecation_category.__module__,
                                                     getattr(rank_zero.rank_zero_only, "rank", None)],
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What ``after`` changed of ``before`` (new modules and new loggers are not changes)."""
    diffs = []
    for name, old in before["modules"].items():
        new = after["modules"].get(name, {})
        diffs += [f"{name}.{k}" for k, v in old.items() if new.get(k) != v]
    for name, old in before["loggers"].items():
        if after["loggers"].get(name) != old:
            diffs.append(f"logger {name!r}: {old} -> {after['loggers'].get(name)}")
    for key in ("warnings", "torch", "rank_zero"):
        if before[key] != after[key]:
            diffs.append(f"{key}: {before[key]} -> {after[key]}")
    return diffs
