"""What if: a model, a MOM and a GPU we do not have, answered from traces (notebook 06).

Everything here reads `momlab.estimate`'s cached traces: a change of batch
size, GPU (of the same kernel family) or a MOM already traced redraws in a
fifth of a second, without running anything (most of it is matplotlib
drawing text; the figure and its panels are kept from one update to the
next); a new model size, precision or MOM traces once (seconds for a real
size, under one for a tiny one) and is cached from then on, on disk too.
Measured points from results/*.jsonl of the same model, size, precision and
device are drawn over the predictions.

`figure()` draws one state; `app()` wraps it in ipywidgets for the notebook.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure  # not pyplot: no global backend, nothing shown twice in a notebook
from matplotlib.ticker import FuncFormatter

from momlab import catalog
from momlab import metrics
from momlab.estimate import calibrate, estimate, predict_max_batch, records, s1_grid, throughput_curve
from momlab.gpus import get as get_gpu
from momlab.gpus import gpus
from momlab.timemodel import _result_files
from momlab.plots import OOM_MARKER, mom_style
from momlab.plots import save as plots_save
from momlab.units import format_bytes
from momlab.usermodel import name_of, resolve

PARTS = (("params_bytes", "weights"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer"),
         ("activation_bytes", "activations"), ("workspace_bytes", "workspace"))
PART_COLORS = ("#4C72B0", "#55A868", "#8172B2", "#DD8452", "#C44E52")
# slider keywords per family, in display order
SLIDERS = {"bert": ("num_layers", "hidden_size", "seq_len"), "gpt": ("num_layers", "hidden_size", "seq_len"),
           "vit": ("num_layers", "hidden_size", "image_size"), "swin": ("num_layers", "hidden_size", "image_size"),
           "resnet": ("num_layers", "hidden_size", "image_size"),
           "llama": ("num_layers", "hidden_size", "seq_len"), "qwen2": ("num_layers", "hidden_size", "seq_len"),
           "mixtral": ("num_layers", "hidden_size", "seq_len")}


def _sliders(model) -> tuple[str, ...]:
    """The slider keywords of `model`: its family's, or a given model's own (a config, a user's module)."""
    spec = catalog.spec(resolve(model))
    if spec.family in SLIDERS:
        return SLIDERS[spec.family]
    return tuple(k for k in ("num_layers", "hidden_size", "seq_len", "image_size") if k in spec.keywords)


def size_from(model: str, size=None, **flat) -> dict:
    """Size keywords from a notebook's parameters: a dict, "tiny" (the preset), plus flat values.

    >>> size_from("bert-base", "tiny", num_layers=3, seq_len=None)["num_layers"]
    3
    """
    if size in (None, "", "default"):
        out = {}
    elif size == "tiny":
        out = catalog.tiny(resolve(model))
    elif isinstance(size, dict):
        out = dict(size)
    else:
        raise ValueError(f"size must be a dict of size keywords, 'tiny' or None, got {size!r}")
    out.update({k: int(v) for k, v in flat.items() if v is not None})
    return out


@dataclass
class State:
    """What the figure shows: one configuration, several MOMs."""

    model: str = "bert-large"  # or a transformers config / momlab.UserModel (momlab.usermodel)
    gpu: str = "A100-40"
    precision: str = "fp32"
    moms: tuple = ("exact", "ckpt")
    batch_size: int = 32
    size: dict = field(default_factory=dict)
    results: object = None  # where measured records are (default results/*.jsonl)

    def resolved_size(self) -> dict:
        return catalog.resolve_size(resolve(self.model), self.size)


@dataclass
class View:
    """What one update computed: per MOM the estimate at the batch, its curve, its max batch."""

    state: State
    at_batch: dict  # mom -> Estimate (or None: the MOM does not apply)
    curves: dict  # mom -> list[Estimate]
    max_batch: dict  # mom -> int
    verdict: str
    skipped: dict  # mom -> why it does not apply
    capacity: int
    calibrated: bool
    provenance: str = ""  # where the step times come from (`Calibration.describe`)


def compute(state: State) -> View:
    """Estimates for `state` (traces on first use, then cached)."""
    state = replace(state, model=resolve(state.model))  # a raw config: resolved once, named in the text
    g = get_gpu(state.gpu)
    at, curves, maxb, skipped = {}, {}, {}, {}
    for mom in state.moms:
        try:
            mb = predict_max_batch(state.model, mom, gpu=state.gpu, precision=state.precision, **state.size)
        except ValueError as exc:  # ckpt-selective on a ResNet, bf16 on a V100, ...
            skipped[mom] = str(exc).splitlines()[0]
            continue
        maxb[mom] = mb
        grid = sorted(set(s1_grid(mb)) | {state.batch_size})  # the grid `verdict` scans, and this batch
        curves[mom] = throughput_curve(state.model, mom, gpu=state.gpu, batch_sizes=grid,
                                           precision=state.precision, results=state.results, **state.size)
        at[mom] = estimate(state.model, mom, batch_size=state.batch_size, gpu=state.gpu,
                               precision=state.precision, results=state.results, **state.size)
    cal = calibrate(state.gpu, results=state.results)
    return View(state, at, curves, maxb, _verdict(state, curves), skipped, g.memory_bytes, cal.calibrated,
                cal.describe())


def _verdict(state: State, curves: dict) -> str:
    """The S1 sentence of momlab.metrics, over the curves drawn (`s1_grid`: every fit and the first miss)."""
    table = metrics.s1_summary(records([e for c in curves.values() for e in c]))
    return metrics.s1_verdict(table, where=state.gpu)["text"]


# -- measured points -----------------------------------------------------------------------

_MEASURED: dict = {}


def measured(state: State):
    """Measured records (fits, with a throughput) of this model, size, precision and device."""
    import os

    from momlab.results import read_records

    files = _result_files(state.results)
    key = tuple((f, os.path.getmtime(f)) for f in files if os.path.exists(f))
    if key not in _MEASURED:
        recs = []
        for f in files:
            recs.extend(read_records(f))
        _MEASURED.clear()
        _MEASURED[key] = recs
    g = get_gpu(state.gpu)
    size = state.resolved_size()
    device = "cpu" if state.gpu == "cpu" else "cuda"
    out = []
    for r in _MEASURED[key]:
        env = r.get("env") or {}
        if (r.get("model") == name_of(state.model) and r.get("precision") == state.precision and r.get("size") == size
                and env.get("device") == device and g.matches(env.get("device_name"))
                and r.get("fits") and isinstance(r.get("throughput"), (int, float)) and r["throughput"] > 0):
            out.append(r)
    return out


# -- drawing -----------------------------------------------------------------------------------

PNG_DPI = 90  # the widget's image: 990 x 378 pixels
_PANELS = ("what-if memory", "what-if throughput")


def new_figure() -> Figure:
    """An empty what-if figure with its own Agg canvas, which keeps its renderer from one update to the next
    (a figure without one gets a new canvas and renderer at every savefig)."""
    fig = Figure(figsize=(11, 4.2), dpi=PNG_DPI)
    FigureCanvasAgg(fig)
    return fig


def _panels(fig: Figure):
    """The two axes of `fig`, made on its first drawing and emptied on the next ones.

    Kept rather than made anew: new axes make new ticks and tick labels,
    which cost as much as the rest of an update together.
    """
    if [ax.get_label() for ax in fig.axes] != list(_PANELS):
        fig.clf()
        gs = fig.add_gridspec(1, 2, width_ratios=[1, 1.5])
        ax_mem = fig.add_subplot(gs[0], label=_PANELS[0])
        ax_tp = fig.add_subplot(gs[1], label=_PANELS[1])
        ax_tp.set_xscale("log", base=2)
        ax_tp.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 256, not mathtext's 2^8
        # fixed margins: tight_layout would cost a third of an update
        fig.subplots_adjust(left=0.06, right=0.985, bottom=0.2, top=0.86, wspace=0.2)
        return ax_mem, ax_tp
    for ax in fig.axes:
        for container in list(ax.containers):
            container.remove()
        for artist in [*ax.patches, *ax.lines, *ax.texts, *ax.collections]:
            artist.remove()
        if ax.legend_ is not None:
            ax.legend_.remove()
        ax.set_xlabel("")
    return fig.axes


def figure(view: View, fig=None):
    """Memory breakdown at the batch vs the GPU's capacity, and throughput vs batch per MOM.

    `fig`: a figure of an earlier update to draw into (see `new_figure`).
    """
    if fig is None:
        fig = new_figure()
    ax_mem, ax_tp = _panels(fig)
    s = view.state
    moms = [m for m in s.moms if m in view.at_batch]
    peaks = [view.at_batch[m].peak_bytes for m in moms]
    gib, unit = (2 ** 30, "GiB") if max(peaks + [view.capacity]) >= 2 ** 30 and max(peaks or [0]) >= 2 ** 28 \
        else (2 ** 20, "MiB")
    x = np.arange(len(moms))
    bottom = np.zeros(len(moms))
    for (key, label), color in zip(PARTS, PART_COLORS):
        vals = np.array([getattr(view.at_batch[m], key) for m in moms], dtype=float) / gib
        ax_mem.bar(x, vals, bottom=bottom, color=color, label=label, width=0.6)
        bottom += vals
    for i, m in enumerate(moms):
        e = view.at_batch[m]
        if e.host_bytes:
            ax_mem.annotate(f"+{format_bytes(e.host_bytes)} host", (i, bottom[i]), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
    cap = view.capacity / gib
    highest = float(bottom.max()) if len(bottom) else 0.0
    label = f"{s.gpu}: {format_bytes(view.capacity)}"
    if highest and cap > 8 * highest:  # the capacity line would flatten the bars: say it instead
        top = highest * 1.35
        ax_mem.set_xlabel(f"{label}: off scale, {cap / highest:,.0f}x the largest peak", fontsize=8)
    else:
        top = max(cap, highest) * 1.25  # the legend's row above the tallest bar and the capacity line
        ax_mem.axhline(cap, color="black", ls="--", lw=1)
        ax_mem.text(len(moms) - 0.5 if moms else 0, cap, label, va="bottom", ha="right", fontsize=8)
    ax_mem.set_xticks(x, moms, rotation=20, ha="right", fontsize=8)
    ax_mem.set_ylabel(f"{unit} (predicted peak)")
    # titles at a fixed height: placing them above the tick labels measures every label (a fifth of an update)
    ax_mem.set_title(f"{s.model} at batch {s.batch_size}, {s.precision}", fontsize=10, y=1)
    # one row along the top, above every bar (`top`), where "upper left" covered the first, tallest one
    ax_mem.legend(fontsize=7, loc="upper center", ncols=len(PARTS), frameon=False, handlelength=1.0,
                  handletextpad=0.4, columnspacing=0.8)
    ax_mem.relim()  # the limits of this update's artists only (a kept panel remembers the last ones)
    ax_mem.autoscale_view()
    ax_mem.set_ylim(0, top or 1)

    points = measured(s)
    for m in moms:
        style = mom_style(m)
        c = style["color"]
        curve = view.curves[m]
        fit = [e for e in curve if e.fits]
        if fit:
            # exact over the others: ckpt-auto is exact wherever exact fits, and would hide it
            ax_tp.plot([e.batch_size for e in fit], [e.throughput for e in fit], color=c, label=m, lw=1.5,
                       ls=style.get("linestyle", "-"), zorder=2.5 if m == "exact" else 2)
            last = fit[-1]
            ax_tp.plot([last.batch_size], [last.throughput], style.get("marker", "o"), color=c, ms=4)
        over = [e for e in curve if not e.fits]
        if over:
            first = over[0]
            ax_tp.plot([first.batch_size], [first.batch_size / first.step_time_s], **OOM_MARKER)
        pts = [r for r in points if r.get("mom") == m]
        if pts:
            ax_tp.scatter([r["batch_size"] for r in pts], [r["throughput"] for r in pts], s=24,
                          facecolors="none", edgecolors=c, linewidths=1.3, label=f"{m} measured", zorder=3)
    ax_tp.axvline(s.batch_size, color="grey", ls=":", lw=1)
    ax_tp.relim()
    ax_tp.autoscale_view()
    ax_tp.set_xlabel("batch size" + (f"\n{_wrap(view.provenance, 90)}" if view.provenance else ""), fontsize=8)
    ax_tp.set_ylabel("samples/s (predicted)" + ("" if view.calibrated else ", uncalibrated"))
    ax_tp.set_title(_wrap(view.verdict, 70), fontsize=9, y=1)
    if moms:
        ax_tp.legend(fontsize=7, loc="upper left")
    return fig


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def png(fig) -> bytes:
    """The widget's image. Least zlib effort: the bytes cross a loopback socket, and compressing them
    harder cost a tenth of an update."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI, pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def save(view: View, path_without_ext) -> list[Path]:
    """Draw `view` and write ``<path>.png`` and ``<path>.pdf`` (as `momlab.plots.save`)."""
    return plots_save(figure(view), str(path_without_ext).removesuffix(".png"))


# -- widgets -------------------------------------------------------------------------------------

def _slider_range(model: str, key: str, size: dict) -> tuple[int, int, int]:
    from momlab.search import size_step

    spec = catalog.spec(resolve(model))
    step = size_step(model, key, **{k: v for k, v in size.items() if k != key})
    default = max(spec.size[key], spec.tiny.get(key, spec.size[key]))
    low = step if key != "image_size" else max(step, spec.tiny.get(key, step))
    high = max(default * 2, low + step)
    return low, high // step * step, step


class App:
    """The widgets of notebook 06 around `compute` and `figure`; `update()` redraws."""

    def __init__(self, state: State, figure_path=None):
        import ipywidgets as w

        self.state = state
        self.figure_path = figure_path
        self.fig = new_figure()
        self.last_update_s = math.nan
        self._busy = False
        style = {"description_width": "80px"}
        options = [(m, m) for m in catalog.models()]
        if not isinstance(state.model, str):  # a given model: listed by its name beside the catalog
            options.append((name_of(state.model), state.model))
        self.model = w.Dropdown(options=options, value=state.model, description="model", style=style)
        self.gpu = w.Dropdown(options=gpus(), value=state.gpu, description="GPU", style=style)
        self.precision = w.Dropdown(options=["fp32", "bf16", "fp16"], value=state.precision, description="precision",
                                    style=style)
        import momlab.moms

        options = list(dict.fromkeys([*momlab.moms.moms(), "quant4+ckpt", "swap+ckpt", "quant4+swap", *state.moms]))
        self.moms = w.SelectMultiple(options=options, value=tuple(state.moms), description="MOMs", rows=6, style=style)
        self.batch = w.IntSlider(value=state.batch_size, min=1, max=max(64, 4 * state.batch_size), description="batch",
                                 continuous_update=False, style=style)
        self.sliders = {}
        self.size_box = w.VBox()
        self.image = w.Image(format="png")
        self.verdict = w.HTML()
        self.status = w.HTML()
        self._build_sliders()
        for widget in (self.gpu, self.precision, self.moms, self.batch):
            widget.observe(self._changed, names="value")
        self.model.observe(self._model_changed, names="value")
        # controls in columns above the figure: beside it, a notebook's ~1000 pixels cut them off on the left
        controls = w.HBox([w.VBox([self.model, self.gpu, self.precision, self.batch]), self.moms, self.size_box],
                          layout=w.Layout(flex_flow="row wrap"))
        self.image.layout = w.Layout(max_width="100%", height="auto")  # its own 990 pixels where they fit
        self.widget = w.VBox([controls, self.image, self.verdict, self.status])
        self.update()

    def _build_sliders(self):
        import ipywidgets as w

        size = self.state.resolved_size()
        self.sliders = {}
        for key in _sliders(self.state.model):
            low, high, step = _slider_range(self.state.model, key, size)
            s = w.IntSlider(value=size[key], min=low, max=max(high, size[key]), step=step, description=key,
                            continuous_update=False, style={"description_width": "80px"})
            s.observe(self._changed, names="value")
            self.sliders[key] = s
        self.size_box.children = list(self.sliders.values())

    def _model_changed(self, change):
        self.state = replace(self.state, model=change["new"], size={})
        self._build_sliders()
        self.update()

    def _changed(self, change=None):
        if self._busy:
            return
        self.state = replace(
            self.state, gpu=self.gpu.value, precision=self.precision.value, moms=tuple(self.moms.value),
            batch_size=int(self.batch.value),
            size={**self.state.size, **{k: int(s.value) for k, s in self.sliders.items()}})
        self.update()

    def update(self) -> View:
        """Recompute and redraw (traces only what is not cached yet)."""
        t0 = time.perf_counter()
        try:
            view = compute(self.state)
        except ValueError as exc:
            self.status.value = f"<span style='color:#b00'>{exc}</span>"
            return None
        figure(view, self.fig)
        self.image.value = png(self.fig)
        self.verdict.value = f"<b>{view.verdict}</b>" + "".join(
            f"<br>{m} does not apply: {why}" for m, why in view.skipped.items())
        top = max([*view.max_batch.values(), self.state.batch_size, 8])
        self._busy = True  # widening the slider must not trigger another update
        try:
            self.batch.max = max(self.batch.max, int(top * 1.25) + 1)
        finally:
            self._busy = False
        self.last_update_s = time.perf_counter() - t0
        self.status.value = (f"<small>updated in {self.last_update_s:.2f} s; "
                             f"{'calibrated' if view.calibrated else 'uncalibrated'} step times "
                             f"({calibrate(self.state.gpu, results=self.state.results).describe()})</small>")
        if self.figure_path:
            self.fig.savefig(self.figure_path, dpi=110)
        self.view = view
        return view


def app(state: State | None = None, *, figure_path=None, **kw) -> App:
    """The what-if widgets for `state` (or ``State(**kw)``); ``app(...).widget`` is what to display."""
    if state is None:
        state = State(**kw)
    return App(state, figure_path)


# -- which MOM lets a model train at all (notebook 08) ---------------------------------------------

def train_at_all(model, gpus_: list[str], moms=None, *, precision: str = "bf16", results=None, **size):
    """Per GPU and MOM, predicted: does `model` train at all (largest batch > 0), its best batch and speed.

    One row per (gpu, mom): ``max_batch`` (0: not even batch 1 fits),
    ``best_batch`` and ``throughput`` (samples/s, the highest predicted
    under the memory), ``tokens_per_s`` (throughput x seq_len, for text),
    ``peak_at_1`` (predicted peak at batch 1) against ``capacity``, and
    ``calibrated`` (step times fitted from measurements of that GPU, else
    the default efficiency). Every number is a prediction (`momlab.estimate`).
    """
    import pandas as pd

    from momlab.estimate import verdict

    model = resolve(model)
    full = catalog.resolve_size(model, size)
    rows = []
    for g in gpus_:
        v = verdict(model, moms, gpu=g, precision=precision, batch_size=1, results=results, **size)
        for r in v["rows"]:
            if not r.get("applicable"):
                continue
            rows.append({"gpu": g, "mom": r["mom"], "trains": r["max_batch"] > 0, "max_batch": r["max_batch"],
                         "best_batch": r["best_batch"], "throughput": r["throughput"],
                         "tokens_per_s": r["throughput"] * full["seq_len"] if "seq_len" in full else math.nan,
                         "peak_at_1": r["peak_at_batch"], "capacity": get_gpu(g).memory_bytes,
                         "calibrated": r["calibrated"], "source": "predicted"})
    df = pd.DataFrame(rows)
    df.attrs.update(model=name_of(model), precision=precision, size=full)
    return df
