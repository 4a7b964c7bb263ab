"""The time model: calibration recovers the parameters that made the times, swap overlaps per phase.

Hand-built steps (numpy arrays in the shape of `momlab.estimate.Probe`) so
every expected time is worked out here, not by the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from momlab import gpus
from momlab.gpus import get
from momlab.timemodel import (
    Calibration,
    default_calibration,
    fit_gpu,
    step_time,
    swap_overlap,
)

V100 = get("V100-16")
FP32, CONV32, FP16 = 0, 1, 3
TRUTH = {"fp32": 0.6, "conv32": 0.72, "half": 0.45, "memory": 0.81, "launch": 1.7e-5, "kernel": 4e-6}


def _step(flops, nbytes, fmt, *, host=0, forward=0, backward=0, group=None, group_bytes=None, group_cycles=None):
    n = len(flops)
    return SimpleNamespace(flops=np.asarray(flops, dtype=float), extra_flops=np.zeros(n),
                           bytes=np.asarray(nbytes, dtype=float), fmt=np.asarray(fmt, dtype=np.int8),
                           host_bytes=host, forward_ops=forward, backward_ops=backward,
                           group=None if group is None else np.asarray(group, dtype=np.int32),
                           group_bytes=None if group_bytes is None else np.asarray(group_bytes, dtype=float),
                           group_cycles=None if group_cycles is None else np.asarray(group_cycles, dtype=float))


def _cal(params: dict) -> Calibration:
    comp = {k: params[k] for k in ("fp32", "conv32", "half")}
    return Calibration("V100-16", comp["half"], params["launch"], True, "test", compute_efficiency=comp,
                       memory_efficiency=params["memory"], kernel_s=params.get("kernel", 0.0))


def _model_step(rng, batch: int, kind: str):
    """A step of 300 ops: big matmuls or convolutions (compute-bound), elementwise ops (memory-bound),
    small ops whose kernels are shorter than a launch; costs grow with the batch as a real step's do."""
    n = 300
    heavy = rng.random(n) < 0.3
    flops = np.where(heavy, rng.uniform(1e9, 5e9, n) * batch, 0.0)
    nbytes = np.where(heavy, rng.uniform(1e6, 4e6, n) * batch, rng.uniform(2e5, 4e6, n) * batch)
    nbytes[rng.random(n) < 0.2] = 4096.0  # scalars, norms of one vector: launch-bound at any batch
    fmt = np.where(heavy, CONV32 if kind == "cnn" else FP16, FP32)
    return _step(flops, nbytes, fmt)


def test_calibration_recovers_known_parameters():
    """Exact records of two kinds of model at several batch sizes, timed with known parameters: the fit
    finds them (a fit of one efficiency, or one that keeps defaults, misses by 10-40%)."""
    rng = np.random.default_rng(0)
    probes = [_model_step(rng, b, kind) for kind in ("cnn", "transformer") for b in (1, 2, 4, 16, 64, 128)]
    truth = _cal(TRUTH)
    measured = [step_time(p, V100, truth).step_time_s for p in probes]
    cal = fit_gpu(V100, probes, measured, [f"r{i}" for i in range(len(probes))], "synthetic")
    assert cal.calibrated and cal.records == len(probes) == len(cal.residuals) == len(cal.fitted_on)
    assert set(cal.fitted) == {"conv32", "half", "memory", "launch", "kernel"}  # no fp32 matmuls here
    for k in ("conv32", "half", "memory", "launch", "kernel"):
        assert cal.params()[k] == pytest.approx(TRUTH[k], rel=0.02), k
    assert cal.error < 0.005


def test_calibration_recovers_parameters_through_syncs_and_windows():
    """Records whose host waits before the optimizer (fp16's loss scaling) and records timed without their
    optimizer: the fit predicts each the way it was measured, and still finds the parameters."""
    rng = np.random.default_rng(3)
    probes, syncs, windows = [], [], []
    for kind in ("cnn", "transformer"):
        for i, b in enumerate((1, 2, 4, 16, 64, 128)):
            p = _model_step(rng, b, kind)
            p.forward_ops, p.backward_ops = 100, 260  # 40 optimizer ops
            probes.append(p)
            syncs.append(kind == "transformer")
            windows.append("forward-backward" if kind == "transformer" and i % 2 else "step")
    truth = _cal(TRUTH)
    measured = [step_time(p, V100, truth, sync=s, window=w).step_time_s for p, s, w in zip(probes, syncs, windows)]
    cal = fit_gpu(V100, probes, measured, source="synthetic", syncs=syncs, windows=windows)
    for k in ("conv32", "half", "memory", "launch"):
        assert cal.params()[k] == pytest.approx(TRUTH[k], rel=0.02), k
    assert cal.error < 0.005
    # fitted as if every record were a whole step with no sync, the same times give other parameters
    blind = fit_gpu(V100, probes, measured, source="blind")
    assert blind.error > 10 * cal.error


