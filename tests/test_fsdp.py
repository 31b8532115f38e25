"""Real ModelParallelStrategy runs on the CPU (gloo, 2 and 4 ranks): FSDP2 (``fully_shard``) and tensor parallel
(``parallelize_module``), whose parameters, gradients and optimizer states are DTensors.

One spawn (tests/ddp_scripts/fsdp_guard.py, both layouts, ~40 s on 2 cores) runs, per layout: the fit without and
with the guard, one with a fault of each ``FaultInjector`` kind, one with faults on rank 1 only, a NaN made by one
rank's backward, a clipped fit against ``torch.nn.utils.clip_grad_norm_``; under FSDP2 also lagged reads (a fused
AdamW, an SGD) and a checkpoint saved under the guard and resumed. A second spawn of 4 processes runs FSDP2 on top
of tensor parallel (2 x 2 mesh). Every rank must finish: a hang (ranks waiting on each other's collectives) fails
at the subprocess timeout.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_nanguard.detect.ranks import local_norm_power
from lightning_nanguard.core.dtensors import is_dtensor, local, norm_share

from .ranks import launch, per_step

SCRIPT = Path(__file__).parent / "ddp_scripts" / "fsdp_guard.py"
LAYOUTS = ("fsdp", "tp")


@pytest.fixture(scope="module")
def sharded_fits(tmp_path_factory):
    """``{layout: [rank 0's fits, rank 1's fits]}`` and the output folder: one spawn of 2 processes, as torchrun
    would launch them."""
    out = tmp_path_factory.mktemp("fsdp")
    ranks = [saved["fits"] for saved in launch(SCRIPT, out, 2, *LAYOUTS, timeout=420)]
    return {layout: [ranks[0][layout], ranks[1][layout]] for layout in LAYOUTS}, out


@pytest.fixture(scope="module")
def two_d_fits(tmp_path_factory):
    """Rank 0..3's fits of FSDP2 + tensor parallel on a 2 x 2 mesh: one spawn of 4 processes (~35 s on 2 cores)."""
    out = tmp_path_factory.mktemp("fsdp2d")
    return [saved["fits"]["2d"] for saved in launch(SCRIPT, out, 4, "2d", timeout=420)]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def same_state(a: dict, b: dict) -> bool:
    """Full weights, Adam moments and step counts bitwise equal."""
    return same(a["weights"], b["weights"]) and a["optimizer"].keys() == b["optimizer"].keys() and all(
        same(a["optimizer"][i], b["optimizer"][i]) for i in a["optimizer"])


def summary(fit: dict) -> list[tuple]:
    return [(e["step"], e["kind"], e["cause"], e["actions"], e["rank"], e["culprit"], e["details"].get("ranks"))
            for e in fit["events"]]


def finite(fit: dict) -> bool:
    return all(torch.isfinite(v).all() for v in fit["state"].values()) and all(
        torch.isfinite(v).all() for s in fit["optimizer"].values() for v in s.values())


def state_after(fit: dict, global_step: int) -> dict:
    """The full state as the batch that made ``trainer.global_step == global_step`` left it."""
    return next(r["state"] for r in fit["steps"] if r["step"] + 1 == global_step)


# ------------------------------------------------------------------------------------------- real runs


