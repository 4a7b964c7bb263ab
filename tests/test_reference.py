"""The paper's V100 table reproduces the numbers ../shared/paper/BRIEF.md quotes."""

import math

import pandas as pd
import pytest

from momlab.reference import (
    paper_gpu_count, paper_largest, paper_memory_per_sample, paper_peaks, paper_runs, paper_s1,
    paper_s1_runs, paper_scaling,
)
from momlab.reference import _s1_table

# BRIEF.md, "Numbers from its data (one V100, 16 GB)":
# (model, mom) -> (max batch or None where BRIEF gives none, max throughput, ratio to exact)
# BRIEF's Checkpoint column is DTR for the ResNets; "592+" is a batch with no OOM above it.
BRIEF_S1 = {
    ("resnet50", "exact"): (168, 378.9, None),
    ("resnet50", "ckpt-dtr"): (None, 142.5, 0.38),
    ("resnet50", "quant4"): (480, 282.4, 0.75),
    ("resnet50", "quant4+swap"): (688, 185.7, 0.49),
    ("resnet50", "swap"): (400, 39.9, 0.11),
    ("wide-resnet50-2", "exact"): (120, 204.0, None),
    ("wide-resnet50-2", "ckpt-dtr"): (None, 82.5, 0.40),
    ("wide-resnet50-2", "quant4"): (368, 166.1, 0.81),
    ("wide-resnet50-2", "quant4+swap"): (656, 120.7, 0.59),
    ("wide-resnet50-2", "swap"): (128, 29.2, 0.14),
    ("resnet152", "exact"): (72, 153.9, None),
    ("resnet152", "quant4"): (304, 124.8, 0.81),
    ("resnet152", "quant4+swap"): (672, 84.6, 0.55),
    ("resnet152", "swap"): (168, 19.1, 0.12),
    ("swin-large", "exact"): (32, 70.7, None),
    ("swin-large", "ckpt"): (108, 76.9, 1.09),
    ("swin-large", "quant4"): (92, 75.9, 1.07),
    ("swin-large", "quant4+swap"): (196, 47.8, 0.68),
    ("swin-large", "swap"): (184, 17.1, 0.24),
    ("bert-large", "exact"): (44, 164.0, None),
    ("bert-large", "ckpt"): (400, 139.1, 0.85),
    ("bert-large", "quant4"): (176, 109.2, 0.67),
    ("bert-large", "quant4+swap"): (592, 61.3, 0.37),
    ("bert-large", "quant4+ckpt"): (784, 90.0, 0.55),
    ("gpt3-small", "exact"): (19, 88.9, None),
    ("gpt3-small", "ckpt"): (37, 71.3, 0.80),
    ("gpt3-small", "quant4"): (30, 50.8, 0.57),
    ("gpt3-small", "quant4+swap"): (32, 26.2, 0.29),
    ("gpt3-medium", "exact"): (6, 26.4, None),
    ("gpt3-medium", "ckpt"): (26, 27.3, 1.04),
    ("gpt3-medium", "quant4"): (12, 19.4, 0.73),
}


@pytest.fixture(scope="module")
def s1():
    return paper_s1().set_index(["model", "mom"])


@pytest.mark.parametrize("key", list(BRIEF_S1), ids=lambda k: "/".join(k))
def test_s1_matches_brief(s1, key):
    batch, throughput, ratio = BRIEF_S1[key]
    row = s1.loc[key]
    if batch is not None:
        assert row["max_batch_size"] == batch
    # 0.06: BRIEF rounds GPT3-Small ckpt's 71.2498 to 71.3 (via 71.25)
    assert row["max_throughput"] == pytest.approx(throughput, abs=0.06)
    if ratio is not None:
        assert row["ratio"] == pytest.approx(ratio, abs=0.006)
    else:
        assert row["ratio"] == 1.0


def test_s1_open_ended_batch_is_flagged(s1):
    # BRIEF's "592+": the BERT quant4+swap sweep recorded no OOM above 592
    assert s1.loc[("bert-large", "quant4+swap"), "oom_batch_size"] is pd.NA
    assert s1.loc[("bert-large", "exact"), "oom_batch_size"] == 52
    assert s1.loc[("resnet50", "exact"), "oom_batch_size"] == 176


