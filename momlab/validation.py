"""Predicted against the paper's V100: memory (maximum batch, breakdowns, slopes) and speed
(S1 ratios and verdicts, throughput curves, the S2' depth crossing).

The paper measured on one V100 (16 GB) what the estimator predicts without
it, in code momlab did not write, so the comparison is independent evidence
(STYLE 14). Every prediction is recomputed from `momlab.estimate` (traced
memory, the calibrated time model of momlab.timemodel); nothing predicted is
stored. The measurements are the paper's own (`momlab.reference`).

Memory, predicted with the paper's own software stack (``setup="paper"``,
`momlab.workload.stack`) at its precision per model:

- `max_batch_table`: per (model, MOM) of the paper's one-GPU S1 sweeps, the
  predicted largest batch against the paper's. The paper's point is the
  midpoint between its largest batch that fit and its smallest that failed
  (its sweeps step by 4 or 8, so the true limit lies between); where it
  recorded no failure, its largest fit (a lower bound, marked). Asked-for
  configurations the paper never ran are rows marked "no paper data";
  `max_batch_summary` gives the median error of the comparable rows.
- `breakdown_table`: activations, model-related (weights, gradients,
  optimizer state) and peak at the paper's breakdown batch sizes.
- `slope_table`: peak memory per extra sample, and what the step keeps at
  the end of forward, against the paper's memory sweeps.
- `largest_table`: S2, the largest BERT-L that trains at batch 24 per MOM,
  deeper or wider, predicted against the paper's depth and width sweeps
  (the size where its run last fit and the next, where it failed).
- `paper_headroom`: the paper against itself. Where its run stopped, as a
  share of the batch at which its own peak-memory records (a line through
  its memory sweep) fill the card. Near 1 its run stopped where its
  allocated memory filled the GPU, which is what momlab predicts; far below
  1 something its allocated-memory records do not show stopped it (the swap
  rows: most likely host memory). `max_batch_table` marks rows under
  `GPU_BOUND_HEADROOM` (``gpu_bound=False``, kept comparable) and
  `max_batch_summary` gives their median error both with and without them.

Speed, with the same stack: the calibration uses only the paper's Exact
rows (traced with the paper's stack: the S1 sweeps' and the depth study's,
`momlab.timemodel.reference_records`); the MOM rows, Checkpoint's depth
curve and where it overtakes Exact (`s1_table`, `verdicts`, `curves`,
`depth_curves`, `crossing`, `summary`) are what this checks the time model
against. The paper's swap was GACT's, whose copies run on the compute
stream (`momlab.estimate.swap_schedule`).

Rows where the paper's MOM is another system than momlab's are shown and
marked (``comparable=False``, `OTHER_SYSTEM`): ResNet "Checkpoint" was DTR
(dynamic rematerialization under a budget; momlab predicts its per-block
checkpointing), BERT "Swap" was DeepSpeed ZeRO-3 offload, GPT's "cpu-off"
DeepSpeed CPU offload. Nothing here is fitted to these numbers: they are
the test, not the input.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from momlab import catalog, reference
from momlab.errors import check_choice
from momlab.estimate import (ALLOCATORS, best_throughput, calibrate, cuda_overheads, estimate, predict_max_batch,
                             predict_max_size, profile, throughput_curve)
from momlab.gpus import get as get_gpu
from momlab.timemodel import StepTime

GPU = "V100-16"
# every prediction here is made with the paper's own software stack (`momlab.workload.stack`): what its runs ran
SETUP = "paper"
MODELS = ["resnet50", "wide-resnet50-2", "swin-large", "bert-large", "gpt3-small", "gpt3-medium"]
# the paper's rows and the momlab MOM predicted for each; a note marks a row whose paper MOM is another system
PAPER_MOMS = {"exact": "exact", "ckpt": "ckpt", "ckpt-dtr": "ckpt", "quant4": "quant4", "swap": "swap",
              "quant4+swap": "quant4+swap", "quant4+ckpt": "quant4+ckpt", "swap+ckpt": "swap+ckpt"}
# (at the model's headline precision: BERT-L's earlier fp32 sweep ran GACT's own swap, `reference.OTHER_PRECISIONS`)
OTHER_SYSTEM = {
    ("bert-large", "swap"): "paper: DeepSpeed ZeRO-3 offload",
    ("gpt3-small", "cpu-off"): "paper: DeepSpeed CPU offload",
    **{(m, "ckpt-dtr"): "paper: DTR (dynamic tensor rematerialization)"
       for m in ("resnet50", "wide-resnet50-2", "resnet152")},
}
# the paper's batch sizes of its memory-breakdown figure (background_memory.png)
BREAKDOWN_BATCH = {"resnet50": 80, "bert-large": 36, "swin-large": 36, "gpt3-small": 6}
# a paper run that stopped below this share of the batch at which its own peak records fill the card was not
# stopped by GPU memory: the most fragmentation momlab's caching-allocator replay finds on the paper's
# configurations is about a quarter of the reserve (swin-large ckpt), far from half (docs/LOG.md 2026-12-04)
GPU_BOUND_HEADROOM = 0.5
# the paper's S1 models whose maximum batch momlab predicts by default (ResNet-152, GPT3-Medium have data too)
MEMORY_MODELS = ["resnet50", "wide-resnet50-2", "swin-large", "bert-large", "gpt3-small"]
# the paper's S2 sweeps (BERT-large at batch 24, `largest_table`): deeper and wider
LARGEST_DIMS = ("num_layers", "hidden_size")
# the paper's depth study (S2'): BERT-large, Checkpoint against Exact
DEPTH_MOMS = ("exact", "ckpt")


def _precision(model: str, precision: str | None) -> str:
    """The precision a row of `model` is predicted at: `precision`, or the model's headline one."""
    return precision or reference.PRECISION.get(model, "fp32")


def _other_system(model: str, mom: str, precision: str | None) -> str:
    """The note of a paper row whose MOM is another system than momlab's ("" when it is momlab's)."""
    same = precision is None or precision == reference.PRECISION.get(model)
    return OTHER_SYSTEM.get((model, mom), "") if same else ""


