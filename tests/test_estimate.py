"""Estimates: traced memory equals measured memory, two traces give every batch, the GPU catalog.

The comparisons against `momlab.measure` use the `cpu` device: the same CPU
kernels, so a trace must reproduce the measured bytes (the brief asks 3%; in
practice they are equal). GPU predictions cannot be measured here; their
tests check what can be checked without one: the CUDA attention kernel is
traced, the catalog numbers, calibration from records, the closed forms.
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import momlab.moms
from momlab import catalog
from momlab.estimate import (
    TRACE_BATCHES,
    Estimate,
    Probe,
    _first_batch,
    _source_digest,
    calibrate,
    clear_cache,
    estimate,
    predict_max_batch,
    predict_max_size,
    profile,
    verdict,
)
from momlab.gpus import for_device_name, get, gpus
from momlab.measure import measure
from momlab.search import max_batch_size

MODELS = catalog.models()
# ckpt-auto is planned per batch between the profiles of two of these (tests/test_ckpt_auto.py), not traced itself
MOMS = [m for m in momlab.moms.moms() if m != "ckpt-auto"]
# the combinations the paper ran: traced against measured like the atomic MOMs (on bert-base in `make test`)
MOMS += ["quant4+ckpt", "swap+ckpt", "quant4+swap"]
MEMORY = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "workspace_bytes",
          "host_bytes")
# the subset `make test` runs: every model exactly, every MOM on a transformer and a ResNet; the rest of
# the matrix (about 10 minutes here) is marked exhaustive: `make test-all`
FAST = ({(m, "exact") for m in MODELS} | {("bert-base", m) for m in MOMS}
        | {("resnet50", m) for m in ("ckpt", "ckpt-selective", "quant4")})


def _applies(model: str, mom: str) -> bool:
    return not (mom == "ckpt-selective" and catalog.spec(model).family == "resnet")


def _matrix():
    return [pytest.param(model, mom, marks=() if (model, mom) in FAST else (pytest.mark.exhaustive,), id=f"{model}-{mom}")
            for model in MODELS for mom in MOMS]


@pytest.fixture(autouse=True)
def _traced_here(monkeypatch):
    """Every trace these tests check is made by them: traces on disk from another run would test nothing."""
    monkeypatch.setattr("momlab.estimate.TRACE_CACHE", None)


@pytest.fixture(scope="module", autouse=True)
def _no_records(tmp_path_factory):
    """Calibrate `cpu` from nothing measured here: results/ of other runs must not change these tests."""
    empty = tmp_path_factory.mktemp("results")
    yield empty


def _cpu_estimate(model, mom, batch, results, **kw):
    return estimate(model, mom, batch_size=batch, gpu="cpu", results=results, **catalog.tiny(model), **kw)


@pytest.mark.parametrize("model,mom", _matrix())
def test_traced_memory_equals_measured_on_cpu(model, mom, _no_records):
    """Every catalog model's tiny preset and every MOM: the estimate is the measurement, without running."""
    size = catalog.tiny(model)
    if not _applies(model, mom):
        with pytest.raises(ValueError, match="ckpt-selective"):
            _cpu_estimate(model, mom, 2, _no_records)
        return
    e = _cpu_estimate(model, mom, 2, _no_records)
    m = measure(model, mom, batch_size=2, steps=1, **size)
    assert e.peak_bytes == pytest.approx(m.peak_bytes, rel=0.03)
    assert e.activation_bytes == pytest.approx(m.activation_bytes, rel=0.03)
    # the traced step is the measured step: every field is in fact equal
    assert {k: getattr(e, k) for k in MEMORY} == {k: getattr(m, k) for k in MEMORY}
    assert e.flops == m.flops and e.memory_source == "predicted" and e.gpu == "cpu" and e.fits


@pytest.mark.parametrize("model,mom,precision", [
    ("bert-base", "exact", "bf16"), ("bert-base", "ckpt", "fp16"), ("gpt2", "quant4", "bf16"),
    ("resnet50", "exact", "bf16"),  # batch norm statistics stay fp32 (meta kernels say bf16)
    # layer norm statistics of a half input with an fp32 weight (Swin's patch embedding under autocast: CPU's
    # "mixed type" layer norm keeps them fp32, a half model's in half), GradScaler
    ("swin-tiny", "swap", "fp16"),
    pytest.param("vit-base", "ckpt-selective", "bf16", marks=pytest.mark.exhaustive),
])
def test_mixed_precision_traces_cpu_autocast(model, mom, precision, _no_records):
    """bf16/fp16: fake CPU weights get CPU autocast, so the trace is the measured mixed-precision step."""
    e = _cpu_estimate(model, mom, 2, _no_records, precision=precision)
    m = measure(model, mom, batch_size=2, steps=1, precision=precision, **catalog.tiny(model))
    assert {k: getattr(e, k) for k in MEMORY} == {k: getattr(m, k) for k in MEMORY}
    assert e.precision == precision and e.flops == m.flops


@pytest.mark.parametrize("model,mom,kernels", [
    ("bert-base", "exact", "cpu"), ("bert-base", "quant4", "cpu"), ("gpt2", "swap+ckpt", "cuda"),
    ("resnet50", "ckpt", "cpu"), ("vit-base", "ckpt-selective", "cuda"),
])
def test_interpolation_equals_a_direct_trace(model, mom, kernels):
    """Memory is affine in the batch, op by op: two traces give a third batch exactly."""
    prof = profile(model, mom, kernels=kernels, **catalog.tiny(model))
    first = TRACE_BATCHES.index(_first_batch(mom))  # where the search starts: 4 for quantization
    assert prof.aligned and (prof.lo.batch_size, prof.hi.batch_size) == TRACE_BATCHES[first:first + 2]
    for batch in (7, 13):
        read = prof.at(batch)
        traced = prof.at(batch, trace=True)
        assert read is not traced
        for field in MEMORY:
            assert getattr(read, field) == getattr(traced, field), field
        assert np.array_equal(read.live, traced.live)
        assert read.flops.sum() == traced.flops.sum() and read.bytes.sum() == traced.bytes.sum()


