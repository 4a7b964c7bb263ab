"""The paper's scenario metrics, as pure functions of a records DataFrame.

Input: rows as `momlab.results.load` (or ``pd.DataFrame(m.to_dict() for m in
...)``) gives: model, mom, batch_size, device, precision, budget, fits,
throughput, peak_bytes, step_time_s, and the size either as ``size.<keyword>``
columns or a ``size`` dict. A configuration (what MOMs are compared within)
is model, device, precision, budget, the size keywords, and the device model
(``env.device_name``) when the frame has it; rows of other configurations
never mix. The baseline is "exact".

- `s1_summary` (S1, bigger batch): per MOM the largest batch that fits, the
  maximum throughput over every batch that fits and where it is reached,
  and its ratio to the baseline's maximum throughput; ``pays`` is ratio > 1.
- `s2_summary` (S2, bigger model): per MOM and size keyword, the largest size
  that fits at each batch, and the throughput there.
- `s2prime` (S2', bigger model judged fairly): per MOM and size value, the
  maximum throughput over batches; `crossover` reads off where a MOM starts
  to beat the baseline.
- `fixed_batch`: memory saved and time overhead at one batch size, the
  numbers papers usually report (and which, the paper argues, do not say
  whether training gets better).

A ratio is ``inf`` when the baseline was measured but never fits where the
MOM does, and NaN when the baseline was not measured.
"""

from __future__ import annotations

import math

import pandas as pd

BASELINE = "exact"
SIZE_PREFIX = "size."


def _size_columns(df: pd.DataFrame) -> list[str]:
    return sorted(c for c in df.columns if c.startswith(SIZE_PREFIX))