def _models(models, precision: str | None, default: list[str]) -> list[str]:
    """`models`, or those of `default` the paper swept at `precision` (all of them at the headline ones)."""
    if models is not None:
        return list(models)
    if precision is None:
        return list(default)
    have = set(reference.paper_s1(precision=precision)["model"])
    return [m for m in default if m in have]


def s1_table(models=None, *, gpu: str = GPU, results=None, precision: str | None = None) -> pd.DataFrame:
    """Per (model, MOM) of the paper's one-V100 S1 table: predicted and measured maximum throughput.

    `precision`: None for each model's headline precision (the paper's S1
    table), or another the paper swept at (``"fp32"``: BERT-L's earlier fp32
    runs and the ResNets, `momlab.reference.OTHER_PRECISIONS`); `models`
    default: every model with sweeps at it.

    Columns: model, precision, mom (the paper's label), predicted_mom, note (empty:
    comparable), comparable, paper_max_batch, pred_max_batch,
    paper_best_batch, pred_best_batch, paper_throughput, pred_throughput
    (samples/s, predicted), paper_ratio and pred_ratio (MOM/Exact maximum
    throughput), ratio_error (pred_ratio - paper_ratio), throughput_error
    (pred_throughput / paper_throughput - 1).

    The same like for like, the time model alone: pred_best_paper_batch and
    pred_throughput_paper_batches (the predicted best of the batch sizes the
    paper ran that fit, whether or not momlab predicts them to fit: the paper's
    memory, momlab's speed), pred_ratio_paper_batches and
    ratio_error_paper_batches. Where the two ratios differ, the predicted
    maximum batch moved the verdict; NaN where the traces do not align (each
    batch would be a trace of its own).
    """
    models = _models(models, precision, MODELS)
    paper = reference.paper_s1(precision=precision)
    runs = reference.paper_s1_runs(precision=precision)
    rows = []
    for model in models:
        prec = _precision(model, precision)
        mine = paper[(paper["model"] == model) & paper["mom"].isin(list(PAPER_MOMS))]
        pred, failed = {}, {}
        for mom in dict.fromkeys(PAPER_MOMS[m] for m in mine["mom"]):
            try:
                mb = predict_max_batch(model, mom, gpu=gpu, precision=prec, setup=SETUP)
            except RuntimeError as exc:  # traces that do not align: no closed-form max batch; shown, not hidden
                pred[mom], failed[mom] = (0, 0, math.nan), f"not predicted: {str(exc).split(':')[-1].strip()}"
                continue
            best = best_throughput(model, mom, gpu=gpu, precision=prec, results=results, max_batch=mb,
                                   setup=SETUP)
            pred[mom] = (mb, best.batch_size if best else 0, best.throughput if best else 0.0)
        for r in mine.itertuples(index=False):
            mom = PAPER_MOMS[r.mom]
            mb, bb, tp = pred[mom]
            note = _other_system(model, r.mom, precision) or failed.get(mom, "")
            ran = runs[(runs["model"] == model) & (runs["mom"] == r.mom) & runs["fits"]
                       & runs["throughput"].notna()]
            pb, ptp = (_best_of(model, mom, sorted({int(b) for b in ran["batch_size"]}), gpu, results, prec)
                       if mom not in failed else (0, math.nan))
            rows.append({"model": model, "precision": prec, "mom": r.mom, "predicted_mom": mom, "note": note,
                         "comparable": not note,
                         "paper_max_batch": int(r.max_batch_size), "pred_max_batch": mb,
                         "paper_best_batch": int(r.best_batch_size), "pred_best_batch": bb,
                         "paper_throughput": float(r.max_throughput), "pred_throughput": tp,
                         "paper_ratio": float(r.ratio), "pred_best_paper_batch": pb,
                         "pred_throughput_paper_batches": ptp})
    t = pd.DataFrame(rows)
    for suffix in ("", "_paper_batches"):
        base = t[t["mom"] == "exact"].set_index("model")[f"pred_throughput{suffix}"]
        t[f"pred_ratio{suffix}"] = t[f"pred_throughput{suffix}"] / t["model"].map(base)
        t[f"ratio_error{suffix}"] = t[f"pred_ratio{suffix}"] - t["paper_ratio"]
    t["throughput_error"] = t["pred_throughput"] / t["paper_throughput"] - 1
    return t


def _at_batches(model: str, mom: str, batches: list[int], gpu: str, results, prec: str) -> list | None:
    """The paper stack's predicted steps of `model` at `batches`, fitting or not; None where the traces do not
    align (each batch would then be a trace of its own)."""
    if not profile(model, mom, precision=prec, setup=SETUP).aligned:
        return None
    return throughput_curve(model, mom, gpu=gpu, batch_sizes=batches, precision=prec, results=results, setup=SETUP)


def _best_of(model: str, mom: str, batches: list[int], gpu: str, results, prec: str) -> tuple[int, float]:
    """The predicted best (batch, samples/s) of `batches`, fitting or not; (0, NaN) where there are none or the
    traces do not align."""
    est = _at_batches(model, mom, batches, gpu, results, prec) if batches else None
    if not est:
        return 0, math.nan
    b, tp = max(((e.batch_size, e.batch_size / e.step_time_s) for e in est), key=lambda x: x[1])
    return int(b), float(tp)


def verdicts(table: pd.DataFrame) -> pd.DataFrame:
    """Per model, the S1 verdict: which MOMs beat Exact (ratio > 1), predicted and in the paper.

    Columns: model, paper_beat, pred_beat (sorted lists of paper labels),
    same (the two sets are equal), paper_best, pred_best (the winner, Exact
    included); with `s1_table`'s like-for-like ratios, pred_beat_paper_batches
    and same_paper_batches (the verdict of the time model alone, at the
    batches the paper ran).
    """
    out = []
    for model, g in table.groupby("model", sort=False):
        paper = sorted(g.loc[g["paper_ratio"] > 1, "mom"])
        pred = sorted(g.loc[g["pred_ratio"] > 1, "mom"])
        row = {"model": model, "paper_beat": paper, "pred_beat": pred, "same": paper == pred,
               "paper_best": g.loc[g["paper_ratio"].idxmax(), "mom"],
               "pred_best": g.loc[g["pred_ratio"].idxmax(), "mom"]}
        if "pred_ratio_paper_batches" in g:
            like = sorted(g.loc[g["pred_ratio_paper_batches"] > 1, "mom"])
            row.update(pred_beat_paper_batches=like, same_paper_batches=paper == like)
        out.append(row)
    return pd.DataFrame(out)