@pytest.mark.slow  # one spawn of 2 processes, ~45 s on 2 cores
@pytest.mark.ddp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_healthy_sharded_fit_is_bitwise_the_unguarded_one_for_one_small_all_reduce_per_step(sharded_fits, layout):
    """Zero events; the full weights (``full_tensor()``) and optimizer state bitwise those of the fit without the
    guard. Per step the guard issues one all-reduce (its evidence vector) and one host read; a snapshot step adds
    the agreement that the weights and optimizer states are finite (one all-reduce of 4 numbers)."""
    fits, _ = sharded_fits
    for rank in fits[layout]:
        healthy, plain = rank["healthy"], rank["plain"]
        assert healthy["events"] == [] and healthy["counters"]["incidents"] == 0
        assert healthy["counters"]["snapshots"] > 0
        assert same(healthy["state"], plain["state"]) and healthy["optimizer"].keys() == plain["optimizer"].keys()
        assert all(same(healthy["optimizer"][i], plain["optimizer"][i]) for i in plain["optimizer"])
        rows = per_step(healthy)
        assert len(rows) == 19 and 0 < sum(s for *_, s in rows) < len(rows)
        size = rows[0][1][0][1]  # the evidence vector's length
        for step, calls, reads, snapshot in rows:
            assert calls == [("all_reduce", size)] + [("all_reduce", 4)] * snapshot, (step, calls)
            assert reads.count("tolist") == 1 + snapshot, (step, reads)
        assert all(reads == ["tolist"] for _, _, reads, snapshot in rows if not snapshot)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_fault_kind_under_sharding_is_handled_alike_on_every_rank(sharded_fits, layout):
    """An input (step 3), a module output (6), a gradient element on rank 1 only (9), a weight after the update
    (12) and an Adam ``exp_avg_sq`` element (16): every rank records the same events, the step is skipped as under
    DDP; the bad weights of steps 12 and 16 are found on the next step and rolled back, bitwise, to the snapshot's
    weights and optimizer state; the gradient fault names rank 1, whose shard held it; the final state is finite."""
    fits, _ = sharded_fits
    r0, r1 = (rank["faults"] for rank in fits[layout])
    assert summary(r0) == summary(r1)
    assert [(s, k, c, a) for s, k, c, a, *_ in summary(r0)] == [
        (3, "input", "input", ["skip_step"]), (6, "loss", "unknown", ["skip_step", "clip"]),
        (9, "gradient", "transient", ["skip_step"]), (13, "parameter", "optimizer", ["skip_step", "rollback"]),
        (17, "parameter", "optimizer", ["skip_step", "rollback"])]
    assert all(applied for _, _, _, applied in r0["injected"] + r1["injected"])
    assert len(r1["injected"]) == len(r0["injected"]) + 1  # the gradient fault: rank 1's only
    events = r0["events"]
    assert events[0]["details"]["inputs"][0]["samples"] and events[1]["culprit"] == "net.0"
    assert (events[2]["rank"], events[2]["details"]["ranks"]) == (1, [1])  # its own shard of the gradient
    assert not events[2]["details"]["replay"]["reproduced"]
    assert "sharded" in events[1]["details"]["replay"]  # the replay ran in lockstep, every rank together, and says so
    for fit in (r0, r1):
        for event in fit["events"][3:]:
            restored = event["details"]["restored_step"]
            assert same_state(state_after(fit, event["step"] + 1), state_after(fit, restored)), event["step"]
        assert finite(fit) and fit["global_step"] == 20
    assert r0["counters"] == r1["counters"] and r0["counters"]["rollbacks"] == 2


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_faults_on_one_rank_only_are_named_from_that_rank_and_replayed_by_all_or_none(sharded_fits, layout):
    """On rank 1 only: an input (step 3), a module output (7) and a weight (11). The ranks' diagnoses differ (only
    rank 1 sees its input or its shard of the weights; a replay is a collective both make or neither), yet both
    finish, record the same events and name rank 1 for the input, the module output and the weight."""
    fits, _ = sharded_fits
    r0, r1 = (rank["one_rank"] for rank in fits[layout])
    assert summary(r0) == summary(r1)
    events = r0["events"]
    assert [e["step"] for e in events] == [3, 7, 12]
    # the bad input is rank 1's own (under tensor parallel the row-wise layer's all-reduce makes rank 0's loss NaN
    # too: its flag is listed, but a rank's own bad batch outranks a flag)
    assert (events[0]["kind"], events[0]["cause"], events[0]["rank"]) == ("input", "input", 1)
    assert events[0]["details"]["ranks"] == ([1] if layout == "fsdp" else [0, 1])
    # the module output: rank 1's own replay made it (under tensor parallel rank 0 received it through the all-reduce)
    assert (events[1]["rank"], events[1]["culprit"], events[1]["details"]["ranks"]) == (1, "net.0", [1])
    assert (events[2]["kind"], events[2]["cause"], events[2]["rank"]) == ("parameter", "optimizer", 1)
    assert events[2]["culprit"] == "net.0.weight" and "rollback" in events[2]["actions"]
    assert r0["counters"] == r1["counters"] and r0["counters"]["replays"] == 1  # the module output's, on both
    for fit in (r0, r1):
        assert same_state(state_after(fit, 13), state_after(fit, events[2]["details"]["restored_step"]))
        assert finite(fit)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_made_by_one_ranks_backward_is_reproduced_by_the_lockstep_replay(sharded_fits, layout):
    """Rank 1's backward makes the gradient NaN at steps 4 and 5 (the last): the replay, every rank's forward and
    backward together (under FSDP2 a real backward: ``autograd.grad`` sees no gradient of the sharded parameters),
    reproduces it, so the cause is not ``transient`` (which would skip the step and do nothing else)."""
    fits, _ = sharded_fits
    r0, r1 = (rank["backward"] for rank in fits[layout])
    assert summary(r0) == summary(r1)
    event = r0["events"][0]
    assert (event["step"], event["kind"]) == (4, "gradient") and event["cause"] != "transient"
    assert event["details"]["replay"]["reproduced"] and event["details"]["replay"]["nonfinite_grads"]
    # the fit ends inside the streak (step 5, the last): its end-of-fit check runs on every rank alike
    assert [e["step"] for e in r0["events"]] == [4, 5] and r0["global_step"] == 6
    assert finite(r0) and finite(r1)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("layout", LAYOUTS)