def test_each_curve_weighs_the_same_in_the_fit():
    """Records that disagree (one model's curve 30% slower than the parameters make it): the compromise the
    fit finds does not move when the other curve is sampled four times over, unless its records are not
    grouped by curve."""
    rng = np.random.default_rng(4)
    cnn = [_model_step(rng, b, "cnn") for b in (1, 2, 4, 16, 64, 128)]
    tf = [_model_step(rng, b, "transformer") for b in (1, 2, 4, 16, 64, 128)]
    truth = _cal(TRUTH)
    t_cnn = [1.3 * step_time(p, V100, truth).step_time_s for p in cnn]
    t_tf = [step_time(p, V100, truth).step_time_s for p in tf]

    def fit(repeat, grouped):
        probes, times = cnn + tf * repeat, t_cnn + t_tf * repeat
        groups = ["cnn"] * len(cnn) + ["tf"] * (len(tf) * repeat) if grouped else None
        return fit_gpu(V100, probes, times, source="two curves", groups=groups).params()

    once, four = fit(1, True), fit(4, True)
    for k in ("conv32", "half", "memory", "launch"):
        assert four[k] == pytest.approx(once[k], rel=1e-3), k
    ungrouped = fit(4, False)
    assert max(abs(ungrouped[k] / once[k] - 1) for k in ("conv32", "half", "memory", "launch")) > 0.01


def test_loss_scaling_waits_for_the_gpu_before_the_optimizer():
    """fp16's overflow check reads a flag on the host: the optimizer's issue can no longer hide behind the
    backward kernels still queued; a forward-backward window leaves the optimizer out of the step."""
    cal = _cal({**TRUTH, "launch": 1e-3, "kernel": 0.0})
    ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    # 10 forward/backward kernels of 5 ms, then 10 optimizer kernels of 10 us (1 ms each to issue)
    p = _step([0.0] * 20, [ms * 5] * 10 + [ms * 0.01] * 10, [FP32] * 20, forward=4, backward=10)
    queued = 1e-3 + 50e-3 + 10 * 10e-6  # issued while the GPU works through backward: 0.1 ms after it
    assert step_time(p, V100, cal).step_time_s == pytest.approx(queued)
    synced = step_time(p, V100, cal, sync=True)
    assert synced.step_time_s == pytest.approx(1e-3 + 50e-3 + 10e-3 + 10e-6)
    assert synced.optimizer_s == pytest.approx(10e-3 + 10e-6)
    timed = step_time(p, V100, cal, sync=True, window="forward-backward")
    assert timed.step_time_s == pytest.approx(51e-3) and timed.optimizer_s == synced.optimizer_s
    with pytest.raises(ValueError, match="step, forward-backward"):
        step_time(p, V100, cal, window="optimizer")


def test_a_cpu_step_times_the_same_window():
    """On a CPU (one op at a time, each paying its launch) the paper BERT's forward-backward window leaves the
    optimizer's ops and their launches out too, and the step says which window it covers."""
    cpu = get("cpu")
    cal = _cal({**TRUTH, "launch": 1e-3, "kernel": 0.0})
    ms = cpu.memory_bandwidth * TRUTH["memory"] * 1e-3
    # 10 forward/backward ops of 5 ms, then 10 optimizer ops of 2 ms
    p = _step([0.0] * 20, [ms * 5] * 10 + [ms * 2] * 10, [FP32] * 20, forward=4, backward=10)
    whole = step_time(p, cpu, cal)
    assert whole.step_time_s == pytest.approx(50e-3 + 20e-3 + 20 * 1e-3) and whole.window == "step"
    timed = step_time(p, cpu, cal, window="forward-backward")
    assert timed.step_time_s == pytest.approx(50e-3 + 10 * 1e-3) and timed.window == "forward-backward"
    assert timed.optimizer_s == pytest.approx(whole.optimizer_s) == pytest.approx(20e-3)


def test_fitted_efficiencies_stay_physical():
    """Times faster than the datasheet peak allows cannot push an efficiency above 1."""
    rng = np.random.default_rng(1)
    probes = [_model_step(rng, b, "transformer") for b in (1, 4, 16, 64, 128, 256)]
    at_peak = _cal({"fp32": 1.0, "conv32": 1.0, "half": 1.0, "memory": 1.0, "launch": 1e-6})
    measured = [0.5 * step_time(p, V100, at_peak).step_time_s for p in probes]
    cal = fit_gpu(V100, probes, measured, source="too fast")
    assert all(0 < v <= 1.0 for k, v in cal.params().items() if k != "launch")
    assert 1e-7 <= cal.launch_s <= 1e-3
    assert cal.error > 0.2  # the fit says it could not explain them


def test_one_record_fits_one_scale():
    rng = np.random.default_rng(2)
    p = _model_step(rng, 8, "transformer")
    base = default_calibration(V100)
    measured = 3.0 * step_time(p, V100, base).step_time_s
    cal = fit_gpu(V100, [p], [measured], ["one"], "one")
    assert cal.fitted == ("scale",)
    assert step_time(p, V100, cal).step_time_s == pytest.approx(measured, rel=1e-9)


