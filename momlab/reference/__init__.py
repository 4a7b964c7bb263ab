"""The paper's own V100 measurements, as a tidy table, and its headline numbers.

``paper_v100.csv`` beside this file holds one row per run of the paper's
benchmark code (Liu, Jha, Cheung, "An Evaluation of Memory Optimization
Methods for Training Neural Networks", arXiv 2303.14633), derived from its raw
logs by ``scripts/derive_reference.py``, whose docstring says how names, units,
copies and odd files were handled. Columns follow ``Measurement`` where they
mean the same thing:

- ``model``, ``mom``: momlab names (raw names where momlab has none);
  ``algorithm`` keeps the raw label, ``source`` the raw ``file:line``.
- ``batch_size``: per GPU. ``gpus``: data-parallel GPUs (V100 16 GB each).
- ``throughput``: samples per second summed over all GPUs; NaN when the run
  did not fit or was not timed. ``fits``: False for an out-of-memory.
- ``size.num_layers``, ``size.hidden_size``, ``size.width_per_group``,
  ``size.seq_len``, ``size.num_heads``: the model size where it was varied.
- ``peak_bytes`` (allocator peak), ``activation_bytes``, ``workspace_bytes``,
  ``model_bytes`` (weights + gradients + optimizer state), ``params_bytes``
  (weights), ``total_bytes`` (allocated at the end of forward): the paper's
  own definitions, per GPU, as measured (not momlab's).
- ``gpu_utilization``: where the paper sampled it (its utilization runs and
  the speed runs they repeat), nvidia-smi's share of time a kernel was
  running on the GPU over the run, 0-1.
- ``budget``: the memory budget of DTR runs. ``experiment``: which study the
  run belongs to (speed, mem, depth, width, max_depth, ...).

The functions below select the runs behind each of the paper's results:
``paper_s1`` (S1: the ``speed`` sweeps on one GPU at the paper's precision and
default size), ``paper_gpu_count`` (the same on 1-8 GPUs), ``paper_scaling``
(S2': the ``depth``/``width`` batch searches), ``paper_largest`` (S2: the
``max_depth``/``max_width`` sweeps at batch 24) and
``paper_memory_per_sample`` (the ``mem`` sweeps; GPT's timed runs, which
record their peak). ``paper_runs`` is the
whole table. ``tests/test_reference.py`` checks them against the numbers
../shared/paper/BRIEF.md quotes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pandas as pd

CSV = Path(__file__).with_name("paper_v100.csv")

GPU = "V100-16GB"

# the models of the paper's S1 table, in its order
MODELS = ["resnet50", "wide-resnet50-2", "resnet152", "swin-large", "bert-large",
          "gpt3-small", "gpt3-medium"]
MOMS = ["exact", "ckpt", "ckpt-dtr", "quant4", "quant4+swap", "swap", "quant4+ckpt",
        "swap+ckpt"]

# the precision each model was trained in for the paper's headline results
PRECISION = {
    "resnet50": "fp32", "wide-resnet50-2": "fp32", "resnet152": "fp32",
    "swin-large": "fp16", "bert-large": "fp16", "gpt3-small": "fp16",
    "gpt3-medium": "fp16",
}
# one-V100 S1 sweeps at another precision than the headline one: BERT-L in fp32, the paper's earlier runs
# (March-May 2022, text_classification_results_*.json, GACT's earlier code; its "swap" there is GACT's
# activation swap, where the fp16 sweep's is another system)
OTHER_PRECISIONS = {"bert-large": ("fp32",)}
# size columns a model's default configuration may carry explicitly
DEFAULT_SIZE = {"bert-large": {"size.num_layers": 24, "size.hidden_size": 1024}}
UNITS = {
    "resnet50": "img/s", "wide-resnet50-2": "img/s", "resnet152": "img/s",
    "swin-large": "img/s", "bert-large": "seq/s", "gpt3-small": "seq/s",
    "gpt3-medium": "seq/s",
}
# the experiments whose runs recorded a step's peak to measure memory: the memory sweeps ("mem"; "mem_fp32", fp16
# runs of BERT-L under a name the raw data does not explain, scripts/derive_reference.py) and the breakdown
# figure's runs ("background")
MEMORY_EXPERIMENTS = ("mem", "mem_fp32", "background")
SIZE_COLUMNS = ["size.num_layers", "size.hidden_size", "size.width_per_group",
                "size.seq_len", "size.num_heads"]


@functools.lru_cache(maxsize=1)
def _table() -> pd.DataFrame:
    df = pd.read_csv(CSV, dtype={"fits": bool, "model": str, "mom": str})
    for col in ["batch_size", "gpus", *SIZE_COLUMNS, "peak_bytes", "activation_bytes",
                "workspace_bytes", "model_bytes", "params_bytes", "total_bytes", "budget"]:
        df[col] = df[col].astype("Int64")
    df.insert(df.columns.get_loc("precision"), "gpu", GPU)
    df["device"] = "cuda"
    df["memory_source"] = "cuda"  # torch.cuda.memory_allocated on the V100s
    return df


def paper_runs() -> pd.DataFrame:
    """Every run of the paper's raw data, one row each (a fresh copy)."""
    return _table().copy()