def test_clipping_dtensor_gradients_matches_torch_clip_grad_norm(sharded_fits, layout):
    """``clip.max_norm`` on sharded gradients (FSDP2: all in dim 0; tensor parallel: in dim 0 or 1, the last bias
    replicated and counted once) leaves them as ``torch.nn.utils.clip_grad_norm_`` on the same
    DTensors does, to within the rounding of the norm (every step clipped: the norm of these gradients is far above
    the limit). Not bitwise: torch reduces each gradient's norm over the ranks, the guard the sum of their powers
    (one number in the step's one all-reduce); the coefficients differ in the last bit at most."""
    fits, _ = sharded_fits
    for rank in fits[layout]:
        clip = rank["clip"]
        assert clip["counters"]["clipped_steps"] == 3 and len(clip["torch_grads"]) == 3
        assert all(n > 0.05 for n in clip["torch_norms"])
        for theirs, ours in zip(clip["torch_grads"], clip["guard_grads"]):
            assert len(theirs) == len(ours) == 4
            assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(theirs, ours))


@pytest.mark.slow
@pytest.mark.ddp
def test_a_sharded_checkpoint_never_holds_a_nan_and_resumes(sharded_fits):
    """A weight made NaN on rank 1 only just before a checkpoint (step 10) is found by every rank (one all-reduce),
    rolled back on both, and the checkpoint written from the restored shards; a fit resumed from it runs to the
    end without an incident."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fits, out = sharded_fits
    r0, r1 = (rank["ckpt"] for rank in fits["fsdp"])
    assert summary(r0) == summary(r1)
    assert [(s, k, a, rank) for s, k, _, a, rank, *_ in summary(r0)] == [(10, "parameter", ["rollback"], 1)]
    converted = out / "step10.pt"
    dcp_to_torch_save(out / "fsdp" / "ckpts" / "epoch=0-step=10.ckpt", converted)
    saved = torch.load(converted, weights_only=False)
    weights = saved["state_dict"]
    assert set(weights) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert all(torch.isfinite(v).all() for v in weights.values())
    restored = state_after(r0, r0["events"][0]["details"]["restored_step"])["weights"]
    assert all(torch.equal(weights[k], restored[k]) for k in weights)
    for rank in fits["fsdp"]:
        resume = rank["resume"]
        assert resume["events"] == [] and resume["global_step"] == 20 and finite(resume)
        assert resume["counters"]["rollbacks"] == 1  # the guard's own state came back with the checkpoint


@pytest.mark.slow
@pytest.mark.ddp
def test_lagged_reads_under_fsdp2_skip_on_the_device_with_a_fused_adamw_and_roll_back_otherwise(sharded_fits):
    """``check.sync: lagged``: a fused AdamW honours the guard's ``found_inf`` on DTensor parameters, so the two bad
    steps (an input on rank 1 at step 5, a gradient on both at step 10) are skipped on the device, no rollback, and
    the fit ends bitwise as the eager one; an SGD cannot skip on the device: its bad steps are applied and rolled
    back one step later, and its weights end finite."""
    fits, _ = sharded_fits
    for rank in fits["fsdp"]:
        lagged, eager = rank["lagged_fused"], rank["eager_fused"]
        assert [e["step"] for e in lagged["events"]] == [e["step"] for e in eager["events"]] == [5, 10]
        assert all(e["actions"] == ["skip_step"] for e in lagged["events"])
        assert (lagged["counters"]["skipped_steps"], lagged["counters"]["rollbacks"]) == (2, 0)
        assert same(lagged["state"], eager["state"]) and all(
            same(lagged["optimizer"][i], eager["optimizer"][i]) for i in eager["optimizer"])
        sgd = rank["lagged_sgd"]
        assert [e["step"] for e in sgd["events"]] == [5, 10] and sgd["counters"]["rollbacks"] == 2
        assert all("rollback" in e["actions"] for e in sgd["events"]) and finite(sgd)
    assert summary(fits["fsdp"][0]["lagged_sgd"]) == summary(fits["fsdp"][1]["lagged_sgd"])


@pytest.mark.slow  # one spawn of 4 processes, ~35 s on 2 cores
@pytest.mark.ddp
def test_fsdp2_on_top_of_tensor_parallel_on_a_2x2_mesh(two_d_fits):
    """FSDP2 over the data-parallel dim of a 2 x 2 mesh, on top of tensor parallel: the healthy fit is bitwise the
    unguarded one for one all-reduce per step; each fault kind is handled alike on all 4 ranks (the gradient fault
    on rank 1 names rank 1), with bitwise rollbacks; clipping matches ``clip_grad_norm_`` (the last bias, replicated
    over the tensor-parallel dim and sharded over the other, counted once)."""
    for rank in two_d_fits:
        healthy = rank["healthy"]
        assert healthy["events"] == [] and same(healthy["state"], rank["plain"]["state"])
        size = per_step(healthy)[0][1][0][1]
        assert all(calls == [("all_reduce", size)] + [("all_reduce", 4)] * snapshot
                   for _, calls, _, snapshot in per_step(healthy))
        faults = rank["faults"]
        assert summary(faults) == summary(two_d_fits[0]["faults"]) and finite(faults)
        assert [(s, k, a) for s, k, _, a, *_ in summary(faults)] == [
            (3, "input", ["skip_step"]), (6, "loss", ["skip_step", "clip"]), (9, "gradient", ["skip_step"]),
            (13, "parameter", ["skip_step", "rollback"]), (17, "parameter", ["skip_step", "rollback"])]
        assert (faults["events"][2]["rank"], faults["events"][2]["details"]["ranks"]) == (1, [1])
        for event in faults["events"][3:]:
            assert same_state(state_after(faults, event["step"] + 1),
                              state_after(faults, event["details"]["restored_step"]))
        clip = rank["clip"]
        assert clip["counters"]["clipped_steps"] == 3
        for theirs, ours in zip(clip["torch_grads"], clip["guard_grads"]):
            assert len(theirs) == len(ours) == 4
            assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(theirs, ours))


# ------------------------------------------------------------------------------------ pure, one process


def test_the_local_norm_power_of_plain_tensors_weighs_each_once():
    """Plain tensors (one rank's own shard, as under the old FSDP's flat parameters) count fully, an empty one not
    at all, a NaN anywhere makes the sum NaN; the inf-norm is the maximum."""
    a, b, empty = torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0]]), torch.zeros(0)
    assert float(local_norm_power([a, b, empty, None], 2.0, world=2)) == 30.0
    assert float(local_norm_power([a, empty], math.inf, world=2)) == 4.0
    assert math.isnan(float(local_norm_power([a, torch.tensor([math.nan])], 2.0, world=2)))
    assert float(local_norm_power([empty], 2.0)) == 0.0
    assert not is_dtensor(a) and local(a) is a and norm_share(a, 4) == 1.0