def test_s1_takes_one_source_file_per_model():
    # S1 must not mix the fp32 BERT sweep, the 36/48-layer sweeps or the depth study
    runs = paper_runs()
    s1_sources = {
        "bert-large": "text_classification_fp16_v100_results_speed_results.json",
        "gpt3-small": "GPT_v100_results_speed_results.json",
        "swin-large": "Swin-Transformer_v100_results_speed_results.json",
        "resnet50": "resnet_v100_results_speed_results.json",
    }
    for model, source in s1_sources.items():
        best = paper_s1().query("model == @model and mom == 'exact'").iloc[0]
        hits = runs[(runs["model"] == model) & (runs["throughput"] == best["max_throughput"])]
        assert set(hits["source"].str.split(":").str[0]) == {source}


def test_memory_per_sample_matches_brief():
    # BRIEF's MB/sample are thousandths of a GiB: the paper divided by 1024**3
    per = paper_memory_per_sample("bert-large").set_index("mom")["bytes_per_sample"] / 2**30 * 1000
    assert round(per["exact"]) == 204
    assert round(per["ckpt"], 1) == 20.8
    assert round(per["quant4"], 1) == 43.5
    assert round(per["quant4+ckpt"], 1) == 8.3


def test_gpts_memory_sweep_is_the_peak_its_timed_runs_recorded():
    """fairseq recorded the peak with every timed GPT run (no `mem` sweep): gpt3-small's exact runs, batch 1 to
    19, rise from 3,006,777,856 bytes to 14,806,451,200 (read from the raw GPT_v100_results_speed_results.json);
    the least-squares line over every run (some batches ran several times) has that slope within 1%."""
    per = paper_memory_per_sample("gpt3-small").set_index("mom")
    assert per.loc["exact", "bytes_per_sample"] == pytest.approx((14806451200 - 3006777856) / 18, rel=0.01)
    assert (per.loc["exact", "batch_lo"], per.loc["exact", "batch_hi"]) == (1, 19)
    assert {"ckpt", "quant4", "quant4+swap"} <= set(per.index)
    # a model with a mem sweep keeps it (resnet50's timed runs recorded peaks too)
    assert paper_memory_per_sample("resnet50").set_index("mom").loc["exact", "batch_hi"] == 168


def test_every_peak_the_paper_recorded_at_any_size():
    """`paper_peaks` reads every one-V100 peak record of a model that fit: BERT-L's memory sweeps at 24, 36 and 48
    layers (the raw text_classification_fp16_v100_results_mem_results_36.json's first run: batch 8, 11,106,165,248
    bytes), BERT-base's breakdown runs at the one precision they have (fp16, batch 4-168), GPT's timed runs (the
    raw GPT_v100_results_speed_results.json's exact run at batch 19: 14,806,451,200 bytes)."""
    bert = paper_peaks("bert-large")
    assert set(bert["size.num_layers"]) == {24, 36, 48} and set(bert["precision"]) == {"fp16"}
    assert set(bert["experiment"]) == {"mem", "mem_fp32", "background"} and bert["fits"].all()
    first36 = bert[bert["size.num_layers"] == 36].sort_values("batch_size").iloc[0]
    assert (first36["mom"], first36["batch_size"], first36["peak_bytes"]) == ("exact", 8, 11106165248)
    base = paper_peaks("bert-base")
    assert len(base) == 22 and set(base["precision"]) == {"fp16"}
    assert (base["batch_size"].min(), base["batch_size"].max()) == (4, 168)
    gpt = paper_peaks("gpt3-small")
    assert set(gpt["experiment"]) == {"speed"} and 14806451200 in set(gpt["peak_bytes"])
    assert len(paper_peaks("bert-large", "fp32")) > 0 and set(paper_peaks("bert-large", "fp32")["precision"]) == {"fp32"}
    with pytest.raises(ValueError, match="bert-base"):
        paper_peaks("vit-huge")


def test_activation_per_sample_is_the_slope_of_the_recorded_activations():
    """ResNet-50 quant4: the paper recorded 602,364,969 bytes at the end of forward at batch 32 and
    8,946,031,002 at 480 (read from the raw file); its sweep is a line to the per mille. Swap keeps nothing."""
    got = paper_memory_per_sample("resnet50").set_index("mom")["activation_per_sample"]
    assert got["quant4"] == pytest.approx((8946031002 - 602364969) / (480 - 32), rel=2e-3)
    assert got["swap"] == 0.0
    assert got["quant4+swap"] == pytest.approx(2.61e6, rel=0.01)