def curves(model: str, *, gpu: str = GPU, results=None, precision: str | None = None) -> pd.DataFrame:
    """The predicted throughput at every batch size the paper measured, beside the measurement, per MOM
    (at the model's headline precision, or `precision`).

    Columns: model, precision, mom (paper label), batch_size, paper_throughput (NaN: the
    paper's run did not fit), pred_throughput (batch / predicted step time,
    whether or not it is predicted to fit), pred_fits.
    """
    prec = _precision(model, precision)
    runs = reference.paper_s1_runs(precision=precision)
    runs = runs[(runs["model"] == model) & runs["mom"].isin(list(PAPER_MOMS))]
    rows = []
    for mom, g in runs.groupby("mom", sort=False):
        est = _at_batches(model, PAPER_MOMS[mom], sorted({int(b) for b in g["batch_size"]}), gpu, results, prec)
        if est is None:
            continue
        measured = g.groupby("batch_size")["throughput"].max()
        for e in est:
            rows.append({"model": model, "precision": prec, "mom": mom, "batch_size": e.batch_size,
                         "paper_throughput": float(measured.get(e.batch_size, math.nan)),
                         "pred_throughput": e.batch_size / e.step_time_s, "pred_fits": e.fits})
    return pd.DataFrame(rows)


def utilization_table(models=None, *, gpu: str = GPU, results=None) -> pd.DataFrame:
    """Predicted against the paper's GPU utilization: where a step's time goes, host or GPU.

    The paper sampled nvidia-smi's utilization (the share of time a kernel
    runs on the GPU) over Exact and Checkpoint runs of one V100
    (``gpu_utilization`` in `momlab.reference`). The time model predicts it
    as the kernels' device seconds over the whole step's wall time
    (`momlab.timemodel.StepTime.gpu_utilization`): under 1 where the GPU
    waits for the host to issue kernels (or, at fp16, for the loss scaler's
    check). It tells apart what a throughput curve cannot: a step predicted
    right for the wrong reason (host time where the GPU was busy). nvidia-smi
    samples the whole loop, data loading and logging included, and each run's
    rows repeat noisily (BERT-L exact at batch 20: 12%), so compare medians,
    not rows. Nothing is fitted to it.

    One row per paper run (model, mom, batch_size, paper_utilization,
    pred_utilization, error: predicted minus measured share,
    paper_step_time_s, pred_step_time_s: each over the window the paper
    timed, pred_busy_s, source); `models`: those to show (default all that
    have utilization records).
    """
    runs = reference.paper_utilization_runs()
    runs = runs[runs["mom"].isin(list(PAPER_MOMS))]
    if models is not None:
        runs = runs[runs["model"].isin(list(models))]
    rows = []
    for r in runs.itertuples(index=False):
        e = estimate(r.model, PAPER_MOMS[r.mom], batch_size=int(r.batch_size), gpu=gpu,
                     precision=r.precision, results=results, setup=SETUP)
        measured_step = r.step_time_s if r.step_time_s == r.step_time_s else r.batch_size / r.throughput
        util = StepTime(step_time_s=e.step_time_s, **e.time).gpu_utilization  # `Estimate.time`: the rest of it
        rows.append({"model": r.model, "mom": r.mom, "batch_size": int(r.batch_size),
                     "paper_utilization": float(r.gpu_utilization), "pred_utilization": util,
                     "error": util - float(r.gpu_utilization),
                     "paper_step_time_s": float(measured_step), "pred_step_time_s": e.step_time_s,
                     "pred_busy_s": float(e.time["busy_s"]), "source": r.source})
    return pd.DataFrame(rows, columns=["model", "mom", "batch_size", "paper_utilization", "pred_utilization",
                                       "error", "paper_step_time_s", "pred_step_time_s", "pred_busy_s", "source"])