def _prepare(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with ``size.*`` columns (expanded from a ``size`` dict if needed) and a budget column."""
    df = df.copy()
    if not _size_columns(df) and "size" in df.columns:
        sizes = pd.DataFrame([s if isinstance(s, dict) else {} for s in df["size"]], index=df.index)
        for k in sizes.columns:
            df[SIZE_PREFIX + k] = sizes[k]
    if "budget" not in df.columns:
        df["budget"] = math.nan
    df["fits"] = df["fits"].astype(bool)
    return df


def _label(df: pd.DataFrame, exclude: str | None = None) -> pd.Series:
    """The size keywords of each row as one hashable text, e.g. 'hidden_size=64,num_layers=2'."""
    cols = [c for c in _size_columns(df) if c != (SIZE_PREFIX + exclude if exclude else None)]

    def one(row) -> str:
        return ",".join(f"{c[len(SIZE_PREFIX):]}={int(row[c])}" for c in cols if pd.notna(row[c]))

    if df.empty:
        return pd.Series([], dtype=object, index=df.index)
    return df[cols].apply(one, axis=1) if cols else pd.Series("", index=df.index)


def _config(df: pd.DataFrame) -> list[str]:
    cols = ["model", "device", "precision", "budget"]
    return cols + (["env.device_name"] if "env.device_name" in df.columns else [])


def _ratio(value: pd.Series, base: pd.Series, base_fits: pd.Series) -> pd.Series:
    """value/base; inf where the baseline was measured, never fits, and the MOM does; NaN where unmeasured."""
    out = value / base
    out[(base_fits == False) & value.notna()] = math.inf  # noqa: E712 - NaN (unmeasured) stays NaN
    return out


def _pays(ratio: pd.Series) -> pd.Series:
    return pd.Series(pd.array([pd.NA if pd.isna(r) else bool(r > 1) for r in ratio], dtype="boolean"),
                     index=ratio.index)


def _join_baseline(table: pd.DataFrame, keys: list[str], columns: dict, baseline: str) -> pd.DataFrame:
    """Add the baseline MOM's `columns` (name -> new name) on matching `keys`."""
    base = table[table["mom"] == baseline][keys + list(columns)].rename(columns=columns)
    return table.merge(base, on=keys, how="left")


def _baseline_first(t: pd.DataFrame, keys: list[str], baseline: str) -> pd.DataFrame:
    """Sort by `keys` (the last one being mom), the baseline first within each configuration."""
    order = t.assign(_not_base=t["mom"] != baseline)
    order = order.sort_values(keys[:-1] + ["_not_base", "mom"], kind="stable", na_position="first")
    return order.drop(columns="_not_base").reset_index(drop=True)


def _summaries(df, keys, value_col):
    """Per group of `keys`: largest fitting `value_col`, smallest failing one above it, max throughput."""
    rows = []
    for k, g in df.groupby(keys, dropna=False, sort=True):
        ok = g[g["fits"]]
        largest = int(ok[value_col].max()) if len(ok) else 0
        bad = g[(~g["fits"]) & (g[value_col] > largest)]
        tp = ok["throughput"].dropna()
        best = ok.loc[tp.idxmax()] if len(tp) else None
        rows.append({**dict(zip(keys, k)), "largest": largest,
                     "first_failure": int(bad[value_col].min()) if len(bad) else math.nan,
                     "max_throughput": float(tp.max()) if len(tp) else math.nan,
                     "at": int(best[value_col]) if best is not None else math.nan,
                     "best_batch_size": int(best["batch_size"]) if best is not None else math.nan,
                     "throughput_at_largest": float(ok[ok[value_col] == largest]["throughput"].max())
                     if len(ok) else math.nan,
                     "any_fits": bool(len(ok)), "points": len(g)})
    return pd.DataFrame(rows, columns=keys + ["largest", "first_failure", "max_throughput", "at", "best_batch_size",
                                              "throughput_at_largest", "any_fits", "points"])


def s1_summary(df: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """S1 per configuration and MOM: max_batch_size, oom_batch_size (smallest failing batch above it,
    NaN if none was measured: then max_batch_size is only a lower bound), max_throughput, best_batch_size,
    baseline_max_throughput, ratio, pays (ratio > 1), batch_ratio (max batch over the baseline's)."""
    df = _prepare(df)
    df["size_label"] = _label(df)
    keys = _config(df) + ["size_label", "mom"]
    t = _summaries(df, keys, "batch_size")
    t = t.rename(columns={"largest": "max_batch_size", "first_failure": "oom_batch_size"})
    t = _join_baseline(t, keys[:-1], {"max_throughput": "baseline_max_throughput", "any_fits": "_base_fits",
                                     "max_batch_size": "_base_batch"}, baseline)
    t["ratio"] = _ratio(t["max_throughput"], t["baseline_max_throughput"], t["_base_fits"])
    t["pays"] = _pays(t["ratio"])
    t["batch_ratio"] = _ratio(t["max_batch_size"].where(t["any_fits"]), t["_base_batch"], t["_base_fits"])
    cols = keys + ["max_batch_size", "oom_batch_size", "max_throughput", "best_batch_size",
                   "baseline_max_throughput", "ratio", "pays", "batch_ratio", "points"]
    return _baseline_first(t[cols], keys, baseline)


def _dims(df: pd.DataFrame, dim: str | None) -> list[str]:
    if dim is not None:
        if SIZE_PREFIX + dim not in df.columns:
            raise ValueError(f"no size column {dim!r}; size keywords in this frame: "
                             f"{', '.join(c[len(SIZE_PREFIX):] for c in _size_columns(df))}")
        return [dim]
    if "scan" in df.columns:
        dims = [d for d in df["scan"].dropna().unique() if SIZE_PREFIX + str(d) in df.columns]
    else:
        dims = [c[len(SIZE_PREFIX):] for c in _size_columns(df) if df[c].nunique(dropna=True) > 1]
    if not dims:
        raise ValueError("no scanned size keyword in this frame; pass dim=")
    return sorted(dims)


def _scan_rows(df: pd.DataFrame, dim: str) -> pd.DataFrame:
    rows = df[df["scan"] == dim] if "scan" in df.columns and (df["scan"] == dim).any() else df
    rows = rows[rows[SIZE_PREFIX + dim].notna()].copy()
    rows["dim"] = dim
    rows["other_size"] = _label(rows, exclude=dim)
    return rows


def s2_summary(df: pd.DataFrame, dim: str | None = None, baseline: str = BASELINE) -> pd.DataFrame:
    """S2 per configuration, MOM, size keyword (`dim`; default: every scanned one) and batch size:
    largest (value of dim that fits; 0 if none), throughput_at_largest, oom_value (smallest failing value
    above it; NaN if unmeasured), baseline_largest and size_ratio (largest over the baseline's)."""
    df = _prepare(df)
    parts = []
    for d in _dims(df, dim):
        rows = _scan_rows(df, d)
        rows["value"] = rows[SIZE_PREFIX + d]
        keys = _config(rows) + ["dim", "other_size", "batch_size", "mom"]
        t = _summaries(rows, keys, "value")
        t = _join_baseline(t, keys[:-1], {"largest": "baseline_largest", "any_fits": "_base_fits"}, baseline)
        t["size_ratio"] = _ratio(t["largest"].where(t["any_fits"]), t["baseline_largest"].where(t["_base_fits"]),
                                 t["_base_fits"])
        parts.append(t.rename(columns={"first_failure": "oom_value"}))
    t = pd.concat(parts, ignore_index=True)
    keys = _config(t) + ["dim", "other_size", "batch_size", "mom"]
    cols = keys + ["largest", "throughput_at_largest", "oom_value", "baseline_largest", "size_ratio", "points"]
    return _baseline_first(t[cols], keys, baseline)


def s2prime(df: pd.DataFrame, dim: str | None = None, baseline: str = BASELINE) -> pd.DataFrame:
    """S2' per configuration, MOM, size keyword and value: max_throughput over every batch that fits,
    best_batch_size, max_batch_size, baseline_max_throughput, ratio and pays (ratio > 1)."""
    df = _prepare(df)
    parts = []
    for d in _dims(df, dim):
        rows = _scan_rows(df, d)
        rows["value"] = rows[SIZE_PREFIX + d].astype(int)
        keys = _config(rows) + ["dim", "other_size", "value", "mom"]
        t = _summaries(rows, keys, "batch_size")
        t = t.rename(columns={"largest": "max_batch_size"})
        t = _join_baseline(t, keys[:-1], {"max_throughput": "baseline_max_throughput", "any_fits": "_base_fits"},
                           baseline)
        t["ratio"] = _ratio(t["max_throughput"], t["baseline_max_throughput"], t["_base_fits"])
        t["pays"] = _pays(t["ratio"])
        parts.append(t)
    t = pd.concat(parts, ignore_index=True)
    cols = _config(t) + ["dim", "other_size", "value", "mom", "max_throughput", "best_batch_size", "max_batch_size",
                         "baseline_max_throughput", "ratio", "pays"]
    return t[cols].sort_values(_config(t) + ["dim", "other_size", "mom", "value"], ignore_index=True)


def crossover(s2p: pd.DataFrame) -> pd.DataFrame:
    """From an `s2prime` table: per configuration, size keyword and MOM, the smallest measured value
    from which the MOM beats the baseline at every larger measured value (NaN if it never does)."""
    keys = _config(s2p) + ["dim", "other_size", "mom"]
    rows = []
    for k, g in s2p.groupby(keys, dropna=False, sort=True):
        g = g.sort_values("value")
        pays = g["pays"].fillna(False).astype(bool).tolist()
        start = math.nan
        for i in range(len(pays) - 1, -1, -1):
            if not pays[i]:
                break
            start = int(g["value"].iloc[i])
        rows.append({**dict(zip(keys, k)), "pays_from": start})
    return pd.DataFrame(rows, columns=keys + ["pays_from"])


def fixed_batch(df: pd.DataFrame, batch_size: int, baseline: str = BASELINE) -> pd.DataFrame:
    """At one batch size, per configuration and MOM: fits, peak_bytes, saved_bytes and memory_saving
    (1 - peak / baseline peak), step_time_s, overhead (step time / baseline's - 1) and throughput_ratio.
    Savings and overheads are NaN unless both fit. Repeated rows: the last recorded counts."""
    df = _prepare(df)
    df = df[df["batch_size"] == batch_size].copy()
    df["size_label"] = _label(df)
    keys = _config(df) + ["size_label", "mom"]
    cols = ["fits", "peak_bytes", "activation_bytes", "step_time_s", "throughput"]
    cols = [c for c in cols if c in df.columns]
    t = df.groupby(keys, dropna=False, sort=True)[cols].last().reset_index()
    t["batch_size"] = batch_size
    t = _join_baseline(t, keys[:-1], {c: "baseline_" + c for c in cols}, baseline)
    both = t["fits"].astype(bool) & (t["baseline_fits"] == True)  # noqa: E712 - NaN (no baseline) is False
    t["saved_bytes"] = (t["baseline_peak_bytes"] - t["peak_bytes"]).where(both)
    t["memory_saving"] = (1 - t["peak_bytes"] / t["baseline_peak_bytes"]).where(both)
    t["overhead"] = (t["step_time_s"] / t["baseline_step_time_s"] - 1).where(both)
    t["throughput_ratio"] = (t["throughput"] / t["baseline_throughput"]).where(both)
    out = keys + ["batch_size", "fits", "peak_bytes", "baseline_peak_bytes", "saved_bytes", "memory_saving",
                  "step_time_s", "baseline_step_time_s", "overhead", "throughput_ratio"]
    return _baseline_first(t[out], keys, baseline)


# -- over rank counts (notebook 07; records of momlab.sweep.scan_ranks) --------------------------

def rank_scaling(df, baseline: str = "exact"):
    """Per model, parallel strategy, rank count and MOM: the maximum throughput over the batches that fit, the
    batch where it is reached, and its ratio to `baseline`'s at the same strategy and rank count.

    Columns: model, parallel, panel ("model, parallel"), gpus (the rank
    count), mom, max_batch_size, best_batch_size, max_throughput, ratio: what
    `momlab.plots.gpu_count` draws (a panel per strategy with
    ``model=panel``). Rows at one rank (parallel ``none``) are repeated under
    every strategy, as its 1-GPU point.
    """
    df = df[df["fits"].astype(bool)]
    strategies = sorted({p for p in df["parallel"] if p != "none"}) or ["none"]
    rows = []
    for (model, par, ranks, mom), g in df.groupby(["model", "parallel", "ranks", "mom"]):
        best = g.loc[g["throughput"].idxmax()]
        for p in (strategies if par == "none" else [par]):
            rows.append(dict(model=model, parallel=p, panel=f"{model}, {p}", gpus=int(ranks), mom=mom,
                             max_batch_size=int(g["batch_size"].max()), best_batch_size=int(best["batch_size"]),
                             max_throughput=float(best["throughput"])))
    out = pd.DataFrame(rows, columns=["model", "parallel", "panel", "gpus", "mom", "max_batch_size",
                                      "best_batch_size", "max_throughput"])
    base = out[out["mom"] == baseline].set_index(["model", "parallel", "gpus"])["max_throughput"]
    out["ratio"] = [t / base.get((m, p, g), math.nan)
                    for m, p, g, t in zip(out["model"], out["parallel"], out["gpus"], out["max_throughput"])]
    return out.sort_values(["model", "parallel", "mom", "gpus"]).reset_index(drop=True)


def rank_memory(df, batch_size: int | None = None):
    """Per-rank memory against rank count: one row per (model, parallel, ranks, mom, batch) that fits, with
    the per-rank fields (maximum over ranks) and ``comm_bytes``."""
    df = df[df["fits"].astype(bool)].copy()
    if batch_size is not None:
        df = df[df["batch_size"] == batch_size]
    df["comm_bytes"] = [(o or {}).get("comm_bytes", 0) if isinstance(o, dict) else 0 for o in df["options"]]
    df["model_state_bytes"] = df["params_bytes"] + df["grads_bytes"] + df["optimizer_bytes"]
    cols = ["model", "parallel", "ranks", "mom", "batch_size", "peak_bytes", "params_bytes", "grads_bytes",
            "optimizer_bytes", "model_state_bytes", "activation_bytes", "comm_bytes", "workspace_bytes", "host_bytes"]
    return df[cols].sort_values(["model", "parallel", "mom", "batch_size", "ranks"]).reset_index(drop=True)


# -- the S1 verdict, in words: the one text every caller shows (estimate.verdict, whatif, notebooks) ----

def s1_verdict(s1: pd.DataFrame, *, where: str, baseline: str = BASELINE) -> dict:
    """Which MOM wins S1 in an `s1_summary` table of one configuration, and the sentence saying so.

    Returns ``best`` (the MOM with the highest max_throughput; None when
    nothing fits), ``throughput``, ``batch_size`` (where it is reached),
    ``max_batch``, ``ratio_vs_exact`` (its ratio to the baseline's; inf when
    the baseline fits nowhere, NaN without a baseline) and ``text``, e.g.
    "S1 on A100-40: quant4 is fastest, 812 samples/s at batch 96 (max batch
    128), 1.07x exact." `where` names the device in the text.
    """
    if s1["model"].nunique() > 1 or len(s1) and s1[_config(s1)[1:]].astype(str).drop_duplicates().shape[0] > 1:
        raise ValueError("s1_verdict takes the s1_summary of one configuration; group the table first")
    model = s1["model"].iloc[0] if len(s1) else "the model"
    ok = s1[s1["max_throughput"].notna() & (s1["max_batch_size"] > 0)]
    if ok.empty:
        return {"best": None, "throughput": math.nan, "batch_size": 0, "max_batch": 0, "ratio_vs_exact": math.nan,
                "text": f"S1: nothing fits {model} on {where}, not even at batch 1."}
    win = ok.loc[ok["max_throughput"].idxmax()]
    base = ok[ok["mom"] == baseline]
    measured_base = (s1["mom"] == baseline).any()
    ratio = (float(win["max_throughput"] / base["max_throughput"].iloc[0]) if len(base)
             else math.inf if measured_base else math.nan)
    text = (f"S1 on {where}: {win['mom']} is fastest, {win['max_throughput']:,.4g} samples/s at batch "
            f"{int(win['best_batch_size'])} (max batch {int(win['max_batch_size'])})")
    if win["mom"] != baseline and measured_base:
        text += f", {ratio:.2f}x {baseline}" if len(base) else f", {baseline} does not fit at all"
    elif win["mom"] == baseline and len(ok) > 1:
        runner = ok[ok["mom"] != baseline].sort_values("max_throughput").iloc[-1]
        text += (f"; no MOM beats {baseline} (best: {runner['mom']}, "
                 f"{runner['max_throughput'] / win['max_throughput']:.2f}x)")
    return {"best": str(win["mom"]), "throughput": float(win["max_throughput"]),
            "batch_size": int(win["best_batch_size"]), "max_batch": int(win["max_batch_size"]),
            "ratio_vs_exact": ratio, "text": text + "."}
