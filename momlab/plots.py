"""The paper's figures as pure functions: a DataFrame of records in, a Figure out.

Records are rows of ``Measurement.to_dict()`` (or ``momlab.reference.paper_runs()``),
with the size either as a ``size`` dict column or as ``size.<keyword>`` columns.
An optional ``source`` column ("momlab" / "paper"; the paper table's raw
file:line counts as "paper") tells the two apart: where a frame holds both,
the paper's lines are dotted with hollow markers and its bars hatched. Every MOM
has one colour and marker in every figure (``MOM_STYLE``: seaborn's colorblind
palette, exact black); combinations are dashed. Figures are built with
``matplotlib.figure.Figure`` (no pyplot state); ``save`` writes PNG and PDF.

- ``memory_breakdown``: stacked bars of activations, model-related (weights,
  gradients, optimizer state) and workspace (paper Figure 1).
- ``batch_curves``: S1, throughput against batch size, a panel per model, a
  black x where a MOM ran out of memory (paper case-study figures).
- ``largest_model``: S2, the largest trainable size per MOM, with the
  throughput there.
- ``size_curves``: S2', maximum throughput against depth or width.
- ``gpu_count``: MOM/exact ratio of maximum throughput against GPU count.
- ``compare_table``: our S1 ratios beside the paper's.
"""

from __future__ import annotations

import math
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from momlab.errors import check_choice
from momlab.reference import UNITS
from momlab.units import format_bytes, parse_bytes

_CB = sns.color_palette("colorblind")  # blue orange green red purple brown pink gray yellow cyan
_DARK = sns.color_palette("dark")
EXACT_COLOR = "#222222"

# One colour and marker per MOM, the same in every figure: seaborn's colorblind
# palette, and its "dark" twin where ten colours run out or are too pale on
# white (yellow, light pink); the pairs drawn together most often (quant4 and
# quant4+swap, ckpt and swap+ckpt) get the most distinct hues. Markers avoid
# "x", which marks an out-of-memory. Combinations are dashed.
MOM_STYLE: dict[str, dict] = {
    "exact": {"color": EXACT_COLOR, "marker": "o", "label": "Exact"},
    "ckpt": {"color": _CB[0], "marker": "s", "label": "Checkpoint"},
    "ckpt-selective": {"color": _CB[9], "marker": "s", "label": "Checkpoint (selective)"},
    "ckpt-auto": {"color": _DARK[9], "marker": "p", "label": "Checkpoint (auto)"},
    "ckpt-dtr": {"color": _DARK[0], "marker": "h", "label": "Checkpoint (DTR)"},
    "swap": {"color": _CB[2], "marker": "v", "label": "Swap"},
    "quant8": {"color": _DARK[8], "marker": "^", "label": "Quantize 8-bit"},
    "quant4": {"color": _CB[4], "marker": "^", "label": "Quantize 4-bit"},
    "quant2": {"color": _DARK[4], "marker": "<", "label": "Quantize 2-bit"},
    "quant4+swap": {"color": _CB[1], "marker": "P", "label": "Quantize+Swap"},
    "quant4+ckpt": {"color": _DARK[6], "marker": "D", "label": "Quantize+Checkpoint"},
    "swap+ckpt": {"color": _CB[7], "marker": "d", "label": "Swap+Checkpoint"},
}
# colours no MOM above uses, for names outside MOM_STYLE (chosen by hash)
_SPARE = [_CB[3], _CB[5], _DARK[1], _DARK[2], _DARK[5], _DARK[7]]
for _name, _style in MOM_STYLE.items():
    _style["linestyle"] = "--" if "+" in _name else "-"

# stacked categories of the memory breakdown, bottom to top
BREAKDOWN = {"activations": _CB[0], "model-related": _CB[1], "workspace": _CB[2]}
OOM_MARKER = {"marker": "x", "color": "black", "markersize": 9, "markeredgewidth": 2.2,
              "linestyle": "none"}
DIM_LABELS = {
    "num_layers": "depth (number of layers)",
    "hidden_size": "width (hidden size)",
    "width_per_group": "width (channels per group)",
    "seq_len": "sequence length",
    "image_size": "input resolution (px)",
    "num_heads": "attention heads",
}


def mom_style(mom: str) -> dict:
    """Colour, marker, line style and label of a MOM; stable for names not in
    ``MOM_STYLE`` too (a combination in another order finds its entry; an
    unknown name gets a colour from its hash)."""
    if mom in MOM_STYLE:
        return dict(MOM_STYLE[mom])
    atoms = set(mom.split("+"))
    for name, style in MOM_STYLE.items():
        if set(name.split("+")) == atoms:
            return dict(style)
    color = _SPARE[zlib.crc32(mom.encode()) % len(_SPARE)]
    return {"color": color, "marker": "*", "label": mom,
            "linestyle": "--" if "+" in mom else "-"}


def _moms_in_order(moms) -> list[str]:
    known = list(MOM_STYLE)
    present = list(dict.fromkeys(moms))
    return sorted(present, key=lambda m: (known.index(m) if m in known else len(known), m))