def test_swap_copies_overlap_their_own_phase_only():
    """Forward copies hide behind forward compute, prefetches behind backward's; never across phases."""
    cal = _cal({**TRUTH, "launch": 0.0, "kernel": 0.0})
    bw = V100.memory_bandwidth * TRUTH["memory"]
    # 4 forward ops of 1 ms each, 8 backward ops of 1 ms, 2 optimizer ops of 1 ms (memory-bound)
    ms = bw * 1e-3
    nbytes = [ms] * 14
    fmt = [FP32] * 14
    copy = V100.pinned_bandwidth * 1e-3  # bytes that take 1 ms per direction
    cases = [(2 * copy, 4e-3 + 8e-3 + 2e-3),  # 2 ms each way: hidden in both phases
             (6 * copy, 6e-3 + 8e-3 + 2e-3),  # 6 ms: forward (4 ms) exposes 2 ms, backward (8 ms) hides it
             (10 * copy, 10e-3 + 10e-3 + 2e-3)]  # 10 ms: exposed in both; the optimizer hides nothing
    for host, expected in cases:
        p = _step([0.0] * 14, nbytes, fmt, host=host, forward=4, backward=12)
        t = step_time(p, V100, cal)
        assert t.step_time_s == pytest.approx(expected, rel=1e-9)
        assert t.transfer_s == pytest.approx(2 * host / V100.pinned_bandwidth)
        assert t.exposed_transfer_s == pytest.approx(expected - 14e-3, abs=1e-12)
    # one phase's long compute does not hide the other phase's copies (a whole-step overlap would: 14 ms)
    p = _step([0.0] * 14, nbytes, fmt, host=6 * copy, forward=4, backward=12)
    assert step_time(p, V100, cal).step_time_s > max(14e-3, 2 * 6e-3)
    assert swap_overlap(1.0, 2.0, 1.5) == (1.5, 2.0)


def test_the_papers_swap_copies_on_the_compute_stream():
    """GACT's swap (the paper's) issues its copies on the compute stream: they add to compute, except the
    copies back of quantize+swap, prefetched beside backward."""
    from momlab.estimate import swap_schedule

    cal = _cal({**TRUTH, "launch": 0.0, "kernel": 0.0})
    ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    copy = V100.pinned_bandwidth * 1e-3
    p = _step([0.0] * 14, [ms] * 14, [FP32] * 14, host=2 * copy, forward=4, backward=12)  # 2 ms each way
    expected = {"overlap": 14e-3, "serial": 14e-3 + 4e-3, "serial-forward": 14e-3 + 2e-3}
    for schedule, seconds in expected.items():
        t = step_time(p, V100, cal, swap=schedule)
        assert t.step_time_s == pytest.approx(seconds, rel=1e-9), schedule
        assert t.exposed_transfer_s == pytest.approx(seconds - 14e-3, abs=1e-12)
    # 10 ms each way: serial-forward's backward still hides up to its 8 ms of compute
    p = _step([0.0] * 14, [ms] * 14, [FP32] * 14, host=10 * copy, forward=4, backward=12)
    assert step_time(p, V100, cal, swap="serial-forward").step_time_s == pytest.approx((4 + 10) * 1e-3 + 10e-3 + 2e-3)
    with pytest.raises(ValueError, match="overlap, serial, serial-forward"):
        step_time(p, V100, cal, swap="async")
    assert swap_schedule("swap") == swap_schedule("quant4+swap", "default") == "overlap"
    assert swap_schedule("swap", "paper") == swap_schedule("swap+ckpt", "paper") == "serial"
    assert swap_schedule("quant4+swap", "paper") == "serial-forward"
    assert swap_schedule("ckpt", "paper") == "overlap"  # nothing to copy
    # a recomputation swapped within backward (GACT's hooks on through a reentrant checkpoint's backward): 1 ms
    # each way more, both on the compute stream for the paper's swap
    p = _step([0.0] * 14, [ms] * 14, [FP32] * 14, host=2 * copy, forward=4, backward=12)
    p.backward_host = copy
    t = step_time(p, V100, cal, swap="serial")
    assert t.step_time_s == pytest.approx(14e-3 + 4e-3 + 2e-3) and t.transfer_s == pytest.approx(6e-3)
    assert step_time(p, V100, cal, swap="serial-forward").step_time_s == pytest.approx(14e-3 + 2e-3 + 1e-3)


def test_swap_copies_run_at_the_pinned_rate_of_the_link():
    for name in ("V100-16", "A100-40", "H100-80"):
        g = get(name)
        assert 0.5 * g.host_bandwidth < g.pinned_bandwidth < g.host_bandwidth


def test_a_fused_kernel_is_one_kernel():
    """Quantization's encode: its traced CPU ops (here 3 of 1 ms) cost one kernel moving its in and out,
    and pay one kernel's overhead."""
    cal = _cal(TRUTH)
    bw = V100.memory_bandwidth * TRUTH["memory"]
    ms = bw * 1e-3
    plain = _step([0.0] * 4, [ms] * 4, [FP32] * 4)
    fused = _step([0.0] * 4, [ms] * 4, [FP32] * 4, group=[-1, 0, 0, 0], group_bytes=[ms / 2])
    launch, kernel = TRUTH["launch"], TRUTH["kernel"]  # the GPU starts once the host has issued the first kernel
    assert step_time(plain, V100, cal).step_time_s == pytest.approx(launch + 4e-3 + 4 * kernel)
    t = step_time(fused, V100, cal)
    assert t.step_time_s == pytest.approx(launch + 1e-3 + 0.5e-3 + 2 * kernel)
    assert t.fused_s == pytest.approx(0.5e-3 + kernel) and t.overhead_s == pytest.approx(2 * kernel)


