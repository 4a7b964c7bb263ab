"""ckpt-auto: the fewest checkpointed blocks that fit, found in few steps, never more recompute than ckpt."""

from __future__ import annotations

import math

import pytest

from momlab import catalog
from momlab.accounting import StorageTracker
from momlab.errors import OutOfMemory
from momlab.measure import measure
from momlab.moms import apply, auto
from momlab.workload import build

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "bert-base"
SIZE = {**catalog.tiny(MODEL), "num_layers": 6}  # per-layer activations dominate at batch >= 16


# -- the parts that need no device ------------------------------------------------------------

def test_order_is_bytes_per_flop_then_index():
    assert auto.order([10, 40, 40, 5], [1, 2, 4, 0]) == [3, 1, 0, 2]  # 0 FLOPs: free to recompute
    assert auto.order([7, 7, 7], [3, 3, 3]) == [0, 1, 2]  # equal blocks: earliest first


def test_predicted_peak_counts_the_rebuilt_block():
    saving = [10, 20, 30]
    assert auto.predict_peak([], saving, 200, 120) == 200
    # the last block is rebuilt first in backward, when nothing has been freed yet
    assert auto.predict_peak([2], saving, 200, 120) == 200
    # block 0 is rebuilt after blocks 1 and 2 freed 50: its 10 bytes cost nothing
    assert auto.predict_peak([0], saving, 200, 120) == 190
    assert auto.predict_peak([0, 1, 2], saving, 200, 160) == 170  # 200 - 60 + 30, above the floor
    assert auto.predict_peak([0, 1, 2], saving, 200, 180) == 180  # never below the checkpointed step


@pytest.mark.parametrize("answer", range(0, 13))
@pytest.mark.parametrize("guess", [0, 3, 6, 12])
def test_fewest_finds_the_smallest_fitting_plan_in_log_steps(answer, guess):
    calls = []

    def fits(k):
        calls.append(k)
        return k >= answer

    best, trials = auto.fewest(fits, guess, 12)
    assert best == answer and len(set(calls)) == len(calls) == len(trials)
    assert [k for k, _ in trials] == calls and all(ok == (k >= answer) for k, ok in trials)
    assert len(trials) <= 2 * math.ceil(math.log2(abs(answer - guess) + 1)) + 2
    if answer == guess:
        assert len(trials) == (1 if answer == 0 else 2)


def test_fewest_when_nothing_fits():
    best, trials = auto.fewest(lambda k: False, 2, 5)
    assert best is None and [k for k, _ in trials] == [2, 3, 5]


# -- the handle ---------------------------------------------------------------------------------

def test_checkpoint_rewraps_exactly_the_chosen_blocks():
    w = build(MODEL, batch_size=2, **catalog.tiny(MODEL))
    model = w.model
    handle = apply(model, "ckpt-auto", catalog.blocks(MODEL, model))
    layers = model.bert.encoder.layer

    def wrapped():
        return [i for i, m in enumerate(layers) if type(m).__name__ == "CheckpointWrapper"]

    assert handle.checkpointed == () and wrapped() == []
    handle.checkpoint([1])
    assert handle.checkpointed == (1,) and wrapped() == [1]
    handle.checkpoint([0, 1])
    assert wrapped() == [0, 1]
    handle.checkpoint([])
    assert wrapped() == []
    with pytest.raises(ValueError, match=r"block indices must be in 0\.\.1"):
        handle.checkpoint([2])
    handle.checkpoint([0])
    handle.remove()
    assert wrapped() == [] and handle.checkpointed == ()


def test_a_plan_belongs_to_ckpt_auto_only():
    w = build(MODEL, batch_size=2, **catalog.tiny(MODEL))
    with pytest.raises(ValueError, match="checkpoint=.* is ckpt-auto's plan; MOM 'ckpt'"):
        apply(w.model, "ckpt", catalog.blocks(MODEL, w.model), checkpoint=[0])
    handle = apply(w.model, "quant4", catalog.blocks(MODEL, w.model))
    with pytest.raises(ValueError, match="ckpt-auto's plan; this model has MOM 'quant4'"):
        handle.checkpoint([0])