def _default_size(df: pd.DataFrame) -> pd.Series:
    """Rows at their model's default size: size columns empty, or equal to
    ``DEFAULT_SIZE`` where the raw data writes the default out (BERT-L)."""
    ok = pd.Series(True, index=df.index)
    for model, size in DEFAULT_SIZE.items():
        rows = df["model"] == model
        for col, value in size.items():
            ok &= ~rows | df[col].isna() | (df[col] == value)
    for col in SIZE_COLUMNS:
        explicit = df["model"].map(lambda m, c=col: c in DEFAULT_SIZE.get(m, {}))
        ok &= explicit | df[col].isna()
    return ok


def other_sweeps(models=None) -> list[tuple[str, str]]:
    """(model, precision) of each one-V100 S1 sweep at another precision than the model's headline one
    (`OTHER_PRECISIONS`), of `models` (default all)."""
    return [(m, p) for m, precs in OTHER_PRECISIONS.items() if models is None or m in models for p in precs]


def check_precision(precision: str | None) -> None:
    """``precision``: None (each model's headline precision, `PRECISION`) or one the paper ran S1 sweeps at."""
    valid = sorted(set(PRECISION.values()) | {p for ps in OTHER_PRECISIONS.values() for p in ps})
    if precision is not None and precision not in valid:
        raise ValueError(f"unknown precision {precision!r}; the paper's S1 sweeps ran at {', '.join(valid)} "
                         f"(None: each model's headline precision, {PRECISION})")


def _at_precision(df: pd.DataFrame, precision: str | None) -> pd.Series:
    """Rows at `precision`, or at their model's headline precision (`PRECISION`) when it is None."""
    check_precision(precision)
    return df["precision"] == (df["model"].map(PRECISION) if precision is None else precision)


def _s1_runs(gpus: int | None = 1, precision: str | None = None) -> pd.DataFrame:
    """The batch sweeps behind S1: experiment "speed", the paper's precision
    (or `precision`) and default size, on ``gpus`` GPUs (all counts when None)."""
    df = _table()
    sel = (df["experiment"] == "speed") & df["model"].isin(PRECISION)
    sel &= _at_precision(df, precision)
    sel &= _default_size(df)
    if gpus is not None:
        sel &= df["gpus"] == gpus
    return df[sel]


def paper_utilization_runs() -> pd.DataFrame:
    """The one-GPU runs at the paper's precision and default size whose GPU utilization it sampled."""
    df = _table()
    sel = df["gpu_utilization"].notna() & df["fits"] & (df["gpus"] == 1) & df["model"].isin(PRECISION)
    sel &= (df["precision"] == df["model"].map(PRECISION)) & _default_size(df)
    return df[sel].copy()


