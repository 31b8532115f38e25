"""Every incident as a picture: the gradient-flow window on the device, the pictures in TensorBoard (read back through a
real ``tensorboard`` server, the way a browser gets them) and beside the report, the dashboard, ``report --plot``.

Two real fits with a TensorBoardLogger are shared by the module (``runs``): a gradient explosion built up over ~45
steps in one module (``net.2``; tests/picture_runs.py) and a one-step NaN input; one tensorboard server serves both.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_nanguard import NaNGuard
from lightning_nanguard.detect.flow import Flow, FlowWindow, fastest_growing
from lightning_nanguard.errors import SinkWriteWarning
from lightning_nanguard.report import cli
from lightning_nanguard.report.picture_sink import dashboard_layout
from lightning_nanguard.report.pictures import PLOTS_OFF, flow_data, where_data

from . import models, picture_runs
from .test_sync_modes import HostReads

ROOT = Path(__file__).resolve().parents[1]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# -------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    explosion, exploded = picture_runs.explosion(root)
    nan, nan_model = picture_runs.nan_input(root)
    return {"root": root, "explosion": explosion, "nan": nan, "nan_model": nan_model, "exploded": exploded}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(runs):
    """A real tensorboard server on the module's logs (loaded before it serves), its base URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(runs["root"]), "--port",
                             str(port), "--host", "127.0.0.1", "--load_fast", "false", "--reload_task", "blocking",
                             "--reload_interval", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(url + "/data/runs", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("tensorboard exited at start")
                time.sleep(0.25)
        else:
            pytest.fail("tensorboard did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _get(url: str) -> bytes:
    return urllib.request.urlopen(url, timeout=30).read()


def _event(guard: Any, kind: str) -> Any:
    return next(e for e in guard.events if e.kind == kind)


# --------------------------------------------------------------------------------- the window (pure parts)


def test_the_window_keeps_the_newest_steps_in_order_and_survives_its_stored_form():
    window = FlowWindow(4)
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    names = {id(params[0]): "a.weight", id(params[1]): "b.weight"}
    for step in range(6):
        window.record(step, params, 2, torch.tensor([float(step), 10.0 * step]), lambda p: names[id(p)])
        window.judged(step, loss=0.5 * step, total=1.0, limit=None, mark="h")
    window.mark(5, "s")
    flow = window.capture()
    assert flow is not None and flow.steps == [2, 3, 4, 5] and flow.modules == ["a", "b"]
    assert flow.norms == [[2.0, 3.0, 4.0, 5.0], [20.0, 30.0, 40.0, 50.0]] and flow.marks == "hhhs"
    assert window.nbytes == 4 * 2 * 4  # steps x tensors x float32
    flow.norms[0][1] = math.nan
    flow.norms[1][3] = math.inf
    back = Flow.from_dict(json.loads(json.dumps(flow.for_event(5, "b").to_dict())))
    assert back.steps == flow.steps and back.marks == "hhhi" and back.culprit == "b" and back.loss == [1, 1.5, 2, 2.5]
    assert math.isnan(back.norms[0][1]) and back.norms[1][3] == math.inf and back.norms[0][0] == 2.0
    with pytest.raises(ValueError, match="malformed"):
        Flow.from_dict(dict(flow.to_dict(), norms="AAAA"))


def test_the_fastest_growing_module_is_the_culprit_of_the_window_and_none_when_nothing_grew():
    steps = list(range(20))
    flat = [1.0 + 0.1 * (s % 3) for s in steps]
    grows = [1.0 if s < 10 else 1.5 ** (s - 9) for s in steps]
    flow = Flow(modules=["a", "b"], steps=steps, norms=[flat, grows], loss=[1.0] * 20, grad_norm=[1.0] * 20,
                threshold=[math.nan] * 20, marks="h" * 20)
    found = fastest_growing(flow, onset=9)
    assert found is not None and found["module"] == "b" and found["growth"] > 50
    assert fastest_growing(Flow(modules=["a"], steps=steps, norms=[flat], loss=[1.0] * 20, grad_norm=[1.0] * 20,
                                threshold=[math.nan] * 20, marks="h" * 20)) is None


# ------------------------------------------------------------------------------------- the real fits


@pytest.mark.slow
def test_a_divergence_names_the_module_that_ran_away_and_its_heatmap_shows_it_rising(runs):
    event = _event(runs["explosion"], "divergence")
    assert event.cause == "exploding_gradient" and event.culprit == "net.2"  # before the window: None
    assert event.details["runaway"]["module"] == "net.2"
    assert "| culprit | net.2 |" in event.markdown()
    data = flow_data(event.to_dict())
    assert data is not None and data.modules == ["net.0", "net.2", "net.4", "net.6"]
    assert data.culprit_row == 1 and data.steps[data.incident_col] == event.step
    # from before the explosion to 25-32 steps into it (before the loss runs away): the culprit's norm rises
    # 300-fold, the other modules' stay within 5x
    early = [data.steps.index(s) for s in range(5, 15)]
    late = [data.steps.index(s) for s in range(45, 53)]

    def rise(row: int) -> float:
        values = data.log_norms[row]
        return sum(values[c] for c in late) / len(late) - sum(values[c] for c in early) / len(early)

    assert rise(1) > 2.5, [rise(r) for r in range(4)]
    assert all(abs(rise(r)) < 0.7 for r in (0, 2, 3)), [rise(r) for r in range(4)]


@pytest.mark.slow
def test_the_measured_case_names_the_layer_whose_weights_grow_and_marks_what_its_rollback_undid(tmp_path):
    """The issue's measured case (the last Linear's weights grow 1.6x per step from step 20): every divergence named
    culprit None. The gradients of the layers below it grow faster than its own (multiplied by its weights in
    backward): the weights name it. The second event's window shows the steps the first one's rollback undid."""
    guard, _ = picture_runs.growing_last_layer(tmp_path)
    events = [e for e in guard.events if e.kind == "divergence"]
    assert len(events) >= 2 and all(e.culprit == "net.6" for e in events), [(e.step, e.culprit) for e in events]
    assert events[0].details["runaway"]["by"] == "weights"
    first, second = events[0], events[1]
    flow = Flow.from_dict(second.flow)
    undone = [s for s, m in zip(flow.steps, flow.marks) if m == "r"]
    assert undone == list(range(first.details["restored_step"] + 1, first.step))
    assert flow.marks[flow.steps.index(first.step)] == "i" if first.step in flow.steps else True
    grown = fastest_growing(Flow.from_dict(first.flow), first.details["divergence"].get("onset_step"))
    assert grown is not None and grown["module"] != "net.6"  # the gradients alone would name its neighbour


@pytest.mark.slow
def test_a_nan_input_marks_its_step_non_finite_in_both_pictures(runs):
    event = _event(runs["nan"], "input")
    assert event.step == picture_runs.NAN_STEP
    data = flow_data(event.to_dict())
    assert data is not None and data.incident_col is not None
    assert {c for _, c in data.nonfinite} == {data.incident_col}  # every module's gradient at that step: NaN
    assert all(math.isnan(data.log_norms[r][data.incident_col]) for r in range(len(data.modules)))
    where = where_data(event.to_dict())
    assert where is not None and all(v is not None and not math.isfinite(v) for v in where.grad_at_step)
    assert all(math.isfinite(v) and v > 0 for v in where.grad_healthy)  # their healthy scale from the window
    files = sorted(p.name for p in runs["nan"].report_dir.glob("*.png"))
    assert files == [f"incident-0001-step{event.step}-gradient_flow.png", f"incident-0001-step{event.step}-"
                                                                         "where_it_broke.png"]


@pytest.mark.slow
def test_tensorboard_serves_each_incident_picture_at_its_step(runs, server):
    tags = json.loads(_get(server + "/data/plugin/images/tags"))
    for run, guard in (("explosion/version_0", runs["explosion"]), ("nan_input/version_0", runs["nan"])):
        assert run in tags, tags.keys()
        pictured = [e for e in guard.events if e.flow is not None]
        assert pictured == guard.events
        for kind in {e.kind for e in pictured}:
            for picture in ("gradient_flow", "where_it_broke"):
                tag = f"nanguard/incident/{kind}/{picture}"
                assert tag in tags[run], tags[run].keys()
                query = urllib.parse.urlencode({"run": run, "tag": tag})
                samples = json.loads(_get(f"{server}/data/plugin/images/images?{query}"))
                assert [s["step"] for s in samples] == [e.log_step for e in pictured if e.kind == kind]
                for sample in samples:
                    width, height = _png_size(_get(f"{server}/data/plugin/images/individualImage?{sample['query']}"))
                    assert 600 <= width <= 2000 and 200 <= height <= 2000, (tag, width, height)


@pytest.mark.slow
def test_tensorboard_serves_the_guard_dashboard(server):
    layout = json.loads(_get(server + "/data/plugin/custom_scalars/layout"))
    charts = {c["title"]: c["multiline"]["tag"] for cat in layout["category"] if cat["title"] == "NaNGuard"
              for c in cat["chart"]}
    assert charts == {title: tags for title, (_, tags) in dashboard_layout()["NaNGuard"].items()}
    assert "^nanguard/grad_norm$" in charts["gradient norm and clip threshold"]
    import re

    assert re.search(charts["loss (what the model logs)"][0], "train_loss")
    assert not re.search(charts["loss (what the model logs)"][0], "nanguard/loss")


@pytest.mark.slow
def test_report_plot_draws_the_same_pictures_from_events_jsonl(runs, tmp_path, capsys):
    assert cli.main(["report", str(runs["root"]), "--plot", str(tmp_path / "plots")]) == 0
    drawn = sorted(p.relative_to(tmp_path / "plots").as_posix() for p in (tmp_path / "plots").rglob("*.png"))
    live = sorted(p.relative_to(runs["root"]).as_posix() for p in runs["root"].rglob("incident-*.png"))
    assert drawn == live and len(drawn) == 2 * (len(runs["explosion"].events) + len(runs["nan"].events))
    for path in (tmp_path / "plots").rglob("*.png"):
        width, height = _png_size(path.read_bytes())
        assert width >= 600 and height >= 200
    assert "net.2" in capsys.readouterr().out  # the table's culprit column
    assert cli.main(["report", str(tmp_path / "missing"), "--plot", str(tmp_path / "p2")]) == 2


# -------------------------------------------------------------------------------------- a healthy fit


@pytest.mark.slow
def test_a_healthy_fit_draws_nothing_reads_nothing_more_and_keeps_its_weights(tmp_path, monkeypatch):
    data = models.loader(models.regression_data(256), batch_size=32)
    pl.seed_everything(0, verbose=False)
    _, plain = picture_runs.fit(tmp_path, "plain", models.Regression(), data, 8)
    reads = {}
    for size in (256, 0):
        counter = HostReads(monkeypatch)
        losses: dict[int, float] = {}
        pl.seed_everything(0, verbose=False)
        guard, model = picture_runs.fit(tmp_path, f"window{size}", models.Regression(), data, 8,
                                        NaNGuard(logging={"flow_window": size}))
        trainer = pl.Trainer(max_steps=8, logger=False, callbacks=[counter.probe(losses), NaNGuard(
            logging={"flow_window": size})], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        pl.seed_everything(0, verbose=False)
        trainer.fit(models.Regression(), data)
        reads[size] = [(s, name) for s, name, _ in counter.reads if s >= 0]
        monkeypatch.undo()
        assert guard.events == [] and not list(guard.report_dir.glob("*.png"))
        assert models.same_weights(model, plain)
    assert reads[256] == reads[0] == [(s, "tolist") for s in range(8)]  # the step's one read, nothing more


def test_a_window_of_zero_keeps_nothing_and_draws_no_flow(fit):
    guard = NaNGuard(logging={"flow_window": 0})
    fit(models.NaNLossOnBatches(bad=(3,)), models.regression_data(256), [guard], steps=6)
    assert [e.kind for e in guard.events] == ["loss"] and guard.events[0].flow is None
    assert guard._parts.flow.nbytes == 0 and not list(guard.report_dir.glob("*.png"))
    assert (guard.report_dir / "incident-0001-step3.txt").exists()


# --------------------------------------------------------------------------- without matplotlib, a broken one


BLOCKER = """
import sys
from importlib.machinery import PathFinder

class _WithoutMatplotlib(PathFinder):  # the path finder, as if matplotlib were not installed
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ("matplotlib", "mpl_toolkits"):
            return None
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):  # nor its metadata (what torchmetrics asks about)
        return (d for d in PathFinder.find_distributions(*args, **kwargs)
                if (d.metadata["Name"] or "").lower() != "matplotlib")

sys.meta_path[:] = [_WithoutMatplotlib if f is PathFinder else f for f in sys.meta_path]
sys.argv = ["picture_runs", sys.argv[1]]
import runpy
runpy.run_module("tests.picture_runs", run_name="__main__")
"""


@pytest.mark.slow
def test_without_matplotlib_the_fit_and_events_are_the_same_and_one_line_says_so(runs, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", BLOCKER, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(proc.stdout.strip().splitlines()[-1])
    assert events == [e.to_dict() for e in runs["nan"].events]  # the window is kept with the event all the same
    said = (proc.stdout + proc.stderr).count(PLOTS_OFF)
    assert said == 1, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("*.png")) and list(tmp_path.rglob("incident-0001-*.txt"))


@pytest.mark.slow
def test_a_matplotlib_that_raises_warns_once_and_changes_nothing(runs, tmp_path, monkeypatch):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the backend broke")

    monkeypatch.setattr(FigureCanvasAgg, "draw", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard, model = picture_runs.nan_input(tmp_path)
    ours = [w for w in caught if issubclass(w.category, SinkWriteWarning)]
    assert len(ours) == 1 and "the incident pictures" in str(ours[0].message)
    assert "the backend broke" in str(ours[0].message)
    assert [e.to_dict() for e in guard.events] == [e.to_dict() for e in runs["nan"].events]
    assert models.same_weights(model, runs["nan_model"])
    assert not list(tmp_path.rglob("*.png")) and guard._recorder.failed_writes == {"the incident pictures": 1}


# ------------------------------------------------------------------------------ a good guest to the user's plots


class _UsersOwnPlot(pl.Callback):
    """The user's own matplotlib at every batch end, in the training thread: a small log-scale pyplot figure with a
    math-text title, drawn to PNG (each error it raises is kept, as a user's callback that does not catch it would
    end the fit)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.drawn = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(2, 1.5))
        try:
            ax.plot([1, 2, 3], [1.0, 10.0, 100.0])
            ax.set_yscale("log")
            ax.set_title(r"$\alpha_{i}^{2}$ loss")
            fig.savefig(io.BytesIO(), format="png")
            self.drawn += 1
        except Exception as exc:  # noqa: BLE001  (what the user would see: counted, then asserted to be none)
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            plt.close(fig)


@pytest.mark.slow
def test_two_guards_and_the_users_own_plots_lose_no_picture_and_never_raise(tmp_path):
    """Two guards (one named) and the user's own math-text plotting at every batch end, in one fit with six NaN
    losses, three fits in a row: every picture of both guards is written (PNG files and ``add_image`` tags), no
    picture warning, and the user's figure never raises (matplotlib is not thread-safe: the guard draws in the
    training thread)."""
    from pytorch_lightning.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bad = (4, 9, 14, 19, 24, 29)
    for run in range(3):
        logger = TensorBoardLogger(str(tmp_path), name=f"fit{run}")
        guards = [NaNGuard(logging={"verbose": False}), NaNGuard(name="b", logging={"verbose": False})]
        user = _UsersOwnPlot()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = models.trainer(tmp_path / f"fit{run}", [*guards, user], max_steps=36, max_epochs=-1,
                                     logger=logger, log_every_n_steps=50)
            trainer.fit(models.NaNLossOnBatches(bad=set(bad)), models.loader(models.regression_data(36 * 8), 8))
        assert user.errors == [] and user.drawn == 36, (run, user.errors[:3])
        assert not [str(w.message) for w in caught if issubclass(w.category, SinkWriteWarning)], run
        acc = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
        acc.Reload()
        for guard, prefix in zip(guards, ("nanguard/", "nanguard/b/")):
            assert [e.step for e in guard.events] == list(bad), (run, prefix)
            pngs = sorted(p.name for p in guard.report_dir.glob("incident-*.png"))
            assert pngs == sorted(f"incident-{i:04d}-step{s}-{name}.png" for i, s in enumerate(bad, 1)
                                  for name in ("gradient_flow", "where_it_broke")), (run, prefix)
            tags = [t for t in acc.Tags()["images"] if t.startswith(prefix + "incident/")
                    and (prefix == "nanguard/b/" or not t.startswith("nanguard/b/"))]
            assert sorted((t, im.step) for t in tags for im in acc.Images(t)) == sorted(
                (f"{prefix}incident/loss/{name}", s) for s in bad for name in ("gradient_flow", "where_it_broke")), \
                (run, prefix)