# -- measured plans ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup():
    """A budget between exact's and ckpt's peak at batch 24: some blocks must be checkpointed, not all."""
    exact = measure(MODEL, batch_size=24, steps=1, **SIZE)
    full = measure(MODEL, "ckpt", batch_size=24, steps=1, **SIZE)
    budget = (exact.peak_bytes + full.peak_bytes) // 2
    return budget, exact, full


def _fits_with(plan, budget, batch_size, mom="ckpt-auto"):
    """Independently of measure: does one step with the blocks `plan` checkpointed stay within `budget`?"""
    w = build(MODEL, batch_size=batch_size, mom=mom, **SIZE)
    w.handle.checkpoint(plan)
    w.step()  # optimizer state, untracked
    tracker = StorageTracker(budget=budget)
    try:
        with tracker:
            state = w.state_tensors()
            tracker.track(state["params"] + state["optimizer"])
            w.step()
    except OutOfMemory:
        return False
    return True


def test_plan_is_the_fewest_blocks_that_fit(setup):
    budget, exact, full = setup
    m = measure(MODEL, "ckpt-auto", batch_size=24, budget=budget, steps=1, **SIZE)
    plan = m.options["ckpt_plan"]
    k = len(plan["checkpointed"])
    assert m.fits and m.peak_bytes <= budget and plan["blocks"] == SIZE["num_layers"]
    assert 0 < k < SIZE["num_layers"], plan
    assert plan["checkpointed"] == sorted(plan["order"][:k])
    assert [k, True] in plan["trials"] and [k - 1, False] in plan["trials"]
    assert len(plan["trials"]) <= 4  # the prediction was close
    # independently: this plan fits, one block fewer does not
    assert _fits_with(plan["order"][:k], budget, 24)
    assert not _fits_with(plan["order"][:k - 1], budget, 24)
    # less recomputation than ckpt, less memory than exact
    assert exact.flops < m.flops < full.flops
    assert full.peak_bytes <= m.peak_bytes < exact.peak_bytes


def test_where_exact_fits_nothing_is_checkpointed(setup):
    budget, exact, _ = setup
    m = measure(MODEL, "ckpt-auto", batch_size=8, budget=budget, steps=1, **SIZE)
    e = measure(MODEL, batch_size=8, budget=budget, steps=1, **SIZE)
    assert m.options["ckpt_plan"]["checkpointed"] == [] and m.options["ckpt_plan"]["trials"] == [[0, True]]
    assert (m.peak_bytes, m.activation_bytes, m.flops) == (e.peak_bytes, e.activation_bytes, e.flops)


def test_without_a_budget_on_cpu_nothing_is_checkpointed():
    m = measure(MODEL, "ckpt-auto", batch_size=4, steps=1, **catalog.tiny(MODEL))
    e = measure(MODEL, batch_size=4, steps=1, **catalog.tiny(MODEL))
    assert m.options["ckpt_plan"]["checkpointed"] == [] and m.peak_bytes == e.peak_bytes


def test_where_ckpt_does_not_fit_neither_does_ckpt_auto(setup):
    _, _, full = setup
    budget = full.peak_bytes - 1
    a = measure(MODEL, "ckpt-auto", batch_size=24, budget=budget, steps=1, **SIZE)
    c = measure(MODEL, "ckpt", batch_size=24, budget=budget, steps=1, **SIZE)
    assert not a.fits and not c.fits and "out of memory" in a.error


def test_combines_with_quantization(setup):
    budget, _, _ = setup
    q = measure(MODEL, "quant4+ckpt-auto", batch_size=48, budget=budget, steps=1, **SIZE)
    plain = measure(MODEL, "ckpt-auto", batch_size=48, budget=budget, steps=1, **SIZE)
    assert q.fits and q.mom == "quant4+ckpt-auto"
    # quantized activations need fewer blocks recomputed for the same budget
    assert len(q.options["ckpt_plan"]["checkpointed"]) < len(plain.options["ckpt_plan"]["checkpointed"])