def test_a_kernel_bound_by_its_instructions_takes_its_cycles():
    """A fused kernel with instruction cycles (GACT's) takes the longer of its bytes at the fitted bandwidth and
    its cycles at the GPU's multiprocessors x clock; a device without that rate (0) keeps the bytes' time."""
    cal = _cal({**TRUTH, "kernel": 0.0})
    ms_bytes = V100.memory_bandwidth * TRUTH["memory"] * 1e-3  # 1 ms of traffic
    ms_cycles = V100.sm_clock_hz * 1e-3  # 1 ms of instructions
    for cycles, want in ((0.5 * ms_cycles, 1e-3), (3 * ms_cycles, 3e-3)):
        step = _step([0.0] * 3, [0.0] * 3, [FP32] * 3, group=[0, 0, 0], group_bytes=[ms_bytes],
                     group_cycles=[cycles])
        assert step_time(step, V100, cal).fused_s == pytest.approx(want)
    unknown = dataclasses.replace(V100, sm_clock_hz=0.0)
    step = _step([0.0], [0.0], [FP32], group=[0], group_bytes=[ms_bytes], group_cycles=[3 * ms_cycles])
    assert step_time(step, unknown, cal).fused_s == pytest.approx(1e-3)


def test_sm_clocks_agree_with_fp32_peaks():
    """Each catalog GPU's multiprocessors x boost clock, times its FP32 lanes per SM (64 on Volta, Turing and
    A100; 128 on GA102, Ada and Hopper) and 2 FLOPs an FMA, is its datasheet's fp32 peak: two sources, one
    number, so a typo in either shows."""
    for name in gpus.gpus()[:-1]:
        g = gpus.get(name)
        lanes = g.peak("fp32") / (2 * g.sm_clock_hz)
        assert min(abs(lanes - 64), abs(lanes - 128)) / lanes < 0.01, (name, lanes)


def test_gpu_utilization_is_the_share_of_the_whole_step_a_kernel_runs():
    """nvidia-smi's utilization as the time model predicts it: a queue of long kernels keeps the GPU busy
    but for the first launch; a queue of tiny ones leaves it waiting for the host; a step timed over forward
    and backward only still counts its optimizer's wall time and kernels (nvidia-smi samples the loop)."""
    cal = _cal({**TRUTH, "launch": 10e-6, "kernel": 0.0})
    per_ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    long = _step([0.0] * 10, [per_ms] * 10, [FP32] * 10)  # 1 ms kernels, issued every 10 us
    t = step_time(long, V100, cal)
    assert t.busy_s == pytest.approx(10e-3)
    assert t.gpu_utilization == pytest.approx(10e-3 / (10e-6 + 10e-3))
    tiny = _step([0.0] * 100, [per_ms * 1e-3] * 100, [FP32] * 100)  # 1 us kernels, issued every 10 us
    t = step_time(tiny, V100, cal)
    assert t.busy_s == pytest.approx(100e-6) and t.step_time_s == pytest.approx(100 * 10e-6 + 1e-6)
    assert t.gpu_utilization == pytest.approx(100e-6 / (100 * 10e-6 + 1e-6))
    # 4 ops forward, 4 backward, 2 optimizer ops of 1 ms each; the window leaves the optimizer out
    phased = _step([0.0] * 10, [per_ms] * 10, [FP32] * 10, forward=4, backward=8)
    whole, window = step_time(phased, V100, cal), step_time(phased, V100, cal, window="forward-backward")
    assert window.step_time_s == pytest.approx(whole.step_time_s - 2e-3)
    assert window.busy_s == whole.busy_s and window.gpu_utilization == pytest.approx(whole.gpu_utilization)
    assert math.isnan(step_time(long, get("cpu"), cal).gpu_utilization)


def test_every_kernel_pays_its_overhead_on_the_device_only():
    """A kernel occupies the GPU for its roofline time plus the overhead of starting and draining it: a
    queue of tiny kernels the host runs ahead of takes their count times the overhead; a CPU op pays its
    launch and no device overhead."""
    cal = _cal({**TRUTH, "launch": 1e-6, "kernel": 5e-6})
    ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    tiny = _step([0.0] * 100, [ms * 1e-3] * 100, [FP32] * 100)  # 1 us of traffic each, issued every 1 us
    t = step_time(tiny, V100, cal)
    assert t.step_time_s == pytest.approx(1e-6 + 100 * (1e-6 + 5e-6)) and t.overhead_s == pytest.approx(100 * 5e-6)
    cpu = get("cpu")
    op = cpu.memory_bandwidth * TRUTH["memory"] * 1e-3
    on_cpu = _step([0.0] * 100, [op * 1e-3] * 100, [FP32] * 100)
    t = step_time(on_cpu, cpu, cal)
    assert t.step_time_s == pytest.approx(100 * (1e-6 + 1e-6)) and t.overhead_s == 0.0


