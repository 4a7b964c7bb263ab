"""measure(): run one configuration and record its memory and speed.

The method follows the paper, with its flaw removed: every model is timed over
the whole step (forward, loss, backward, optimizer step, zero grads).

1. Build the workload; put weights on the books; `warmup` steps create the
   optimizer state (a budget is already enforced here).
2. One probe step with memory accounting on (the CUDA allocator's counters on
   a GPU; exact storage accounting on the emulated CPU device): peak, and the
   breakdown read at the end of forward (activations) and the end of backward
   (gradients). One step under FlopCounterMode counts the FLOPs.
3. `steps` timed steps with accounting off, synchronized on CUDA; the median
   is the step time.

An out-of-memory anywhere (real, or the emulated budget) is data: the record
says ``fits=False`` and the memory that was live when it happened.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from momlab import catalog
from momlab.accounting import StorageTracker, unique_storage_bytes
from momlab.device import CudaMemory, check_device, empty_cache, is_oom, synchronize, total_memory
from momlab.errors import OutOfMemory, check_choice
from momlab.moms import auto
from momlab.provenance import environment
from momlab.record import Measurement
from momlab.units import parse_bytes
from momlab.workload import PRECISIONS, Workload, build, check_batch_size, parse_mom, stack


def _check(model, mom, batch_size, device, budget, precision, steps, warmup, size):
    catalog.spec(model)
    size = catalog.resolve_size(model, size)
    mom = parse_mom(mom)
    check_batch_size(batch_size)
    check_choice("precision", precision, PRECISIONS)
    dev = check_device(device)
    if dev.type == "meta":
        raise ValueError("measure runs on a real device (cpu or cuda); use momlab.estimate for predictions")
    budget = None if budget is None else parse_bytes(budget)
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return size, mom, dev, budget


class _Probe:
    """Reads the device account at the end of forward and the end of backward."""

    def __init__(self, live, host, workload: Workload):
        self.live, self.host, self.w = live, host, workload
        self.forward_live = self.forward_host = self.grads_bytes = self.forward_grads = 0

    def forward_end(self):
        self.forward_live = self.live()
        self.forward_host = self.host()
        # gradients zeroed in place (not freed) are resident through forward: not activations
        self.forward_grads = unique_storage_bytes(self.w.state_tensors()["grads"])

    def backward_end(self):
        self.grads_bytes = unique_storage_bytes(self.w.state_tensors()["grads"])


def measure(model: str, mom: str = "exact", *, batch_size: int, device: str = "cpu", budget=None,
            precision: str = "fp32", steps: int = 3, warmup: int = 1, seed: int = 0, attention: str | None = None,
            setup: str = "default", **size) -> Measurement:
    """Measure one training configuration; see the module docstring and `Measurement`.

    >>> m = measure("bert-base", batch_size=2, **catalog.tiny("bert-base"))  # doctest: +SKIP
    >>> m.fits, m.peak_bytes > m.params_bytes
    (True, True)
    """
    size, mom, dev, budget = _check(model, mom, batch_size, device, budget, precision, steps, warmup, size)
    st = stack(model, setup, attention)
    base = dict(model=model, mom=mom, batch_size=batch_size, device=dev.type, precision=precision, size=size,
                budget=budget, attention=st.attention, setup=st.setup, env=environment(dev))
    gc.collect()
    if dev.type == "cuda":
        return _measure_cuda(base, dev, budget, steps, warmup, seed)
    return _measure_emulated(base, dev, budget, steps, warmup, seed)


def _unfit(base: dict, live: int, error: str, memory_source: str, options: dict | None = None) -> Measurement:
    nan = math.nan
    return Measurement(**base, fits=False, peak_bytes=live, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
                       activation_bytes=0, workspace_bytes=0, host_bytes=0, step_time_s=nan, throughput=nan,
                       flops=0, memory_source=memory_source, error=error, options=options or {})


def _breakdown(base, w: Workload, peak: int, bytes_of, probe: _Probe, flops: int, times, memory_source: str):
    state = w.state_tensors()
    params = bytes_of(state["params"])
    optimizer = bytes_of(state["optimizer"])
    grads = probe.grads_bytes
    activation = max(0, probe.forward_live - params - optimizer - probe.forward_grads)
    workspace = max(0, peak - params - grads - optimizer - activation)
    step_time = statistics.median(times)
    return Measurement(
        **base, fits=True, peak_bytes=peak, params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer,
        activation_bytes=activation, workspace_bytes=workspace, host_bytes=probe.forward_host,
        step_time_s=step_time, throughput=base["batch_size"] / step_time, flops=flops,
        memory_source=memory_source, step_times_s=tuple(times), options=dict(w.options),
    )


def _count_flops(w: Workload) -> int:
    """FLOPs of one step, counted by FlopCounterMode in a step of its own: its
    module tracking keeps checkpoint-recomputed tensors alive, so it must not
    run in the step whose memory is measured (checkpointing's peak rose 40%)."""
    with FlopCounterMode(display=False) as counter:
        w.step()
    return int(counter.get_total_flops())


def _warm_up(w: Workload, warmup: int) -> None:
    """`warmup` steps, and more while fp16's GradScaler skips the optimizer
    step (inf/nan gradients at its first scale), so that the probe step
    starts with optimizer state resident."""
    for _ in range(warmup):
        w.step()
    for _ in range(16):
        if w.optimizer.state:
            return
        w.step()


def _timed_steps(w: Workload, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        inputs = w.batch()
        synchronize(w.device)
        t0 = time.perf_counter()
        w.step(inputs)
        synchronize(w.device)
        times.append(time.perf_counter() - t0)
        del inputs
    return times


class _EmulatedMeter:
    """The emulated device's account (a `StorageTracker`), as the probe and ckpt-auto read it."""

    def __init__(self, tracker: StorageTracker):
        self.tracker = tracker
        self.capacity = tracker.budget

    def live(self) -> int:
        return self.tracker.device_bytes

    def host(self) -> int:
        return self.tracker.host_bytes

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def peak(self) -> int:
        return self.tracker.peak_bytes

    @contextmanager
    def unlimited(self):
        budget, self.tracker.budget = self.tracker.budget, None
        try:
            yield
        finally:
            self.tracker.budget = budget


class _CudaMeter:
    """The CUDA allocator's counters under the budget cap; a host tracker counts swap's bytes."""

    def __init__(self, mem: CudaMemory, host: StorageTracker):
        self.mem, self.host_tracker = mem, host
        self.capacity = mem.budget if mem.budget is not None else total_memory(mem.device)

    def live(self) -> int:
        return self.mem.allocated()

    def host(self) -> int:
        return self.host_tracker.host_bytes

    def reset_peak(self) -> None:
        synchronize(self.mem.device)
        self.mem.reset_peak()

    def peak(self) -> int:
        synchronize(self.mem.device)
        return self.mem.peak()

    @contextmanager
    def unlimited(self):
        with self.mem.uncapped():
            yield


def _probe_step(w: Workload, meter) -> tuple[int, _Probe]:
    """One step with the account read at the end of forward and backward; returns (peak, probe)."""
    gc.collect()
    meter.reset_peak()
    probe = _Probe(meter.live, meter.host, w)
    w.step(on_forward_end=probe.forward_end, on_backward_end=probe.backward_end)
    return meter.peak(), probe


def _try(w: Workload, run: Callable):
    """`run()`, or None if it ran out of memory (the step's partial state is dropped)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - only OOM is an answer here
        if not is_oom(exc):
            raise
    # outside the except block: the traceback and the tensors it holds are gone
    w.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    empty_cache(w.device)
    return None


def _warm_probe(w: Workload, meter, warmup: int) -> tuple[int, _Probe]:
    """Warm up, then the probe step; ckpt-auto first chooses its plan (see `momlab.moms.auto`)."""
    if w.handle is None or "ckpt-auto" not in w.mom.split("+"):
        _warm_up(w, warmup)
        return _probe_step(w, meter)
    return _plan_checkpoints(w, meter, warmup)


def _plan_checkpoints(w: Workload, meter, warmup: int) -> tuple[int, _Probe]:
    """ckpt-auto: the fewest blocks (by bytes saved per recompute FLOP) whose step measured to fit.

    Warm-up runs fully checkpointed (what fits if anything does) and leaves
    the optimizer state resident; an out-of-memory there or in the fully
    checkpointed probe is the answer, as for `ckpt`. Block costs come from
    one step with nothing checkpointed and the budget lifted; each trial of
    the search is one probe step under the budget, and the chosen plan's
    probe is the measured one. The plan goes into the record's options.
    """
    handle, n = w.handle, len(w.handle.blocks)
    capacity = meter.capacity
    if capacity is None:  # no budget on the emulated device: nothing to fit, nothing to checkpoint
        handle.checkpoint([])
        _warm_up(w, warmup)
        w.options["ckpt_plan"] = {"blocks": n, "checkpointed": [], "trials": []}
        return _probe_step(w, meter)
    handle.checkpoint(range(n))
    _warm_up(w, warmup)
    probes = {n: _probe_step(w, meter)}  # out of memory here: nothing fits (the record says so)
    plan = {"blocks": n}
    handle.checkpoint([])
    costs = auto.BlockCosts(handle.blocks, meter.live)

    def exact_step():
        with meter.unlimited(), costs:
            return _probe_step(w, meter)[0]

    exact_peak = _try(w, exact_step)
    if exact_peak is None:  # too big for the whole device: no costs; blocks in order, all of them first
        ranking, guess = list(range(n)), n
    else:
        ranking = auto.order(costs.saving, costs.flops)
        floor = probes[n][0]
        guess = next(k for k in range(n + 1)
                     if k == n or auto.predict_peak(ranking[:k], costs.saving, exact_peak, floor) <= capacity)
        plan.update(exact_peak_bytes=exact_peak, saving_bytes=costs.saving, recompute_flops=costs.flops)

    def fits(k: int) -> bool:
        if k not in probes:
            handle.checkpoint(ranking[:k])
            result = _try(w, lambda: _probe_step(w, meter))
            if result is None:
                return False
            probes[k] = result
        return True

    best, trials = auto.fewest(fits, guess, n)  # n fits (measured above): best is a number
    handle.checkpoint(ranking[:best])
    plan.update(order=ranking, predicted=guess, checkpointed=list(handle.checkpointed),
                trials=[list(t) for t in trials])
    w.options["ckpt_plan"] = plan
    return probes[best]


def _measure_emulated(base, dev, budget, steps, warmup, seed) -> Measurement:
    tracker = StorageTracker(budget=budget)
    w = None
    try:
        w = build(base["model"], batch_size=base["batch_size"], mom=base["mom"], device=dev.type,
                  precision=base["precision"], seed=seed, attention=base["attention"],
                  setup=base["setup"], **base["size"])
        with tracker:
            tracker.track(w.state_tensors()["params"])
            tracker.check_budget()
            peak, probe = _warm_probe(w, _EmulatedMeter(tracker), warmup)
        flops = _count_flops(w)
        times = _timed_steps(w, steps)
        return _breakdown(base, w, peak, unique_storage_bytes, probe, flops, times,
                          "cpu-emulated")
    except Exception as exc:  # noqa: BLE001 - only OOM is data; everything else propagates
        if not is_oom(exc):
            raise
        live = exc.live if isinstance(exc, OutOfMemory) else tracker.device_bytes
        error = str(exc).splitlines()[0]
        options = dict(w.options) if w is not None else {}
    # outside the except block: the traceback (and the tensors it holds) is gone
    w = None
    empty_cache(dev)
    return _unfit(base, live, error, "cpu-emulated", options)


def _measure_cuda(base, dev, budget, steps, warmup, seed) -> Measurement:
    mem = CudaMemory(dev, budget)
    empty_cache(dev)
    w = None
    try:
        with mem.capped():
            w = build(base["model"], batch_size=base["batch_size"], mom=base["mom"], device=dev.type,
                      precision=base["precision"], seed=seed, attention=base["attention"],
                      setup=base["setup"], **base["size"])
            # a tracker on the host side counts what a MOM keeps in host memory (swap)
            host = StorageTracker(devices=("cpu",))
            with host:
                peak, probe = _warm_probe(w, _CudaMeter(mem, host), warmup)
            flops = _count_flops(w)
            times = _timed_steps(w, steps)
        return _breakdown(base, w, peak, unique_storage_bytes, probe, flops, times, "cuda")
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        live = torch.cuda.memory_allocated(dev)
        error = str(exc).splitlines()[0]
        options = dict(w.options) if w is not None else {}
    w = None
    empty_cache(dev)
    return _unfit(base, live, error, "cuda", options)
