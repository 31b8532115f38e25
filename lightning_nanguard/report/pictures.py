"""The pictures of an incident, drawn from its event alone (``event.to_dict()``: its stored gradient-flow window, its
details), so that the live sink (:mod:`.picture_sink`) and ``nanguard report --plot`` draw the same ones:

- :func:`flow_data` / :func:`draw_flow`, *gradient flow*: a heatmap of every module's gradient norm (rows: modules in
  model order, columns: the window's steps, log10 colour), the incident's step marked, the culprit's row outlined,
  and above it the total gradient norm against the clip threshold and the loss, with the steps that were skipped,
  rolled back or were incidents shaded;
- :func:`where_data` / :func:`draw_where`, *where it broke*: per module, the largest |output| in the incident's
  replay and the gradient norm at the bad step against the module's healthy scale (the median of its healthy steps
  in the window); non-finite values are marked as such, never drawn as zero.

The ``*_data`` functions are pure (lists and floats: what a test reads); the ``draw_*`` ones build a matplotlib
``Figure`` on its own Agg canvas, without pyplot (no global state: the user's pyplot figures are never touched) and
need matplotlib (the ``plots`` extra). matplotlib is not thread-safe (its math-text parser above all): they are
called in the training thread (:mod:`.picture_sink`) or the CLI's, never on a thread beside the user's own plots.
Nothing here imports torch.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..detect.flow import MARKS, Flow

__all__ = ["FlowData", "WhereData", "flow_data", "where_data", "draw_flow", "draw_where", "figures", "png_bytes",
           "rgb_array", "PICTURES", "plots_available", "PLOTS_OFF"]

PICTURES = ("gradient_flow", "where_it_broke")  # the tag (and file) name of each picture
PLOTS_OFF = ("[nanguard] incident pictures are off: matplotlib is not installed "
             "(pip install 'lightning-nanguard[plots]' turns them on); everything else is recorded as usual")
_SHADE = {"s": ("#9e9e9e", "skipped"), "r": ("#ff9800", "rolled back"), "i": ("#d62728", "incident"),
          "o": ("#80deea", "GradScaler overflow")}
_DPI = 100


def plots_available() -> bool:
    """Can the pictures be drawn here? (matplotlib can be found; it is imported only when a picture is drawn)"""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------- data


@dataclass
class FlowData:
    """The gradient-flow heatmap: ``log_norms[row][col]`` is the log10 gradient norm of ``modules[row]`` at
    ``steps[col]`` (NaN: not recorded, or non-finite: then ``(row, col)`` is in ``nonfinite``)."""

    modules: list[str]
    steps: list[int]
    log_norms: list[list[float]]
    nonfinite: list[tuple[int, int]]
    marks: str
    loss: list[float]
    grad_norm: list[float]
    threshold: list[float]
    culprit_row: Optional[int]
    incident_col: Optional[int]
    title: str


@dataclass
class WhereData:
    """Where it broke, per module (model order): the replay's largest finite |output| (``act_abs_max``; NaN: not in the
    replay) and its non-finite count, and the gradient norm at the bad step (``grad_at_step``: NaN/Inf as they were;
    None: a module without parameters of its own) against the healthy median of the window (``grad_healthy``)."""

    modules: list[str]
    act_abs_max: list[float]
    act_nonfinite: list[int]
    grad_at_step: list[Optional[float]]
    grad_healthy: list[float]
    culprit_row: Optional[int]
    title: str


def _title(event: Mapping[str, object], what: str) -> str:
    parts = [f"{what}: incident #{event.get('index', '?')}, step {event.get('step')}, {event.get('kind')}"]
    if event.get("cause"):
        parts.append(f"cause {event['cause']}")
    if event.get("culprit"):
        parts.append(f"culprit {event['culprit']}")
    if event.get("op"):
        parts.append(f"op {event['op']}")
    return ", ".join(parts)


def _flow_of(event: Mapping[str, object]) -> Optional[Flow]:
    stored = event.get("flow")
    return Flow.from_dict(stored) if stored is not None else None


def _culprit_row(modules: list[str], culprit: object) -> Optional[int]:
    """The row of the culprit: its module, or the module of a culprit parameter, or a module inside it."""
    if not culprit or not isinstance(culprit, str):
        return None
    for name in (culprit, culprit.rpartition(".")[0]):
        if name in modules:
            return modules.index(name)
    inside = [i for i, m in enumerate(modules) if m.startswith(culprit + ".")]
    return inside[0] if inside else None


def flow_data(event: Mapping[str, object]) -> Optional[FlowData]:
    """The heatmap of ``event`` (a ``to_dict()``), every step from the window's first to its last one a column (steps
    the window did not record: NaN); None without a stored window."""
    flow = _flow_of(event)
    if flow is None or not flow.steps:
        return None
    first, last = flow.steps[0], flow.steps[-1]
    steps = list(range(first, last + 1)) if last - first < 4 * len(flow.steps) else list(flow.steps)
    at = {s: j for j, s in enumerate(flow.steps)}
    cols = [at.get(s) for s in steps]

    def pick(values: list[float]) -> list[float]:
        return [values[j] if j is not None else math.nan for j in cols]

    logs: list[list[float]] = []
    bad: list[tuple[int, int]] = []
    for r, row in enumerate(flow.norms):
        out = []
        for c, j in enumerate(cols):
            v = row[j] if j is not None else math.nan
            if j is not None and not math.isfinite(v):
                bad.append((r, c))
            out.append(math.log10(v) if math.isfinite(v) and v > 0 else math.nan)
        logs.append(out)
    marks = "".join(flow.marks[j] if j is not None else " " for j in cols)
    step = event.get("step")
    return FlowData(modules=list(flow.modules), steps=steps, log_norms=logs, nonfinite=bad, marks=marks,
                    loss=pick(flow.loss), grad_norm=pick(flow.grad_norm), threshold=pick(flow.threshold),
                    culprit_row=_culprit_row(flow.modules, event.get("culprit")),
                    incident_col=steps.index(step) if isinstance(step, int) and step in steps else None,
                    title=_title(event, "gradient flow"))


def where_data(event: Mapping[str, object]) -> Optional[WhereData]:
    """Where it broke (:class:`WhereData`); None without a stored window nor replay outputs."""
    flow = _flow_of(event)
    if flow is None:
        return None
    acts = {a["module"]: a for a in flow.activations}
    step = event.get("step", -1)
    j = flow.column(int(step)) if isinstance(step, (int, float, str)) else None
    if j is None and not acts:
        return None
    # model order: the replay's calls (modules without parameters too), then the window's modules it did not record
    modules = list(acts) + [m for m in flow.modules if m not in acts] if acts else list(flow.modules)
    healthy_cols = [c for c, m in enumerate(flow.marks) if m == "h"]
    grad_at: list[Optional[float]] = []
    healthy = []
    for name in modules:
        row = flow.norms[flow.modules.index(name)] if name in flow.modules else None
        grad_at.append(row[j] if row is not None and j is not None else None)  # None: no gradient of its own
        values = sorted(row[c] for c in healthy_cols if math.isfinite(row[c])) if row is not None else []
        healthy.append(values[len(values) // 2] if values else math.nan)
    return WhereData(modules=modules,
                     act_abs_max=[float(acts[m]["abs_max"]) if m in acts else math.nan for m in modules],
                     act_nonfinite=[int(acts[m]["nonfinite"]) if m in acts else 0 for m in modules],
                     grad_at_step=grad_at, grad_healthy=healthy,
                     culprit_row=_culprit_row(modules, event.get("culprit")), title=_title(event, "where it broke"))


# ---------------------------------------------------------------------------------------------- drawing


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI)
    FigureCanvasAgg(fig)
    return fig


def _row_height(n: int) -> float:
    return max(0.12, min(0.3, 8.0 / max(n, 1)))


def draw_flow(data: FlowData) -> Any:
    """The gradient-flow picture of :func:`flow_data` (a matplotlib ``Figure``)."""
    import numpy as np
    from matplotlib import colormaps

    rows = len(data.modules)
    height = 2.4 + _row_height(rows) * rows + 0.8
    fig = _figure(10.0, min(height, 16.0))
    top, heat = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, max(_row_height(rows) * rows,
                                                                                            1.2)]})
    x = np.arange(len(data.steps))
    for c, mark in enumerate(data.marks):  # skipped, rolled back, incident steps shaded in both panels
        if mark in _SHADE:
            for ax in (top, heat):
                ax.axvspan(c - 0.5, c + 0.5, color=_SHADE[mark][0], alpha=0.35 if ax is top else 0.18, lw=0)
    norm = np.array([v if math.isfinite(v) and v > 0 else np.nan for v in data.grad_norm])
    top.plot(x, norm, color="#1f77b4", lw=1.2, label="total gradient norm")
    thr = np.array(data.threshold, dtype=float)
    if np.isfinite(thr).any():
        top.step(x, thr, where="mid", color="#2ca02c", lw=1.0, ls="--", label="clip threshold")
    if np.isfinite(norm).any():
        top.set_yscale("log")
    top.set_ylabel("grad norm", fontsize=8)
    loss = np.array(data.loss, dtype=float)
    if np.isfinite(loss).any():
        twin = top.twinx()
        twin.plot(x, loss, color="#7f7f7f", lw=0.9, alpha=0.8, label="loss")
        finite = loss[np.isfinite(loss)]
        if finite.size and finite.min() > 0 and finite.max() / max(finite.min(), 1e-300) > 100:
            twin.set_yscale("log")
        twin.set_ylabel("loss", fontsize=8, color="#7f7f7f")
        twin.tick_params(labelsize=7)
    handles, labels = top.get_legend_handles_labels()
    from matplotlib.patches import Patch

    present = sorted(set(data.marks) & set(_SHADE))
    handles += [Patch(color=_SHADE[m][0], alpha=0.5) for m in present]
    labels += [f"{_SHADE[m][1]} step" for m in present]
    top.legend(handles, labels, fontsize=7, loc="upper left", ncol=3, framealpha=0.8)
    top.tick_params(labelsize=7)
    top.set_title(data.title, fontsize=9)

    grid = np.array(data.log_norms, dtype=float).reshape(rows, len(data.steps))
    cmap = colormaps["viridis"].with_extremes(bad="#eeeeee")
    image = heat.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap,
                        extent=(-0.5, len(data.steps) - 0.5, rows - 0.5, -0.5))
    if data.nonfinite:  # non-finite norms: a red cross, never a colour
        rr, cc = zip(*data.nonfinite)
        heat.scatter(cc, rr, marker="x", color="#d62728", s=18, lw=1.2, label="NaN/Inf")
        heat.legend(fontsize=7, loc="lower left", framealpha=0.8)
    if data.incident_col is not None:
        for ax in (top, heat):
            ax.axvline(data.incident_col, color="#d62728", lw=1.2)
    heat.set_yticks(range(rows), data.modules, fontsize=max(5, min(8, int(160 / max(rows, 1)))))
    if data.culprit_row is not None:
        r = data.culprit_row
        from matplotlib.patches import Rectangle

        heat.add_patch(Rectangle((-0.5, r - 0.5), len(data.steps), 1, fill=False, ec="#d62728", lw=1.8))
        label = heat.get_yticklabels()[r]
        label.set_color("#d62728")
        label.set_fontweight("bold")
    ticks = _ticks(len(data.steps))
    heat.set_xticks(ticks, [str(data.steps[t]) for t in ticks], fontsize=7)
    heat.set_xlabel("optimizer step", fontsize=8)
    bar = fig.colorbar(image, ax=[top, heat], fraction=0.025, pad=0.07 if np.isfinite(loss).any() else 0.02)
    bar.set_label("log10 gradient norm", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return fig


def _ticks(n: int, most: int = 12) -> list[int]:
    every = max(1, math.ceil(n / most))
    return list(range(0, n, every))


def draw_where(data: WhereData) -> Any:
    """The where-it-broke picture of :func:`where_data` (a matplotlib ``Figure``): the replay's outputs (when the
    incident was replayed) beside the gradient norms at the bad step."""
    import numpy as np

    rows = len(data.modules)
    replayed = any(math.isfinite(v) for v in data.act_abs_max) or any(data.act_nonfinite)
    fig = _figure(10.0, min(1.4 + _row_height(rows) * rows + 0.6, 16.0))
    axes = fig.subplots(1, 2, sharey=True) if replayed else [fig.subplots(1, 1)]
    y = np.arange(rows)

    def bars(ax: Any, values: Sequence[Optional[float]], bad: list[bool], color: str,
             also: Sequence[float] = ()) -> None:
        finite = [v if v is not None and math.isfinite(v) and v > 0 else np.nan for v in values]
        ax.barh(y, finite, color=color, height=0.6)
        known = [v for v in list(finite) + list(also) if math.isfinite(v) and v > 0]
        low = min(known) / 10 if known else 1e-3
        top = max(known) * 10 if known else 1.0
        ax.set_xscale("log")
        ax.set_xlim(low, top)
        for i, (v, b) in enumerate(zip(values, bad)):
            if b:  # non-finite: a red cell with its name across the row (never a bar of zero)
                ax.axhspan(i - 0.4, i + 0.4, color="#d62728", alpha=0.15, lw=0)
                word = "NaN" if v is None or math.isnan(v) else "Inf" if v > 0 else "-Inf"
                ax.text(low * 1.3, i, word, color="#d62728", fontsize=8, va="center", ha="left", fontweight="bold")
        ax.tick_params(labelsize=7)

    if replayed:
        left = axes[0]
        act_bad = [n > 0 for n in data.act_nonfinite]
        bars(left, [math.nan if b else v for v, b in zip(data.act_abs_max, act_bad)], act_bad, "#9467bd")
        for i, (v, b) in enumerate(zip(data.act_abs_max, act_bad)):
            if not b and math.isnan(v):
                left.text(left.get_xlim()[0], i, " not recorded: after the first non-finite output", fontsize=6,
                          va="center", color="#7f7f7f")
        left.set_title("largest |output| in the replay (finite values; red: non-finite)", fontsize=8)
    right = axes[-1]
    grad_bad = [v is not None and not math.isfinite(v) for v in data.grad_at_step]
    healthy = [v if math.isfinite(v) and v > 0 else math.nan for v in data.grad_healthy]
    bars(right, data.grad_at_step, grad_bad, "#1f77b4", healthy)
    right.scatter(healthy, y, marker="|", s=160, color="#2ca02c", lw=2.5, label="healthy median (window)", zorder=3)
    right.legend(fontsize=7, loc="lower right", framealpha=0.8)
    right.set_title("gradient norm at the bad step" + ("" if replayed else " (not replayed: nothing non-finite)"),
                    fontsize=8)
    first = axes[0]
    first.set_yticks(y, data.modules, fontsize=max(5, min(8, int(160 / max(rows, 1)))))
    first.invert_yaxis()
    if data.culprit_row is not None:
        label = first.get_yticklabels()[data.culprit_row]
        label.set_color("#d62728")
        label.set_fontweight("bold")
        for ax in axes:
            ax.axhspan(data.culprit_row - 0.5, data.culprit_row + 0.5, color="#d62728", alpha=0.08, lw=0)
    fig.suptitle(data.title, fontsize=9)
    fig.tight_layout()
    return fig


# -------------------------------------------------------------------------------------------- output


def figures(event: Mapping[str, object]) -> dict[str, Any]:
    """The pictures of ``event`` (a ``to_dict()``) by name (:data:`PICTURES`); none without a stored window."""
    out: dict[str, Any] = {}
    flow = flow_data(event)
    if flow is not None:
        out["gradient_flow"] = draw_flow(flow)
    where = where_data(event)
    if where is not None:
        out["where_it_broke"] = draw_where(where)
    return out


def png_bytes(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def rgb_array(fig: Any) -> Any:
    """The picture as an ``H x W x 3`` uint8 array (what ``add_image(..., dataformats="HWC")`` takes)."""
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


assert set(_SHADE) <= set(MARKS)