def test_ops_that_run_no_kernel_cost_nothing():
    """`_unsafe_view` (the view reshape and matmul take of a fresh result: its schema declares no alias, so the
    trace logs it) and allocations without values run no kernel: with their bytes and an op of their own each,
    a step takes what it takes without them, on a GPU (no kernel, no launch) and on a CPU; and a traced step
    logs such views under that name (eager attention's matmuls), so the rule meets the ops it is for."""
    from momlab import catalog
    from momlab.estimate import profile
    from momlab.timemodel import OP_IDS

    mm, view, empty = (OP_IDS.setdefault(n, len(OP_IDS)) for n in (
        "aten.mm.default", "aten._unsafe_view.default", "aten.empty.memory_format"))
    cal = _cal(TRUTH)
    ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    plain = _step([1e9] * 4, [ms] * 4, [FP16] * 4, forward=2, backward=4)
    plain.ops = np.full(4, mm, dtype=np.int32)
    mixed = _step([1e9, 0, 1e9, 0, 1e9, 0, 1e9], [ms, ms, ms, 4 * ms, ms, ms, ms], [FP16, FP32] * 3 + [FP16],
                  forward=4, backward=7)
    mixed.ops = np.array([mm, view, mm, empty, mm, view, mm], dtype=np.int32)
    for g in (V100, get("cpu")):
        a, b = step_time(plain, g, cal), step_time(mixed, g, cal)
        assert b.step_time_s == pytest.approx(a.step_time_s) and b.ops == a.ops == 4
        assert b.ideal_s == pytest.approx(a.ideal_s) and b.launch_s == pytest.approx(a.launch_s)
        assert b.bytes_moved == a.bytes_moved == 4 * ms  # the traffic an Estimate reports: the kernels' only
    p = profile("bert-base", kernels="cuda", setup="paper", **catalog.tiny("bert-base")).lo  # eager attention
    names = {i: n for n, i in OP_IDS.items()}
    assert "aten._unsafe_view.default" in {names[int(i)] for i in p.ops}


def test_the_host_runs_ahead_of_the_gpu():
    """Eager PyTorch issues kernels asynchronously: the host's time per op hides behind long kernels and
    short kernels wait for the host, so a step is not the sum of per-op maxima of kernel and launch."""
    cal = _cal({**TRUTH, "launch": 1e-3, "kernel": 0.0})
    ms = V100.memory_bandwidth * TRUTH["memory"] * 1e-3
    tiny = _step([0.0] * 10, [ms * 0.01] * 10, [FP32] * 10)  # 10 us kernels, 1 ms to issue each
    assert step_time(tiny, V100, cal).step_time_s == pytest.approx(10e-3 + 10e-6)
    long = _step([0.0] * 10, [ms * 5] * 10, [FP32] * 10)  # 5 ms kernels: the host waits on the queue
    assert step_time(long, V100, cal).step_time_s == pytest.approx(1e-3 + 50e-3)
    # 5 kernels of 5 ms, then 20 of 10 us: the 20 issues (20 ms) hide behind the 25 ms of long kernels
    # queued before them; per-op maxima would charge 25 + 20 ms
    mix = _step([0.0] * 25, [ms * 5] * 5 + [ms * 0.01] * 20, [FP32] * 25)
    assert step_time(mix, V100, cal).step_time_s == pytest.approx(1e-3 + 25e-3 + 20 * 10e-6)


def test_calibration_never_uses_mom_records(tmp_path):
    from momlab import catalog
    from momlab.estimate import calibrate

    size = catalog.resolve_size("bert-base", catalog.tiny("bert-base"))
    rec = {"model": "bert-base", "mom": "ckpt", "batch_size": 16, "precision": "fp32", "size": size,
           "fits": True, "step_time_s": 0.01, "throughput": 1600.0, "flops": 1,
           "env": {"device": "cuda", "device_name": "NVIDIA A100-SXM4-40GB"}}
    (tmp_path / "a100.jsonl").write_text(json.dumps(rec) + "\n")
    cal = calibrate("A100-40", results=tmp_path)
    assert not cal.calibrated and math.isnan(cal.error)


