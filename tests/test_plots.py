"""Figures show the data they are given: lines, bars, OOM marks, colours, files."""

import math

import matplotlib.colors as mcolors
import pandas as pd
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from momlab import plots
from momlab.reference import paper_largest, paper_runs, paper_s1, paper_scaling

MiB, GiB = 2**20, 2**30


def rec(model, mom, batch, throughput=None, *, fits=True, size=None, **kw):
    """One Measurement.to_dict()-like row."""
    row = {"model": model, "mom": mom, "batch_size": batch, "device": "cpu",
           "precision": "fp32", "size": size or {}, "fits": fits,
           "throughput": math.nan if throughput is None or not fits else throughput,
           "peak_bytes": 0, "params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0,
           "activation_bytes": 0, "workspace_bytes": 0, "budget": None,
           "memory_source": "cpu-emulated"}
    row.update(kw)
    return row


@pytest.fixture
def sweep():
    return pd.DataFrame([
        rec("tiny-bert", "exact", 8, 10.0), rec("tiny-bert", "exact", 16, 12.0),
        rec("tiny-bert", "exact", 16, 11.0),  # a repeat: the best run is drawn
        rec("tiny-bert", "exact", 32, fits=False), rec("tiny-bert", "exact", 64, fits=False),
        rec("tiny-bert", "ckpt", 8, 7.0), rec("tiny-bert", "ckpt", 16, 9.0),
        rec("tiny-bert", "ckpt", 32, 9.5),  # no failure recorded: no x
        rec("tiny-gpt", "exact", 4, fits=False),  # nothing fits
        rec("tiny-gpt", "quant4", 4, 3.0), rec("tiny-gpt", "quant4", 8, 5.0),
        rec("tiny-gpt", "quant4", 12, fits=False),
    ])


def curve_lines(ax):
    return [ln for ln in ax.lines if ln.get_gid() != "oom"]


def oom_marks(ax):
    return [(float(ln.get_xdata()[0]), float(ln.get_ydata()[0]))
            for ln in ax.lines if ln.get_gid() == "oom"]


def visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def same_color(a, b):
    return mcolors.to_hex(a) == mcolors.to_hex(b)


def test_batch_curves_lines_and_oom_marks(sweep):
    fig = plots.batch_curves(sweep)
    assert isinstance(fig, Figure)
    bert, gpt = visible_axes(fig)
    assert bert.get_title() == "tiny-bert" and gpt.get_title() == "tiny-gpt"
    lines = {ln.get_label(): ln for ln in curve_lines(bert)}
    assert set(lines) == {"Exact", "Checkpoint"}
    assert list(lines["Exact"].get_xdata()) == [8, 16]
    assert list(lines["Exact"].get_ydata()) == [10.0, 12.0]
    # x at the first failing batch above the last fit, at the last point's height
    assert oom_marks(bert) == [(32.0, 12.0)]
    # tiny-gpt: exact never fits (x at its first batch, at zero), quant4 fails at 12
    assert [ln.get_label() for ln in curve_lines(gpt)] == ["Quantize 4-bit"]
    assert sorted(oom_marks(gpt)) == [(4.0, 0.0), (12.0, 5.0)]
    for ln in bert.lines + gpt.lines:
        if ln.get_gid() == "oom":
            assert ln.get_marker() == "x" and same_color(ln.get_color(), "black")


def test_batch_curves_units_and_panels_per_size(sweep):
    wide = sweep.copy()
    wide["size"] = [{"hidden_size": 64}] * len(wide)
    both = pd.concat([sweep.assign(size=[{"hidden_size": 32}] * len(sweep)), wide])
    fig = plots.batch_curves(both, models=["tiny-bert"])
    titles = [ax.get_title() for ax in visible_axes(fig)]
    assert titles == ["tiny-bert (hidden_size=32)", "tiny-bert (hidden_size=64)"]
    assert visible_axes(fig)[0].get_ylabel() == "throughput (samples/s)"
    fig = plots.batch_curves(sweep, unit="seq/s")
    assert visible_axes(fig)[0].get_ylabel() == "throughput (seq/s)"