def utilization_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per (model, MOM) of `utilization_table`: runs, the batch range, the median measured and predicted
    utilization and the median error (predicted minus measured share)."""
    g = table.groupby(["model", "mom"], sort=False)
    return pd.DataFrame({"runs": g.size(), "batch_lo": g["batch_size"].min(), "batch_hi": g["batch_size"].max(),
                         "paper_median": g["paper_utilization"].median(),
                         "pred_median": g["pred_utilization"].median(),
                         "median_error": g["error"].median()}).reset_index()


def depth_curves(depths=None, *, model: str = "bert-large", gpu: str = GPU, results=None,
                 traced=(12, 24), max_batch: int = 4096) -> pd.DataFrame:
    """S2': predicted maximum throughput (best batch that fits) against depth, per MOM, beside the paper's.

    A stack of identical layers makes every per-step cost affine in the
    depth (each layer adds the same ops, saved bytes and weights): the step
    time and the peak at each batch are read off traces at two depths
    (`traced`) and interpolated / extrapolated in depth, rather than traced
    at every depth (a bert-large trace is seconds; the paper's study has 16
    depths).

    Two predictions per depth. ``pred_throughput`` is the best over every
    batch that fits (what a user searching finely would get).
    ``pred_throughput_paper_batches`` is the best over the batch sizes the
    paper tried at that depth (`momlab.reference.paper_scaling_runs`), which
    is the quantity the paper measured: its depth study stepped coarsely
    (exact at 38 layers tried 12 and 20 only), so its maximum throughput is
    the best of those that fit. NaN where the paper has no run at that depth.

    Columns: mom, num_layers, pred_max_batch, pred_best_batch,
    pred_throughput, pred_best_paper_batch, pred_throughput_paper_batches,
    paper_best_batch, paper_throughput (NaN where the paper has no point).
    """
    study = _Study("num_layers", model, gpu, max_batch)
    depths = sorted(set(study.paper["num_layers"])) if depths is None else list(depths)
    d1, d2 = traced
    rows = []
    for mom in DEPTH_MOMS:
        peaks, times = [], []
        for d in traced:
            peak, t = study.predict(mom, results, num_layers=d)
            peaks.append(peak)
            times.append(t)
        for d in depths:
            w = (d - d1) / (d2 - d1)
            rows.append(study.row(mom, d, peaks[0] + w * (peaks[1] - peaks[0]), times[0] + w * (times[1] - times[0])))
    return pd.DataFrame(rows)


def width_curves(widths=None, *, model: str = "bert-large", gpu: str = GPU, results=None,
                 max_batch: int = 4096) -> pd.DataFrame:
    """S2' along the width: predicted maximum throughput against ``hidden_size``, per MOM, beside the paper's.

    The paper grew BERT-L's width by setting only ``hidden_size``: 16 heads
    and the pretrained 4096-wide MLP at every width (`momlab.workload.Stack`'s
    ``mlp_width``), as the paper stack builds it. A width changes every op's
    shape, so each is a trace of its own (a stack traced 3 and 4 layers deep
    and unrolled, `momlab.estimate`: seconds a width, cached). An
    out-of-sample check of memory and time together: no run of the width
    study is in the V100's calibration (`momlab.timemodel.reference_records`),
    Exact's included. Predictions as `depth_curves`' (over every batch, and
    over the batches the paper tried at that width; the width study's records
    kept only the runs that fit, so there the batches are the paper's memory
    answer and the prediction checks the time model alone).

    Columns: mom, hidden_size, then as `depth_curves`.
    """
    study = _Study("hidden_size", model, gpu, max_batch)
    widths = sorted(set(study.paper["hidden_size"])) if widths is None else list(widths)
    rows = []
    for mom in DEPTH_MOMS:
        for w in widths:
            rows.append(study.row(mom, w, *study.predict(mom, results, hidden_size=w)))
    return pd.DataFrame(rows)


def _usable(g) -> int:
    """What the allocator may hold on GPU `g` under the paper's stack: its memory less the CUDA context."""
    return g.memory_bytes - cuda_overheads(g, SETUP).context_bytes


class _Study:
    """One of the paper's S2' scaling studies along `dim` (`momlab.reference.paper_scaling`): the batch grid its
    predictions are made on, and a row of predicted and measured maximum throughput at a size."""

    def __init__(self, dim: str, model: str, gpu: str, max_batch: int):
        self.dim, self.model, self.gpu = dim, model, gpu
        self.paper = reference.paper_scaling(dim, model)
        self.tried = reference.paper_scaling_runs(dim, model)
        self.precision = reference.PRECISION[model]
        g = self.g = get_gpu(gpu)
        self.cap = _usable(g)
        # every batch up to 512 (the paper's larger models fit a few dozen), log-spaced above, and the paper's own
        grid = np.unique(np.concatenate([np.arange(1, min(512, max_batch) + 1),
                                         np.round(np.geomspace(1, max_batch, 96)).astype(int),
                                         self.tried["batch_size"].astype(int).to_numpy()]))
        self.grid = grid[grid <= max_batch]

    def predict(self, mom: str, results, **size) -> tuple[np.ndarray, np.ndarray]:
        """The predicted peak bytes and step seconds at every batch of the grid, at `size`."""
        prof = profile(self.model, mom, precision=self.precision, kernels=self.g.kernels, setup=SETUP, **size)
        est = throughput_curve(self.model, mom, gpu=self.gpu, batch_sizes=self.grid, precision=self.precision,
                               results=results, setup=SETUP, **size)
        return prof.peak_bytes(self.grid), np.array([e.step_time_s for e in est])

    def row(self, mom: str, size: int, peak: np.ndarray, step: np.ndarray) -> dict:
        """The curves' row of `mom` at `size` from its predicted `peak` and `step` over the grid."""
        grid = self.grid
        fits = peak <= self.cap
        tp = np.where(fits, grid / step, 0.0)
        i = int(np.argmax(tp))
        fit_batches = grid[fits]
        ran = self.tried[(self.tried["mom"] == mom) & (self.tried[f"size.{self.dim}"] == size)]["batch_size"]
        on = np.isin(grid, ran.astype(int).to_numpy())
        tp_paper = np.where(fits & on, tp, 0.0)
        j = int(np.argmax(tp_paper))
        got = self.paper[(self.paper["mom"] == mom) & (self.paper[self.dim] == size)]
        return {"mom": mom, self.dim: size,
                "pred_max_batch": int(fit_batches.max()) if len(fit_batches) else 0,
                "pred_best_batch": int(grid[i]) if tp[i] > 0 else 0, "pred_throughput": float(tp[i]),
                "pred_best_paper_batch": int(grid[j]) if tp_paper[j] > 0 else 0,
                "pred_throughput_paper_batches": float(tp_paper[j]) if on.any() else math.nan,
                "paper_best_batch": int(got["best_batch_size"].iloc[0]) if len(got) else 0,
                "paper_throughput": float(got["max_throughput"].iloc[0]) if len(got) else math.nan}


def crossing(curves: pd.DataFrame, column: str, mom: str = "ckpt", base: str = "exact",
             dim: str = "num_layers") -> float:
    """The size along `dim` (`depth_curves`' num_layers, `width_curves`' hidden_size) at which `mom`'s maximum
    throughput overtakes `base`'s (linear between the sizes around the first sign change of their
    difference); NaN when it never does."""
    a = curves[curves["mom"] == mom].set_index(dim)[column]
    b = curves[curves["mom"] == base].set_index(dim)[column]
    both = pd.concat([a, b], axis=1, keys=["m", "b"]).dropna()
    both = both[(both["m"] > 0) | (both["b"] > 0)]
    diff = (both["m"] - both["b"]).sort_index()
    for (x0, y0), (x1, y1) in zip(diff.items(), list(diff.items())[1:]):
        if y0 <= 0 < y1:
            return float(x0 + (x1 - x0) * (-y0) / (y1 - y0))
    return math.nan