def test_calibration_skips_records_of_models_it_cannot_trace_again(tmp_path):
    """A store also holds a user's module's runs (notebook 08: momlab.UserModel, stored by its name); a
    calibration re-traces each record's model by name, so it fits the catalog models' records and leaves those."""
    from momlab import catalog
    from momlab.estimate import calibrate

    size = catalog.resolve_size("bert-base", catalog.tiny("bert-base"))
    env = {"device": "cuda", "device_name": "NVIDIA A100-SXM4-40GB"}
    recs = [{"model": "bert-base", "mom": "exact", "batch_size": b, "precision": "fp32", "size": size,
             "fits": True, "step_time_s": t, "throughput": b / t, "flops": 1, "env": env}
            for b, t in ((4, 0.004), (16, 0.009))]
    recs.append({**recs[0], "model": "token-mlp", "size": {}})
    (tmp_path / "a100.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cal = calibrate("A100-40", results=tmp_path)
    assert cal.calibrated and len(cal.fitted_on) == 2
    assert all(label.startswith("bert-base") for label in cal.fitted_on)


def test_crossing_is_where_the_difference_changes_sign():
    import pandas as pd

    from momlab.validation import crossing

    d = pd.DataFrame({"mom": ["exact"] * 3 + ["ckpt"] * 3, "num_layers": [30, 34, 38] * 2,
                      "t": [124.0, 99.0, 67.0, 117.0, 103.0, 91.0]})
    # 30: -7, 34: +4 -> 30 + 4 * 7 / 11
    assert crossing(d, "t") == pytest.approx(30 + 4 * 7 / 11)
    assert math.isnan(crossing(d.assign(t=[1.0, 1.0, 1.0, 0.5, 0.5, 0.5]), "t"))


def test_depth_curves_predict_the_paper_s_maximum_over_the_batches_it_ran(monkeypatch):
    """The paper's depth study stepped coarsely (exact at 38 layers ran 12 and 20 only), so its maximum
    throughput at a depth is the best of the batches it ran that fit; the like-for-like prediction picks from
    those batches, the fine one from every batch. Traces are stubbed with an affine model in batch and depth
    (throughput rising with the batch, so each best is the largest batch that fits)."""
    from momlab import reference, validation

    g = get(validation.GPU)
    cap = g.memory_bytes - validation.cuda_overheads(g, validation.SETUP).context_bytes

    def fake_profile(model, mom, *, num_layers, **kw):  # affine in depth; the largest batch that fits: 1601 // depth
        per_sample = cap * num_layers / 1601
        return SimpleNamespace(peak_bytes=lambda b: np.asarray(b, dtype=float) * per_sample)

    def fake_curve(model, mom, *, batch_sizes, num_layers, **kw):
        return [SimpleNamespace(step_time_s=0.1 * num_layers + 0.01 * b) for b in batch_sizes]

    monkeypatch.setattr(validation, "profile", fake_profile)
    monkeypatch.setattr(validation, "throughput_curve", fake_curve)
    d = validation.depth_curves(depths=[30, 38, 42, 64, 70])
    ran = reference.paper_scaling_runs("num_layers")
    for r in d.itertuples():
        fits = 1601 // r.num_layers
        assert r.pred_max_batch == fits
        tried = set(ran.loc[(ran["mom"] == r.mom) & (ran["size.num_layers"] == r.num_layers), "batch_size"])
        if not tried:  # no run at that depth (the study stepped by 4 from 2): no like-for-like prediction
            assert math.isnan(r.pred_throughput_paper_batches)
            continue
        best = max((b for b in tried if b <= fits), default=0)
        assert r.pred_best_paper_batch == best
        want = best / (0.1 * r.num_layers + 0.01 * best) if best else 0.0
        assert r.pred_throughput_paper_batches == pytest.approx(want)
        assert r.pred_throughput_paper_batches <= r.pred_throughput
    exact38 = d[(d["mom"] == "exact") & (d["num_layers"] == 38)].iloc[0]
    assert exact38.pred_max_batch == 42 and exact38.pred_best_paper_batch == 36  # it ran 12, 20, 36, 68, ...
    assert d[d["num_layers"] == 64]["pred_throughput_paper_batches"].isna().all()
    assert d[d["num_layers"] == 70]["pred_throughput_paper_batches"].notna().all()


def test_width_curves_trace_every_width_and_predict_over_the_batches_the_paper_ran(monkeypatch):
    """S2' along the width: a width changes every op's shape, so each is traced at its own hidden size (no
    shortcut across widths); the like-for-like prediction is the best of the batches the paper's runs trained
    at that width, the fine one the best of every batch; and `crossing` reads the width where Checkpoint
    overtakes Exact. Traces are stubbed: the largest batch that fits is 64000 // width for exact and four times
    that for ckpt; a step costs width / 2e4 s (the weights' update) + width / 1e6 s a sample (ckpt: a third
    more a sample), so at 512 wide Exact is faster and at 1344 Checkpoint."""
    from momlab import reference, validation

    g = get(validation.GPU)
    cap = g.memory_bytes - validation.cuda_overheads(g, validation.SETUP).context_bytes
    traced = []

    def fits(mom, width):
        return 64000 // width * (1 if mom == "exact" else 4)

    def step(mom, width, b):
        return width / 2e4 + width / 1e6 * (1.0 if mom == "exact" else 4 / 3) * b

    def fake_profile(model, mom, *, hidden_size, **kw):
        traced.append((mom, hidden_size))
        per_sample = cap / (fits(mom, hidden_size) + 0.5)
        return SimpleNamespace(peak_bytes=lambda b: np.asarray(b, dtype=float) * per_sample)

    def fake_curve(model, mom, *, batch_sizes, hidden_size, **kw):
        return [SimpleNamespace(step_time_s=step(mom, hidden_size, b)) for b in batch_sizes]

    monkeypatch.setattr(validation, "profile", fake_profile)
    monkeypatch.setattr(validation, "throughput_curve", fake_curve)
    w = validation.width_curves(widths=[512, 1344])
    assert sorted(traced) == sorted((m, h) for m in validation.DEPTH_MOMS for h in (512, 1344))
    ran = reference.paper_scaling_runs("hidden_size")
    best_tp = {}
    for r in w.itertuples():
        top = fits(r.mom, r.hidden_size)
        assert r.pred_max_batch == top and r.pred_best_batch == top  # throughput rises with the batch
        best_tp[r.mom, r.hidden_size] = top / step(r.mom, r.hidden_size, top)
        assert r.pred_throughput == pytest.approx(best_tp[r.mom, r.hidden_size])
        tried = set(ran.loc[(ran["mom"] == r.mom) & (ran["size.hidden_size"] == r.hidden_size), "batch_size"])
        best = max(b for b in tried if b <= top)
        assert r.pred_best_paper_batch == best
        assert r.pred_throughput_paper_batches == pytest.approx(best / step(r.mom, r.hidden_size, best))
    exact = w[(w["mom"] == "exact") & (w["hidden_size"] == 1344)].iloc[0]
    assert exact.pred_max_batch == 47 and exact.pred_best_paper_batch == 20  # the paper's runs there: 4, 12, 20
    lo = best_tp["ckpt", 512] - best_tp["exact", 512]
    hi = best_tp["ckpt", 1344] - best_tp["exact", 1344]
    assert lo < 0 < hi
    assert validation.crossing(w, "pred_throughput", dim="hidden_size") == pytest.approx(512 + 832 * -lo / (hi - lo))


def test_s1_ratios_at_the_paper_s_batches_take_its_memory_and_momlab_s_speed(monkeypatch):
    """Like for like, the S1 check keeps the paper's memory (the batch sizes it ran that fit) and predicts only
    the speed at them, whatever maximum batch momlab predicts: here every MOM is predicted to fit batch 8 only,
    and the step costs 10 ms + 5 ms a sample (exact) or 6 ms a sample (the others), so each like-for-like best
    is the largest batch the paper timed."""
    from momlab import reference, validation

    per_sample = lambda mom: 0.005 if mom == "exact" else 0.006  # noqa: E731
    monkeypatch.setattr(validation, "predict_max_batch", lambda *a, **k: 8)
    monkeypatch.setattr(validation, "best_throughput", lambda model, mom, **k: SimpleNamespace(
        batch_size=8, throughput=8 / (0.01 + per_sample(mom) * 8)))
    monkeypatch.setattr(validation, "profile", lambda *a, **k: SimpleNamespace(aligned=True))
    monkeypatch.setattr(validation, "throughput_curve", lambda model, mom, *, batch_sizes, **k: [
        SimpleNamespace(batch_size=b, step_time_s=0.01 + per_sample(mom) * b) for b in batch_sizes])
    t = validation.s1_table(["bert-large"]).set_index("mom")
    runs = reference.paper_s1_runs()
    ran = runs[(runs["model"] == "bert-large") & runs["fits"] & runs["throughput"].notna()]
    want = {}
    for mom in t.index:
        largest = int(ran.loc[ran["mom"] == mom, "batch_size"].max())
        assert t.loc[mom, "pred_best_paper_batch"] == largest
        want[mom] = largest / (0.01 + per_sample(mom) * largest)
        assert t.loc[mom, "pred_throughput_paper_batches"] == pytest.approx(want[mom])
        assert t.loc[mom, "pred_max_batch"] == 8
    assert t.loc["exact", "pred_best_paper_batch"] == 44 and t.loc["ckpt", "pred_best_paper_batch"] == 400
    assert t.loc["ckpt", "pred_ratio_paper_batches"] == pytest.approx(want["ckpt"] / want["exact"])
    assert t.loc["ckpt", "ratio_error_paper_batches"] == pytest.approx(
        want["ckpt"] / want["exact"] - t.loc["ckpt", "paper_ratio"])
    assert t.loc["ckpt", "pred_ratio"] == pytest.approx(0.05 / 0.058)  # at batch 8 each: another number
    v = validation.verdicts(t.reset_index()).iloc[0]
    assert v.pred_beat_paper_batches == [] and v.same_paper_batches
    assert "at the paper's batches" in validation.ratio_text(t.reset_index())


def test_s1_check_at_another_precision_predicts_that_precision_and_its_own_swap(monkeypatch):
    """BERT-L's fp32 sweep is checked at fp32 (every prediction asked for fp32), against its own runs (best
    exact batch 32, not the fp16 sweep's 44), and its swap row is comparable: GACT's own swap there, where the
    fp16 sweep's "swap" is DeepSpeed's offload (marked)."""
    from momlab import validation

    asked = set()

    def predict(model, mom, *, precision, **k):
        asked.add(precision)
        return 8

    monkeypatch.setattr(validation, "predict_max_batch", predict)
    monkeypatch.setattr(validation, "best_throughput", lambda model, mom, **k: SimpleNamespace(
        batch_size=8, throughput=100.0))
    monkeypatch.setattr(validation, "profile", lambda *a, **k: SimpleNamespace(aligned=True))
    monkeypatch.setattr(validation, "throughput_curve", lambda model, mom, *, batch_sizes, precision, **k: [
        asked.add(precision) or SimpleNamespace(batch_size=b, step_time_s=0.01 + 0.001 * b) for b in batch_sizes])
    t = validation.s1_table(["bert-large"], precision="fp32").set_index("mom")
    assert asked == {"fp32"} and set(t["precision"]) == {"fp32"}
    assert t.loc["exact", "paper_best_batch"] == 32 and t.loc["exact", "pred_best_paper_batch"] == 32
    assert t.loc["swap", "comparable"] and t.loc["swap", "note"] == ""
    assert t.loc["swap", "paper_ratio"] == pytest.approx(13.68 / 50.44)
    assert "swap-lz4" not in t.index  # no momlab MOM stands for it
    asked.clear()
    head = validation.s1_table(["bert-large"]).set_index("mom")
    assert asked == {"fp16"} and not head.loc["swap", "comparable"] and "DeepSpeed" in head.loc["swap", "note"]
    assert "bert-large fp32" in validation.ratio_text(t.reset_index())
    with pytest.raises(ValueError, match="fp16, fp32"):
        validation.s1_table(["bert-large"], precision="fp64")


def test_predicted_vs_paper_draws_points_and_lines():
    import pandas as pd

    from momlab import plots

    c = pd.DataFrame({"model": "bert-large", "mom": ["exact"] * 3 + ["ckpt"] * 3, "batch_size": [8, 16, 32] * 2,
                      "paper_throughput": [100.0, 150.0, float("nan"), 80, 120, 130],
                      "pred_throughput": [110.0, 160.0, 170.0, 85, 125, 135],
                      "pred_fits": [True, True, False, True, True, True]})
    fig = plots.predicted_vs_paper(c, calibration="calibrated on test")
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata())]
    assert [list(ln.get_xdata()) for ln in lines] == [[8, 16], [8, 16], [16, 32], [8, 16, 32], [8, 16, 32]]
    assert "calibrated on test" in fig.get_suptitle().replace("\n", " ")