def test_resnet_orders_blocks_by_bytes_per_flop():
    """Bottlenecks differ (early stages: big activations, few FLOPs); the plan starts with the best ratio."""
    size = catalog.tiny("resnet50")
    exact = measure("resnet50", batch_size=16, steps=1, **size)
    full = measure("resnet50", "ckpt", batch_size=16, steps=1, **size)
    budget = (exact.peak_bytes + full.peak_bytes) // 2
    m = measure("resnet50", "ckpt-auto", batch_size=16, budget=budget, steps=1, **size)
    plan = m.options["ckpt_plan"]
    ratios = [s / f for s, f in zip(plan["saving_bytes"], plan["recompute_flops"])]
    assert m.fits and plan["order"] == sorted(range(len(ratios)), key=lambda i: (-ratios[i], i))
    assert ratios[plan["order"][0]] > ratios[plan["order"][-1]]


# -- estimated plans: measure's rule on traces, against its measured plans ---------------------

def _estimate(mom, batch_size, budget, **kw):
    from momlab.estimate import estimate

    return estimate(MODEL, mom, batch_size=batch_size, gpu="cpu", budget=budget, **SIZE, **kw)


def test_estimate_plans_what_measure_measured(setup):
    """On the CPU target (which `measure` runs on, with the same emulated budget) the estimate's plan is the
    plan measure's steps verified, its predicted peak the measured peak within 1% and its FLOPs the measured
    ones: the block costs come from a traced forward, the plan from measure's rule, the step from the traces
    of exact and ckpt."""
    budget, exact, full = setup
    m = measure(MODEL, "ckpt-auto", batch_size=24, budget=budget, steps=1, **SIZE)
    e = _estimate("ckpt-auto", 24, budget)
    plan, measured = e.ckpt_plan, m.options["ckpt_plan"]
    assert e.fits and e.mom == "ckpt-auto" and e.peak_bytes <= budget
    assert plan["checkpointed"] == measured["checkpointed"] and plan["order"] == measured["order"]
    assert plan["blocks"] == SIZE["num_layers"] and 0 < len(plan["checkpointed"]) < plan["blocks"]
    assert plan["saving_bytes"] == measured["saving_bytes"]
    assert abs(e.peak_bytes / m.peak_bytes - 1) < 0.01 and abs(e.flops / m.flops - 1) < 0.01
    none, every = _estimate("exact", 24, budget), _estimate("ckpt", 24, budget)
    assert none.step_time_s < e.step_time_s < every.step_time_s
    assert 0 < plan["recompute_share"] < 1 and every.peak_bytes <= e.peak_bytes < none.peak_bytes


def test_estimate_checkpoints_nothing_where_exact_fits_and_fits_only_where_ckpt_does(setup):
    from momlab.estimate import predict_max_batch, throughput_curve

    budget, _, full = setup
    e, x = _estimate("ckpt-auto", 8, budget), _estimate("exact", 8, budget)
    assert e.ckpt_plan["checkpointed"] == [] and (e.peak_bytes, e.step_time_s, e.flops) == (x.peak_bytes,
                                                                                        x.step_time_s, x.flops)
    tight = full.peak_bytes - 1  # the measured full bound at 24 no longer fits
    e, c = _estimate("ckpt-auto", 24, tight), _estimate("ckpt", 24, tight)
    assert not e.fits and not c.fits and len(e.ckpt_plan["checkpointed"]) == SIZE["num_layers"]
    top = predict_max_batch(MODEL, "ckpt", gpu="cpu", budget=budget, **SIZE)
    assert predict_max_batch(MODEL, "ckpt-auto", gpu="cpu", budget=budget, **SIZE) == top
    curve = throughput_curve(MODEL, "ckpt-auto", gpu="cpu", batch_sizes=[8, 24, 48, top, top + 1], budget=budget,
                             **SIZE)
    counts = [len(c.ckpt_plan["checkpointed"]) for c in curve]
    assert counts == sorted(counts) and counts[0] == 0 and [c.fits for c in curve] == [True] * 4 + [False]


def test_estimate_needs_fewer_blocks_with_quantization_as_measured(setup):
    budget, _, _ = setup
    q = measure(MODEL, "quant4+ckpt-auto", batch_size=48, budget=budget, steps=1, **SIZE)
    eq, ep = _estimate("quant4+ckpt-auto", 48, budget), _estimate("ckpt-auto", 48, budget)
    assert eq.fits and eq.mom == "quant4+ckpt-auto"
    assert eq.ckpt_plan["checkpointed"] == q.options["ckpt_plan"]["checkpointed"]
    assert len(eq.ckpt_plan["checkpointed"]) < len(ep.ckpt_plan["checkpointed"])
