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

import dataclasses
import gc
import math
import statistics
from contextlib import contextmanager
from typing import Callable

import torch

from momlab.accounting import StorageTracker, unique_storage_bytes
from momlab.device import CudaMemory, empty_cache, host_limit, is_oom, oom_where, synchronize
from momlab.config import Config
from momlab.distributed import measure_ranks
from momlab.errors import OutOfMemory
from momlab.moms import auto
from momlab.provenance import environment
from momlab import steps as steps_
from momlab.record import Measurement
from momlab.usermodel import name_of
from momlab.workload import Workload, build


class _Probe:
    """Reads the device account at the end of forward and the end of backward."""

    def __init__(self, live, host, workload: Workload):
        self.live, self.host, self.w = live, host, workload
        self.forward_live = self.forward_host = self.grads_bytes = self.forward_grads = 0
        self.allocator: dict | None = None  # CUDA: the allocator's peaks of this step (`CudaMemory.peaks`)

    def forward_end(self):
        self.forward_live = self.live()
        self.forward_host = self.host()
        # gradients zeroed in place (not freed) are resident through forward: not activations
        self.forward_grads = unique_storage_bytes(self.w.state_tensors()["grads"])

    def backward_end(self):
        self.grads_bytes = unique_storage_bytes(self.w.state_tensors()["grads"])


def measure(model: str, mom: str = "exact", *, batch_size: int, device: str = "cpu", budget=None,
            precision: str = "fp32", steps: int = 3, warmup: int = 1, seed: int = 0, ranks: int = 1,
            parallel: str = "none", attention: str | None = None, setup: str = "default", **size) -> Measurement:
    """Measure one training configuration; see the module docstring and `Measurement`.

    `model`: a catalog name, a transformers config, or a `momlab.UserModel`
    (`momlab.usermodel`); the record names it by its name.

    `ranks` > 1 or a `parallel` strategy other than "none" (one of
    `momlab.distributed.PARALLEL`: ddp, fsdp, zero2, and fsdp/zero2 with
    "+offload") trains on that many ranks, one process each
    (`momlab.distributed.measure_distributed`): `batch_size` and `budget` are
    then per rank, the memory fields the maximum over ranks, and
    ``options["per_rank"]`` each rank's.

    >>> m = measure("bert-base", batch_size=2, **momlab.tiny("bert-base"))  # doctest: +SKIP
    >>> m.fits, m.peak_bytes > m.params_bytes
    (True, True)
    """
    c = Config.of(model, mom, batch_size=batch_size, device=device, budget=budget, precision=precision, steps=steps,
                  warmup=warmup, seed=seed, ranks=ranks, parallel=parallel, attention=attention,
                  setup=setup, **size)
    if c.distributed:
        return measure_ranks(c)
    dev = c.device
    # base["model"] is the resolved model (build takes it); records name it (_record)
    base = dict(model=c.model, mom=c.mom, batch_size=c.batch_size, device=dev.type, precision=c.precision,
                size=c.size, budget=c.budget, attention=c.attention, setup=c.setup, env=environment(dev))
    gc.collect()
    if dev.type == "cuda":
        return _measure_cuda(base, dev, c.budget, c.steps, c.warmup, c.seed)
    return _measure_emulated(base, dev, c.budget, c.steps, c.warmup, c.seed)


def _record(base: dict) -> dict:
    """The record's fields of `base`: the model by its name (a given model is an object)."""
    return {**base, "model": name_of(base["model"])}


def _unfit(base: dict, live: int, error: str, memory_source: str, options: dict | None = None) -> Measurement:
    """`error`'s out-of-memory as data; `options["oom"]` says whether device or host memory ran out."""
    nan = math.nan
    return Measurement(**_record(base), fits=False, peak_bytes=live, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
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
        **_record(base), fits=True, peak_bytes=peak, params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer,
        activation_bytes=activation, workspace_bytes=workspace, host_bytes=probe.forward_host,
        step_time_s=step_time, throughput=base["batch_size"] / step_time, flops=flops,
        memory_source=memory_source, step_times_s=tuple(times), options=dict(w.options),
    )


def count_flops(w: Workload, room=None) -> int:
    """FLOPs of one step of `w` (`momlab.steps.count_flops`)."""
    return steps_.count_flops(w.step, room)


def _warm_up(w: Workload, warmup: int) -> None:
    steps_.warm_up(w.step, w.optimizer, warmup)