def test_predicted_utilization_draws_samples_as_points_and_the_prediction_as_a_line():
    import pandas as pd

    from momlab import plots

    # two samples at batch 32 (the paper repeated the sweep), one predicted value per batch
    t = pd.DataFrame({"model": "swin-large", "mom": "exact", "batch_size": [16, 32, 16, 32],
                      "paper_utilization": [0.64, 0.77, 0.66, 0.82], "pred_utilization": [0.70, 0.79] * 2})
    fig = plots.predicted_utilization(t)
    ax = fig.axes[0]
    points, line = [ln for ln in ax.get_lines() if len(ln.get_xdata())]
    assert list(points.get_ydata()) == pytest.approx([64, 66, 77, 82]) and points.get_linestyle() == "None"
    assert list(line.get_xdata()) == [16, 32] and list(line.get_ydata()) == pytest.approx([70, 79])
    assert ax.get_ylim() == (0, 105) and "utilization" in ax.get_ylabel()
    with pytest.raises(ValueError, match="utilization_table"):
        plots.predicted_utilization(t.iloc[:0])


def test_v100_calibration_records_are_the_exact_runs_of_the_checked_studies():
    """The V100 is fitted on the Exact runs of what momlab.validation checks, never a MOM row: the S1 sweeps
    (headline precisions and BERT-L's fp32 one) and BERT-L's depth study, which weighs as one curve however
    many depths it ran (12 depths from 2 to 42 layers, 47 timed runs)."""
    from collections import Counter

    from momlab import reference, timemodel

    recs = timemodel.reference_records("V100-16")
    assert {r["mom"] for r in recs} == {"exact"} and {r["setup"] for r in recs} == {"paper"}
    curves = Counter(map(timemodel._curve, recs))
    depth = reference.paper_scaling_runs("num_layers", "bert-large")
    timed = depth[(depth["mom"] == "exact") & depth["fits"] & depth["throughput"].notna()]
    assert curves["bert-large fp16 depth study"] == len(timed) == 47
    assert sorted({r["size"]["num_layers"] for r in recs if r["size"]}) == [2, 6, 10, 14, 18, 22, 24, 26, 30, 34,
                                                                          38, 42]
    assert curves["bert-large fp32"] == 4 and curves["bert-large fp16"] == 6 and len(curves) == 9
    assert timemodel.reference_records("A100-40") == []


