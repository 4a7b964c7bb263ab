"""max_batch_size / max_model_size: the exact sequence of values tried, on fake steps.

The fake step's memory is a known function of batch and size, so every
answer and every trial is known in advance (accelerate's test style: a
simulated OOM, the sequence asserted). Real CPU searches are marked slow.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

from momlab import catalog
from momlab.measure import measure
from momlab.record import Measurement
from momlab.search import Search, find_max, max_batch_size, max_model_size, size_step, trial_bound
from momlab.units import parse_bytes

BASE = 1000  # bytes every fake step needs (weights, optimizer state)
PER_SAMPLE = {"exact": 100, "ckpt": 25}  # activation bytes per sample per layer at hidden 64
CALLS: list[dict] = []


def fake_memory(mom: str, batch_size: int, size: dict) -> int:
    layers, hidden = size.get("num_layers", 1), size.get("hidden_size", 64)
    return BASE + batch_size * PER_SAMPLE[mom] * layers * hidden // 64 + hidden * hidden


def fake_measure(model, mom="exact", *, batch_size, device="cpu", budget=None, precision="fp32", steps=3,
                 warmup=1, seed=0, **size) -> Measurement:
    """A measure() whose peak is fake_memory(); fits=False past the budget, like the real one."""
    CALLS.append(dict(model=model, mom=mom, batch_size=batch_size, device=device, budget=budget,
                      precision=precision, steps=steps, warmup=warmup, seed=seed, size=size))
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    peak = fake_memory(mom, batch_size, size)
    fits = budget is None or peak <= parse_bytes(budget)
    return Measurement(model=model, mom=mom, batch_size=batch_size, device=device, precision=precision,
                       size=dict(size), fits=fits, peak_bytes=peak, params_bytes=BASE, grads_bytes=0,
                       optimizer_bytes=0, activation_bytes=peak - BASE, workspace_bytes=0, host_bytes=0,
                       step_time_s=0.01 if fits else math.nan, throughput=batch_size / 0.01 if fits else math.nan,
                       flops=0, budget=None if budget is None else parse_bytes(budget),
                       options={"pid": os.getpid()})


def budget_for(answer: int, mom: str = "exact", **size) -> int:
    """A budget under which exactly batch sizes 1..answer fit."""
    return fake_memory(mom, answer, {**size, "hidden_size": size.get("hidden_size", 64)}) if answer else BASE


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


# -- the algorithm on its own ------------------------------------------------------

@pytest.mark.parametrize("answer, tried", [
    (0, [1]),
    (1, [1, 2]),
    (2, [1, 2, 4, 3]),
    (5, [1, 2, 4, 8, 6, 5]),
    (8, [1, 2, 4, 8, 16, 12, 10, 9]),
    (100, [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]),
])
def test_find_max_exact_sequence(answer, tried):
    s = find_max(lambda v: SimpleNamespace(fits=v <= answer), dim="batch_size")
    assert s.value == answer
    assert s.tried == tried
    assert s.first_failure == answer + 1
    assert len(s.trials) <= trial_bound(answer)


def test_find_max_is_exact_and_within_bound_for_every_answer():
    for answer in range(0, 300):
        s = find_max(lambda v: SimpleNamespace(fits=v <= answer))
        assert s.value == answer
        assert s.first_failure == answer + 1 and s.failure.fits is False
        assert s.best is None if answer == 0 else s.best.fits
        bound = 1 if answer == 0 else 2 * math.ceil(math.log2(answer)) + 2
        assert len(s.trials) <= bound, (answer, s.tried)
        assert len(set(s.tried)) == len(s.tried)  # never measures a value twice


def test_find_max_on_a_step_grid():
    s = find_max(lambda v: SimpleNamespace(fits=v <= 37), step=4)
    assert s.tried == [4, 8, 16, 32, 64, 48, 40, 36]
    assert (s.value, s.first_failure) == (36, 40)
    assert 36 in s.grid and 37 not in s.grid and s.grid.next(36) == 40


def test_find_max_from_a_start_that_fails_halves_first():
    s = find_max(lambda v: SimpleNamespace(fits=v <= 5), start=16)
    assert s.tried == [16, 8, 4, 6, 5] and s.value == 5
    s = find_max(lambda v: SimpleNamespace(fits=False), start=16)
    assert s.tried == [16, 8, 4, 2, 1] and s.value == 0 and s.first_failure == 1


def test_find_max_limit_caps_the_search():
    s = find_max(lambda v: SimpleNamespace(fits=v <= 100), limit=50)
    assert s.tried == [1, 2, 4, 8, 16, 32, 50] and s.value == 50
    assert s.capped and s.first_failure is None and s.failure is None
    s = find_max(lambda v: SimpleNamespace(fits=v <= 37), limit=40)
    assert s.tried == [1, 2, 4, 8, 16, 32, 40, 36, 38, 37] and s.value == 37 and s.first_failure == 38


@pytest.mark.parametrize("kw", [dict(step=0), dict(start=6, step=4), dict(limit=2, step=4), dict(step=1.5)])
def test_find_max_rejects_bad_grids(kw):
    with pytest.raises(ValueError):
        find_max(lambda v: SimpleNamespace(fits=True), **kw)


# -- max_batch_size through a measure function ----------------------------------------

@pytest.mark.parametrize("answer", [0, 1, 3, 17, 64])
def test_max_batch_size_fake(answer):
    budget = budget_for(answer)
    s = max_batch_size("fake", budget=budget, measure_fn=fake_measure)
    assert isinstance(s, Search) and s.dim == "batch_size"
    assert s.value == answer
    assert [m.batch_size for m in s.trials] == s.tried == [c["batch_size"] for c in CALLS]
    assert len(s.trials) <= trial_bound(answer)
    if answer:
        assert s.best.fits and s.best.batch_size == answer
    assert s.failure.batch_size == answer + 1 and not s.failure.fits


def test_max_batch_size_passes_budget_and_fast_steps_to_every_trial():
    s = max_batch_size("fake", "ckpt", budget="16KiB", device="cpu", precision="bf16", seed=3,
                       measure_fn=fake_measure, num_layers=2)
    assert s.value == (16384 - BASE - 64 * 64) // (25 * 2) == 225
    assert CALLS and all(c["budget"] == "16KiB" for c in CALLS)  # passed through as given
    assert all((c["steps"], c["warmup"], c["seed"], c["precision"], c["mom"]) == (1, 1, 3, "bf16", "ckpt")
               for c in CALLS)
    assert all(c["size"] == {"num_layers": 2} for c in CALLS)


def test_max_batch_size_sequence_and_steps_option():
    s = max_batch_size("fake", budget=budget_for(5), steps=2, warmup=3, measure_fn=fake_measure)
    assert s.tried == [1, 2, 4, 8, 6, 5]
    assert {(c["steps"], c["warmup"]) for c in CALLS} == {(2, 3)}


def test_max_batch_size_paper_grid_of_four():
    s = max_batch_size("fake", budget=budget_for(37), step=4, measure_fn=fake_measure)
    assert s.tried == [4, 8, 16, 32, 64, 48, 40, 36] and s.value == 36


def test_non_oom_error_stops_the_search_and_propagates():
    def broken(model, mom="exact", *, batch_size, **kw):
        if batch_size >= 8:
            raise RuntimeError("boom: not a memory problem")
        return fake_measure(model, mom, batch_size=batch_size, **kw)

    with pytest.raises(RuntimeError, match="boom") as info:
        max_batch_size("fake", budget=10**9, measure_fn=broken)
    assert [c["batch_size"] for c in CALLS] == [1, 2, 4]  # stopped at once: nothing after 8
    assert any("batch_size=8" in n and "[1, 2, 4]" in n for n in info.value.__notes__)


def test_value_error_of_the_first_trial_propagates():
    def unknown_model(model, mom="exact", **kw):
        raise ValueError(f"unknown model {model!r}; valid: bert-base, gpt2")

    with pytest.raises(ValueError, match="unknown model 'bertt'"):
        max_batch_size("bertt", budget=10**9, measure_fn=unknown_model)


def test_search_on_cpu_needs_a_budget():
    with pytest.raises(ValueError, match="budget"):
        max_batch_size("fake", budget=None, measure_fn=fake_measure)
    with pytest.raises(ValueError, match="batch_size"):
        max_batch_size("fake", budget=10**6, batch_size=4, measure_fn=fake_measure)


def test_measure_fn_by_name():
    s = max_batch_size("fake", budget=budget_for(3), measure_fn="test_search:fake_measure")
    assert s.value == 3


# -- max_model_size ------------------------------------------------------------------

def test_max_model_size_on_a_head_count_grid():
    # hidden_size must stay a multiple of 12 heads: grid 12, 24, 36, ...; answer 120 (k=10)
    budget = fake_memory("exact", 4, {"num_layers": 2, "hidden_size": 120})
    assert fake_memory("exact", 4, {"num_layers": 2, "hidden_size": 132}) > budget
    s = max_model_size("fake", dim="hidden_size", batch_size=4, budget=budget, step=12, num_layers=2,
                       measure_fn=fake_measure)
    assert s.dim == "hidden_size" and s.step == 12
    assert s.tried == [12, 24, 48, 96, 192, 144, 120, 132]
    assert (s.value, s.first_failure) == (120, 132)
    assert all(c["batch_size"] == 4 and c["size"]["num_layers"] == 2 for c in CALLS)
    assert [c["size"]["hidden_size"] for c in CALLS] == s.tried
    assert s.best.size["hidden_size"] == 120 and s.best.fits and not s.failure.fits


def test_max_model_size_layers_default_step_and_answer_zero():
    budget = fake_memory("exact", 8, {"num_layers": 9}) + 50
    s = max_model_size("fake", dim="num_layers", batch_size=8, budget=budget, step=1, measure_fn=fake_measure)
    assert s.value == 9 and s.tried == [1, 2, 4, 8, 16, 12, 10, 9]
    s = max_model_size("fake", dim="num_layers", batch_size=8, budget=BASE, step=1, measure_fn=fake_measure)
    assert s.value == 0 and s.tried == [1]


def test_max_model_size_validates_dim():
    with pytest.raises(ValueError, match="num_layers"):
        max_model_size("fake", dim="depth", batch_size=1, budget=10**6, measure_fn=fake_measure)
    with pytest.raises(ValueError, match="num_layers"):
        max_model_size("fake", dim="num_layers", num_layers=3, batch_size=1, budget=10**6, measure_fn=fake_measure)


def test_size_step_natural_grids():
    assert size_step("bert-base", "hidden_size") == 12  # bert-base's head count
    assert size_step("bert-base", "hidden_size", num_heads=2) == 2  # an explicit head count wins
    assert size_step("bert-base", "num_layers") == 1
    with pytest.raises(ValueError):
        size_step("bert-base", "depth")


# -- command line ------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch):
    from momlab import search
    from momlab.cli import parser

    monkeypatch.setattr(search, "resolve_measure", lambda fn=None: fake_measure)
    return lambda *argv: (lambda a: a.func(a))(parser().parse_args(list(argv)))


def test_cli_search_batch(cli, capsys):
    assert cli("search", "bert-base", "--mom", "ckpt", "--budget", str(budget_for(5, "ckpt"))) == 0
    out = capsys.readouterr().out
    assert "max batch_size: 5 (6 does not fit), 6 trials" in out
    assert [c["batch_size"] for c in CALLS] == [1, 2, 4, 8, 6, 5] and CALLS[0]["steps"] == 1


def test_cli_search_model_size_json(cli, capsys):
    budget = fake_memory("exact", 8, {"num_layers": 9}) + 50
    assert cli("search", "bert-base", "--budget", str(budget), "--dim", "num_layers", "--batch-size", "8",
               "--hidden-size", "64", "--json") == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert (d["dim"], d["value"], d["first_failure"], d["step"]) == ("num_layers", 9, 10, 1)
    assert d["tried"] == [1, 2, 4, 8, 16, 12, 10, 9] and len(d["trials"]) == 8
    with pytest.raises(ValueError, match="--batch-size"):
        cli("search", "bert-base", "--budget", "1GiB", "--dim", "num_layers")


def test_cli_sweep(cli, capsys, tmp_path, monkeypatch):
    import importlib

    sweep_module = importlib.import_module("momlab.sweep")  # momlab.sweep, the attribute, is the function

    monkeypatch.setattr(sweep_module, "resolve_measure", lambda fn=None: fake_measure)
    f = tmp_path / "p.yaml"
    f.write_text(f"models: [bert-base]\nmoms: [exact]\nbatch_sizes: auto\nbudget: {budget_for(3)}\n"
                 f"store: {tmp_path / 'out.jsonl'}\n")
    assert cli("sweep", str(f), "--no-progress") == 0
    assert f"4 points (3 fit, 1 out of memory) in {tmp_path / 'out.jsonl'}" in capsys.readouterr().out


# -- fresh process ------------------------------------------------------------------

def test_fresh_process_runs_the_trial_in_another_process():
    # one trial (nothing fits): a spawned interpreter imports momlab, seconds per trial
    s = max_batch_size("fake", budget=budget_for(0), fresh_process=True, measure_fn=fake_measure)
    assert s.tried == [1] and s.value == 0
    assert s.trials[0].options["pid"] != os.getpid()
    assert CALLS == []  # nothing ran in this process


@pytest.mark.slow
def test_fresh_process_each_trial_new_and_errors_propagate():
    from momlab.search import measure_in_fresh_process

    s = max_batch_size("fake", budget=budget_for(1), fresh_process=True, measure_fn=fake_measure)
    assert s.tried == [1, 2] and s.value == 1
    pids = [m.options["pid"] for m in s.trials]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    with pytest.raises(ValueError, match="batch_size must be"):
        measure_in_fresh_process(fake_measure, model="fake", batch_size=0)


# -- real CPU: momlab.measure and the MOMs -------------------------------------------

# bert-base's tiny preset with 8 layers: per-layer activations dominate (2-class head, no big
# logits), the case checkpointing and activation quantization are for
REAL_MODEL = "bert-base"


@pytest.fixture(scope="module")
def real_setup():
    size = {**catalog.tiny(REAL_MODEL), "num_layers": 8}
    # at batch 1 or 2 the peak is the optimizer step's, whatever the batch: grow from 8
    m8 = measure(REAL_MODEL, batch_size=8, steps=1, **size)
    m16 = measure(REAL_MODEL, batch_size=16, steps=1, **size)
    assert m16.peak_bytes > m8.peak_bytes
    budget = (m8.peak_bytes + m16.peak_bytes) // 2  # exact fits about 12
    exact = max_batch_size(REAL_MODEL, budget=budget, **size)
    return size, budget, exact


@pytest.mark.slow
def test_real_max_batch_size_fits_and_next_does_not(real_setup):
    size, budget, s = real_setup
    assert s.value >= 1 and len(s.trials) <= trial_bound(s.value)
    assert s.best.fits and s.best.batch_size == s.value and s.best.budget == budget
    assert not s.failure.fits and s.failure.batch_size == s.value + 1
    # measured again, independently of the search: value fits, value+1 does not
    assert measure(REAL_MODEL, batch_size=s.value, budget=budget, steps=1, **size).fits
    assert not measure(REAL_MODEL, batch_size=s.value + 1, budget=budget, steps=1, **size).fits


@pytest.mark.slow
@pytest.mark.parametrize("mom", ["ckpt", "quant4"])
def test_real_moms_fit_larger_batches_than_exact(real_setup, mom):
    size, budget, exact = real_setup
    # the limit keeps the trials few (and cheap) once the MOM is known to beat exact
    other = max_batch_size(REAL_MODEL, mom, budget=budget, limit=2 * exact.value + 2, **size)
    assert other.value > exact.value, (exact.tried, [m.peak_bytes for m in exact.trials],
                                       other.tried, [m.peak_bytes for m in other.trials])