def test_size_dict_and_flat_columns_give_the_same_figure(sweep):
    flat = sweep.drop(columns="size").assign(**{"size.num_layers": 2})
    nested = sweep.assign(size=[{"num_layers": 2}] * len(sweep))
    a, b = plots.batch_curves(flat), plots.batch_curves(nested)
    for ax_a, ax_b in zip(visible_axes(a), visible_axes(b)):
        assert ax_a.get_title() == ax_b.get_title()
        assert oom_marks(ax_a) == oom_marks(ax_b)
        assert [list(ln.get_ydata()) for ln in ax_a.lines] == \
            [list(ln.get_ydata()) for ln in ax_b.lines]


def test_colours_are_fixed_per_mom_across_figures(sweep):
    one = plots.batch_curves(sweep)
    two = plots.batch_curves(sweep[sweep["mom"] != "exact"])  # other MOMs, other order
    colours = {}
    for fig in (one, two):
        for ax in visible_axes(fig):
            for ln in curve_lines(ax):
                colours.setdefault(ln.get_label(), set()).add(mcolors.to_hex(ln.get_color()))
    assert all(len(c) == 1 for c in colours.values())
    assert colours["Checkpoint"] == {mcolors.to_hex(plots.MOM_STYLE["ckpt"]["color"])}
    assert colours["Exact"] == {mcolors.to_hex(plots.EXACT_COLOR)}
    hexes = [mcolors.to_hex(s["color"]) for s in plots.MOM_STYLE.values()]
    assert len(set(hexes)) == len(hexes)
    markers = {s["marker"] for s in plots.MOM_STYLE.values()}
    assert "x" not in markers  # x means out of memory
    assert plots.mom_style("ckpt+quant4") == plots.MOM_STYLE["quant4+ckpt"]
    assert plots.mom_style("cpu-off") == plots.mom_style("cpu-off")
    for mom in ["exact", "ckpt", "ckpt-selective", "ckpt-auto", "swap", "quant8", "quant4",
                "quant2", "quant4+ckpt", "swap+ckpt", "quant4+swap", "ckpt-dtr"]:
        assert mom in plots.MOM_STYLE


def test_memory_breakdown_stacks_three_categories():
    df = pd.DataFrame([
        rec("a", "exact", 4, 1.0, activation_bytes=300 * MiB, params_bytes=100 * MiB,
            grads_bytes=100 * MiB, optimizer_bytes=200 * MiB, workspace_bytes=50 * MiB),
        rec("b", "exact", 4, 1.0, activation_bytes=10 * MiB, params_bytes=1 * MiB,
            grads_bytes=1 * MiB, optimizer_bytes=2 * MiB, workspace_bytes=0),
    ])
    fig = plots.memory_breakdown(df, budget="2GiB")
    ax = fig.axes[0]
    assert len(ax.containers) == 3 and all(len(c) == 2 for c in ax.containers)
    assert ax.get_ylabel() == "memory (GiB)"  # the budget sets the range
    act, model, work = ([bar.get_height() for bar in c] for c in ax.containers)
    assert act == pytest.approx([300 / 1024, 10 / 1024])
    assert model == pytest.approx([400 / 1024, 4 / 1024])
    assert work == pytest.approx([50 / 1024, 0])
    assert [bar.get_y() for bar in ax.containers[2]] == pytest.approx([700 / 1024, 14 / 1024])
    budget_lines = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
    assert budget_lines and budget_lines[0].get_ydata()[0] == pytest.approx(2.0)
    assert "emulated budget (CPU)" in fig.get_suptitle()
    small = plots.memory_breakdown(df.iloc[[1]])
    assert small.axes[0].get_ylabel() == "memory (MiB)"
    # the tallest bar's top segment is empty (no workspace): the axis still leaves room above the bar
    assert small.axes[0].get_ylim()[1] > 14 * 1.02
    assert ax.get_ylim()[1] > 2.0  # the budget line, not the bars, sets the top


def test_memory_breakdown_uses_model_bytes_of_the_paper_table():
    runs = paper_runs()
    bg = runs[(runs["experiment"] == "background") & (runs["model"] == "resnet50")
              & (runs["batch_size"] == 80)]
    fig = plots.memory_breakdown(bg.iloc[[0]])
    act, model, _ = ([bar.get_height() for bar in c] for c in fig.axes[0].containers)
    assert act[0] == pytest.approx(6513.2 / 1024, abs=1e-3)  # the raw 6513.2 MiB
    assert model[0] == pytest.approx((6814.45 - 6513.2) / 1024, abs=1e-3)
    assert "V100-16GB" in fig.get_suptitle()