def _prepare(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with ``size.<keyword>`` columns, expanded from a ``size`` dict if needed."""
    df = df.copy()
    if "size" in df.columns and not any(c.startswith("size.") for c in df.columns):
        sizes = pd.DataFrame([s if isinstance(s, dict) else {} for s in df["size"]], index=df.index)
        for k in sizes.columns:
            df[f"size.{k}"] = sizes[k]
    if "fits" in df.columns:
        df["fits"] = df["fits"].astype(bool)
    return df


# where a row comes from; drawn apart only when a frame holds both
PAPER_LINE = {"linestyle": ":", "alpha": 0.8, "markerfacecolor": "none"}


def _origin(df: pd.DataFrame) -> pd.Series:
    """"momlab" or "paper" per row, from the optional ``source`` column: a row
    is momlab's when it has no source or source "momlab", the paper's
    otherwise (``reference.paper_runs`` keeps the raw file:line there)."""
    if "source" not in df.columns:
        return pd.Series("momlab", index=df.index)
    src = df["source"]
    return src.where(src.isna() | (src == "momlab"), "paper").fillna("momlab")


def _line_kw(mom: str, origin: str, mixed: bool) -> dict:
    s = mom_style(mom)
    kw = {"color": s["color"], "marker": s["marker"], "linestyle": s["linestyle"],
          "label": s["label"], "markersize": 5, "linewidth": 1.6}
    if mixed and origin == "paper":
        kw.update(PAPER_LINE, label=f"{s['label']} (paper)")
    return kw


def _origin_handles(mixed: bool) -> list:
    if not mixed:
        return []
    return [Line2D([], [], color="gray", marker="o", label="momlab"),
            Line2D([], [], color="gray", marker="o", label="paper", **PAPER_LINE)]


def _size_label(row: pd.Series, columns: list[str]) -> str:
    parts = [f"{c[5:]}={int(row[c])}" for c in columns if pd.notna(row[c])]
    return ", ".join(parts)


def _unique(df: pd.DataFrame, column: str):
    if column not in df.columns:
        return None
    values = df[column].dropna().unique()
    return values[0] if len(values) == 1 else None


def _budget(budget) -> int | None:
    """Bytes of a budget given as int, "2GiB" or a DataFrame cell; None when absent."""
    if budget is None or budget is pd.NA:
        return None
    if isinstance(budget, np.generic):  # what a DataFrame cell holds
        budget = budget.item()
    if isinstance(budget, float) and math.isnan(budget):
        return None
    return parse_bytes(budget)


def _env_device(df: pd.DataFrame):
    """The device name of ``Measurement.env`` dicts, when all rows share one."""
    if "env" not in df.columns:
        return None
    names = {e.get("device_name") for e in df["env"] if isinstance(e, dict)} - {None}
    return names.pop() if len(names) == 1 else None


def describe(df: pd.DataFrame | None = None, *, device=None, precision=None, budget=None) -> str:
    """The measurement context for a title: device, precision, budget, and how
    memory was obtained ("emulated budget (CPU)" for a budget enforced on the
    CPU accounting, "predicted" for estimates). Values not passed are taken
    from ``df`` where a column holds a single one."""
    if df is not None:
        device = device or _unique(df, "gpu") or _unique(df, "env.device_name") \
            or _env_device(df) or _unique(df, "device")
        precision = precision or _unique(df, "precision")
        if budget is None:
            budget = _unique(df, "budget")
    source = _unique(df, "memory_source") if df is not None else None
    parts = [str(p) for p in (device, precision) if p]
    budget = _budget(budget)
    if budget is not None:
        parts.append(f"budget {format_bytes(budget)}")
        if source == "cpu-emulated":
            parts.append("emulated budget (CPU)")
    if source == "predicted":
        parts.append("predicted")
    return " · ".join(parts)


def _title(fig: Figure, title: str | None, context: str) -> None:
    text = " — ".join(t for t in (title, context) if t)
    if text:
        # wrapped to the figure's width (about 11 characters per inch at 11 pt)
        width = max(20, int(fig.get_figwidth() * 11))
        fig.suptitle(textwrap.fill(text, width), fontsize=11)


def _unit_for(model: str | None, unit: str | None) -> str:
    return unit or UNITS.get(model or "", "samples/s")


def _bytes_unit(max_bytes: float) -> tuple[str, float]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= size:
            return name, size
    return "B", 1


def memory_breakdown(df: pd.DataFrame, *, title: str | None = "Memory breakdown",
                     device=None, precision=None, budget=None, unit: str | None = None) -> Figure:
    """Stacked bars per record: activations, model-related (``model_bytes`` if
    the frame has it, else params + grads + optimizer) and workspace, in GiB,
    MiB or KiB by the data's range (``unit`` forces one). Bars are labelled by
    model, with MOM and batch size where the frame holds several; negative
    values (the paper's GPT offloading runs) are drawn as zero. A ``budget``
    draws a dashed line."""
    df = _prepare(df).reset_index(drop=True)
    if df.empty:
        raise ValueError("memory_breakdown needs at least one record")
    act = df["activation_bytes"].astype(float).fillna(0)
    if "model_bytes" in df.columns and df["model_bytes"].notna().all():
        model = df["model_bytes"].astype(float)
    else:
        parts = [c for c in ("params_bytes", "grads_bytes", "optimizer_bytes") if c in df.columns]
        if not parts:
            raise ValueError("need model_bytes or params_bytes/grads_bytes/optimizer_bytes columns")
        model = df[parts].astype(float).fillna(0).sum(axis=1)
    work = df["workspace_bytes"].astype(float).fillna(0) if "workspace_bytes" in df.columns \
        else pd.Series(0.0, index=df.index)
    stack = {"activations": act.clip(lower=0), "model-related": model.clip(lower=0),
             "workspace": work.clip(lower=0)}
    total = sum(stack.values())
    budget_bytes = _budget(budget)
    top = max(float(total.max()), float(budget_bytes or 0))
    names = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}
    if unit is not None and unit not in names:
        raise ValueError(f"unit must be one of {list(names)}, got {unit!r}")
    unit, scale = (unit, names[unit]) if unit else _bytes_unit(top)

    df["_origin"] = _origin(df)
    mixed = df["_origin"].nunique() > 1

    def several(col):
        return col in df.columns and df[col].nunique() > 1
    # a bar's label names what differs between bars; what all share goes in the title
    labels = []
    for _, r in df.iterrows():
        parts = [str(r["model"])] if several("model") or not several("mom") else []
        if several("mom"):
            parts.append(mom_style(r["mom"])["label"])
        if several("batch_size"):
            parts.append(f"batch {int(r['batch_size'])}")
        note = _scaled_note(r)
        if note:
            parts.append(note)
        if mixed:
            parts.append(f"({r['_origin']})")
        labels.append("\n".join(parts))
    shared = [str(df["model"].iloc[0])] if "model" in df.columns and not several("model") \
        and several("mom") else []
    if "batch_size" in df.columns and not several("batch_size"):
        shared.append(f"batch {int(df['batch_size'].iloc[0])}")
    if shared and title:
        title = f"{title} ({', '.join(shared)})"

    fig = Figure(figsize=(max(4.0, 0.75 * len(df) + 1.5), 4.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(df))
    bottom = np.zeros(len(df))
    for name, values in stack.items():
        heights = values.to_numpy() / scale
        ax.bar(x, heights, bottom=bottom, color=BREAKDOWN[name], label=name, width=0.6)
        bottom += heights
    if budget_bytes:
        ax.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(budget_bytes)}")
    # a zero-height segment on top of the tallest bar is a sticky edge that pins the axis to its top
    ax.set_ylim(0, 1.05 * top / scale)
    ax.set_xticks(x, labels, rotation=0 if len(df) <= 6 else 60,
                  ha="center" if len(df) <= 6 else "right", fontsize=9)
    ax.set_ylabel(f"memory ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    _title(fig, title, describe(df, device=device, precision=precision, budget=budget))
    return fig


_SHORT = {"num_layers": "layers", "hidden_size": "hidden", "num_heads": "heads", "seq_len": "seq",
          "image_size": "px", "width_per_group": "wpg"}


def _scaled_note(row: pd.Series) -> str:
    """The size keywords where a record differs from its catalog model's default ("4 layers")."""
    from momlab import catalog

    if row.get("model") not in catalog.models():
        return ""
    default = catalog.spec(row["model"]).size
    diff = []
    for k, v in default.items():
        got = row.get(f"size.{k}")
        if got is not None and not pd.isna(got) and int(got) != v:
            diff.append(f"{int(got)} {_SHORT[k]}")
    return ", ".join(diff)


def _with_size_label(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with a ``_size`` column: its size keywords as text ("" when none)."""
    cols = sorted(c for c in df.columns if c.startswith("size."))
    if not cols or df.empty:
        return df.assign(_size="")
    return df.assign(_size=df.apply(lambda r: _size_label(r, cols), axis=1))


def _panel_keys(df: pd.DataFrame, models) -> list[tuple[str, str]]:
    """(model, size label) of each panel, in the order given or first seen."""
    order = list(models) if models is not None else list(dict.fromkeys(df["model"]))
    keys = []
    for m in order:
        sizes = list(dict.fromkeys(df.loc[df["model"] == m, "_size"]))
        if not sizes:
            raise ValueError(f"no records for model {m!r}; models present: "
                             f"{sorted(df['model'].unique())}")
        keys += [(m, s) for s in sizes]
    return keys


def _grid(n: int, ncols: int | None, panel=(4.2, 3.2), min_width: float = 6.0):
    ncols = ncols or min(n, 3)
    nrows = math.ceil(n / ncols)
    # a single panel still gets room for the legend and the title
    fig = Figure(figsize=(max(panel[0] * ncols, min_width), panel[1] * nrows + 1.1),
                 layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _mom_legend(fig: Figure, moms, *, oom: bool, extra: list | None = None) -> None:
    handles = [Line2D([], [], color=mom_style(m)["color"], marker=mom_style(m)["marker"],
                      linestyle=mom_style(m)["linestyle"], label=mom_style(m)["label"])
               for m in moms]
    if oom:
        handles.append(Line2D([], [], label="out of memory", **OOM_MARKER))
    handles += extra or []
    # as many columns as fit the figure's width (about 1.9 inch an entry)
    ncols = max(1, min(len(handles), int(fig.get_figwidth() / 1.9)))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8,
               frameon=False)


def _markevery(n: int, most: int = 14) -> list[int]:
    """Indices of at most ``most`` markers, first and last included: dense
    sweeps (the paper's BERT has 100 batches) otherwise draw a solid band."""
    if n <= most:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, most).round().astype(int).tolist()))


def batch_curves(df: pd.DataFrame, *, models: list[str] | None = None,
                 moms: list[str] | None = None, title: str | None = "Throughput against batch size",
                 unit: str | None = None, device=None, precision=None, budget=None,
                 ncols: int | None = None) -> Figure:
    """S1: a panel per model (and per size, where the frame holds several),
    throughput against batch size, a line per MOM through the batches that fit
    (the best run where a batch was repeated). A black x marks where a MOM ran
    out of memory: at the first failing batch above its last fitting one, at
    that point's height; at zero when no batch fits. A MOM whose sweep
    recorded no failure gets no x: its last point is a lower bound.
    Throughput is samples per second over all devices of a run (img/s or
    seq/s for the paper's models; ``unit`` overrides)."""
    df = _prepare(df)
    if moms is not None:
        df = df[df["mom"].isin(moms)]
    if df.empty:
        raise ValueError("batch_curves needs at least one record")
    df = _with_size_label(df).assign(_origin=_origin(df))
    mixed = df["_origin"].nunique() > 1
    keys = _panel_keys(df, models)
    fig, axes = _grid(len(keys), ncols)
    all_moms, any_oom = [], False
    for ax, (model, size) in zip(axes, keys):
        panel = df[(df["model"] == model) & (df["_size"] == size)]
        for mom in _moms_in_order(panel["mom"]):
            for origin, runs in panel[panel["mom"] == mom].groupby("_origin", sort=True):
                ok = runs[runs["fits"] & runs["throughput"].notna()]
                curve = ok.groupby("batch_size")["throughput"].max().sort_index()
                if len(curve):
                    ax.plot(curve.index, curve.to_numpy(), markevery=_markevery(len(curve)),
                            **_line_kw(mom, origin, mixed))
                failed = runs.loc[~runs["fits"], "batch_size"].dropna()
                if len(curve):
                    failed = failed[failed > curve.index.max()]
                if len(failed):
                    y = float(curve.iloc[-1]) if len(curve) else 0.0
                    ax.plot([failed.min()], [y], gid="oom", label="_oom", zorder=5, **OOM_MARKER)
                    any_oom = True
            all_moms.append(mom)
        origins = set(panel["_origin"])
        suffix = f" — {origins.pop()}" if mixed and len(origins) == 1 else ""
        ax.set_title(model + (f" ({size})" if size else "") + suffix, fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"throughput ({_unit_for(model, unit)})")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _mom_legend(fig, _moms_in_order(all_moms), oom=any_oom, extra=_origin_handles(mixed))
    _title(fig, title, describe(df, device=device, precision=precision, budget=budget))
    return fig


def _largest_table(df: pd.DataFrame, dim: str | None,
                   batch_size: int | None) -> tuple[pd.DataFrame, str]:
    """(mom, largest, throughput, _origin) from an S2 summary or raw records."""
    df = df.assign(_origin=_origin(df))
    cols = ["mom", "largest", "throughput", "_origin"]
    if batch_size is not None and "batch_size" in df.columns:
        df = df[df["batch_size"] == batch_size]
    if "largest" in df.columns:  # momlab.metrics.s2_summary
        d = dim or _unique(df, "dim") or "size"
        if dim is not None and "dim" in df.columns:
            df = df[df["dim"] == dim]
        tp = "throughput_at_largest" if "throughput_at_largest" in df.columns else "throughput"
        table = df.rename(columns={tp: "throughput"})[cols]
    elif dim is None:
        raise ValueError("pass dim= (a size keyword) for raw records or a paper_largest table")
    elif dim in df.columns and "fits" not in df.columns:  # momlab.reference.paper_largest
        d, table = dim, df.rename(columns={dim: "largest"})[cols]
    else:
        d, col = dim, f"size.{dim}"
        if col not in df.columns:
            raise ValueError(f"no column {col!r}; size columns: "
                             f"{[c for c in df.columns if c.startswith('size.')]}")
        rows = []
        for (mom, origin), g in df.groupby(["mom", "_origin"]):
            ok = g[g["fits"] & g[col].notna()]
            largest = ok[col].max() if len(ok) else 0
            rows.append({"mom": mom, "largest": largest, "_origin": origin,
                         "throughput": ok.loc[ok[col] == largest, "throughput"].max()
                         if len(ok) else math.nan})
        table = pd.DataFrame(rows, columns=cols)
    dup = table.duplicated(["mom", "_origin"], keep=False)
    if dup.any():
        raise ValueError(f"several rows for MOM {table.loc[dup, 'mom'].iloc[0]!r}: pass "
                         "batch_size= or select one configuration and size keyword first")
    return table, d


def largest_model(df_s2: pd.DataFrame, *, dim: str | None = None, batch_size: int | None = None,
                  title: str | None = None, unit: str | None = None, device=None,
                  precision=None, budget=None) -> Figure:
    """S2: a bar per MOM, the largest model size that trains (at ``batch_size``),
    annotated with the throughput at that size. Takes raw records (with
    ``dim``), a ``metrics.s2_summary`` table or a ``reference.paper_largest``
    one. A MOM for which no size fits gets an empty bar marked "none fits";
    the paper's bars are hatched when the frame also holds momlab's."""
    table, d = _largest_table(_prepare(df_s2), dim, batch_size)
    mixed = table["_origin"].nunique() > 1
    order = {m: i for i, m in enumerate(_moms_in_order(table["mom"]))}
    table = table.assign(_k=table["mom"].map(order)).sort_values(["_k", "_origin"]) \
        .reset_index(drop=True)
    model = _unique(df_s2, "model")
    u = _unit_for(model, unit)
    fig = Figure(figsize=(max(4.0, 0.9 * len(table) + 1.5), 4.0), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(table))
    heights = table["largest"].fillna(0).astype(float).to_numpy()
    colors = [mom_style(m)["color"] for m in table["mom"]]
    bars = ax.bar(x, heights, color=colors, width=0.6)
    for bar, h, tp, origin in zip(bars, heights, table["throughput"], table["_origin"]):
        if mixed and origin == "paper":
            bar.set_hatch("//")
            bar.set_edgecolor("white")
        text = "none fits" if h == 0 else (f"{tp:.3g} {u}" if pd.notna(tp) else "not timed")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, h), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    labels = [mom_style(m)["label"] + (f"\n({o})" if mixed else "")
              for m, o in zip(table["mom"], table["_origin"])]
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=9)
    ax.set_ylabel(f"largest {DIM_LABELS.get(d, d)}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(top=max(heights.max(), 1) * 1.15)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    what = title or "Largest trainable model" + (f" ({model})" if model else "") \
        + (f", batch {batch_size}" if batch_size else "")
    _title(fig, what, describe(df_s2, device=device, precision=precision, budget=budget))
    return fig


def _curve_table(df: pd.DataFrame, dim: str) -> pd.DataFrame:
    """(mom, value, max_throughput, _origin) from S2' summaries
    (``reference.paper_scaling``: a ``<dim>`` column; ``metrics.s2prime``:
    ``dim`` and ``value``), from raw records, or from a mix of them."""
    df = df.assign(_origin=_origin(df))
    col = f"size.{dim}"
    parts = []
    if "max_throughput" in df.columns:
        summary = df[df["max_throughput"].notna()]
        if "dim" in summary.columns:
            summary = summary[summary["dim"].isna() | (summary["dim"] == dim)]
        value = summary[dim] if dim in summary.columns else pd.Series(np.nan, index=summary.index)
        if "value" in summary.columns:
            value = value.fillna(summary["value"])
        parts.append(summary.assign(value=value)[["mom", "value", "max_throughput", "_origin"]])
        df = df[df["max_throughput"].isna()]
    if "throughput" in df.columns and len(df):
        if col not in df.columns:
            raise ValueError(f"no column {col!r}; size columns: "
                             f"{[c for c in df.columns if c.startswith('size.')]}")
        ok = df[df["fits"] & df["throughput"].notna() & df[col].notna()]
        parts.append(ok.groupby(["mom", col, "_origin"])["throughput"].max()
                     .rename("max_throughput").reset_index().rename(columns={col: "value"}))
    if not parts:
        raise ValueError(f"need size.{dim} records or a table with max_throughput")
    table = pd.concat(parts, ignore_index=True)
    return table[table["value"].notna()]


def size_curves(df: pd.DataFrame, dim: str, *, title: str | None = None, unit: str | None = None,
                device=None, precision=None, budget=None) -> Figure:
    """S2': maximum throughput (over every batch that fits) against model size
    along ``dim`` (a size keyword: num_layers for depth, hidden_size or
    width_per_group for width), a line per MOM. Where a MOM's line rises above
    exact's is where it starts to pay. Takes raw records, a
    ``metrics.s2prime`` table or a ``reference.paper_scaling`` one (and a
    concatenation of them, told apart by ``source``)."""
    dim = dim.removeprefix("size.")
    table = _curve_table(_prepare(df), dim)
    if table.empty:
        raise ValueError(f"no timed run that fits along {dim!r}")
    mixed = table["_origin"].nunique() > 1
    model = _unique(df, "model")
    fig = Figure(figsize=(5.2, 4.4), layout="constrained")
    ax = fig.subplots()
    for mom in _moms_in_order(table["mom"]):
        for origin, t in table[table["mom"] == mom].groupby("_origin", sort=True):
            t = t.sort_values("value")
            ax.plot(t["value"], t["max_throughput"], **_line_kw(mom, origin, mixed))
    ax.set_xlabel(DIM_LABELS.get(dim, dim))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # sizes are whole layers / widths
    ax.set_ylabel(f"max throughput ({_unit_for(model, unit)})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    what = title or f"Max throughput against {DIM_LABELS.get(dim, dim).split(' (')[0]}" \
        + (f" ({model})" if model else "")
    _title(fig, what, describe(df, device=device, precision=precision, budget=budget))
    return fig


def gpu_count(df: pd.DataFrame, *, moms: list[str] | None = None,
              title: str | None = "MOM/Exact max throughput against GPU count",
              device=None, precision=None, ncols: int | None = None) -> Figure:
    """MOM/exact ratio of maximum throughput against the number of GPUs, a
    panel per model and a line per MOM; the dashed line at 1 is exact. Takes
    a ``reference.paper_gpu_count`` table (model, mom, gpus, ratio) or any
    frame with model, mom, gpus and max_throughput (ratios computed here);
    ``moms`` keeps only those."""
    df = df.copy()
    if "ratio" not in df.columns:
        origin = _origin(df)
        exact = df[df["mom"] == "exact"].assign(_o=origin) \
            .set_index(["model", "gpus", "_o"])["max_throughput"]
        df["ratio"] = [t / exact.get((m, g, o), math.nan) for m, g, o, t in
                       zip(df["model"], df["gpus"], origin, df["max_throughput"])]
    if moms is not None:
        df = df[df["mom"].isin(set(moms) | {"exact"})]
    df["_origin"] = _origin(df)
    mixed = df["_origin"].nunique() > 1
    models = list(dict.fromkeys(df["model"]))
    fig, axes = _grid(len(models), ncols, panel=(3.6, 3.2))
    all_moms = []
    for ax, model in zip(axes, models):
        panel = df[(df["model"] == model) & (df["mom"] != "exact")]
        for mom in _moms_in_order(panel["mom"]):
            for origin, t in panel[panel["mom"] == mom].groupby("_origin", sort=True):
                t = t.sort_values("gpus")
                ax.plot(t["gpus"], t["ratio"], **_line_kw(mom, origin, mixed))
            all_moms.append(mom)
        ax.axhline(1.0, color=EXACT_COLOR, linestyle="--", linewidth=1, gid="exact")
        counts = sorted(df.loc[df["model"] == model, "gpus"].unique())
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("GPUs or ranks (data parallel)")
        ax.set_ylabel("max throughput / Exact's")
        ax.grid(alpha=0.3)
    exact = Line2D([], [], color=EXACT_COLOR, linestyle="--", label="Exact (= 1)")
    _mom_legend(fig, _moms_in_order(all_moms), oom=False,
                extra=[exact] + _origin_handles(mixed))
    _title(fig, title, describe(df, device=device, precision=precision))
    return fig


def compare_table(ours_s1: pd.DataFrame, paper_s1: pd.DataFrame, *, stand_ins: dict | None = None) -> pd.DataFrame:
    """Our S1 beside the paper's, per (model, mom): ratio (max throughput over
    exact's), max batch and max throughput of each, and ``same_verdict``
    (both ratios on the same side of 1). Takes ``metrics.s1_summary`` or
    ``reference.paper_s1`` tables (ratios computed if absent); ours must hold
    one configuration per (model, mom). Rows only one side has stay, with NaN.

    `stand_ins` maps one of our models to the paper's model it stands in for
    (a CPU run scales bert-large down to a small bert-base): its rows are
    compared with that model's, and ``model_ours`` says what we ran."""
    stand_ins = dict(stand_ins or {})
    ours_s1 = ours_s1.assign(model_ours=ours_s1["model"], model=ours_s1["model"].map(lambda m: stand_ins.get(m, m)))
    def norm(t: pd.DataFrame, name: str) -> pd.DataFrame:
        t = t.copy()
        dup = t.duplicated(["model", "mom"], keep=False)
        if dup.any():
            raise ValueError(f"{name} holds several rows per (model, mom), e.g. "
                             f"{t.loc[dup, ['model', 'mom']].iloc[0].tolist()}; "
                             "select one configuration (device, precision, budget, size) first")
        if "ratio" not in t.columns:
            exact = t[t["mom"] == "exact"].set_index("model")["max_throughput"]
            t["ratio"] = t["max_throughput"] / t["model"].map(exact)
        cols = ["ratio", "max_batch_size", "max_throughput"]
        return t[["model", "mom"] + [c for c in [*cols, "model_ours"] if c in t.columns]] \
            .rename(columns={c: f"{c}_{name}" for c in cols})
    out = norm(ours_s1, "ours").merge(norm(paper_s1, "paper"), on=["model", "mom"], how="outer")
    verdict = [pd.NA if pd.isna(a) or pd.isna(b) else bool((a > 1) == (b > 1))
               for a, b in zip(out["ratio_ours"], out["ratio_paper"])]
    out["same_verdict"] = pd.array(verdict, dtype="boolean")
    models = list(dict.fromkeys([*ours_s1["model"], *paper_s1["model"]]))
    moms = _moms_in_order(out["mom"])
    out = out.assign(_m=out["model"].map(models.index), _k=out["mom"].map(moms.index)) \
        .sort_values(["_m", "_k"]).drop(columns=["_m", "_k"]).reset_index(drop=True)
    order = ["model", "model_ours", "mom", "ratio_ours", "ratio_paper", "same_verdict"]
    return out[order + [c for c in out.columns if c not in order]]


def gradient_error(errors: pd.DataFrame, *, title: str | None = "Gradient error of activation quantization",
                   device=None) -> Figure:
    """Relative gradient error against the number of rounding draws averaged,
    a line per MOM (``lossy.gradient_error``'s table). Unbiased rounding
    shows as the error of the mean falling like 1/sqrt(draws) (dotted guide);
    the single-draw error is the line's first point."""
    fig = Figure(figsize=(6.8, 3.8), layout="constrained")
    ax = fig.subplots()
    for mom in _moms_in_order(errors["mom"]):
        d = errors[errors["mom"] == mom].sort_values("draws")
        st = mom_style(mom)
        ax.plot(d["draws"], d["error_of_mean"], color=st["color"], marker=st["marker"], label=st["label"])
        first = float(d["error_of_mean"].iloc[0])
        ax.plot(d["draws"], first / np.sqrt(d["draws"]), color=st["color"], linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rounding draws averaged")
    ax.set_ylabel("relative gradient error ||g - g_exact|| / ||g_exact||")
    # outside the axes: the lines span the whole height
    ax.legend(title="dotted: 1/sqrt(draws)", fontsize=8, title_fontsize=8, loc="center left",
              bbox_to_anchor=(1.01, 0.5))
    _title(fig, title, describe(errors, device=device))
    return fig


def loss_curves(curves: pd.DataFrame, *, title: str | None = "Training loss, exact vs quantized activations",
                smooth: int = 10) -> Figure:
    """Training loss per step, a line per MOM (``lossy.train_curves``'s table),
    smoothed over `smooth` steps."""
    fig = Figure(figsize=(5.6, 3.8), layout="constrained")
    ax = fig.subplots()
    for mom in _moms_in_order(curves["mom"]):
        d = curves[curves["mom"] == mom].sort_values("step")
        st = mom_style(mom)
        ax.plot(d["step"], d["loss"].rolling(smooth, min_periods=1).mean(), color=st["color"],
                linestyle=st.get("linestyle", "-"), label=st["label"])
    ax.set_xlabel("training step")
    ax.set_ylabel(f"cross-entropy loss (mean of {smooth} steps)")
    ax.legend(fontsize=8)
    _title(fig, title, "")
    return fig


def _model_mom_panels(df: pd.DataFrame, ncols: int | None, draw) -> tuple[Figure, dict]:
    """A panel per model of `df` (its order), batch size on x; `draw(ax, style, rows)` per MOM in the panel,
    its rows sorted by batch size. Returns the figure and each model's axes."""
    models = list(dict.fromkeys(df["model"]))
    fig, axes = _grid(len(models), ncols)
    for ax, model in zip(axes, models):
        panel = df[df["model"] == model]
        for mom in _moms_in_order(panel["mom"]):
            draw(ax, mom_style(mom), panel[panel["mom"] == mom].sort_values("batch_size"))
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    return fig, dict(zip(models, axes))


def predicted_vs_paper(curves: pd.DataFrame, *, title: str | None = "Predicted throughput against the paper's",
                       device: str = "V100 16 GB", calibration: str = "", ncols: int | None = None) -> Figure:
    """A panel per model: the paper's measured throughput at each batch size (points) and the predicted
    throughput at the same batches (lines), per MOM (``momlab.validation.curves``). Predicted points past
    the predicted largest batch are drawn dotted: their step time is predicted, their memory does not fit."""
    if curves.empty:
        raise ValueError("predicted_vs_paper needs at least one row (momlab.validation.curves)")

    def draw(ax, st, g):
        seen = g[g["paper_throughput"].notna()]
        ax.plot(seen["batch_size"], seen["paper_throughput"], linestyle="none", marker=st["marker"],
                color=st["color"], markersize=4, alpha=0.6, markevery=_markevery(len(seen), 20))
        fits = g[g["pred_fits"]]
        ax.plot(fits["batch_size"], fits["pred_throughput"], color=st["color"], linestyle="-", linewidth=1.6)
        over = g[~g["pred_fits"]]
        if len(over):
            join = pd.concat([fits.tail(1), over])
            ax.plot(join["batch_size"], join["pred_throughput"], color=st["color"], linestyle=":", linewidth=1.2)

    fig, panels = _model_mom_panels(curves, ncols, draw)
    for model, ax in panels.items():
        ax.set_ylabel(f"throughput ({_unit_for(model, None)})")
        ax.set_ylim(bottom=0)
    extra = [Line2D([], [], color="gray", linestyle="none", marker="o", label="paper (measured)"),
             Line2D([], [], color="gray", linestyle="-", label="momlab (predicted)"),
             Line2D([], [], color="gray", linestyle=":", label="predicted, does not fit")]
    _mom_legend(fig, _moms_in_order(curves["mom"]), oom=False, extra=extra)
    _title(fig, title, f"{device}; {calibration}" if calibration else device)
    return fig


def predicted_utilization(table: pd.DataFrame, *,
                          title: str | None = "GPU utilization: the paper's samples against the prediction",
                          device: str = "V100 16 GB", ncols: int | None = None) -> Figure:
    """A panel per model: the share of the loop a kernel runs on the GPU against the batch size, the paper's
    nvidia-smi samples (points) and the predicted share (line), per MOM (``momlab.validation.utilization_table``).
    Below 1 the GPU waits for the host that issues its kernels."""
    if table.empty:
        raise ValueError("predicted_utilization needs at least one row (momlab.validation.utilization_table)")

    def draw(ax, st, g):
        ax.plot(g["batch_size"], 100 * g["paper_utilization"], linestyle="none", marker=st["marker"],
                color=st["color"], markersize=4, alpha=0.6)
        pred = g.groupby("batch_size")["pred_utilization"].first()
        ax.plot(pred.index, 100 * pred.values, color=st["color"], linestyle="-", linewidth=1.6)

    fig, panels = _model_mom_panels(table, ncols, draw)
    for ax in panels.values():
        ax.set_ylabel("GPU utilization (%)")
        ax.set_ylim(0, 105)
    extra = [Line2D([], [], color="gray", linestyle="none", marker="o", label="paper (nvidia-smi, measured)"),
             Line2D([], [], color="gray", linestyle="-", label="momlab (predicted)")]
    _mom_legend(fig, _moms_in_order(table["mom"]), oom=False, extra=extra)
    _title(fig, title, device)
    return fig


def predicted_depth(depth: pd.DataFrame, *, pred_crossing: float = math.nan, paper_crossing: float = math.nan,
                    pred_crossing_paper_batches: float = math.nan,
                    title: str | None = "S2': maximum throughput against depth, predicted and the paper's",
                    device: str = "V100 16 GB", unit: str = "seq/s", dim: str = "num_layers") -> Figure:
    """Maximum throughput (best batch that fits) against model size per MOM: predicted lines,
    the paper's points, and a vertical line where each says the second MOM overtakes Exact
    (``momlab.validation.depth_curves`` and ``crossing``; `dim` "hidden_size" for
    ``validation.width_curves``). Where `depth` has the prediction over the batch
    sizes the paper ran (``pred_throughput_paper_batches``), it is drawn dashed, with its crossing."""
    check_choice("dim", dim, ("num_layers", "hidden_size"))
    fig, (ax,) = _grid(1, 1, panel=(6.4, 4.0))
    like = "pred_throughput_paper_batches" in depth
    for mom in _moms_in_order(depth["mom"]):
        st = mom_style(mom)
        g = depth[depth["mom"] == mom].sort_values(dim)
        pred = g[g["pred_throughput"] > 0]
        ax.plot(pred[dim], pred["pred_throughput"], color=st["color"], linestyle="-", linewidth=1.6)
        if like:
            same = g[g["pred_throughput_paper_batches"] > 0]
            ax.plot(same[dim], same["pred_throughput_paper_batches"], color=st["color"], linestyle="--",
                    linewidth=1.2)
        seen = g[g["paper_throughput"].notna()]
        ax.plot(seen[dim], seen["paper_throughput"], color=st["color"], marker=st["marker"],
                linestyle="none", markersize=5)
    marks = [(pred_crossing, "-", "predicted, every batch"), (paper_crossing, ":", "paper")]
    if like:
        marks.insert(1, (pred_crossing_paper_batches, "--", "predicted, paper's batches"))
    top = ax.get_ylim()[1]
    for k, (x, style, label) in enumerate(marks):
        if math.isfinite(x):
            ax.axvline(x, color="gray", linestyle=style, linewidth=1)
            ax.text(x, top * 0.95 / 1.6 ** k, f" {label}: {x:.0f}", fontsize=7, va="top")
    ax.set_xlabel({"num_layers": "number of layers", "hidden_size": "hidden size"}[dim])
    ax.set_ylabel(f"max throughput ({unit})")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    extra = [Line2D([], [], color="gray", linestyle="none", marker="o", label="paper (measured)"),
             Line2D([], [], color="gray", linestyle="-", label="predicted, best of every batch")]
    if like:
        extra.append(Line2D([], [], color="gray", linestyle="--", label="predicted, best of the paper's batches"))
    _mom_legend(fig, _moms_in_order(depth["mom"]), oom=False, extra=extra)
    _title(fig, title, device)
    return fig


def prediction_scatter(table: pd.DataFrame, *, title: str | None = "Predicted vs measured maximum batch",
                       band: float = 0.15) -> Figure:
    """One point per row of `momlab.validation.max_batch_table`: the paper's comparison point (x) against
    the predicted maximum batch (y), log-log, the diagonal and a +-`band` band drawn. Rows the paper ran
    with another system, gave only a lower bound, or whose run its own memory records show was not stopped by
    GPU memory (``gpu_bound``), are hollow; rows with no paper data are not drawn."""
    fig = Figure(figsize=(5.6, 4.8), layout="constrained")
    ax = fig.add_subplot()
    rows = table[table["paper_point"].notna() & table["predicted_max_batch"].notna()]
    models = list(dict.fromkeys(rows["model"]))
    for i, model in enumerate(models):
        g = rows[rows["model"] == model]
        solid = g["comparable"] & ~g["note"].str.contains("lower bound")
        if "gpu_bound" in g:
            solid &= g["gpu_bound"]
        color = _CB[i % len(_CB)]
        ax.scatter(g.loc[solid, "paper_point"], g.loc[solid, "predicted_max_batch"].astype(float), color=color,
                   label=model, s=36, zorder=3)
        ax.scatter(g.loc[~solid, "paper_point"], g.loc[~solid, "predicted_max_batch"].astype(float),
                   facecolors="none", edgecolors=color, s=36, zorder=3)
    if len(rows):
        lo = min(rows["paper_point"].min(), rows["predicted_max_batch"].astype(float).min()) / 1.5
        hi = max(rows["paper_point"].max(), rows["predicted_max_batch"].astype(float).max()) * 1.5
        xs = np.geomspace(max(lo, 0.5), hi, 50)
        ax.plot(xs, xs, color=EXACT_COLOR, lw=1, label="predicted = measured")
        ax.fill_between(xs, xs * (1 - band), xs * (1 + band), color="0.85", zorder=0,
                        label=f"within {band:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(xs[0], xs[-1])
        ax.set_ylim(xs[0], xs[-1])
    ax.set_xlabel("paper, one V100: maximum batch (midpoint of last fit and first OOM)")
    allocator = rows["allocator"].iloc[0] if "allocator" in rows and len(rows) else "ideal"
    how = {"caching": "replayed caching allocator", "ideal": "live peak, no fragmentation"}.get(allocator, allocator)
    ax.set_ylabel(f"momlab, predicted (not measured; {how})")
    # below the axes, where it covers no point; so does the note on hollow markers
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    ax.text(0.99, 0.01, "hollow: another system in the paper, a lower bound, or a paper run\n"
            "its own memory records show was not stopped by GPU memory", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=6)
    _title(fig, title, f"predicted with the paper's software stack, allocator={allocator}; "
                       "measured: the paper's V100 runs")
    if len(rows):  # last, in the figure as laid out
        _place_labels(fig, ax, np.c_[rows["paper_point"].astype(float), rows["predicted_max_batch"].astype(float)],
                      list(rows["mom"]))
    return fig


def peak_errors(table: pd.DataFrame, *, title: str | None = "Predicted against every peak the paper recorded",
                band: float = 0.05) -> Figure:
    """`momlab.validation.peak_table` drawn: one point per record, the paper's measured peak (x) against the
    prediction's error (y, percent), a color per model, a +-`band` band; records at a model size other than
    the default are diamonds. Rows whose MOM is another system in the paper are counted in a note, not drawn."""
    fig = Figure(figsize=(7.2, 4.6), layout="constrained")
    ax = fig.add_subplot()
    comp = table[table["comparable"].astype(bool)]
    unit, scale = _bytes_unit(float(comp["paper_peak_bytes"].max()) if len(comp) else 1.0)
    ax.axhspan(-100 * band, 100 * band, color="0.88", zorder=0, label=f"within {band:.0%}")
    ax.axhline(0, color=EXACT_COLOR, lw=0.8)
    for i, model in enumerate(dict.fromkeys(comp["model"])):
        g = comp[comp["model"] == model]
        for other_size, marker in ((False, "o"), (True, "D")):
            h = g[(g["size"] != "") == other_size]
            if h.empty:
                continue
            label = f"{model}, {'; '.join(dict.fromkeys(h['size']))}" if other_size else model
            ax.scatter(h["paper_peak_bytes"] / scale, 100 * h["error"], marker=marker, s=12 if marker == "o" else 22,
                       color=_CB[i % len(_CB)], edgecolors="white" if other_size else "none", linewidths=0.5,
                       alpha=0.85, label=label, zorder=3)
    ax.set_xlabel(f"measured peak, the paper's V100 ({unit} allocated)")
    ax.set_ylabel("predicted / measured - 1 (%)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    if len(comp):
        others = len(table) - len(comp)
        ax.text(0.99, 0.01, f"{len(comp)} records: median |error| {comp['error'].abs().median():.1%}, "
                f"{(comp['error'].abs() <= band).mean():.0%} within {band:.0%}"
                + (f"\nnot drawn: {others} record{'s' if others > 1 else ''} of a MOM the paper ran as another "
                   "system" if others else ""),
                transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
    _title(fig, title, "predicted (not measured): the paper's software stack, allocated bytes; "
                       "measured: the paper's runs")
    return fig


def predicted_largest(table: pd.DataFrame, *, title: str | None = "Predicted vs measured largest model") -> Figure:
    """`momlab.validation.largest_table` drawn: one panel per size keyword, one row per MOM; the paper's bracket
    (its size that last fit to the next, that failed; hatched where that size is the sweep's next, its OOM
    record having lost it) as a gray bar, momlab's prediction as a marker in the MOM's color (filled: by the
    table's allocator; hollow: the ideal allocator's, where it differs)."""
    dims = list(dict.fromkeys(table["dim"]))
    fig = Figure(figsize=(4.2 * max(1, len(dims)), 3.0), layout="constrained")
    axes = fig.subplots(1, max(1, len(dims)), squeeze=False)[0]
    allocator = table["allocator"].iloc[0] if len(table) else "ideal"
    for ax, dim in zip(axes, dims):
        g = table[table["dim"] == dim].reset_index(drop=True)
        for y, r in g.iterrows():
            lo, hi = r["paper_largest"], r["paper_first_oom"]
            if lo is not pd.NA and hi is not pd.NA:
                ax.barh(y, float(hi - lo), left=float(lo), height=0.5, color="0.85", edgecolor="0.55", lw=0.6,
                        hatch="///" if r["first_oom_from"] == "grid" else None, zorder=1)
            color = mom_style(r["mom"])["color"]
            if r["predicted"] is not pd.NA:
                ax.scatter([float(r["predicted"])], [y], color=color, s=40, zorder=3)
            if r["predicted"] is not pd.NA and r["predicted_ideal"] != r["predicted"]:  # both NA or neither
                ax.scatter([float(r["predicted_ideal"])], [y], facecolors="none", edgecolors=color, s=40, zorder=3)
        ax.set_yticks(range(len(g)), list(g["mom"]), fontsize=7)
        ax.use_sticky_edges = False  # the bars start inside the frame
        ax.margins(x=0.06)
        ax.invert_yaxis()
        ax.set_xlabel(f"largest {dim} that trains at batch {int(g['batch_size'].iloc[0])}")
        ax.grid(axis="x", color="0.9", lw=0.5)
    handles = [Patch(facecolor="0.85", edgecolor="0.55", label="paper: last fit to first OOM"),
               Patch(facecolor="0.85", edgecolor="0.55", hatch="///", label="first OOM: the sweep's next size"),
               Line2D([], [], ls="", marker="o", color="0.3", label=f"predicted ({allocator} allocator)")]
    if (table["predicted_ideal"] != table["predicted"]).any():
        handles.append(Line2D([], [], ls="", marker="o", markerfacecolor="none", color="0.3",
                              label="predicted, ideal allocator"))
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=7, frameon=False)
    model = table["model"].iloc[0] if len(table) else ""
    _title(fig, title, f"{model} on one V100 16 GB: predicted with the paper's software stack (not measured); "
                       "measured: the paper's scaling sweeps")
    return fig


def _place_labels(fig: Figure, ax, points: np.ndarray, labels: list[str], *, fontsize: float = 6.0) -> None:
    """A label beside each of `points` (data coordinates of `ax`) where it covers no other label and no marker,
    if a free place is near: tried in turn right, left, then above and below on either side, further out each
    round; greedily, the top point first. A label moved off its point's row is tied to it by a thin line. The
    places are found in the laid-out figure (its layout run first) and take no part in the layout."""
    fig.draw_without_rendering()
    px = fig.dpi / 72.0  # pixels a point
    xy = ax.transData.transform(points)
    sizes = []
    for label in labels:
        probe = ax.text(0, 0, label, fontsize=fontsize)
        box = probe.get_window_extent()
        sizes.append((box.width, box.height))
        probe.remove()
    r = 3.5 * px  # a marker's half width
    boxes = [(x - r, y - r, x + r, y + r) for x, y in xy]

    def free(b):
        return all(b[2] <= o[0] or b[0] >= o[2] or b[3] <= o[1] or b[1] >= o[3] for o in boxes)

    for i in sorted(range(len(xy)), key=lambda i: -xy[i, 1]):
        (x, y), (w, h) = xy[i], sizes[i]
        tries = [(4.0, 0.0, "left"), (-4.0, 0.0, "right")]
        for step in (1, 2, 3):
            d = step * (h / px + 1.0)
            tries += [(8.0, d, "left"), (8.0, -d, "left"), (-8.0, d, "right"), (-8.0, -d, "right")]
        for dx, dy, ha in tries:
            x0 = x + dx * px - (w if ha == "right" else 0.0)
            box = (x0, y + dy * px - h / 2, x0 + w, y + dy * px + h / 2)
            if free(box):
                break
        else:  # no free place near: on the right, as before
            dx, dy, ha = tries[0]
            box = (x + dx * px, y - h / 2, x + dx * px + w, y + h / 2)
        boxes.append(box)
        note = ax.annotate(labels[i], tuple(points[i]), fontsize=fontsize, xytext=(dx, dy), textcoords="offset points",
                           ha=ha, va="center", arrowprops=dict(arrowstyle="-", lw=0.4, color="0.45", shrinkA=0,
                                                               shrinkB=2) if dy else None)
        note.set_in_layout(False)


def save(fig: Figure, path_without_ext: str | Path) -> list[Path]:
    """Write ``<path>.png`` (150 dpi) and ``<path>.pdf``; return both paths. The PDF carries no creation date,
    so a rerun that draws the same figure writes the same bytes."""
    base = Path(path_without_ext)
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_name(base.name + ".png"), base.with_name(base.name + ".pdf")]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1], metadata={"CreationDate": None})
    return paths


__all__ = ["MOM_STYLE", "mom_style", "describe", "memory_breakdown", "batch_curves",
           "largest_model", "size_curves", "gpu_count", "compare_table", "gradient_error", "loss_curves",
           "prediction_scatter", "save"]


def predicted_throughput(df: pd.DataFrame, *, title: str | None = None) -> Figure:
    """Grouped bars: predicted throughput of each MOM (x) on each GPU (bars), from
    `momlab.whatif.train_at_all`; a MOM that does not fit at batch 1 is marked "no fit"."""
    if df.empty:
        raise ValueError("predicted_throughput needs at least one row")
    moms = _moms_in_order(df["mom"])
    gpus_ = list(dict.fromkeys(df["gpu"]))
    tokens = "tokens_per_s" in df.columns and df["tokens_per_s"].notna().any()
    col, unit = ("tokens_per_s", "tokens/s") if tokens else ("throughput", "samples/s")
    fig = Figure(figsize=(max(5.0, 0.9 * len(moms) * max(1, len(gpus_)) / 2 + 2), 4.0), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(gpus_)
    palette = sns.color_palette("colorblind", len(gpus_))
    trains = df["trains"].astype(bool)
    top = float(df.loc[trains, col].max()) if trains.any() else 0.0
    top = top if top > 0 else 1.0  # nothing trains: an axis from 0 to 1 holding only the "no fit" marks
    for j, g in enumerate(gpus_):
        sub = df[df["gpu"] == g].set_index("mom")
        xs = np.arange(len(moms)) + (j - (len(gpus_) - 1) / 2) * width
        heights = [float(sub[col].get(m, 0.0)) if bool(sub["trains"].get(m, False)) else 0.0 for m in moms]
        ax.bar(xs, heights, width=width * 0.95, color=palette[j], label=g)
        for x, m, h in zip(xs, moms, heights):
            if m in sub.index and not bool(sub["trains"][m]):
                ax.text(x, top * 0.02, "no fit", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.05 * top)
    ax.set_xticks(np.arange(len(moms)), [mom_style(m)["label"] for m in moms], fontsize=9,
                  rotation=0 if len(moms) <= 4 else 25, ha="center" if len(moms) <= 4 else "right")
    ax.set_ylabel(f"predicted throughput ({unit})")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, ncols=len(gpus_), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    model, prec = df.attrs.get("model", ""), df.attrs.get("precision", "")
    size = df.attrs.get("size") or {}
    context = f"{model} {prec}" + (f", seq {size['seq_len']}" if "seq_len" in size else "") + \
        " - predicted (momlab.estimate), at each MOM's best batch"
    _title(fig, title if title is not None else "Which MOM lets it train, and how fast", context)
    return fig


def rank_memory(table, *, title: str | None = "Per-rank memory against rank count"):
    """Per-rank peak and model state (weights + gradients + optimizer) against rank count, a line per parallel
    strategy and MOM. Takes `momlab.metrics.rank_memory`'s table (one batch size)."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    styles = {"none": ("#222222", "o"), "ddp": ("#0173b2", "s"), "fsdp": ("#de8f05", "^"),
              "zero2": ("#029e73", "v")}
    dashes = ["-", "--", ":", "-."]
    moms = sorted(dict.fromkeys(table["mom"]), key=lambda m: m != "exact")  # exact solid, first
    strategies = [p for p in dict.fromkeys(table["parallel"]) if p != "none"]
    for ax, column, label in zip(axes, ["peak_bytes", "model_state_bytes"], ["peak", "weights + grads + optimizer"]):
        for p in strategies:
            color, marker = styles.get(p.split("+")[0], ("#949494", "D"))
            for i, mom in enumerate(moms):
                t = table[((table["parallel"] == p) | (table["parallel"] == "none")) & (table["mom"] == mom)]
                t = t.sort_values("ranks")
                ax.plot(t["ranks"], t[column] / 2**20, color=color, marker=marker, linestyle=dashes[i % 4],
                        label=f"{p}, {mom}")
        ax.set_xscale("log", base=2)
        counts = sorted(set(table["ranks"]))
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel("ranks")
        ax.set_title(f"per-rank {label}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB per rank")
    axes[1].legend(fontsize=8, frameon=False, loc="upper right")
    if title:
        peak = format_bytes(table["peak_bytes"].max()) if len(table) else "-"
        fig.suptitle(f"{title} (largest peak {peak}; 1 rank = plain training)", fontsize=11)
    return fig