def test_interpolated_estimate_is_measured_memory(_no_records):
    """At a batch never traced, the estimate still equals the measurement."""
    e = _cpu_estimate("gpt2", "ckpt", 5, _no_records)
    m = measure("gpt2", "ckpt", batch_size=5, steps=1, **catalog.tiny("gpt2"))
    assert e.interpolated
    assert {k: getattr(e, k) for k in MEMORY} == {k: getattr(m, k) for k in MEMORY}


@pytest.mark.parametrize("mom", ["exact", "ckpt"])
def test_predicted_max_batch_is_within_one_of_the_search(mom):
    """The closed-form largest batch under a CPU budget against the measured search."""
    size = catalog.tiny("bert-base")
    budget = 48 * 2 ** 20
    found = max_batch_size("bert-base", mom, budget=budget, **size)
    predicted = predict_max_batch("bert-base", mom, gpu="cpu", budget=budget, **size)
    assert found.value > 2
    assert abs(predicted - found.value) <= 1, (predicted, found.value, found.tried)


def _same_probe(a: Probe, b: Probe, names_a: dict, names_b: dict) -> None:
    for f in ("batch_size", "params_bytes", "optimizer_bytes", "grads_bytes", "forward_live", "forward_host"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("live", "flops", "extra_flops", "bytes", "fmt"):
        assert getattr(a, f).dtype == getattr(b, f).dtype and np.array_equal(getattr(a, f), getattr(b, f)), f
    assert [names_a[i] for i in a.ops] == [names_b[i] for i in b.ops]


def test_traces_on_disk_are_the_traces(tmp_path, monkeypatch):
    """A new process reads a configuration's traces from disk instead of tracing: the same traces, op by op."""
    import momlab.estimate as module
    from momlab import timemodel

    monkeypatch.setattr(module, "TRACE_CACHE", tmp_path)
    size = catalog.tiny("bert-base")
    clear_cache()
    traced = profile("bert-base", "ckpt", kernels="cuda", **size)
    files = list(tmp_path.iterdir())
    assert traced.disk is None and len(files) == 1 and files[0].name.startswith("bert-base-ckpt-fp32-cuda-")
    names = {i: n for n, i in timemodel.OP_IDS.items()}
    clear_cache()
    monkeypatch.setattr(timemodel, "OP_IDS", {"aten.an_op_met_first.default": 0})  # a new process's own numbering
    try:
        read = profile("bert-base", "ckpt", kernels="cuda", **size)
        assert read.disk == files[0] and read._session is None  # nothing was built
        read_names = {i: n for n, i in timemodel.OP_IDS.items()}
        _same_probe(traced.lo, read.lo, names, read_names)
        _same_probe(traced.hi, read.hi, names, read_names)
        assert read.aligned and read.at(7).peak_bytes == traced.at(7).peak_bytes
        # a batch traced directly builds the workload now, and agrees with the traces read
        direct = read.at(7, trace=True)
        assert read._session is not None and np.array_equal(direct.live, read.at(7).live)
    finally:
        clear_cache()  # these profiles number ops in the monkeypatched table


def test_traces_on_disk_are_keyed_by_what_they_depend_on(tmp_path, monkeypatch):
    """An edit of momlab, another torch, or a damaged file: traced again, never read."""
    import momlab.estimate as module
    from momlab import timemodel

    monkeypatch.setattr(module, "TRACE_CACHE", tmp_path)
    size = catalog.tiny("bert-base")
    clear_cache()
    try:
        first = profile("bert-base", kernels="cuda", **size)
        clear_cache()
        assert profile("bert-base", kernels="cuda", **size).disk is not None
        monkeypatch.setattr(module, "_SOURCE", "an edited momlab")
        clear_cache()
        assert profile("bert-base", kernels="cuda", **size).disk is None
        monkeypatch.setattr(torch, "__version__", "0.0.0")
        clear_cache()
        assert profile("bert-base", kernels="cuda", **size).disk is None
        assert len(list(tmp_path.glob("*.npz"))) == 3 and not list(tmp_path.glob("*.tmp"))
        newest = max(tmp_path.glob("*.npz"), key=lambda p: p.stat().st_mtime_ns)
        newest.write_bytes(newest.read_bytes()[:200])  # a file cut short
        clear_cache()
        again = profile("bert-base", kernels="cuda", **size)
        assert again.disk is None and again.lo.peak_bytes == first.lo.peak_bytes
        clear_cache()
        assert profile("bert-base", kernels="cuda", **size).disk == newest  # rewritten whole
    finally:
        clear_cache()


def test_source_digest_changes_with_any_edit(tmp_path):
    import momlab.estimate as module
    from momlab import timemodel

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = _source_digest(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    edited = _source_digest(tmp_path)
    (tmp_path / "c.py").write_text("")
    assert len({before, edited, _source_digest(tmp_path)}) == 3
    assert module._SOURCE == _source_digest(Path(module.__file__).parent)


def test_max_batch_closed_form_is_the_last_batch_that_fits():
    prof = profile("bert-base", "ckpt", kernels="cuda", **catalog.tiny("bert-base"))
    cap = prof.at(40).peak_bytes + 1000
    best = prof.max_batch_size(cap)
    assert prof.at(best, trace=True).peak_bytes <= cap < prof.at(best + 1, trace=True).peak_bytes
    assert prof.max_batch_size(prof.lo.params_bytes) == 0  # not even the weights fit
    assert list(prof.peak_bytes([best, best + 1])) == [prof.at(best).peak_bytes, prof.at(best + 1).peak_bytes]


def test_max_model_size_is_exact_on_its_grid(_no_records):
    size = {**catalog.tiny("bert-base")}
    del size["num_layers"]
    budget = 64 * 2 ** 20
    layers = predict_max_size("bert-base", "exact", dim="num_layers", batch_size=8, gpu="cpu", budget=budget, **size)
    assert layers >= 1
    fits, over = (estimate("bert-base", batch_size=8, gpu="cpu", budget=budget, num_layers=n, results=_no_records,
                           **size) for n in (layers, layers + 1))
    assert fits.fits and not over.fits



def _same_step(a: Probe, b: Probe) -> bool:
    return (a.batch_size == b.batch_size and np.array_equal(a.ops, b.ops) and np.array_equal(a.live, b.live)
            and np.array_equal(a.padding, b.padding) and np.allclose(a.flops, b.flops)
            and np.allclose(a.bytes, b.bytes) and (a.params_bytes, a.grads_bytes, a.optimizer_bytes, a.forward_live,
                                                   a.forward_host) == (b.params_bytes, b.grads_bytes,
                                                                       b.optimizer_bytes, b.forward_live, b.forward_host))


@pytest.mark.parametrize("model,mom,kernels,setup,precision,unrolls", [
    ("bert-base", "exact", "cuda", "default", "fp32", True), ("gpt2", "quant4+ckpt", "cuda", "default", "fp32", True),
    ("resnet50", "swap", "cpu", "default", "fp32", True),
    # the paper stack: a per-parameter AdamW loop, the loss scaler, then a loop zeroing every gradient (two stacks
    # in the optimizer phase); quant4's pair of aligned batches reused one block deeper
    ("bert-base", "quant4", "cuda", "paper", "fp16", True),
    # fairseq's half model: the flat master copy's allocator round-up is not affine in the depth (traced whole)
    ("gpt3-small", "exact", "cuda", "paper", "fp16", False),
])
def test_a_deep_stack_unrolled_from_shallow_traces_equals_a_full_trace(model, mom, kernels, setup, precision, unrolls,
                                                                       monkeypatch):
    """Depth extrapolation (issue 13): traces at 3 and 4 blocks give every deeper step op for op, byte for
    byte, as tracing the full depth does, at three depths."""
    size = catalog.tiny("gpt2" if model == "gpt3-small" else model)
    for depth in (5, 7, 10):
        clear_cache()
        monkeypatch.setattr("momlab.estimate.EXTRAPOLATE_DEPTH", True)
        unrolled = profile(model, mom, kernels=kernels, setup=setup, precision=precision,
                           **{**size, "num_layers": depth})
        clear_cache()
        monkeypatch.setattr("momlab.estimate.EXTRAPOLATE_DEPTH", False)
        full = profile(model, mom, kernels=kernels, setup=setup, precision=precision, **{**size, "num_layers": depth})
        assert unrolled.depths == ((3, 4) if unrolls else None) and full.depths is None
        assert _same_step(unrolled.lo, full.lo) and _same_step(unrolled.hi, full.hi), (model, mom, depth)
        assert unrolled.max_batch_size(2 ** 28) == full.max_batch_size(2 ** 28)


def test_below_its_aligned_batches_an_unrolled_stack_is_unrolled_too(monkeypatch):
    """quant4's traces align only once every packed tensor takes several chunks (at real size from batch 4 or
    16); a smaller batch of a deep stack is unrolled from two shallow steps at that batch, equal to the full
    trace, without building the full-depth workload."""
    monkeypatch.setattr("momlab.moms.quant.CHUNK", 4096)  # this tiny model's traces then align from batch 4
    size = {**catalog.tiny("bert-base"), "num_layers": 6}
    clear_cache()
    unrolled = profile("bert-base", "quant4", **size)
    assert unrolled.depths == (3, 4) and unrolled.lo.batch_size == 4
    steps = {b: unrolled.at(b) for b in (1, 3)}
    assert unrolled._session is None
    clear_cache()
    monkeypatch.setattr("momlab.estimate.EXTRAPOLATE_DEPTH", False)
    full = profile("bert-base", "quant4", **size)
    for b, step in steps.items():
        assert _same_step(step, full.at(b)), b


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the deeper copy is forked on Linux only")
def test_a_forked_child_traces_the_deeper_copy_and_changes_no_number(tmp_path, monkeypatch):
    """A first estimate of a deep stack traces its two shallow copies side by side, the deeper one in a forked
    child that leaves it in the disk cache (`_deeper_beside`): the unrolled steps are those of the traces made
    one after the other. A child that fails, or is killed for outliving its grace, leaves nothing, and the
    deeper copy is traced in this process: the same steps again."""
    import momlab.estimate as module

    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1})  # forks on a one-core machine too
    size = {**catalog.tiny("bert-base"), "num_layers": 6}
    args = dict(kernels="cuda", setup="paper", precision="fp16", **size)

    def traced(cache: str, parallel: bool):
        monkeypatch.setattr(module, "TRACE_CACHE", tmp_path / cache)
        monkeypatch.setattr(module, "PARALLEL_DEPTHS", parallel)
        clear_cache()
        deep = profile("bert-base", "quant4", **args)
        deeper = profile("bert-base", "quant4", **{**args, "num_layers": 4})  # this process's copy of it
        return deep, deeper.disk is not None

    monkeypatch.setattr(module, "_FORK_UNSAFE", False)
    serial, read = traced("serial", False)
    assert serial.depths == (3, 4) and not read
    forked, read = traced("forked", True)
    # the child traced the deeper copy; where torch is built for CUDA its autograd does not survive a fork after
    # the backwards just traced, and it says so instead (torch 2.11+cu130 on a machine without a GPU: it did)
    assert read == (not module._FORK_UNSAFE) and (read or torch.backends.cuda.is_built())
    assert _same_step(forked.lo, serial.lo) and _same_step(forked.hi, serial.hi)

    real_threads = torch.set_num_threads
    def failing(n):  # the child's first call: it exits with an error, nothing written
        raise RuntimeError("a child that fails")
    monkeypatch.setattr(torch, "set_num_threads", failing)
    monkeypatch.setattr(module, "_FORK_UNSAFE", False)
    fallback, read = traced("failed", True)
    assert not read and _same_step(fallback.lo, serial.lo) and _same_step(fallback.hi, serial.hi)
    assert not module._FORK_UNSAFE  # a child that failed otherwise leaves forking on

    monkeypatch.setattr(torch, "set_num_threads", lambda n: __import__("time").sleep(600))  # a child that hangs
    monkeypatch.setattr(module, "CHILD_GRACE_S", 0.0)
    killed, read = traced("killed", True)
    assert not read and _same_step(killed.lo, serial.lo)
    assert not list((tmp_path / "killed").glob("*.tmp"))
    monkeypatch.setattr(torch, "set_num_threads", real_threads)

    # an estimate interrupted while its child traces: the child is killed then and there, its copy not written
    monkeypatch.setattr(module, "TRACE_CACHE", tmp_path / "interrupted")
    st = module.stack("bert-base", "paper", None)
    with pytest.raises(KeyboardInterrupt):
        with module._deeper_beside("bert-base", module.parse_mom("quant4"), "fp16", {**size, "num_layers": 4},
                                   "cuda", st):
            raise KeyboardInterrupt
    assert not (tmp_path / "interrupted").exists() or not list((tmp_path / "interrupted").iterdir())
    clear_cache()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the deeper copy is forked on Linux only")