def summary(models=None, *, gpu: str = GPU, results=None, depth: bool = True, width: bool = False) -> dict:
    """The whole check: the S1 table, the verdicts, the depth curves and crossings, the calibration; and
    ``other``, the S1 table of the paper's sweeps at another precision than a model's headline one
    (`momlab.reference.OTHER_PRECISIONS`: BERT-L's fp32 runs; their Exact curve is in the calibration, their
    MOM rows are not), with ``other_verdicts``. `width`: also the width curves (`width_curves`, a trace per
    width: minutes the first time) as ``width``, with their crossings (``pred_width_crossing``,
    ``pred_width_crossing_paper_batches``, ``paper_width_crossing``: hidden sizes)."""
    table = s1_table(models, gpu=gpu, results=results)
    other = [s1_table([m], gpu=gpu, results=results, precision=p) for m, p in reference.other_sweeps(models)]
    other = pd.concat(other, ignore_index=True) if other else table.iloc[:0]
    out = {"table": table, "verdicts": verdicts(table), "calibration": calibrate(gpu, results=results),
           "other": other, "other_verdicts": verdicts(other)}
    if depth:
        d = depth_curves(gpu=gpu, results=results)
        out.update(depth=d, pred_crossing=crossing(d, "pred_throughput"),
                   pred_crossing_paper_batches=crossing(d, "pred_throughput_paper_batches"),
                   paper_crossing=crossing(d, "paper_throughput"))
    if width:
        w = width_curves(gpu=gpu, results=results)
        out.update(width=w, pred_width_crossing=crossing(w, "pred_throughput", dim="hidden_size"),
                   pred_width_crossing_paper_batches=crossing(w, "pred_throughput_paper_batches", dim="hidden_size"),
                   paper_width_crossing=crossing(w, "paper_throughput", dim="hidden_size"))
    return out


def ratio_text(table: pd.DataFrame) -> str:
    """The ratio table as text, with the error per row (`make bench`); "at the paper's batches": the ratio of
    the predicted best of the batch sizes the paper ran that fit (its memory, momlab's speed)."""
    lines = [f"{'':21s} {'':12s} {'MOM/Exact ratio':^23s}  {'at paper batches':^16s}",
             f"{'model, precision':21s} {'MOM':12s} {'paper':>7s} {'pred':>7s} {'error':>7s}  "
             f"{'pred':>7s} {'error':>7s}  "
             f"{'paper tp':>9s} {'pred tp':>9s}  {'max batch p/pred':>16s}  note"]
    for r in table.itertuples(index=False):
        lines.append(f"{r.model + ' ' + r.precision:21s} {r.mom:12s} {r.paper_ratio:7.3f} {r.pred_ratio:7.3f} "
                     f"{r.ratio_error:+7.3f}  "
                     f"{r.pred_ratio_paper_batches:7.3f} {r.ratio_error_paper_batches:+7.3f}  "
                     f"{r.paper_throughput:9.1f} {r.pred_throughput:9.1f}  "
                     f"{r.paper_max_batch:>7d}/{r.pred_max_batch:<8d}  {r.note or ''}")
    comp = table[table["comparable"] & (table["mom"] != "exact")]
    for col, what in (("ratio_error", "predicted"), ("ratio_error_paper_batches", "at the paper's batches")):
        within = int((comp[col].abs() <= 0.15).sum())
        lines.append(f"comparable MOM rows within 0.15 of the paper's ratio, {what}: {within} of {len(comp)}; "
                     f"median |error| {comp[col].abs().median():.3f}; "
                     f"rows not predicted: {int(comp[col].isna().sum())}")
    return "\n".join(lines)


# -- memory: maximum batch, breakdowns, per-sample slopes --------------------------------------

# the models the paper swept memory against batch size for, at their headline precision (`slope_table`)
SLOPE_MODELS = ("bert-large", "resnet50", "swin-large", "wide-resnet50-2", "gpt3-small")
# the models whose peaks the paper recorded and momlab builds (`peak_table`): those of `slope_table`, the other two
# S1 models (ResNet-152, GPT3-Medium) and BERT-base, whose runs only the paper's breakdown figure used
PEAK_MODELS = (*SLOPE_MODELS, "resnet152", "gpt3-medium", "bert-base")
PEAK_COLUMNS = ["model", "precision", "mom", "size", "batch_size", "experiment", "paper_peak_bytes",
                "predicted_peak_bytes", "error", "comparable", "note", "source"]


def paper_headroom(models=None, *, precision: str | None = None) -> pd.DataFrame:
    """Where each of the paper's one-V100 runs stopped, against where its own peak records fill the card.

    Per (model, MOM) of the paper's S1 sweeps (`models`: default every model;
    `precision`: each model's headline one, or the sweeps at that precision)
    with a memory sweep at the same precision and default size: the
    least-squares line of the paper's peak (allocated bytes) against batch,
    and ``records_full_batch``, the batch at which that line reaches the
    card's memory less the paper stack's CUDA context (what its allocator
    could have). ``headroom`` = the paper's smallest failing batch /
    records_full_batch; NaN where no run failed (nothing stopped it). A
    headroom near 1: the run stopped where its allocated memory filled the
    GPU. Well below 1: not GPU memory (see `GPU_BOUND_HEADROOM`). Columns:
    model, mom, paper_oom_batch, mem_runs, bytes_per_sample, records_full_batch,
    headroom. Only the paper's data: no prediction is involved.
    """
    g = get_gpu(GPU)
    usable = _usable(g)
    s1 = reference.paper_s1(precision=precision)
    rows = []
    for model in dict.fromkeys(s1["model"]):
        if models is not None and model not in models:
            continue
        try:
            lines = reference.paper_memory_per_sample(model, precision).set_index("mom")
        except ValueError:  # no memory sweep of this model
            continue
        for r in s1[s1["model"] == model].itertuples(index=False):
            if r.mom not in lines.index:
                continue
            slope, intercept, n = lines.loc[r.mom, ["bytes_per_sample", "intercept_bytes", "batches"]]
            full = (usable - intercept) / slope if slope > 0 else math.inf
            oom = r.oom_batch_size
            rows.append({"model": model, "mom": r.mom, "paper_oom_batch": oom, "mem_runs": int(n),
                         "bytes_per_sample": float(slope), "records_full_batch": float(full),
                         "headroom": math.nan if pd.isna(oom) else float(oom) / full})
    return pd.DataFrame(rows, columns=["model", "mom", "paper_oom_batch", "mem_runs", "bytes_per_sample",
                                       "records_full_batch", "headroom"])