def test_titles_state_device_precision_budget_and_source():
    df = pd.DataFrame([rec("a", "exact", 4, 1.0, budget=GiB)])
    assert plots.describe(df) == "cpu · fp32 · budget 1.00 GiB · emulated budget (CPU)"
    cuda = df.assign(memory_source="cuda", device="cuda")
    assert plots.describe(cuda, device="A100-80GB", precision="bf16") == \
        "A100-80GB · bf16 · budget 1.00 GiB"
    assert plots.describe(df.assign(memory_source="predicted", budget=None)).endswith("predicted")
    on_gpu = df.assign(device="cuda", memory_source="cuda", budget=None,
                       env=[{"device_name": "NVIDIA H200"}])
    assert plots.describe(on_gpu) == "NVIDIA H200 · fp32"
    fig = plots.batch_curves(df.assign(budget=None), title="S1")
    assert fig.get_suptitle() == "S1 — cpu · fp32"


def test_largest_model_bars_and_annotations():
    rows = []
    for mom, fits_up_to in [("exact", 4), ("ckpt", 8), ("quant4", 0)]:
        for layers in (2, 4, 8, 16):
            ok = layers <= fits_up_to
            rows.append(rec("tiny-bert", mom, 24, layers * 1.5 if ok else None, fits=ok,
                            size={"num_layers": layers}))
    fig = plots.largest_model(pd.DataFrame(rows), dim="num_layers", batch_size=24)
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == [4, 8, 0]
    assert [t.get_text() for t in ax.texts] == ["6 samples/s", "12 samples/s", "none fits"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["Exact", "Checkpoint",
                                                            "Quantize 4-bit"]
    assert same_color(ax.patches[1].get_facecolor(), plots.MOM_STYLE["ckpt"]["color"])


def test_largest_model_from_the_paper_table():
    fig = plots.largest_model(paper_largest("num_layers"), dim="num_layers", batch_size=24)
    heights = {t.get_text(): b.get_height()
               for t, b in zip(fig.axes[0].get_xticklabels(), fig.axes[0].patches)}
    assert (heights["Exact"], heights["Checkpoint"], heights["Quantize 4-bit"]) == (32, 60, 52)
    assert "94.9 seq/s" in [t.get_text() for t in fig.axes[0].texts]


def test_size_curves_take_the_best_batch_per_size():
    rows = [rec("m", "exact", b, tp, size={"num_layers": n})
            for n, b, tp in [(2, 8, 10.0), (2, 16, 14.0), (4, 8, 6.0), (4, 16, 5.0)]]
    rows += [rec("m", "ckpt", 32, 9.0, size={"num_layers": n}) for n in (2, 4, 8)]
    rows.append(rec("m", "exact", 8, fits=False, size={"num_layers": 8}))
    fig = plots.size_curves(pd.DataFrame(rows), "num_layers")
    lines = {ln.get_label(): ln for ln in fig.axes[0].lines}
    assert list(lines["Exact"].get_xdata()) == [2, 4]
    assert list(lines["Exact"].get_ydata()) == [14.0, 6.0]
    assert list(lines["Checkpoint"].get_xdata()) == [2, 4, 8]
    assert fig.axes[0].get_xlabel() == "depth (number of layers)"
    paper = plots.size_curves(paper_scaling("num_layers"), "num_layers")
    exact = {ln.get_label(): ln for ln in paper.axes[0].lines}["Exact"]
    assert max(exact.get_xdata()) == 42


def test_gpu_count_ratio_lines_and_unit_line():
    df = pd.DataFrame({
        "model": ["m"] * 6, "mom": ["exact", "exact", "ckpt", "ckpt", "quant4", "quant4"],
        "gpus": [1, 4, 1, 4, 1, 4], "max_throughput": [100.0, 300.0, 80.0, 330.0, 70.0, 240.0],
    })
    fig = plots.gpu_count(df)
    ax = visible_axes(fig)[0]
    lines = {ln.get_label(): ln for ln in ax.lines if ln.get_gid() != "exact"}
    assert set(lines) == {"Checkpoint", "Quantize 4-bit"}
    assert list(lines["Checkpoint"].get_xdata()) == [1, 4]
    assert list(lines["Checkpoint"].get_ydata()) == pytest.approx([0.8, 1.1])
    unit = [ln for ln in ax.lines if ln.get_gid() == "exact"]
    assert len(unit) == 1 and list(unit[0].get_ydata()) == [1.0, 1.0]
    only = plots.gpu_count(df, moms=["quant4"])
    assert [ln.get_label() for ln in visible_axes(only)[0].lines
            if ln.get_gid() != "exact"] == ["Quantize 4-bit"]


def test_compare_table_side_by_side():
    ours = pd.DataFrame({"model": ["bert-large"] * 3, "mom": ["exact", "ckpt", "quant4"],
                         "max_throughput": [100.0, 110.0, 50.0],
                         "max_batch_size": [8, 64, 32]})
    table = plots.compare_table(ours, paper_s1())
    row = table.set_index(["model", "mom"]).loc[("bert-large", "ckpt")]
    assert row["ratio_ours"] == pytest.approx(1.1)
    assert row["ratio_paper"] == pytest.approx(139.05 / 163.95)
    assert row["same_verdict"] == False  # noqa: E712 (pandas BooleanDtype)
    q = table.set_index(["model", "mom"]).loc[("bert-large", "quant4")]
    assert q["same_verdict"] == True  # noqa: E712
    assert {"max_batch_size_ours", "max_batch_size_paper"} <= set(table.columns)
    # rows only the paper has stay, with NaN on our side
    assert table.set_index(["model", "mom"]).loc[("resnet50", "exact"), "ratio_ours"] != \
        table.set_index(["model", "mom"]).loc[("resnet50", "exact"), "ratio_ours"]
    with pytest.raises(ValueError, match="one configuration"):
        plots.compare_table(pd.concat([ours, ours]), paper_s1())
    # a scaled-down stand-in is compared with the paper's model it stands for, and says so
    small = ours.assign(model="bert-base")
    stood = plots.compare_table(small, paper_s1(), stand_ins={"bert-base": "bert-large"}).set_index(["model", "mom"])
    assert stood.loc[("bert-large", "ckpt"), "model_ours"] == "bert-base"
    assert stood.loc[("bert-large", "ckpt"), "ratio_paper"] == pytest.approx(139.05 / 163.95)
    assert "bert-base" not in stood.index.get_level_values("model")


def test_paper_batch_curves_mark_the_paper_ooms():
    runs = paper_runs()
    s1 = runs[(runs["experiment"] == "speed") & (runs["gpus"] == 1)
              & (runs["model"] == "resnet50")]
    fig = plots.batch_curves(s1)
    ax = visible_axes(fig)[0]
    assert ax.get_ylabel() == "throughput (img/s)"
    exact = {ln.get_label(): ln for ln in curve_lines(ax)}["Exact"]
    marks = dict(oom_marks(ax))
    assert 176.0 in marks and marks[176.0] == pytest.approx(exact.get_ydata()[-1])
    assert max(exact.get_ydata()) == pytest.approx(378.91)


def test_save_writes_png_and_pdf(tmp_path, sweep):
    paths = plots.save(plots.batch_curves(sweep), tmp_path / "sub" / "s1")
    png, pdf = paths
    assert png.name == "s1.png" and pdf.name == "s1.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


def test_momlab_and_paper_rows_are_drawn_apart(sweep):
    ours = sweep.assign(source="momlab")
    theirs = sweep.assign(source="paper", throughput=sweep["throughput"] * 2)
    fig = plots.batch_curves(pd.concat([ours, theirs]), models=["tiny-bert"])
    ax = visible_axes(fig)[0]
    lines = {ln.get_label(): ln for ln in curve_lines(ax)}
    assert set(lines) == {"Exact", "Checkpoint", "Exact (paper)", "Checkpoint (paper)"}
    assert lines["Exact (paper)"].get_linestyle() == ":"
    assert list(lines["Exact (paper)"].get_ydata()) == [20.0, 24.0]
    assert same_color(lines["Exact (paper)"].get_color(), lines["Exact"].get_color())
    assert sorted(oom_marks(ax)) == [(32.0, 12.0), (32.0, 24.0)]
    assert {"momlab", "paper"} <= {t.get_text() for t in fig.legends[0].get_texts()}
    # the paper's raw file:line sources count as the paper's
    paper = plots.size_curves(pd.concat([
        paper_scaling("num_layers").assign(source="paper"),
        pd.DataFrame([rec("bert-large", "exact", 8, 100.0, size={"num_layers": 24})]),
    ]), "num_layers")
    labels = {ln.get_label() for ln in paper.axes[0].lines}
    assert {"Exact", "Exact (paper)", "Checkpoint (paper)"} <= labels


def test_largest_model_refuses_several_rows_per_mom():
    table = pd.DataFrame({"mom": ["exact", "exact"], "batch_size": [8, 16], "dim": "num_layers",
                          "largest": [8, 4], "throughput_at_largest": [1.0, 2.0]})
    with pytest.raises(ValueError, match="batch_size="):
        plots.largest_model(table)
    fig = plots.largest_model(table, batch_size=16)
    assert [b.get_height() for b in fig.axes[0].patches] == [4]


def test_predicted_throughput_marks_what_does_not_fit_on_an_axis_from_zero():
    df = pd.DataFrame({"mom": ["exact", "ckpt", "swap+ckpt"] * 2, "gpu": ["H100-80"] * 3 + ["H200"] * 3,
                       "trains": [False, True, True, True, True, True],
                       "tokens_per_s": [float("nan"), 900.0, 300.0, 1500.0, 1000.0, 350.0]})
    df["throughput"] = df["tokens_per_s"] / 4096  # as `whatif.train_at_all` gives them, at 4k tokens
    ax = plots.predicted_throughput(df).axes[0]
    heights = [[bar.get_height() for bar in c] for c in ax.containers]
    assert heights == [[0.0, 900.0, 300.0], [1500.0, 1000.0, 350.0]]
    assert [t.get_text() for t in ax.texts] == ["no fit"]
    assert ax.get_ylim() == pytest.approx((0.0, 1.05 * 1500.0))
    assert ax.get_ylabel() == "predicted throughput (tokens/s)"
    nothing = plots.predicted_throughput(df.assign(trains=False, tokens_per_s=0.0, throughput=0.0)).axes[0]
    assert [t.get_text() for t in nothing.texts] == ["no fit"] * 6
    assert nothing.get_ylim() == pytest.approx((0.0, 1.05))  # not an axis around zero


def test_prediction_scatter_labels_its_points_without_covering_one_another():
    """A crowded corner (six MOMs of one model within 10% of each other, as gpt3-small's are in notebook 04):
    each point keeps its MOM's label, no two labels overlap once drawn, and the legend sits outside the axes."""
    moms = ["exact", "ckpt", "swap", "quant4", "quant4+swap", "quant4+ckpt"]
    table = pd.DataFrame([{"model": "gpt3-small", "mom": m, "paper_point": 30.0 * (1 + 0.02 * i),
                           "predicted_max_batch": 40.0 * (1 + 0.03 * i), "comparable": i != 2, "note": "",
                           "gpu_bound": True, "allocator": "ideal"} for i, m in enumerate(moms)]
                         + [{"model": "bert-large", "mom": "exact", "paper_point": 500.0, "predicted_max_batch": 520.0,
                             "comparable": True, "note": "", "gpu_bound": True, "allocator": "ideal"}])
    fig = plots.prediction_scatter(table)
    fig.draw_without_rendering()  # lays the figure out and places every text
    ax = fig.axes[0]
    notes = [t for t in ax.texts if t.get_text() in moms]
    assert sorted(t.get_text() for t in notes) == sorted(moms + ["exact"])
    boxes = [Text.get_window_extent(t) for t in notes]  # the text's own box, without its leader line
    overlaps = [(notes[i].get_text(), notes[j].get_text()) for i in range(len(boxes))
                for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
    assert overlaps == []
    # the hollow point is the one that is not comparable, and the legend does not sit on the data
    assert len(ax.collections) >= 2
    assert not fig.legends[0].get_window_extent().overlaps(ax.get_window_extent())


def test_peak_errors_draws_each_comparable_record_and_marks_other_sizes():
    """One point per comparable record at (measured GiB, error %); a deeper model's records are diamonds labelled
    with their size; a record of another system in the paper is counted in the note, not drawn; the legend sits
    outside the axes."""
    rows = [{"model": "bert-large", "mom": "exact", "size": "", "batch_size": b, "paper_peak_bytes": b * 2**30,
             "error": 0.01, "comparable": True, "note": ""} for b in (4, 8)]
    rows += [{"model": "bert-large", "mom": "ckpt", "size": "num_layers=36", "batch_size": 8,
              "paper_peak_bytes": 11 * 2**30, "error": -0.02, "comparable": True, "note": ""},
             {"model": "bert-large", "mom": "swap", "size": "", "batch_size": 8, "paper_peak_bytes": 3 * 2**30,
              "error": 1.8, "comparable": False, "note": "paper: DeepSpeed ZeRO-3 offload"}]
    fig = plots.peak_errors(pd.DataFrame(rows))
    fig.draw_without_rendering()
    ax = fig.axes[0]
    points = {c.get_label(): c.get_offsets().tolist() for c in ax.collections if c.get_offsets().size}
    assert points["bert-large"] == [[4.0, 1.0], [8.0, 1.0]]
    assert points["bert-large, num_layers=36"] == [[11.0, -2.0]]
    assert sum(len(v) for v in points.values()) == 3  # the DeepSpeed record is not drawn
    note = " ".join(t.get_text() for t in ax.texts)
    assert "3 records" in note and "not drawn: 1 record" in note and "GiB" in ax.get_xlabel()
    assert not fig.legends[0].get_window_extent().overlaps(ax.get_window_extent())


def test_predicted_largest_draws_the_papers_brackets_and_the_predictions():
    """One bar per MOM spanning the paper's bracket (hatched where its upper end is the sweep's next size), a
    filled marker at the prediction and a hollow one at the ideal allocator's answer where it differs."""
    table = pd.DataFrame([
        {"model": "bert-large", "dim": "num_layers", "mom": "exact", "batch_size": 24, "paper_largest": 32,
         "paper_first_oom": 36, "first_oom_from": "recorded", "predicted_ideal": 35, "predicted": 35},
        {"model": "bert-large", "dim": "num_layers", "mom": "ckpt", "batch_size": 24, "paper_largest": 60,
         "paper_first_oom": 64, "first_oom_from": "recorded", "predicted_ideal": 66, "predicted": 63},
        {"model": "bert-large", "dim": "hidden_size", "mom": "exact", "batch_size": 24, "paper_largest": 1312,
         "paper_first_oom": 1408, "first_oom_from": "grid", "predicted_ideal": 1488, "predicted": 1392}])
    for col in ("paper_largest", "paper_first_oom", "predicted_ideal", "predicted"):
        table[col] = table[col].astype("Int64")
    table["allocator"] = "caching"
    fig = plots.predicted_largest(table)
    depth, width = fig.axes[:2]
    bars = [(p.get_x(), p.get_x() + p.get_width()) for p in depth.patches]
    assert bars == [(32, 36), (60, 64)] and not any(p.get_hatch() for p in depth.patches)
    assert [(p.get_x(), p.get_x() + p.get_width()) for p in width.patches] == [(1312, 1408)]
    assert width.patches[0].get_hatch() == "///"
    xs = sorted(float(c.get_offsets()[0][0]) for c in depth.collections)
    assert xs == [35.0, 63.0, 66.0]  # exact's two answers agree: one marker; ckpt's ideal one hollow
    assert [t.get_text() for t in depth.get_yticklabels()] == ["exact", "ckpt"]


def test_predicted_scaling_draws_along_depth_or_width():
    """`predicted_depth` draws each MOM's predicted line and the paper's points against the study's size, depth
    or width (`dim`), with a vertical line at each crossing; another size is refused, naming the valid ones."""
    rows = [{"mom": m, "hidden_size": h, "pred_throughput": tp, "pred_throughput_paper_batches": tp * 0.9,
             "paper_throughput": tp * 1.1}
            for m, pts in (("exact", ((512, 300.0), (1344, 110.0))), ("ckpt", ((512, 240.0), (1344, 107.0))))
            for h, tp in pts]
    fig = plots.predicted_depth(pd.DataFrame(rows), dim="hidden_size", pred_crossing=1400.0, paper_crossing=1324.0,
                                pred_crossing_paper_batches=math.nan)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "hidden size"
    xs = [tuple(ln.get_xdata()) for ln in ax.get_lines() if ln.get_linestyle() in ("-", "--")]
    assert sorted(x for x in xs if x[0] != x[1]) == [(512, 1344)] * 4  # per MOM: every batch, the paper's
    marks = [x[0] for x in map(tuple, (ln.get_xdata() for ln in ax.get_lines())) if len(x) == 2 and x[0] == x[1]]
    assert sorted(marks) == [1324.0, 1400.0]  # the two finite crossings
    points = [tuple(ln.get_xdata()) for ln in ax.get_lines() if ln.get_linestyle() == "None"]
    assert points == [(512, 1344)] * 2  # the paper's, per MOM
    with pytest.raises(ValueError, match="num_layers.*hidden_size"):
        plots.predicted_depth(pd.DataFrame(rows), dim="width_per_group")