def _timed_steps(w: Workload, steps: int) -> list[float]:
    return steps_.timed_steps(w.step, w.batch, w.device, steps)


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

    def allocator_peaks(self) -> None:
        return None  # no allocator behind the emulated device

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
        self.capacity = mem.capacity  # what the allocator may hold: the budget less the CUDA context

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

    def allocator_peaks(self) -> dict:
        return self.mem.peaks()

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
    # read here, with the step they belong to: ckpt-auto may run failing trials after its chosen one
    probe.allocator = meter.allocator_peaks()
    return meter.peak(), probe


def _try(w: Workload, run: Callable):
    """`run()`, or None if it ran out of memory (the step's partial state is dropped)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - only OOM is an answer here
        if not is_oom(exc):
            raise
    # outside the except block: the traceback and the tensors it holds are gone
    w.recover()
    gc.collect()
    empty_cache(w.device)
    return None


def _warm_probe(w: Workload, meter, warmup: int) -> tuple[int, _Probe]:
    """Warm up, then the probe step; ckpt-auto first chooses its plan (see `momlab.moms.auto`)."""
    if w.handle is None or not w.mom.has("ckpt-auto"):
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


def _oom_record(base, exc, live: int, w, memory_source: str) -> Measurement:
    options = dict(w.options) if w is not None else {}
    options["oom"] = oom_where(exc)
    return _unfit(base, live, str(exc).splitlines()[0], memory_source, options)


def _measure_emulated(base, dev, budget, steps, warmup, seed) -> Measurement:
    tracker = StorageTracker(budget=budget, host_budget=host_limit())
    w = None
    try:
        w = build(base["model"], batch_size=base["batch_size"], mom=base["mom"], device=dev.type,
                  precision=base["precision"], seed=seed, attention=base["attention"],
                  setup=base["setup"], **base["size"])
        with tracker:
            tracker.track(w.state_tensors()["params"])
            tracker.check_budget()
            peak, probe = _warm_probe(w, _EmulatedMeter(tracker), warmup)
        flops = count_flops(w)
        times = _timed_steps(w, steps)
        _record_compile(w)
        return _breakdown(base, w, peak, unique_storage_bytes, probe, flops, times,
                          "cpu-emulated")
    except Exception as exc:  # noqa: BLE001 - only OOM is data; everything else propagates
        if not is_oom(exc):
            raise
        live = exc.live if isinstance(exc, OutOfMemory) and oom_where(exc) == "device" else tracker.device_bytes
        record = _oom_record(base, exc, live, w, "cpu-emulated")
    # outside the except block: the traceback (and the tensors it holds) is gone
    w = None
    empty_cache(dev)
    return record


def _record_compile(w: Workload) -> None:
    """Quantization's torch.compile state into the record (a GPU run must show it compiled)."""
    state = w.handle.compile_state() if w.handle is not None else None
    if state:
        w.options["quant_compile"] = state


def _measure_cuda(base, dev, budget, steps, warmup, seed) -> Measurement:
    empty_cache(dev)
    mem = CudaMemory(dev, budget)
    w = None
    try:
        with mem.capped():
            w = build(base["model"], batch_size=base["batch_size"], mom=base["mom"], device=dev.type,
                      precision=base["precision"], seed=seed, attention=base["attention"],
                      setup=base["setup"], **base["size"])
            # a tracker on the host side counts what a MOM keeps in host memory (swap), bounded by the host
            host = StorageTracker(devices=("cpu",), host_budget=host_limit())
            with host:
                peak, probe = _warm_probe(w, _CudaMeter(mem, host), warmup)
            peaks = probe.allocator
            flops = count_flops(w, mem.uncapped())
            before = mem.events()
            times = _timed_steps(w, steps)
            after = mem.events()
        _record_compile(w)
        w.options["cuda_memory"] = peaks
        # what the timed steps asked of the driver, per step (the first after FLOP counting may start on an
        # emptied cache under a budget)
        w.options["cuda_allocator_events"] = {k: (after[k] - before[k]) / max(1, steps) for k in after}
        m = _breakdown(base, w, peak, unique_storage_bytes, probe, flops, times, "cuda")
        return dataclasses.replace(m, active_peak_bytes=peaks["active"], reserved_peak_bytes=peaks["reserved"])
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        record = _oom_record(base, exc, torch.cuda.memory_allocated(dev), w, "cuda")
    w = None
    empty_cache(dev)
    return record
