"""Incident diagnosis on a CUDA device, as one short script (run it where a GPU is lent).

1. Backward singularity (tests/test_diagnosis.py's PaddedNorm) on ``accelerator="gpu"``: culprit, op and cause
   as on CPU, and the replay does not change training (CUDA RNG and buffers restored): weights identical with
   ``anomaly.mode`` on_incident vs off.
2. The seed case (graph autoencoder, one feature column ~1e18) under 32-true and bf16-mixed: the replay runs in
   the precision plugin's autocast context; the culprit module, the cause and the working dtype it reports.
3. ``check.activations: always`` on CUDA (the fused inf-norm flag): the unused NaN branch is caught.

    python benchmarks/gpu_diagnosis.py        # prints one line per check; exit 1 if a check fails
    NANGUARD_ACCELERATOR=cpu python benchmarks/gpu_diagnosis.py   # the same checks on CPU
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests import test_detection  # noqa: E402
from tests import test_diagnosis as T  # noqa: E402
from lightning_nanguard import NaNGuard  # noqa: E402
from tests.models import loader, regression_data  # noqa: E402

FAILED = []


def check(name: str, ok: bool, info: object) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {info}", flush=True)
    if not ok:
        FAILED.append(name)


def trainer(**kwargs: object) -> pl.Trainer:
    args = dict(accelerator=os.environ.get("NANGUARD_ACCELERATOR", "gpu"), devices=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tempfile.mkdtemp())
    args.update(kwargs)
    return pl.Trainer(**args)


def main() -> None:
    weights = {}
    for mode in ("on_incident", "off"):
        pl.seed_everything(0, verbose=False)
        guard, model = NaNGuard(anomaly={"mode": mode}), T.PaddedNorm()
        data = loader(T._padded_data(), batch_size=32, shuffle=True)
        trainer(callbacks=[guard], max_epochs=2, deterministic=True).fit(model, data)
        events = [(e.kind, e.culprit, e.op, e.cause) for e in guard.events]
        if mode == "on_incident":
            check("backward singularity on cuda", events[:1] == [("gradient", "rownorm", "SqrtBackward0",
                                                                    "backward_op")], events)
        weights[mode] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    same = all(torch.equal(weights["on_incident"][k], weights["off"][k]) for k in weights["off"])
    check("replay leaves cuda training unchanged", same, same)

    nodes, features = 2708, 64
    g = torch.Generator().manual_seed(0)
    x = torch.rand(nodes, features, generator=g)
    x[:, 7] = 1e18 * (1 + torch.rand(nodes, generator=g))
    adj = (torch.rand(nodes, nodes, generator=g) < 0.002).float() + torch.eye(nodes)
    adj = adj / adj.sum(1, keepdim=True)
    for precision in ("32-true", "bf16-mixed"):
        guard = NaNGuard(recovery={"max_skips": 1, "max_rollbacks": 1}, anomaly={"max_replays": 2})
        t = trainer(callbacks=[guard], max_steps=50, max_epochs=50, precision=precision)
        t.fit(T.GraphAutoencoder(features), DataLoader(TensorDataset(adj[None], x[None]), batch_size=1))
        e = guard.events[0]
        info = (e.kind, e.culprit, e.op, e.cause, e.details.get("dtype"), e.details.get("abs_max_float64"),
                len(guard.events), t.global_step, guard.events[-1].actions, e.details["replay"].get("errors"))
        check(f"seed case {precision}", e.culprit == "decoder.features" and e.cause in ("overflow", "precision")
              and t.global_step < 10, info)

    guard, model = NaNGuard(check={"activations": "always"}), test_detection.SideBranch()
    with torch.no_grad():
        model.aux[0].bias.fill_(-100.0)
    trainer(callbacks=[guard], max_steps=4).fit(model, loader(regression_data(128, 8), batch_size=32))
    e = guard.events[0] if guard.events else None
    check("activation flag on cuda", e is not None and (e.kind, e.culprit, e.op) == ("activation", "aux.1",
                                                                                     "LogBackward0"),
          e and (e.kind, e.culprit, e.op))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
