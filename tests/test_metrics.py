"""Scenario metrics on hand-made frames whose answers are known."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from momlab.metrics import crossover, fixed_batch, s1_summary, s2_summary, s2prime

NAN = math.nan


def rows(model, mom, points, *, scan="batch_size", size=None, budget=1000, **extra):
    """points: (batch_size, throughput or None for out of memory[, size value of `scan`])."""
    out = []
    for p in points:
        bs, tp = p[0], p[1]
        sz = dict(size or {})
        if len(p) > 2:
            sz[scan] = p[2]
        out.append(dict(model=model, mom=mom, batch_size=bs, device="cpu", precision="fp32", budget=budget,
                        size=sz, fits=tp is not None, throughput=NAN if tp is None else float(tp),
                        step_time_s=NAN if tp is None else bs / tp, peak_bytes=extra.get("peak", 0), scan=scan))
    return out


def s1_frame():
    return pd.DataFrame(
        rows("m", "exact", [(1, 10), (2, 18), (4, 30), (8, None)], size={"num_layers": 2})
        + rows("m", "ckpt", [(1, 8), (2, 15), (4, 25), (8, 33), (16, 31), (17, None)], size={"num_layers": 2})
        + rows("m", "quant4", [(1, 5), (2, 9), (4, None)], size={"num_layers": 2})
        + rows("m2", "exact", [(1, None)]) + rows("m2", "ckpt", [(1, 4)])
        + rows("m3", "ckpt", [(1, 7), (2, 12)]))


def test_s1_summary_known_answers():
    raw = s1_summary(s1_frame())
    assert list(raw["mom"]) == ["exact", "ckpt", "quant4", "exact", "ckpt", "ckpt"]  # baseline first
    t = raw.set_index(["model", "mom"])
    assert t.loc[("m", "exact"), "max_batch_size"] == 4 and t.loc[("m", "exact"), "oom_batch_size"] == 8
    assert t.loc[("m", "exact"), "max_throughput"] == 30 and t.loc[("m", "exact"), "best_batch_size"] == 4
    assert t.loc[("m", "exact"), "ratio"] == 1.0 and not t.loc[("m", "exact"), "pays"]
    ck = t.loc[("m", "ckpt")]
    assert (ck.max_batch_size, ck.oom_batch_size, ck.max_throughput, ck.best_batch_size) == (16, 17, 33, 8)
    assert ck.ratio == pytest.approx(1.1) and ck.pays and ck.batch_ratio == 4
    q = t.loc[("m", "quant4")]
    assert (q.max_batch_size, q.max_throughput, q.ratio, q.pays, q.batch_ratio) == (2, 9, pytest.approx(0.3), False,
                                                                                    0.5)
    # the baseline never fits where the MOM does: it pays without bound
    assert t.loc[("m2", "exact"), "max_batch_size"] == 0 and math.isnan(t.loc[("m2", "exact"), "max_throughput"])
    assert t.loc[("m2", "ckpt"), "ratio"] == math.inf and t.loc[("m2", "ckpt"), "pays"]
    # no baseline measured: unknown, not False
    assert math.isnan(t.loc[("m3", "ckpt"), "ratio"]) and pd.isna(t.loc[("m3", "ckpt"), "pays"])
    assert math.isnan(t.loc[("m3", "ckpt"), "oom_batch_size"])  # max batch 2 is only a lower bound
    assert set(t["size_label"]) == {"num_layers=2", ""}


def test_s1_summary_keeps_budgets_and_flattened_sizes_apart():
    df = pd.DataFrame(rows("m", "exact", [(1, 10), (2, None)], budget=100)
                      + rows("m", "exact", [(1, 10), (2, 19), (3, None)], budget=200)
                      + rows("m", "ckpt", [(1, 9), (2, 17), (4, 30)], budget=100))
    df["size.seq_len"] = 32
    df = df.drop(columns="size")
    t = s1_summary(df).set_index(["budget", "mom"])
    assert t.loc[(100, "exact"), "max_batch_size"] == 1 and t.loc[(200, "exact"), "max_batch_size"] == 2
    assert t.loc[(100, "ckpt"), "ratio"] == 3.0 and t.loc[(100, "ckpt"), "size_label"] == "seq_len=32"


def s2_frame():
    layers = (rows("b", "exact", [(24, 50, 8), (24, 25, 16), (24, 12, 32), (24, None, 33)], scan="num_layers",
                   size={"hidden_size": 64})
              + rows("b", "ckpt", [(24, 9, 32), (24, 5, 60), (24, None, 61)], scan="num_layers",
                     size={"hidden_size": 64})
              + rows("b", "quant4", [(24, 6, 52), (24, None, 53)], scan="num_layers", size={"hidden_size": 64}))
    hidden = (rows("b", "exact", [(24, 30, 256), (24, None, 512)], scan="hidden_size", size={"num_layers": 12})
              + rows("b", "ckpt", [(24, 20, 512), (24, None, 1024)], scan="hidden_size", size={"num_layers": 12}))
    return pd.DataFrame(layers + hidden)


def test_s2_summary_largest_size_per_mom_and_dim():
    t = s2_summary(s2_frame())
    assert set(t["dim"]) == {"num_layers", "hidden_size"}
    L = t[t["dim"] == "num_layers"].set_index("mom")
    assert list(L.loc[["exact", "ckpt", "quant4"], "largest"]) == [32, 60, 52]
    assert list(L.loc[["exact", "ckpt", "quant4"], "throughput_at_largest"]) == [12, 5, 6]
    assert list(L.loc[["exact", "ckpt", "quant4"], "oom_value"]) == [33, 61, 53]
    assert L.loc["ckpt", "size_ratio"] == pytest.approx(60 / 32) and L.loc["exact", "other_size"] == "hidden_size=64"
    H = t[t["dim"] == "hidden_size"].set_index("mom")
    assert (H.loc["exact", "largest"], H.loc["ckpt", "largest"], H.loc["ckpt", "size_ratio"]) == (256, 512, 2.0)
    only = s2_summary(s2_frame(), dim="hidden_size")
    assert set(only["dim"]) == {"hidden_size"}
    with pytest.raises(ValueError, match="num_layers"):
        s2_summary(s2_frame(), dim="depth")


def s2p_frame():
    return pd.DataFrame(
        rows("b", "exact", [(8, 100, 24), (16, 120, 24), (32, None, 24), (8, 60, 36), (16, None, 36),
                            (8, None, 48)], scan="num_layers")
        + rows("b", "ckpt", [(8, 80, 24), (16, 95, 24), (64, 110, 24), (8, 55, 36), (64, 70, 36), (8, 40, 48),
                             (32, 50, 48)], scan="num_layers"))


def test_s2prime_max_throughput_per_size_and_crossover():
    t = s2prime(s2p_frame()).set_index(["mom", "value"])
    assert t.loc[("exact", 24), "max_throughput"] == 120 and t.loc[("exact", 24), "best_batch_size"] == 16
    assert t.loc[("exact", 36), "max_throughput"] == 60 and math.isnan(t.loc[("exact", 48), "max_throughput"])
    assert t.loc[("ckpt", 24), "ratio"] == pytest.approx(110 / 120) and not t.loc[("ckpt", 24), "pays"]
    assert t.loc[("ckpt", 36), "ratio"] == pytest.approx(70 / 60) and t.loc[("ckpt", 36), "pays"]
    assert t.loc[("ckpt", 48), "ratio"] == math.inf and t.loc[("ckpt", 48), "max_batch_size"] == 32
    c = crossover(s2prime(s2p_frame())).set_index("mom")
    assert c.loc["ckpt", "pays_from"] == 36 and math.isnan(c.loc["exact", "pays_from"])


def test_fixed_batch_saving_and_overhead():
    df = pd.DataFrame([
        dict(model="m", mom="exact", batch_size=8, device="cpu", precision="fp32", budget=None, size={}, fits=True,
             peak_bytes=1000, step_time_s=0.10, throughput=80.0),
        dict(model="m", mom="ckpt", batch_size=8, device="cpu", precision="fp32", budget=None, size={}, fits=True,
             peak_bytes=400, step_time_s=0.13, throughput=8 / 0.13),
        dict(model="m", mom="quant4", batch_size=8, device="cpu", precision="fp32", budget=None, size={},
             fits=False, peak_bytes=900, step_time_s=NAN, throughput=NAN),
        dict(model="m", mom="ckpt", batch_size=16, device="cpu", precision="fp32", budget=None, size={}, fits=True,
             peak_bytes=700, step_time_s=0.2, throughput=80.0),
    ])
    t = fixed_batch(df, 8).set_index("mom")
    assert t.loc["ckpt", "memory_saving"] == pytest.approx(0.6) and t.loc["ckpt", "saved_bytes"] == 600
    assert t.loc["ckpt", "overhead"] == pytest.approx(0.3)
    assert t.loc["ckpt", "throughput_ratio"] == pytest.approx(1 / 1.3)
    assert t.loc["exact", "memory_saving"] == 0 and t.loc["exact", "overhead"] == 0
    assert math.isnan(t.loc["quant4", "memory_saving"]) and not t.loc["quant4", "fits"]
    assert set(t["batch_size"]) == {8}