def _predict(model: str, mom: str, setup: str, allocator: str = "ideal", precision: str | None = None
             ) -> tuple[int | None, str]:
    """Predicted max batch, or None with the reason it cannot be predicted."""
    try:
        return predict_max_batch(model, mom, gpu=GPU, precision=_precision(model, precision),
                                 setup=setup, allocator=allocator), ""
    except (ValueError, RuntimeError) as exc:  # a paper label momlab has no MOM for; traces that do not align
        return None, str(exc).splitlines()[0]


def max_batch_table(models=None, moms=None, *, setup: str = SETUP, allocator: str = "caching",
                    precision: str | None = None) -> pd.DataFrame:
    """Predicted vs the paper's maximum batch on one V100, one row per (model, MOM).

    `models` default `MEMORY_MODELS` (with `precision`, those of them the
    paper swept at it: ``"fp32"`` adds BERT-L's earlier fp32 runs to the
    ResNets); `moms`: None for every MOM the paper ran on
    each model, or a list (a MOM the paper did not run on a model gives a
    row marked "no paper data"). `allocator` (`momlab.estimate.ALLOCATORS`):
    "caching" replays PyTorch's caching allocator on traced processes (a few
    full traces per row: minutes for the default models), "ideal" takes the
    live peak alone (the closed form, seconds). Columns: model, mom,
    precision, paper_max_batch (largest that fit), paper_oom_batch (smallest
    that failed, <NA> when none recorded), paper_point (the comparison
    point), predicted_ideal (the ideal allocator's), predicted_max_batch
    (`allocator`'s), allocator, paper_headroom and gpu_bound (`paper_headroom`:
    False where the paper's own memory records show its run was not stopped
    by GPU memory; such rows stay comparable and are summarised both ways),
    records_full_batch (`paper_headroom`'s: where the paper's own line of
    allocated peak against batch reaches the card) and error_vs_records
    (predicted_ideal / records_full_batch - 1: the predicted memory against
    the paper's measured memory at the card's edge, fragmentation left out
    of both, whatever stopped the paper's run), error (predicted /
    paper_point - 1), comparable (False for another system or no data), note.
    """
    check_choice("allocator", allocator, ALLOCATORS)
    s1 = reference.paper_s1(precision=precision)
    models = _models(models, precision, MEMORY_MODELS)
    headroom = {(r.model, r.mom): r for r in paper_headroom(models, precision=precision).itertuples()}
    rows = []
    for model in models:
        ran = s1[s1["model"] == model]
        wanted = list(ran["mom"]) if moms is None else list(moms)
        for mom in wanted:
            paper = ran[ran["mom"] == mom]
            row = {"model": model, "mom": mom, "precision": _precision(model, precision),
                   "paper_max_batch": pd.NA, "paper_oom_batch": pd.NA, "paper_point": math.nan}
            notes, comparable = [], True
            if paper.empty:
                notes.append("no paper data")
                comparable = False
            else:
                fit, oom = paper["max_batch_size"].iloc[0], paper["oom_batch_size"].iloc[0]
                row.update(paper_max_batch=fit, paper_oom_batch=oom)
                if pd.isna(oom):
                    row["paper_point"] = float(fit)
                    notes.append("no failing batch recorded: the paper's figure is a lower bound")
                else:
                    row["paper_point"] = (float(fit) + float(oom)) / 2
            other = _other_system(model, mom, precision)
            if other:
                notes.append(other)
                comparable = False
            ideal, why = _predict(model, mom, setup, precision=precision)
            predicted = (ideal if allocator == "ideal" or ideal is None
                         else _predict(model, mom, setup, allocator, precision)[0])
            if predicted is None:
                notes.append(f"not predicted: {why}")
                comparable = False
            row["predicted_ideal"] = pd.NA if ideal is None else ideal
            row["predicted_max_batch"] = pd.NA if predicted is None else predicted
            row["allocator"] = allocator
            h = headroom.get((model, mom))
            row["paper_headroom"] = math.nan if h is None else h.headroom
            row["records_full_batch"] = math.nan if h is None else h.records_full_batch
            row["error_vs_records"] = (ideal / row["records_full_batch"] - 1 if ideal is not None and h is not None
                                       else math.nan)
            row["gpu_bound"] = not row["paper_headroom"] < GPU_BOUND_HEADROOM
            if not row["gpu_bound"]:
                notes.append(f"the paper's run stopped at {h.headroom:.0%} of the batch its own peak records fill "
                             f"the card at ({h.records_full_batch:.0f}): not GPU memory")
            point = row["paper_point"]
            row["error"] = (predicted / point - 1) if predicted is not None and point == point else math.nan
            row["comparable"] = comparable
            row["note"] = "; ".join(notes)
            rows.append(row)
    out = pd.DataFrame(rows)
    for col in ("paper_max_batch", "paper_oom_batch", "predicted_ideal", "predicted_max_batch"):
        out[col] = out[col].astype("Int64")
    return out