@pytest.mark.slow
def test_v100_calibration_on_the_paper_exact_runs_is_physical():
    """The fit on the paper's Exact curves (real-size traces: minutes on a cold cache)."""
    from momlab.estimate import calibrate

    cal = calibrate("V100-16", results=[])
    assert cal.calibrated and cal.records >= 150 and "paper V100-16GB" in cal.source
    assert all(0 < v <= 1.0 for k, v in cal.params().items() if k != "launch")
    assert 1e-7 <= cal.launch_s <= 1e-3 and cal.error < 0.25
    assert all(label.split()[0].split("[")[0] in ("resnet50", "wide-resnet50-2", "resnet152", "swin-large",
                                                  "bert-large", "gpt3-small", "gpt3-medium") for label in cal.fitted_on)
    # BERT-L's fp32 Exact curve is the paper's only fp32 matmul one: it fits their efficiency
    assert "fp32" in cal.fitted and any(label.startswith("bert-large fp32") for label in cal.fitted_on)
    assert any(label.startswith("bert-large[num_layers=42] fp16") for label in cal.fitted_on)
    # each residual's curve, as the fit weighed them (bench_paper_v100 reports the residuals per curve)
    assert len(cal.curves) == len(cal.residuals) and cal.curves.count("bert-large fp16 depth study") == 47