def test_largest_depth_at_batch_24():
    got = paper_largest("num_layers").set_index("mom")
    assert got.loc["exact", "num_layers"] == 32
    assert got.loc["quant4", "num_layers"] == 52
    assert got.loc["ckpt", "num_layers"] == 60
    assert got.loc["exact", "first_oom"] == 36
    assert got.loc["exact", "throughput"] == pytest.approx(94.9)


def test_largest_width_bounds_where_the_sweep_lost_the_failing_size():
    """The BERT width sweep's OOM records lost their hidden size; the raw file
    (text_classification_fp16_v100_results_speed_results_model_size_width.json) writes the sweep in rounds of
    the six MOMs at 1120 + 96k, and each MOM's first failing record sits in the round after its largest fit:
    exact's in the 1408 round, quant4's and ckpt's in the 1888 round, the other three's in the 1984 round."""
    got = paper_largest("hidden_size").set_index("mom")
    assert got["hidden_size"].to_dict() == {"exact": 1312, "ckpt": 1792, "quant4": 1792, "quant4+swap": 1888,
                                            "quant4+ckpt": 1888, "swap+ckpt": 1888}
    assert got["first_oom"].to_dict() == {"exact": 1408, "ckpt": 1888, "quant4": 1888, "quant4+swap": 1984,
                                          "quant4+ckpt": 1984, "swap+ckpt": 1984}
    assert set(got["first_oom_from"]) == {"grid"}
    assert set(paper_largest("num_layers")["first_oom_from"]) == {"recorded"}


def test_depth_curves_cross_at_34_layers():
    curves = paper_scaling("num_layers").pivot(index="num_layers", columns="mom",
                                               values="max_throughput")
    both = curves[["exact", "ckpt"]].dropna()
    ckpt_ahead = both.index[both["ckpt"] > both["exact"]]
    assert ckpt_ahead.min() == 34
    assert list(ckpt_ahead) == [n for n in both.index if n >= 34]
    # the points of case_study_large_model_depth.png
    assert curves.loc[14, "exact"] == pytest.approx(318.21)
    assert curves["ckpt"].dropna().index.max() == 62


def test_width_curves_match_the_published_figure():
    curves = paper_scaling("hidden_size").pivot(index="hidden_size", columns="mom",
                                                values="max_throughput")
    assert curves.loc[320, "exact"] == pytest.approx(369.08)
    assert curves.loc[1856, "ckpt"] == pytest.approx(63.83)


def test_gpu_count_ratios():
    g = paper_gpu_count(["bert-large"]).set_index(["mom", "gpus"])
    assert sorted(g.loc["exact"].index) == [1, 2, 4, 8]
    assert (g.loc["exact", "ratio"] == 1.0).all()
    assert g.loc[("ckpt", 4), "ratio"] == pytest.approx(549.83 / 380.66)
    assert g.loc[("quant4", 2), "max_throughput"] == pytest.approx(236.87)


def test_gpu_count_batch_is_per_gpu_for_gpt():
    # the raw GPT data-parallel files record the global batch of successful runs
    g = paper_gpu_count(["gpt3-small"]).set_index(["mom", "gpus"])
    assert g.loc[("exact", 4), "max_batch_size"] == 17
    assert g.loc[("exact", 8), "max_batch_size"] == 17


def test_published_bert_gpu_figure_uses_the_depth_study_at_one_gpu():
    runs = paper_runs()
    depth24 = runs[(runs["experiment"] == "depth") & (runs["model"] == "bert-large")
                   & (runs["size.num_layers"] == 24)]
    best = depth24.groupby("mom")["throughput"].max()
    assert best["exact"] == pytest.approx(171.97)
    assert best["ckpt"] == pytest.approx(145.88)
    assert best["quant4"] == pytest.approx(131.43)