def max_batch_summary(table: pd.DataFrame) -> dict:
    """Median and largest absolute error of the comparable rows, and how many are within 15%; the same
    keys with ``_gpu_bound`` for the comparable rows whose paper run stopped at GPU memory by its own
    records (``gpu_bound``, `paper_headroom`), and with ``_vs_records`` for the comparable rows' ideal
    prediction against where the paper's own peak records fill the card (``error_vs_records``)."""
    def stats(rows, suffix="", column="error"):
        err = rows[column].dropna().abs()
        return {f"rows{suffix}": int(len(err)),
                f"median_abs_error{suffix}": float(err.median()) if len(err) else math.nan,
                f"max_abs_error{suffix}": float(err.max()) if len(err) else math.nan,
                f"within_15pct{suffix}": int((err <= 0.15).sum())}

    comparable = table[table["comparable"]]
    bound = comparable[comparable["gpu_bound"]] if "gpu_bound" in comparable else comparable
    return {**stats(comparable), **stats(bound, "_gpu_bound"), **stats(comparable, "_vs_records", "error_vs_records")}


def largest_table(dims=LARGEST_DIMS, moms=None, *, model: str = "bert-large", batch_size: int = 24,
                  setup: str = SETUP, allocator: str = "caching") -> pd.DataFrame:
    """S2 on one V100: the largest model each MOM trains at `batch_size`, predicted (`predict_max_size`, the
    caching allocator replayed as in `max_batch_table`'s headline, or `allocator` "ideal") against the paper's
    scaling sweeps (`reference.paper_largest`), per size keyword of `dims`.

    The paper stepped its sizes coarsely (depth 4 layers, width 96), so its answer is a bracket: the largest size
    that fit and the next, where its run failed (``paper_first_oom``; ``first_oom_from`` "grid" where the sweep
    lost that run's size). Columns: model, dim, mom, batch_size, paper_largest, paper_first_oom,
    first_oom_from, paper_point (the bracket's midpoint, as `max_batch_table`'s), predicted_ideal (no
    fragmentation), predicted (by `allocator`), allocator, error (predicted / paper_point - 1), in_bracket
    (paper_largest <= predicted < paper_first_oom; open above where the paper recorded no failure), note (the paper's MOM another system; "not predicted: ..."
    where the estimate cannot be made). Minutes at real size (every width is its own trace, and each size
    the caching allocator is asked about its own replay).
    """
    check_choice("allocator", allocator, ALLOCATORS)
    prec = reference.PRECISION[model]
    rows = []
    for dim in dims:
        paper = reference.paper_largest(dim, model=model, batch_size=batch_size)
        for r in paper.itertuples(index=False):
            if moms is not None and r.mom not in moms:
                continue
            lo, hi = r[paper.columns.get_loc(dim)], r.first_oom
            note = _other_system(model, r.mom, None)
            kw = dict(dim=dim, batch_size=batch_size, gpu=GPU, precision=prec, setup=setup)
            try:
                ideal = predict_max_size(model, PAPER_MOMS.get(r.mom, r.mom), **kw)
                pred = (ideal if allocator == "ideal"
                        else predict_max_size(model, PAPER_MOMS.get(r.mom, r.mom), allocator=allocator, **kw))
            except ValueError as exc:
                ideal = pred = None
                note = note or f"not predicted: {str(exc).splitlines()[0]}"
            point = (lo + hi) / 2 if lo is not pd.NA and hi is not pd.NA else math.nan
            rows.append({"model": model, "dim": dim, "mom": r.mom, "batch_size": batch_size, "paper_largest": lo,
                         "paper_first_oom": hi, "first_oom_from": r.first_oom_from, "paper_point": point,
                         "predicted_ideal": pd.NA if ideal is None else ideal,
                         "predicted": pd.NA if pred is None else pred, "allocator": allocator,
                         "error": pred / point - 1 if pred is not None and point == point else math.nan,
                         "in_bracket": bool(pred is not None and lo is not pd.NA and lo <= pred
                                            and (hi is pd.NA or pred < hi)),
                         "note": note})
    out = pd.DataFrame(rows)
    for col in ("paper_largest", "paper_first_oom", "predicted_ideal", "predicted"):
        out[col] = out[col].astype("Int64")
    return out


def breakdown_table(models=None, *, setup: str = SETUP) -> pd.DataFrame:
    """Predicted vs the paper's exact-step memory breakdown at `BREAKDOWN_BATCH` (bytes).

    One row per (model, component): component is activation (the paper:
    allocated at the end of forward beyond the model-related bytes; momlab:
    ``activation_bytes``), model (weights + gradients + optimizer state;
    momlab: params + grads + optimizer) or peak. Columns: model,
    batch_size, component, paper_bytes, predicted_bytes, error. `models`:
    those of `BREAKDOWN_BATCH` to show (default all).
    """
    runs = reference.paper_runs()
    rows = []
    for model, batch in BREAKDOWN_BATCH.items():
        if models is not None and model not in models:
            continue
        sel = runs[(runs["model"] == model) & (runs["mom"] == "exact") & (runs["gpus"] == 1)
                   & (runs["batch_size"] == batch) & runs["fits"] & runs["activation_bytes"].notna()
                   & (runs["precision"] == reference.PRECISION[model])]
        e = estimate(model, "exact", batch_size=batch, gpu=GPU, precision=reference.PRECISION[model],
                               setup=setup)
        ours = {"activation": e.activation_bytes, "model": e.params_bytes + e.grads_bytes + e.optimizer_bytes,
                "peak": e.peak_bytes}
        first = sel.iloc[0] if len(sel) else None
        paper = {"activation": None if first is None else first["activation_bytes"],
                 "model": None if first is None else first["model_bytes"],
                 "peak": None if first is None else first["peak_bytes"]}
        for comp in ("activation", "model", "peak"):
            p = paper[comp]
            p = math.nan if p is None or pd.isna(p) else float(p)
            rows.append({"model": model, "batch_size": batch, "component": comp, "paper_bytes": p,
                         "predicted_bytes": float(ours[comp]),
                         "error": ours[comp] / p - 1 if p == p and p else math.nan})
    return pd.DataFrame(rows)


def _size_of(model: str, row) -> dict:
    """The model-size settings of a paper record that differ from the catalog's default size."""
    default = catalog.spec(model).size
    size = {}
    for col in reference.SIZE_COLUMNS:
        value = row[col]
        key = col.removeprefix("size.")
        if not pd.isna(value) and default.get(key) != int(value):
            size[key] = int(value)
    return size


