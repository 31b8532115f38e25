"""Which rank an incident names under DDP (CONTRACT: ``rank`` is "the global rank where the fault arose"), on real
2-process gloo DDP (tests/ddp_scripts/ddp_ranks.py, one spawned fit per ``check.sync`` mode, ~15 s each).

Every fault arises on rank 1 only: a NaN loss (its gradients finite, so only rank 1's own flag knows), a NaN input,
a NaN weight written on rank 1 alone (the replicas disagree until the rollback), and a NaN gradient that rank 1's
backward produces and the all-reduce hands to rank 0. For each: the event on every rank names rank 1, both ranks
record the same event, ``details.ranks`` lists the ranks with evidence ([1]), and the replicas end bitwise equal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "ddp_scripts" / "ddp_ranks.py"
PRECEDENCE = Path(__file__).parent / "ddp_scripts" / "ddp_precedence.py"
FAULTS = {3: "loss", 6: "input", 10: "weight", 14: "gradient"}  # the script's faults, by optimizer step


def spawn(out: Path, sync: str, timeout: float = 180, *extra: str, script: Path = SCRIPT) -> list[dict]:
    """Run the script (it launches rank 1 itself); on a hang, kill the whole process group it started."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MASTER_PORT", None)  # Lightning picks a free port
    proc = subprocess.Popen([sys.executable, str(script), str(out), sync, *extra], env=env, cwd=str(out), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # rank 0 and the rank 1 it launched: the ranks wait on each other
        stdout, stderr = proc.communicate()
        pytest.fail(f"the 2-process run hung (ranks waiting on each other):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module", params=["eager", "lagged"])
def ranks_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ddp_ranks_{request.param}")
    return request.param, spawn(out, request.param)


def by_step(run: dict) -> dict[int, dict]:
    return {e["step"]: e for e in run["events"]}


@pytest.mark.slow  # one spawned 2-process fit per sync mode, ~15 s each
@pytest.mark.ddp
def test_ddp_every_rank_records_the_same_events_naming_rank_1(ranks_run):
    sync, (r0, r1) = ranks_run
    assert r0["events"] == r1["events"]  # every field, details and actions included
    assert [e["step"] for e in r0["events"]] == list(FAULTS)
    assert all(e["rank"] == 1 and e["details"]["ranks"] == [1] for e in r0["events"]), sync
    assert r0["counters"]["incidents"] == r1["counters"]["incidents"] == len(FAULTS)
    assert r0["counters"]["snapshots"] == r1["counters"]["snapshots"]  # taken at the same steps on every rank
    assert r0["counters"]["rollbacks"] == r1["counters"]["rollbacks"] == 1 and r0["lr_scale"] == r1["lr_scale"]


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_rank_1_evidence_is_adopted_for_a_nan_loss_input_and_weight(ranks_run):
    _, (r0, r1) = ranks_run
    events = by_step(r0)
    loss, bad_input, weight = events[3], events[6], events[10]
    assert (loss["kind"], loss["culprit"]) == ("loss", "training_step")  # rank 0's own loss was finite
    assert (bad_input["kind"], bad_input["cause"]) == ("input", "input")
    (found,) = bad_input["details"]["inputs"]
    assert (found["field"], found["samples"], found["features"]) == ("batch[0]", [1], [2])  # rank 1's batch
    assert (weight["kind"], weight["culprit"], weight["cause"]) == ("parameter", "head.weight", "optimizer")
    assert [f["name"] for f in weight["details"]["nonfinite_parameters"]] == ["head.weight"]
    assert "rollback" in weight["actions"] and weight["details"]["restored_step"] <= 8  # before the write


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_nan_gradient_from_rank_1_backward_is_named_rank_1(ranks_run):
    """The NaN arises in rank 1's backward (sqrt of an all-zero sample's norm) and reaches rank 0 through the
    gradient all-reduce: rank 1's own replay reproduces it (CONTRACT), rank 0's does not."""
    _, (r0, _) = ranks_run
    event = by_step(r0)[14]
    assert (event["kind"], event["rank"], event["details"]["ranks"]) == ("gradient", 1, [1])
    assert (event["cause"], event["op"], event["culprit"]) == ("backward_op", "SqrtBackward0", "proj.weight")
    assert event["details"]["replay"]["reproduced"]  # rank 1's account, adopted by rank 0


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_replicas_stay_bitwise_identical_after_rank_local_faults(ranks_run):
    sync, (r0, r1) = ranks_run
    assert r0["state"].keys() == r1["state"].keys()
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]), (sync, key)
        assert torch.isfinite(value).all()
    for pid, state in r0["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, r1["optimizer"]["state"][pid][key]), (sync, pid, key)
    assert r1["injected"] == [(9, "parameter", True)] and r0["injected"] == []  # the weight: rank 1 only


@pytest.mark.slow  # one spawned 2-process fit, ~10 s
@pytest.mark.ddp
def test_ddp_an_optimizer_state_poisoned_on_one_rank_is_acted_on_by_every_rank(tmp_path):
    """An Adam ``exp_avg_sq`` element made inf on rank 1 alone (its weights stay finite: the element's update becomes
    0), with the replica check off: the check before the next snapshot sees it on rank 1 only. Every rank must act
    on it together (it is agreed in the snapshot's all-reduce): one event on both ranks, a rollback on both, the
    replicas bitwise identical and finite at the end. (A rank rolling back alone issued collectives the other never
    called: the run hung.)"""
    r0, r1 = spawn(tmp_path, "eager", 180, "state")
    assert r0["events"] == r1["events"]
    (event,) = r0["events"]
    assert (event["kind"], event["details"]["detected_at"]) == ("parameter", "snapshot")
    assert (event["rank"], event["details"]["ranks"]) == (1, [1])  # the rank whose optimizer state it was
    assert "rollback" in event["actions"] and r0["counters"]["rollbacks"] == r1["counters"]["rollbacks"] == 1
    assert r1["injected"] == [(9, "optimizer_state", True)] and r0["injected"] == []
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]) and torch.isfinite(value).all(), key
    for pid, state in r0["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, r1["optimizer"]["state"][pid][key]) and torch.isfinite(value).all(), (pid, key)


@pytest.mark.slow  # one spawned 2-process fit, ~10 s
@pytest.mark.ddp
def test_ddp_without_replays_own_flags_beat_own_diagnosis_and_the_lowest_rank_wins_a_tie(tmp_path):
    """docs/distributed.md: without a replay that reproduces the fault, the event names the rank whose own flags
    were set, before one whose own diagnosis found something (bad inputs), and among equals the lowest rank;
    ``details.ranks`` lists every rank with evidence (tests/ddp_scripts/ddp_precedence.py)."""
    r0, r1 = spawn(tmp_path, "eager", script=PRECEDENCE)
    assert r0["events"] == r1["events"]
    flags_vs_inputs, tie = r0["events"]
    assert (flags_vs_inputs["step"], flags_vs_inputs["rank"], flags_vs_inputs["kind"]) == (3, 0, "loss")
    assert flags_vs_inputs["details"]["ranks"] == [0, 1]  # rank 1's unread NaN input is evidence too
    assert "inputs" not in flags_vs_inputs["details"]  # the account is rank 0's
    assert (tie["step"], tie["rank"], tie["kind"], tie["details"]["ranks"]) == (6, 0, "loss", [0, 1])
    assert r0["counters"]["incidents"] == r1["counters"]["incidents"] == 2