def paper_s1_runs(gpus: int | None = 1, precision: str | None = None) -> pd.DataFrame:
    """The paper's S1 batch sweeps (its default sizes and precisions), one row per run; `precision`: the
    sweeps at that precision instead (BERT-L's fp32 runs, `OTHER_PRECISIONS`)."""
    return _s1_runs(gpus, precision).reset_index(drop=True)


def _s1_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (model, mom): the S1 numbers of a set of batch-sweep runs.

    Columns (named as in ``momlab.metrics.s1_summary``): ``max_batch_size``
    (largest batch that fit), ``oom_batch_size`` (smallest failing batch above
    it, <NA> when none was recorded: then ``max_batch_size`` is only a lower
    bound, the paper's "592+"), ``max_throughput``, ``ratio`` (over the same
    model's exact), ``best_batch_size`` (batch at the maximum throughput),
    ``points`` (runs). Unlike ``metrics.s1_summary`` it does not split by
    budget: the paper's DTR line is the best over its budgets.
    """
    rows = []
    for (model, mom), g in runs.groupby(["model", "mom"], sort=False):
        ok = g[g["fits"]]
        timed = ok[ok["throughput"].notna()]
        max_batch = ok["batch_size"].max() if len(ok) else pd.NA
        failing = g.loc[~g["fits"], "batch_size"]
        if max_batch is not pd.NA:
            failing = failing[failing > max_batch]
        best = timed.loc[timed["throughput"].idxmax()] if len(timed) else None
        rows.append({
            "model": model, "mom": mom,
            "max_batch_size": max_batch,
            "oom_batch_size": failing.min() if len(failing) else pd.NA,
            "max_throughput": best["throughput"] if best is not None else np.nan,
            "best_batch_size": best["batch_size"] if best is not None else pd.NA,
            "points": len(g),
        })
    out = pd.DataFrame(rows, columns=["model", "mom", "max_batch_size", "oom_batch_size",
                                      "max_throughput", "best_batch_size", "points"])
    for col in ["max_batch_size", "oom_batch_size", "best_batch_size"]:
        out[col] = out[col].astype("Int64")
    exact = out[out["mom"] == "exact"].set_index("model")["max_throughput"]
    out.insert(5, "ratio", out["max_throughput"] / out["model"].map(exact))
    return out


def _order(df: pd.DataFrame, *then: str) -> pd.DataFrame:
    """Rows in the paper's model order, then MOM order, then ``then`` columns."""
    model_rank = {m: i for i, m in enumerate(MODELS)}
    mom_rank = {m: i for i, m in enumerate(MOMS)}
    keys = df.assign(
        _model=df["model"].map(lambda m: model_rank.get(m, len(MODELS))),
        _mom=df["mom"].map(lambda m: mom_rank.get(m, len(MOMS))),
    )
    by = ["_model", "model", "_mom", "mom", *then]
    return keys.sort_values(by, kind="stable").drop(columns=["_model", "_mom"]) \
        .reset_index(drop=True)


def paper_s1(gpus: int = 1, precision: str | None = None) -> pd.DataFrame:
    """The paper's S1 table: per model and MOM on ``gpus`` V100s, the largest
    batch that fit, the maximum throughput over all batches, and its ratio to
    exact's (columns as ``_s1_table`` says; ``unit`` is img/s or seq/s).
    At each model's headline precision, or at `precision` for the models
    with sweeps at it (``paper_s1(precision="fp32")``: the ResNets and
    BERT-L's earlier fp32 runs).

    >>> s1 = paper_s1()
    >>> row = s1[(s1.model == "resnet50") & (s1.mom == "quant4")].iloc[0]
    >>> int(row.max_batch_size), round(float(row.max_throughput), 1), round(float(row.ratio), 2)
    (480, 282.4, 0.75)
    """
    out = _order(_s1_table(_s1_runs(gpus, precision)))
    out["unit"] = out["model"].map(UNITS)
    return out


def paper_gpu_count(models: list[str] | None = None) -> pd.DataFrame:
    """MOM/exact ratio of maximum throughput against the number of V100s.

    One row per (model, mom, gpus) for the models with data-parallel runs
    (BERT-L, GPT3-Small, Swin-L, the ResNets), from the same speed sweeps as
    ``paper_s1``. Columns: model, mom, gpus, max_throughput (all GPUs
    together), exact_throughput, ratio, max_batch_size (per GPU).

    The published ``implications_bert_v100_gpu.png`` takes its 1-GPU point from
    the depth study's 24-layer runs (exact 172.0, ckpt 145.9, quant4 131.4
    seq/s); this uses the S1 sweep (164.0, 139.1, 109.2), as ``paper_s1`` does.
    """
    runs = _s1_runs(gpus=None)
    if models is not None:
        runs = runs[runs["model"].isin(models)]
    counts = runs.groupby("model")["gpus"].nunique()
    runs = runs[runs["model"].isin(counts[counts > 1].index)]
    parts = []
    for gpus, g in runs.groupby("gpus"):
        s = _s1_table(g)
        s["gpus"] = gpus
        parts.append(s)
    if not parts:
        raise ValueError(f"no data-parallel runs for models {models}; "
                         f"models with several GPU counts: {sorted(counts[counts > 1].index)}")
    out = pd.concat(parts, ignore_index=True)
    exact = out[out["mom"] == "exact"].set_index(["model", "gpus"])["max_throughput"]
    out["exact_throughput"] = [exact.get((m, n), np.nan) for m, n in zip(out["model"], out["gpus"])]
    out = out[["model", "mom", "gpus", "max_throughput", "exact_throughput", "ratio",
               "max_batch_size"]]
    return _order(out, "gpus")


_DIMS = {"num_layers": "depth", "hidden_size": "width", "width_per_group": "width"}


def _dim(dim: str) -> str:
    d = dim.removeprefix("size.")
    if d not in _DIMS:
        raise ValueError(f"unknown scaling dimension {dim!r}; valid: {sorted(_DIMS)}")
    return d


def paper_scaling_runs(dim: str, model: str = "bert-large") -> pd.DataFrame:
    """S2': every run of the paper's scaling study along ``dim``, those that failed included: the batch
    sizes it tried at each model size (one V100, the model's paper precision). Its maximum throughput at a
    size is the best of these, so a prediction of it is made over the same batches
    (`momlab.validation.depth_curves`). Columns as `paper_runs`, ``size.<dim>`` set on every row."""
    d = _dim(dim)
    df = _table()
    sel = (df["model"] == model) & (df["experiment"] == _DIMS[d]) & (df["gpus"] == 1)
    sel &= (df["precision"] == PRECISION.get(model, "fp32")) & df[f"size.{d}"].notna()
    runs = df[sel]
    if runs.empty:
        have = df.loc[df["experiment"].isin(["depth", "width"]), ["model", "experiment"]]
        raise ValueError(f"no {_DIMS[d]} study for {model!r} along {d}; "
                         f"available: {sorted(set(map(tuple, have.values)))}")
    return runs


def paper_scaling(dim: str, model: str = "bert-large") -> pd.DataFrame:
    """S2': per MOM and model size, the maximum throughput over all batches.

    ``dim`` is ``num_layers`` (depth) or ``hidden_size`` / ``width_per_group``
    (width). Columns: model, mom, ``<dim>``, max_throughput, best_batch_size,
    max_batch_size. One V100, the model's paper precision. For BERT-L depth the
    curves cross at 34 layers, where checkpointing overtakes exact.
    """
    d = _dim(dim)
    runs = paper_scaling_runs(dim, model)
    rows = []
    for (mom, size), g in runs.groupby(["mom", f"size.{d}"]):
        ok = g[g["fits"] & g["throughput"].notna()]
        if ok.empty:
            continue
        best = ok.loc[ok["throughput"].idxmax()]
        rows.append({"model": model, "mom": mom, d: int(size),
                     "max_throughput": best["throughput"],
                     "best_batch_size": int(best["batch_size"]),
                     "max_batch_size": int(g.loc[g["fits"], "batch_size"].max())})
    return _order(pd.DataFrame(rows), d)


def paper_largest(dim: str, model: str = "bert-large", batch_size: int = 24) -> pd.DataFrame:
    """S2: per MOM, the largest model size that trains at ``batch_size``.

    Columns: model, mom, ``<dim>`` (largest size that fit), throughput (at
    it), first_oom (smallest failing size above it), first_oom_from
    ("recorded"; "grid" where the sweep lost the failing run's size, as the
    BERT width sweep's OOM markers do: the sweep's next size above the
    largest fit, its sizes evenly spaced and every MOM stepped through them
    in turn, the raw file's order; <NA> when the MOM recorded no failure).
    BERT-L depth at batch 24: exact 32 layers, quant4 52, ckpt 60.
    """
    d = _dim(dim)
    exp = "max_depth" if d == "num_layers" else "max_width"
    df = _table()
    runs = df[(df["model"] == model) & (df["experiment"] == exp)
              & (df["batch_size"] == batch_size) & (df["gpus"] == 1)]
    if runs.empty:
        have = df.loc[df["experiment"].str.startswith("max_"),
                      ["model", "experiment", "batch_size"]]
        raise ValueError(f"no {exp} sweep for {model!r} at batch {batch_size}; "
                         f"available: {sorted(set(map(tuple, have.values)))}")
    sizes = np.unique(runs[f"size.{d}"].dropna())
    step = np.diff(sizes).min() if len(sizes) > 1 else None
    rows = []
    for mom, g in runs.groupby("mom", sort=False):
        ok = g[g["fits"] & g[f"size.{d}"].notna()]
        largest = ok[f"size.{d}"].max() if len(ok) else pd.NA
        at = ok[ok[f"size.{d}"] == largest]
        failed = g.loc[~g["fits"], f"size.{d}"]
        failing = failed.dropna()
        if largest is not pd.NA:
            failing = failing[failing > largest]
        first, source = (failing.min(), "recorded") if len(failing) else (pd.NA, pd.NA)
        if first is pd.NA and failed.isna().any() and largest is not pd.NA and step:
            first, source = largest + step, "grid"
        rows.append({"model": model, "mom": mom, d: largest,
                     "throughput": at["throughput"].max() if len(at) else np.nan,
                     "first_oom": first, "first_oom_from": source})
    out = pd.DataFrame(rows)
    for col in [d, "first_oom"]:
        out[col] = out[col].astype("Int64")
    return _order(out)


def _peaks(model: str, precision: str | None) -> pd.Series:
    """Rows of `model`'s one-V100 runs that fit and recorded a peak, at `precision` or the model's headline
    one (`PRECISION`; a model outside the S1 sweeps, such as bert-base, at the one its records have)."""
    df = _table()
    check_precision(precision)
    sel = (df["model"] == model) & (df["gpus"] == 1) & df["fits"] & df["peak_bytes"].notna()
    if precision is None and model not in PRECISION:
        precs = sorted(df.loc[sel, "precision"].unique())
        precision = precs[0] if len(precs) == 1 else None
    return sel & (df["precision"] == (precision or PRECISION.get(model, "fp32")))


def paper_peaks(model: str, precision: str | None = None) -> pd.DataFrame:
    """Every peak the paper recorded for `model` on one V100, at any model size: the runs of its memory
    experiments (`MEMORY_EXPERIMENTS`) that fit, at the model's headline precision or `precision` (a
    model outside the S1 sweeps, such as bert-base, at the one precision its records have). A model with no
    memory experiment (GPT) gives its timed runs' peaks, as `paper_memory_per_sample` reads them. Columns
    as `paper_runs`; ``size.*`` names a size other than the default (BERT-L also writes its default out)."""
    df = _table()
    sel = _peaks(model, precision)
    runs = df[sel & df["experiment"].isin(MEMORY_EXPERIMENTS)]
    if runs.empty:
        runs = df[sel & (df["experiment"] == "speed")]
    if runs.empty:
        have = df["peak_bytes"].notna() & (df["gpus"] == 1) & df["fits"]
        have = sorted(set(zip(df.loc[have, "model"], df.loc[have, "precision"])))
        raise ValueError(f"no peak recorded for {model!r} at {precision or 'its headline precision'}; "
                         f"(model, precision) with some: {have}")
    return runs.copy()


def paper_memory_per_sample(model: str = "bert-large", precision: str | None = None) -> pd.DataFrame:
    """Peak memory growth per sample: least-squares slope of ``peak_bytes``
    against batch size over the paper's memory sweep (one V100, default size,
    the model's headline precision or `precision`). GPT has no ``mem`` sweep:
    fairseq's runs recorded their peak with every timed step, so its ``speed``
    sweep is its memory sweep too (the raw GPT_v100_results_mem_results.json
    holds the same records as the speed file).

    Columns: model, mom, bytes_per_sample, intercept_bytes, batches (the
    number of runs fitted), batch_lo and batch_hi (the smallest and largest
    batch among them), activation_per_sample (the same slope of
    ``activation_bytes``, what the step kept at the end of forward; NaN where
    fewer than two runs recorded it). The paper quotes BERT-L in "MB" that are
    thousandths of a GiB (its code divides by 1024**3): exact 204, ckpt 20.8,
    quant4 43.5, quant4+ckpt 8.3 == bytes_per_sample / 2**30 * 1000.
    """
    df = _table()
    sel = _peaks(model, precision) & _default_size(df)
    runs = df[sel & (df["experiment"] == "mem")]
    if runs.empty:  # no memory sweep: the timed runs, where they recorded their peak (GPT)
        runs = df[sel & (df["experiment"] == "speed")]
    if runs.empty:
        have = df["peak_bytes"].notna() & (df["gpus"] == 1) & df["experiment"].isin(["mem", "speed"])
        raise ValueError(f"no memory sweep for {model!r} at {precision or 'its headline precision'}; models with one: "
                         f"{sorted(df.loc[have, 'model'].unique())}")
    rows = []
    for mom, g in runs.groupby("mom", sort=False):
        if g["batch_size"].nunique() < 2:
            continue
        slope, intercept = np.polyfit(g["batch_size"].astype(float),
                                      g["peak_bytes"].astype(float), 1)
        act = g[g["activation_bytes"].notna()]
        act_slope = (np.polyfit(act["batch_size"].astype(float), act["activation_bytes"].astype(float), 1)[0]
                     if act["batch_size"].nunique() >= 2 else np.nan)
        rows.append({"model": model, "mom": mom, "bytes_per_sample": slope,
                     "intercept_bytes": intercept, "batches": len(g), "batch_lo": int(g["batch_size"].min()),
                     "batch_hi": int(g["batch_size"].max()), "activation_per_sample": act_slope})
    return _order(pd.DataFrame(rows))


__all__ = ["paper_runs", "paper_s1", "paper_gpu_count", "paper_scaling", "paper_scaling_runs", "paper_largest",
           "paper_memory_per_sample", "paper_peaks", "paper_utilization_runs", "check_precision", "other_sweeps",
           "MODELS", "PRECISION", "OTHER_PRECISIONS", "MEMORY_EXPERIMENTS", "UNITS", "GPU"]