def peak_table(models=PEAK_MODELS, moms=None, *, setup: str = SETUP) -> pd.DataFrame:
    """Every peak the paper recorded against the prediction of the same run.

    Per record of `momlab.reference.paper_peaks` (one V100: the memory sweeps and the breakdown figure's
    runs, GPT's timed runs; at any model size the paper ran, BERT-L at 36 and 48 layers too), the predicted
    peak of its model, MOM, precision, size and batch, the ``peak_bytes`` `estimate` gives: the allocated
    peak the paper's ``torch.cuda.max_memory_allocated()`` read (no caching-allocator reserve). No record
    is an input to any prediction; BERT-base's runs (the breakdown figure's) and BERT-L's deeper ones are
    in no other check. Records of a MOM momlab has no counterpart for (GPT's DeepSpeed "cpu-off") are left out; rows
    whose MOM is another system in the paper are kept and marked (``comparable=False``, `OTHER_SYSTEM`).

    Columns: model, precision, mom, size (the settings that differ from the model's default, "" at it),
    batch_size, experiment, paper_peak_bytes, predicted_peak_bytes, error, comparable, note, source.
    `models`: of `PEAK_MODELS` (default all); `moms`: the paper's MOM labels to show (default all).
    """
    g = get_gpu(GPU)
    workspace = cuda_overheads(g, setup).cublas_workspace_bytes
    rows = []
    for model in models:
        runs = reference.paper_peaks(model)
        prec = str(runs["precision"].iloc[0])
        for r in runs.to_dict("records"):
            mom = r["mom"]
            if mom not in PAPER_MOMS or (moms is not None and mom not in moms):
                continue
            size = _size_of(model, r)
            # the peak as `estimate` reports it (traced tensors, the allocator's rounding, cuBLAS's workspace),
            # without the time model it would calibrate first
            p = profile(model, PAPER_MOMS[mom], precision=prec, kernels=g.kernels, setup=setup,
                        **size).at(int(r["batch_size"]))
            pred = p.peak_bytes + p.rounding_bytes + workspace
            note = _other_system(model, mom, None)
            paper = float(r["peak_bytes"])
            rows.append({"model": model, "precision": prec, "mom": mom,
                         "size": ", ".join(f"{k}={v}" for k, v in size.items()),
                         "batch_size": int(r["batch_size"]), "experiment": r["experiment"],
                         "paper_peak_bytes": paper, "predicted_peak_bytes": float(pred),
                         "error": pred / paper - 1, "comparable": not note, "note": note,
                         "source": r["source"]})
    return pd.DataFrame(rows, columns=PEAK_COLUMNS)


def peak_summary(table: pd.DataFrame) -> pd.DataFrame:
    """`peak_table` per model, MOM and size: records, median and largest |error|, the share within 5%;
    and a last row, "all", over every comparable record."""
    comp = table[table["comparable"].astype(bool)]

    def stats(g: pd.DataFrame) -> pd.Series:
        err = g["error"].abs()
        return pd.Series({"records": len(g), "batch_lo": int(g["batch_size"].min()),
                          "batch_hi": int(g["batch_size"].max()), "median_abs_error": err.median(),
                          "max_abs_error": err.max(), "within_5pct": float((err <= 0.05).mean())})

    per = [stats(g).rename(key) for key, g in comp.groupby(["model", "mom", "size"], sort=False)]
    out = pd.DataFrame(per + ([stats(comp).rename(("all", "", ""))] if len(comp) else []),
                       columns=["records", "batch_lo", "batch_hi", "median_abs_error", "max_abs_error", "within_5pct"])
    out.index = pd.MultiIndex.from_tuples(list(out.index), names=["model", "mom", "size"])
    return out.astype({"records": int, "batch_lo": int, "batch_hi": int})


def slope_table(models=SLOPE_MODELS, moms=None, *,
                setup: str = SETUP, precision: str | None = None) -> pd.DataFrame:
    """Peak bytes per extra sample: the paper's least-squares slope over its memory sweep vs the
    predicted peak's slope over the same batch range, at each model's headline precision or `precision`;
    beside it the same for what the step keeps at the end of forward (``activation_bytes``, where the paper
    recorded it). Columns: model, precision, mom, paper_bytes_per_sample, predicted_bytes_per_sample, error,
    paper_activation_per_sample, predicted_activation_per_sample, activation_error, batch_lo, batch_hi,
    note. `moms`: those of the paper's sweeps to show (default all)."""
    rows = []
    for model in models:
        prec = _precision(model, precision)
        paper = reference.paper_memory_per_sample(model, precision)
        for _, r in paper.iterrows():
            mom = r["mom"]
            if moms is not None and mom not in moms:
                continue
            lo, hi = int(r["batch_lo"]), int(r["batch_hi"])  # the batches of the runs behind the paper's slope
            note = _other_system(model, mom, precision)
            try:
                prof = profile(model, mom, precision=prec, setup=setup)
                ylo, yhi = prof.peak_bytes([lo, hi])
                pred = (yhi - ylo) / (hi - lo) if hi > lo else math.nan
                # the same line through the profile's two traces as the peak's
                act = (prof.hi.activation_bytes - prof.lo.activation_bytes) / (prof.hi.batch_size - prof.lo.batch_size)
            except ValueError as exc:
                pred = act = math.nan
                note = note or f"not predicted: {str(exc).splitlines()[0]}"
            paper_act = float(r["activation_per_sample"])
            rows.append({"model": model, "precision": prec, "mom": mom,
                         "paper_bytes_per_sample": float(r["bytes_per_sample"]),
                         "predicted_bytes_per_sample": float(pred),
                         "error": pred / float(r["bytes_per_sample"]) - 1 if pred == pred else math.nan,
                         "paper_activation_per_sample": paper_act, "predicted_activation_per_sample": float(act),
                         "activation_error": act / paper_act - 1 if act == act and paper_act else math.nan,
                         "batch_lo": lo, "batch_hi": hi, "note": note})
    return pd.DataFrame(rows)