def test_a_child_whose_autograd_did_not_survive_the_fork_turns_forking_off(tmp_path, monkeypatch):
    """torch built for CUDA starts autograd's device threads at its first backward (fake tensors' too, without a
    GPU), and a child forked after it cannot run a backward: the child says so at once, the deeper copy is traced
    in this process, and this process forks no more (`_FORK_UNSAFE`)."""
    import momlab.estimate as module

    assert module._autograd_runs()  # this process's autograd runs
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(module, "_FORK_UNSAFE", False)
    size = {**catalog.tiny("bert-base"), "num_layers": 6}
    real_fork, forks = module.os.fork, []
    monkeypatch.setattr(module.os, "fork", lambda: forks.append(1) or real_fork())

    def first(cache: str):
        monkeypatch.setattr(module, "TRACE_CACHE", tmp_path / cache)
        clear_cache()
        return profile("bert-base", "exact", kernels="cuda", **size)

    monkeypatch.setattr(module, "_autograd_runs", lambda: False)  # the child's answer, as after a fork there
    told = first("told")
    assert forks == [1] and module._FORK_UNSAFE
    assert profile("bert-base", "exact", kernels="cuda", **{**size, "num_layers": 4}).disk is None  # traced here
    again = first("again")
    assert forks == [1] and again.depths == told.depths == (3, 4)
    assert _same_step(again.lo, told.lo) and _same_step(again.hi, told.hi)
    clear_cache()


