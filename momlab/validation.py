"""How far `momlab.estimate` is from a real GPU: predictions beside the paper's V100 measurements.

The paper measured on one V100 (16 GB) what the estimator predicts without
it, in code momlab did not write, so the comparison is independent evidence
(STYLE 14). Three tables, each predicted with the paper's own software stack
(``setup="paper"``, `momlab.workload.stack`) at its precision per model:

- `max_batch_table`: per (model, MOM) of the paper's one-GPU S1 sweeps, the
  predicted largest batch against the paper's. The paper's point is the
  midpoint between its largest batch that fit and its smallest that failed
  (its sweeps step by 4 or 8, so the true limit lies between); where it
  recorded no failure, its largest fit (a lower bound, marked). Rows whose
  MOM was a different system in the paper (BERT's "swap" was DeepSpeed
  ZeRO-3 offload, the ResNets' checkpointing DTR, GPT's "cpu-off" DeepSpeed
  offload) are shown, marked and left out of the error summary; asked-for
  configurations the paper never ran are rows marked "no paper data".
- `breakdown_table`: activations, model-related (weights, gradients,
  optimizer state) and peak at the paper's breakdown batch sizes.
- `slope_table`: peak memory per extra sample against the paper's memory
  sweeps.

Nothing here is fitted to these numbers: they are the test, not the input.
"""

from __future__ import annotations

import math

import pandas as pd

from momlab import estimate as _estimate
from momlab import reference

GPU = "V100-16"
# the paper's batch sizes of its memory-breakdown figure (background_memory.png)
BREAKDOWN_BATCH = {"resnet50": 80, "bert-large": 36, "swin-large": 36, "gpt3-small": 6}
# MOM labels of the paper that name another system than momlab's MOM of the same name
DIFFERENT_SYSTEM = {
    ("bert-large", "swap"): "DeepSpeed ZeRO-3 offload in the paper",
    ("gpt3-small", "cpu-off"): "DeepSpeed CPU offload in the paper",
    **{(m, "ckpt-dtr"): "DTR (dynamic tensor rematerialization) in the paper"
       for m in ("resnet50", "wide-resnet50-2", "resnet152")},
}
# the paper's S1 models momlab predicts by default (ResNet-152 and GPT3-Medium also have paper data)
MODELS = ["resnet50", "wide-resnet50-2", "swin-large", "bert-large", "gpt3-small"]


def _predict(model: str, mom: str, setup: str) -> tuple[int | None, str]:
    """Predicted max batch, or None with the reason it cannot be predicted."""
    try:
        return _estimate.predict_max_batch(model, mom, gpu=GPU, precision=reference.PRECISION[model],
                                           setup=setup), ""
    except ValueError as exc:  # a paper label momlab has no MOM for (ckpt-dtr, cpu-off)
        return None, str(exc).splitlines()[0]


def max_batch_table(models=None, moms=None, *, setup: str = "paper") -> pd.DataFrame:
    """Predicted vs the paper's maximum batch on one V100, one row per (model, MOM).

    `models` default `MODELS`; `moms`: None for every MOM the paper ran on
    each model, or a list (a MOM the paper did not run on a model gives a
    row marked "no paper data"). Columns: model, mom, precision,
    paper_max_batch (largest that fit), paper_oom_batch (smallest that
    failed, <NA> when none recorded), paper_point (the comparison point),
    predicted_max_batch, error (predicted / paper_point - 1), comparable
    (False for another system or no data), note.
    """
    models = MODELS if models is None else list(models)
    s1 = reference.paper_s1()
    rows = []
    for model in models:
        ran = s1[s1["model"] == model]
        wanted = list(ran["mom"]) if moms is None else list(moms)
        for mom in wanted:
            paper = ran[ran["mom"] == mom]
            row = {"model": model, "mom": mom, "precision": reference.PRECISION.get(model, "fp32"),
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
            if (model, mom) in DIFFERENT_SYSTEM:
                notes.append(DIFFERENT_SYSTEM[(model, mom)])
                comparable = False
            predicted, why = _predict(model, mom, setup)
            if predicted is None:
                notes.append(f"not predicted: {why}")
                comparable = False
            row["predicted_max_batch"] = pd.NA if predicted is None else predicted
            point = row["paper_point"]
            row["error"] = (predicted / point - 1) if predicted is not None and point == point else math.nan
            row["comparable"] = comparable
            row["note"] = "; ".join(notes)
            rows.append(row)
    out = pd.DataFrame(rows)
    for col in ("paper_max_batch", "paper_oom_batch", "predicted_max_batch"):
        out[col] = out[col].astype("Int64")
    return out


def summary(table: pd.DataFrame) -> dict:
    """Median and largest absolute error of the comparable rows, and how many are within 15%."""
    err = table.loc[table["comparable"], "error"].dropna().abs()
    return {"rows": int(len(err)), "median_abs_error": float(err.median()) if len(err) else math.nan,
            "max_abs_error": float(err.max()) if len(err) else math.nan,
            "within_15pct": int((err <= 0.15).sum())}


def breakdown_table(models=None, *, setup: str = "paper") -> pd.DataFrame:
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
        e = _estimate.estimate(model, "exact", batch_size=batch, gpu=GPU, precision=reference.PRECISION[model],
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


def slope_table(models=("bert-large", "resnet50", "swin-large", "wide-resnet50-2"), *,
                setup: str = "paper") -> pd.DataFrame:
    """Peak bytes per extra sample: the paper's least-squares slope over its memory sweep vs the
    predicted peak's slope over the same batch range. Columns: model, mom, paper_bytes_per_sample,
    predicted_bytes_per_sample, error, batch_lo, batch_hi, note."""
    runs = reference.paper_runs()
    rows = []
    for model in models:
        paper = reference.paper_memory_per_sample(model)
        for _, r in paper.iterrows():
            mom = r["mom"]
            sweep = runs[(runs["model"] == model) & (runs["mom"] == mom) & (runs["experiment"] == "mem")
                         & runs["fits"] & (runs["gpus"] == 1)]
            lo, hi = int(sweep["batch_size"].min()), int(sweep["batch_size"].max())
            note = DIFFERENT_SYSTEM.get((model, mom), "")
            try:
                prof = _estimate.profile(model, mom, precision=reference.PRECISION[model], setup=setup)
                ylo, yhi = prof.peak_bytes([lo, hi])
                pred = (yhi - ylo) / (hi - lo) if hi > lo else math.nan
            except ValueError as exc:
                pred, note = math.nan, note or f"not predicted: {str(exc).splitlines()[0]}"
            rows.append({"model": model, "mom": mom, "paper_bytes_per_sample": float(r["bytes_per_sample"]),
                         "predicted_bytes_per_sample": float(pred),
                         "error": pred / float(r["bytes_per_sample"]) - 1 if pred == pred else math.nan,
                         "batch_lo": lo, "batch_hi": hi, "note": note})
    return pd.DataFrame(rows)


__all__ = ["max_batch_table", "breakdown_table", "slope_table", "summary", "BREAKDOWN_BATCH", "DIFFERENT_SYSTEM",
           "GPU", "MODELS"]