def test_runs_table_is_tidy():
    runs = paper_runs()
    assert runs["source"].is_unique
    assert set(runs["gpus"].unique()) == {1, 2, 4, 8}
    # batch 0 only marks a search that found no batch that fits
    assert (runs["batch_size"] >= 0).all()
    assert not runs.loc[runs["batch_size"] == 0, "fits"].any()
    assert runs.loc[~runs["fits"], "throughput"].isna().all()
    assert (runs["gpu"] == "V100-16GB").all()
    assert set(runs["memory_source"]) == {"cuda"}
    moms = set(runs["mom"])
    assert {"exact", "ckpt", "quant4", "swap", "quant4+swap", "quant4+ckpt", "swap+ckpt",
            "ckpt-dtr"} <= moms
    assert not {"L1", "None", "ckpt_swap", "swap_ckpt", "L4bit-swap"} & moms
    # memory is bytes: BERT-L's model state (fp32 weights, grads, AdamW) is ~5.3 GB
    bert = runs[(runs["model"] == "bert-large") & runs["model_bytes"].notna()
                & (runs["precision"] == "fp16")]
    assert bert["model_bytes"].median() == pytest.approx(333.6e6 * 16, rel=0.01)


def test_runs_is_a_copy():
    a = paper_runs()
    a.loc[:, "throughput"] = 0.0
    assert not (paper_runs()["throughput"] == 0.0).all()


def test_s1_table_on_hand_made_runs():
    runs = pd.DataFrame({
        "model": ["m"] * 5, "mom": ["exact", "exact", "exact", "ckpt", "ckpt"],
        "batch_size": [8, 16, 24, 8, 32], "fits": [True, True, False, True, True],
        "throughput": [10.0, 12.0, math.nan, 6.0, 9.0],
    })
    s = _s1_table(runs).set_index("mom")
    assert s.loc["exact", "max_batch_size"] == 16 and s.loc["exact", "oom_batch_size"] == 24
    assert s.loc["ckpt", "oom_batch_size"] is pd.NA
    assert s.loc["ckpt", "ratio"] == pytest.approx(0.75)
    assert s.loc["exact", "best_batch_size"] == 16


def test_s1_at_another_precision_is_bert_large_s_earlier_fp32_sweep():
    """BERT-L's fp32 runs (text_classification_results_speed_results_no_limit.json, March 2022): read by hand
    from the raw file, exact fit 8-32 and failed at 40, its best 50.44 seq/s at 32; GACT's swap best 13.68 at
    160 and failed at 192. The headline table is untouched, and the ResNets (fp32 already) are the same rows."""
    fp32 = paper_s1(precision="fp32").set_index(["model", "mom"])
    exact, swap = fp32.loc[("bert-large", "exact")], fp32.loc[("bert-large", "swap")]
    assert (exact.max_batch_size, exact.oom_batch_size, exact.max_throughput) == (32, 40, 50.44)
    assert (swap.max_batch_size, swap.oom_batch_size, swap.max_throughput) == (176, 192, 13.68)
    assert swap.ratio == pytest.approx(13.68 / 50.44)
    assert set(paper_s1_runs(precision="fp32").query("model == 'bert-large'")["precision"]) == {"fp32"}
    head = paper_s1().set_index(["model", "mom"])
    assert head.loc[("bert-large", "exact"), "max_throughput"] == 163.95
    pd.testing.assert_frame_equal(fp32.loc["resnet50"], head.loc["resnet50"])
    assert "swin-large" not in fp32.index.get_level_values(0)
    fp32_mem = paper_memory_per_sample("bert-large", "fp32").set_index("mom")["bytes_per_sample"]
    fp16_mem = paper_memory_per_sample("bert-large").set_index("mom")["bytes_per_sample"]
    # its own sweep (8 runs, batches 4-32), not the fp16 one: 279 MiB a sample against fp16 autocast's 209
    assert fp32_mem["exact"] / 2**20 == pytest.approx(279.2, abs=0.1)
    assert fp16_mem["exact"] / 2**20 == pytest.approx(208.8, abs=0.1)


def test_unknown_precision_names_the_valid_ones():
    with pytest.raises(ValueError, match="fp16, fp32"):
        paper_s1(precision="fp8")
    with pytest.raises(ValueError, match="fp16, fp32"):
        paper_memory_per_sample("bert-large", "bf16")


def test_unknown_dimension_names_the_valid_ones():
    with pytest.raises(ValueError, match="num_layers"):
        paper_scaling("depth_of_field")
    with pytest.raises(ValueError, match="available"):
        paper_largest("num_layers", model="resnet50")