def test_the_quantized_sizes_pick_the_batches_that_can_align():
    """Two traces of a quantizing MOM align only where no tensor's chunk loop folds in one and not the other
    (more than `quant.CHUNK` values): BERT-L at 128 tokens saves 131K-, 262K- and 524K-value tensors a sample,
    which cross it between 4 and 8 and between 8 and 16, so from sizes at 4 the search starts at 16."""
    from momlab.estimate import _folding_alike
    from momlab.moms import quant

    batches = TRACE_BATCHES[1:]  # from 4
    per_sample = [131072, 262144, 524288]
    assert _folding_alike([n * 4 for n in per_sample], batches) == TRACE_BATCHES[3:]
    assert _folding_alike([n * 4 for n in per_sample[::2]], batches) == batches  # 4 and 8 align: nothing to skip
    assert _folding_alike([], batches) == batches  # nothing quantized
    assert _folding_alike([quant.CHUNK], batches) == TRACE_BATCHES[2:]  # exactly one chunk at 4: folded from 8 on
    assert _folding_alike([3], batches) == batches  # never folds: every pair aligns
    # one count crossing between each pair: none aligns, so the search tries them all in order
    assert _folding_alike([quant.CHUNK * 4 // b for b in batches], batches) == batches


def test_the_sizing_step_stops_after_forward_only_where_backward_packs_nothing():
    """quant4 packs in forward alone, so its sizing step stops there and counts what a whole step counts;
    quant4+ckpt's recomputation packs again in backward (the paper stack's hooks stay on), so its sizing step
    is a whole step."""
    import momlab.estimate as E

    size = {**catalog.tiny("bert-base"), "seq_len": 16}
    clear_cache()
    plain = E._Session("bert-base", "quant4", "fp16", size, "cuda", setup="paper")
    whole, forward = (sorted(plain.quantized_sizes(4, forward_only=f)) for f in (False, True))
    assert sorted(plain.quantized_sizes(4)) == whole == forward != []
    ckpt = E._Session("bert-base", "quant4+ckpt", "fp16", size, "cuda", setup="paper")
    whole, forward = (sorted(ckpt.quantized_sizes(4, forward_only=f)) for f in (False, True))
    assert sorted(ckpt.quantized_sizes(4)) == whole and len(whole) > len(forward)


def test_a_quantizing_search_skips_traces_that_cannot_align_and_keeps_the_step(monkeypatch):
    """The search for two aligned traces skips the batches an untraced step's quantized sizes rule out (two traces fewer
    here: none at 4 or 8) and ends at the pair, and the steps, the plain doubling search finds."""
    import momlab.estimate as E

    # hidden states of 1024 values a sample and attention probabilities of 512 then cross it between 4 and 8 and
    # between 8 and 16
    monkeypatch.setattr("momlab.moms.quant.CHUNK", 4096)
    size = {**catalog.tiny("bert-base"), "seq_len": 16}
    probed = []
    probe = E._Session.probe
    monkeypatch.setattr(E._Session, "probe", lambda self, b: probed.append(b) or probe(self, b))

    def search(skip: bool):
        probed.clear()
        clear_cache()
        with monkeypatch.context() as m:
            if not skip:
                m.setattr(E, "_folding_alike", lambda sizes, batches: batches)
            p = profile("bert-base", "quant4", setup="paper", precision="fp16", **size)
        return p, list(probed)

    skipping, skipped = search(True)
    plain, every = search(False)
    assert every == [4, 8, 16, 32] and skipped == [16, 32]  # the traces at 4 and 8 could not align with the next
    assert skipping.aligned and (skipping.lo.batch_size, skipping.hi.batch_size) == (16, 32)
    assert _same_step(skipping.lo, plain.lo) and _same_step(skipping.hi, plain.hi)
    assert _same_step(skipping.at(8), plain.at(8))  # a batch below the pair: traced when asked, the same


@pytest.mark.parametrize("mom,setup,precision", [("quant4", "default", "fp32"), ("quant4+swap", "paper", "fp16"),
                                                 ("quant4+ckpt", "default", "bf16")])
def test_replayed_quantization_is_the_traced_step(mom, setup, precision, monkeypatch):
    """A trace for a GPU replays a pack or unpack it has already traced for tensors of the same shape (every block
    saves the same ones): the step is op for op, byte for byte, kernel group for kernel group what dispatching
    every op gives."""
    import momlab.estimate as E

    monkeypatch.setattr("momlab.moms.quant.CHUNK", 4096)  # several chunks a tensor: folded passes replayed too
    size = catalog.tiny("bert-base")
    clear_cache()
    replayed = profile("bert-base", mom, setup=setup, precision=precision, **size)
    assert E._REPLAYS  # something was replayed
    clear_cache()
    monkeypatch.setattr(E._Tracer, "replay", lambda self, fn, key, arg: fn(arg))
    plain = profile("bert-base", mom, setup=setup, precision=precision, **size)
    for a, b in ((replayed.lo, plain.lo), (replayed.hi, plain.hi)):
        assert _same_step(a, b) and np.array_equal(a.group, b.group) and np.array_equal(a.group_bytes, b.group_bytes)
        assert np.array_equal(a.fmt, b.fmt) and np.array_equal(a.extra_flops, b.extra_flops)


@pytest.mark.parametrize("model,mom,setup,precision", [
    ("bert-base", "exact", "paper", "fp16"), ("gpt2", "ckpt", "paper", "fp16"), ("resnet50", "quant4", "default", "fp32"),
])
def test_a_replayed_optimizer_update_is_the_traced_one(model, mom, setup, precision, monkeypatch):
    """A session's later traced steps replay the optimizer's update it logged first (AdamW, the GradScaler, GPT's
    fp32 master weights): the step is op for op, byte for byte what running the update again gives."""
    import momlab.estimate as E

    size = catalog.tiny(model)
    clear_cache()
    calls = []
    update = E._Tracer.update
    monkeypatch.setattr(E._Tracer, "update", lambda self, fn: calls.append(self._update_entries is not None)
                        or update(self, fn))
    replayed = profile(model, mom, setup=setup, precision=precision, **size)
    assert calls.count(True) >= 1  # the later trace replayed its update
    clear_cache()
    monkeypatch.setattr(E._Tracer, "update", lambda self, fn: fn())
    plain = profile(model, mom, setup=setup, precision=precision, **size)
    for a, b in ((replayed.lo, plain.lo), (replayed.hi, plain.hi)):
        assert _same_step(a, b) and np.array_equal(a.fmt, b.fmt) and np.array_equal(a.padding, b.padding)
        assert a.optimizer_bytes == b.optimizer_bytes and a.grads_bytes == b.grads_bytes


def test_tracing_leaves_the_garbage_collector_as_it_found_it(monkeypatch):
    """A profile freezes the process's older objects while it traces (its collections then scan only what
    tracing made) and unfreezes them after, even when tracing fails; a process's own freeze is kept."""
    size = {**catalog.tiny("bert-base"), "num_layers": 5}
    clear_cache()
    assert gc.get_freeze_count() == 0
    profile("bert-base", "exact", **size)
    assert gc.get_freeze_count() == 0
    clear_cache()

    def killed(self, batch_size):
        raise RuntimeError("killed mid-trace")

    with monkeypatch.context() as m:
        m.setattr("momlab.estimate._Session.probe", killed)
        with pytest.raises(RuntimeError, match="killed mid-trace"):
            profile("bert-base", "exact", **size)
    assert gc.get_freeze_count() == 0
    clear_cache()
    gc.freeze()
    try:
        profile("bert-base", "ckpt", **size)
        assert gc.get_freeze_count() > 0  # the process's own freeze was not undone (unfreeze empties it)
    finally:
        gc.unfreeze()


def test_an_unrolled_stack_is_the_measured_step(_no_records):
    """Against the measurement, not another trace: bert-base's tiny preset 6 layers deep on the cpu target."""
    size = {**catalog.tiny("bert-base"), "num_layers": 6}
    clear_cache()
    assert profile("bert-base", "ckpt", kernels="cpu", **size).depths == (3, 4)
    e = estimate("bert-base", "ckpt", batch_size=3, gpu="cpu", results=_no_records, **size)
    m = measure("bert-base", "ckpt", batch_size=3, steps=1, **size)
    assert {k: getattr(e, k) for k in MEMORY} == {k: getattr(m, k) for k in MEMORY}

def test_cuda_kernels_trace_fused_attention():
    """On a GPU, attention with dropout is one fused kernel: no probabilities or masks are saved."""
    size = catalog.tiny("bert-base")
    cpu = profile("bert-base", kernels="cpu", **size)
    cuda = profile("bert-base", kernels="cuda", **size)
    from momlab.timemodel import OP_IDS

    names = {v: k for k, v in OP_IDS.items()}
    cuda_ops = {names[i] for i in cuda.lo.ops}
    assert "aten._scaled_dot_product_efficient_attention.default" in cuda_ops
    assert "aten._safe_softmax.default" not in cuda_ops  # the CPU math path's softmax is gone
    assert "aten._safe_softmax.default" in {names[i] for i in cpu.lo.ops}
    # per layer and sample: H*S*S probabilities (fp32) + dropout mask (bool) + dropped probabilities (fp32)
    # are no longer kept; the fused kernel keeps a log-sum-exp of H*S (fp32, padded to 32) instead
    layers, heads, seq, batch = 2, 2, 32, 8
    assert cpu.at(batch).activation_bytes - cuda.at(batch).activation_bytes >= \
        layers * batch * heads * (seq * seq * 9 - 32 * 4)


def test_estimate_record_and_fits(_no_records):
    e = estimate("bert-base", "swap", batch_size=8, gpu="A100-40", results=_no_records, **catalog.tiny("bert-base"))
    assert isinstance(e, Estimate) and e.gpu == "A100-40" and e.device == "cuda"
    # the CUDA context takes its share of the card before the allocator gets any (momlab.estimate.CudaOverheads)
    assert e.fits and e.capacity_bytes == 40 * 2 ** 30 - e.context_bytes > 0 and e.memory_source == "predicted"
    assert e.peak_bytes >= e.params_bytes + e.grads_bytes + e.optimizer_bytes
    assert e.host_bytes > 0 and e.time["transfer_s"] == pytest.approx(2 * e.host_bytes / get("A100-40").pinned_bandwidth)
    assert e.throughput == pytest.approx(8 / e.step_time_s)
    d = e.to_dict()
    assert json.loads(json.dumps(d))["peak_bytes"] == e.peak_bytes
    small = estimate("bert-base", "swap", batch_size=8, gpu="A100-40", budget=e.peak_bytes - 1,
                     results=_no_records, **catalog.tiny("bert-base"))
    assert not small.fits and math.isnan(small.throughput) and small.step_time_s > 0


def test_time_model_orders_moms_and_gpus(_no_records):
    # wide enough that the step is bound by compute and bandwidth, not by launching kernels
    size = {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}
    exact = estimate("bert-base", batch_size=512, gpu="A100-40", results=_no_records, **size)
    ckpt = estimate("bert-base", "ckpt", batch_size=512, gpu="A100-40", results=_no_records, **size)
    assert exact.time["ideal_s"] / exact.efficiency > exact.time["launch_s"]
    assert ckpt.flops > exact.flops and ckpt.step_time_s > exact.step_time_s  # recomputation costs
    h100 = estimate("bert-base", batch_size=512, gpu="H100-80", results=_no_records, **size)
    t4 = estimate("bert-base", batch_size=512, gpu="T4", results=_no_records, **size)
    assert h100.step_time_s < exact.step_time_s < t4.step_time_s
    assert not exact.calibrated and "uncalibrated" in exact.calibration


def test_calibration_from_records_of_the_device(tmp_path):
    """Several measured Exact records of an A100 40GB calibrate A100-40, and only it: fewer than a full
    fit needs, so one scale of every cost, the geometric mean of measured over predicted; a record that did
    not fit, a MOM's record and another GPU's records are not A100-40's Exact timings."""
    size = catalog.tiny("bert-base")
    full = catalog.resolve_size("bert-base", size)
    raw = {b: estimate("bert-base", batch_size=b, gpu="A100-40", results=tmp_path, **size) for b in (8, 16, 32)}
    slower = {8: 2.5, 16: 3.0, 32: 3.6}  # geometric mean exactly 3 (2.5 * 3.0 * 3.6 = 27)

    def rec(batch, seconds, device_name, mom="exact", fits=True):
        return {"model": "bert-base", "mom": mom, "batch_size": batch, "precision": "fp32", "size": full,
                "fits": fits, "step_time_s": seconds, "throughput": batch / seconds, "flops": raw[batch].flops,
                "env": {"device": "cuda", "device_name": device_name}}

    a100 = [rec(b, raw[b].step_time_s * k, "NVIDIA A100-SXM4-40GB") for b, k in slower.items()]
    a100 += [rec(16, 0.5, "NVIDIA A100-SXM4-40GB", mom="ckpt"),
             rec(16, float("nan"), "NVIDIA A100-SXM4-40GB", fits=False)]
    (tmp_path / "a100.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a100))
    (tmp_path / "a100-80.jsonl").write_text(json.dumps(rec(8, raw[8].step_time_s * 10, "NVIDIA A100 80GB PCIe"))
                                            + "\n")
    cal = calibrate("A100-40", results=tmp_path)
    assert cal.calibrated and cal.records == 3 and cal.fitted == ("scale",) and cal.source.endswith("a100.jsonl")
    assert sorted(cal.fitted_on) == sorted(f"bert-base[{','.join(f'{k}={v}' for k, v in sorted(full.items()))}] "
                                           f"fp32 batch {b}" for b in slower)
    # residuals (predicted - measured) / measured: 3/2.5 - 1, 0, 3/3.6 - 1; the error is their median magnitude
    assert sorted(cal.residuals) == pytest.approx(sorted([3 / 2.5 - 1, 0.0, 3 / 3.6 - 1]), abs=1e-6)
    assert cal.error == pytest.approx(1 - 3 / 3.6, rel=1e-6)
    for b in slower:
        e = estimate("bert-base", batch_size=b, gpu="A100-40", results=tmp_path, **size)
        assert e.calibrated and e.step_time_s == pytest.approx(3.0 * raw[b].step_time_s, rel=1e-6), b
        assert e.calibration_records == cal.fitted_on
    other = calibrate("A100-80", results=tmp_path)
    assert other.calibrated and other.records == 1 and other.source.endswith("a100-80.jsonl")
    assert not calibrate("H100-80", results=tmp_path).calibrated


def test_gpu_catalog():
    names = gpus()
    assert names == ["V100-16", "V100-32", "T4", "A10", "L4", "A100-40", "A100-80", "H100-80", "H200-141",
                     "RTX-4090", "cpu"]
    for name in names[:-1]:
        g = get(name)
        assert g.memory_bytes >= 15 * 2 ** 30 and g.memory_bandwidth > 1e11 and g.host_bandwidth > 1e10
        assert g.peak("fp32") and g.peak("fp16") >= g.peak("fp32") and g.source
    assert get("A100-40").peak("bf16") == 312e12 and get("H100-80").peak("bf16") == pytest.approx(989.4e12)
    assert get("V100-16").peak("bf16") is None and get("T4").peak("tf32") is None
    assert for_device_name("NVIDIA A100-SXM4-40GB") == "A100-40"
    assert for_device_name("NVIDIA A100 80GB PCIe") == "A100-80"
    assert for_device_name("NVIDIA H100 80GB HBM3") == "H100-80"
    assert for_device_name("Tesla V100-SXM2-16GB") == "V100-16"
    assert for_device_name("NVIDIA A10") == "A10" and for_device_name("NVIDIA GeForce RTX 4090") == "RTX-4090"
    assert for_device_name("NVIDIA H200") == "H200-141" and for_device_name("Intel Xeon") is None
    cpu = get("cpu")
    assert cpu.kernels == "cpu" and cpu.peak("fp32") > 1e9 and cpu.memory_bytes > 2 ** 30


def test_errors_name_the_valid_choices():
    size = catalog.tiny("bert-base")
    with pytest.raises(ValueError, match="A100-40"):
        estimate("bert-base", batch_size=2, gpu="A100", **size)
    with pytest.raises(ValueError, match="valid precisions here: fp32, fp16"):
        estimate("bert-base", batch_size=2, gpu="V100-16", precision="bf16", **size)
    with pytest.raises(ValueError, match="batch_size"):
        estimate("bert-base", batch_size=0, gpu="A100-40", **size)
    with pytest.raises(ValueError, match="num_layers"):
        estimate("bert-base", batch_size=2, gpu="A100-40", width_per_group=3)
    with pytest.raises(ValueError, match="valid atomic MOMs"):
        estimate("bert-base", "ckpt2", batch_size=2, gpu="A100-40", **size)
    with pytest.raises(ValueError, match="profile 'quant4' and 'quant4\\+ckpt', which bound it"):
        profile("bert-base", "quant4+ckpt-auto", **size)
    with pytest.raises(ValueError, match="valid here: allocator='ideal'"):
        estimate("bert-base", "ckpt-auto", batch_size=2, gpu="A100-40", allocator="caching", **size)


def test_verdict_answers_fit_and_speed(_no_records):
    size = catalog.tiny("bert-base")
    budget = 48 * 2 ** 20
    v = verdict("bert-base", ["exact", "ckpt", "quant4"], gpu="cpu", batch_size=64, budget=budget,
                results=_no_records, **size)
    rows = {r["mom"]: r for r in v["rows"]}
    assert rows["ckpt"]["max_batch"] > rows["exact"]["max_batch"] > 0
    assert rows["exact"]["max_batch"] == predict_max_batch("bert-base", gpu="cpu", budget=budget, **size)
    assert v["s1"]["best"] == max(rows.values(), key=lambda r: r["throughput"])["mom"]
    assert rows["exact"]["fits_at_batch"] is (rows["exact"]["max_batch"] >= 64)
    assert "S1" in v["text"] and "ckpt at batch 64" in v["text"]


def test_the_s2_verdict_names_the_deepest_model_and_its_host_memory(_no_records):
    """S2: the deepest model each MOM trains under the budget, and what swap's deepest keeps on the host (which
    nothing bounds in an estimate): the same numbers as asking for that model's estimate."""
    size = {k: v for k, v in catalog.tiny("bert-base").items() if k != "num_layers"}
    budget = 64 * 2 ** 20
    v = verdict("bert-base", ["exact", "swap"], gpu="cpu", batch_size=8, budget=budget, dim="num_layers",
                results=_no_records, **size)
    rows = {r["mom"]: r for r in v["s2"]["rows"]}
    assert rows["swap"]["num_layers"] > rows["exact"]["num_layers"] > 0 and v["s2"]["best"] == "swap"
    assert rows["exact"]["num_layers"] == predict_max_size("bert-base", batch_size=8, gpu="cpu", budget=budget, **size)
    deepest = estimate("bert-base", "swap", batch_size=8, gpu="cpu", results=_no_records,
                       **{**size, "num_layers": rows["swap"]["num_layers"]})
    assert deepest.fits and rows["swap"]["host_bytes"] == deepest.host_bytes > 0 and rows["exact"]["host_bytes"] == 0
    assert "in host memory" in v["text"].splitlines()[-1]


def test_verdict_skips_moms_that_do_not_apply(_no_records):
    v = verdict("resnet50", ["exact", "ckpt-selective"], gpu="A100-40", results=_no_records,
                **catalog.tiny("resnet50"))
    rows = {r["mom"]: r for r in v["rows"]}
    assert not rows["ckpt-selective"]["applicable"] and "ckpt-selective" in rows["ckpt-selective"]["reason"]
    assert v["s1"]["best"] == "exact"


@pytest.mark.slow
def test_bert_large_at_batch_1024_costs_no_memory():
    """A real size on a laptop: nothing is allocated (the traced peak is far above this machine's RAM)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    e = estimate("bert-large", "exact", batch_size=1024, gpu="A100-80")
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert not e.fits and e.peak_bytes > 200 * 2 ** 30
    assert grown < 2 * 2 ** 30


def test_cli_estimate_json():
    out = subprocess.run([sys.executable, "-m", "momlab", "estimate", "bert-base", "--tiny", "--gpu", "A100-40",
                          "--mom", "ckpt", "--batch-size", "8", "--json", "--max-batch"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    api = estimate("bert-base", "ckpt", batch_size=8, gpu="A100-40", **catalog.tiny("bert-base"))
    assert d["peak_bytes"] == api.peak_bytes and d["gpu"] == "A100-40" and d["mom"] == "ckpt"
    assert d["max_batch_size"] == predict_max_batch("bert-base", "ckpt", gpu="A100-40", **catalog.tiny("bert-base"))
    bad = subprocess.run([sys.executable, "-m", "momlab", "estimate", "bert-base", "--tiny", "--gpu", "B200",
                          "--batch-size", "8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown gpu 'B200'" in bad.stderr and "A100-40" in bad.stderr


def test_whatif_draws_breakdown_and_curves(tmp_path, _no_records):
    from momlab import whatif

    state = whatif.State("bert-base", "A100-40", "fp32", ("exact", "ckpt", "ckpt-selective"), 8,
                         whatif.size_from("bert-base", "tiny"), _no_records)
    view = whatif.compute(state)
    assert set(view.curves) == {"exact", "ckpt", "ckpt-selective"} and view.max_batch["ckpt"] > view.max_batch["exact"]
    assert view.verdict.startswith("S1 on A100-40")
    paths = whatif.save(view, tmp_path / "06_what_if")
    assert [p.suffix for p in paths] == [".png", ".pdf"] and paths[0].stat().st_size > 10_000
    fig = whatif.figure(view)
    mem, tp = fig.axes
    assert len(mem.patches) == 5 * 3  # five categories stacked for three MOMs
    assert {line.get_label() for line in tp.lines} >= {"exact", "ckpt", "ckpt-selective"}



def test_whatif_legend_covers_no_bar_at_the_cards_edge(_no_records):
    """At exact's largest batch its bar reaches the capacity line: the breakdown's legend stays clear of it."""
    from dataclasses import replace

    from momlab import whatif

    state = whatif.State("bert-base", "A100-40", "fp32", ("exact", "ckpt", "swap"), 8,
                         whatif.size_from("bert-base", "tiny"), _no_records)
    edge = replace(state, batch_size=whatif.compute(state).max_batch["exact"])
    fig = whatif.figure(whatif.compute(edge))
    fig.draw_without_rendering()
    mem = fig.axes[0]
    legend = mem.get_legend().get_window_extent()
    bars = [p.get_window_extent() for p in mem.patches if p.get_height() > 0]
    assert bars and not [b for b in bars if b.overlaps(legend)]

def test_whatif_redraw_in_place_is_a_new_drawing(_no_records):
    """An update draws into the last update's figure (what keeps it fast): it shows what a new figure shows."""
    from dataclasses import replace

    from momlab import whatif

    state = whatif.State("bert-base", "A100-40", "fp32", ("exact", "ckpt", "swap"), 8,
                         whatif.size_from("bert-base", "tiny"), _no_records)
    fig = whatif.figure(whatif.compute(state))  # swap's host annotation, three MOMs
    panels = list(fig.axes)
    later = whatif.compute(replace(state, moms=("exact", "ckpt"), batch_size=64, gpu="T4"))
    assert whatif.figure(later, fig) is fig and fig.axes == panels
    assert len(panels[0].patches) == 5 * 2 and not panels[0].texts
    assert whatif.png(fig) == whatif.png(whatif.figure(later))


def test_size_from_notebook_parameters():
    from momlab import whatif

    assert whatif.size_from("bert-base", None) == {}
    assert whatif.size_from("bert-base", "tiny", seq_len=64) == {**catalog.tiny("bert-base"), "seq_len": 64}
    assert whatif.size_from("resnet50", {"num_layers": 3}, image_size=None) == {"num_layers": 3}
    with pytest.raises(ValueError, match="tiny"):
        whatif.size_from("bert-base", "small")
