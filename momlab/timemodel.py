"""The time model with its calibration: a traced step's ops -> predicted seconds on a device.

Time is a roofline per operation (Paleo, Qi et al. 2017, with the graph
traced rather than described by hand). On a GPU each op's kernel takes

    max(flops / (peak FLOP/s of its format * compute efficiency of the format),
        bytes read and written / (memory bandwidth * memory efficiency)) + kernel overhead

(the overhead: the device time of starting and draining any kernel, a few
microseconds however small its work), and the host spends a launch cost
issuing it. Eager PyTorch issues kernels
asynchronously from one host thread: the GPU runs a kernel once it is issued
and the one before it has ended (`queue_ends`), so the host's time hides
behind long kernels and short kernels wait for the host. A step of small ops
takes its ops times the launch cost, a step of big ones the sum of its
kernels, a mix less than the sum of per-op maxima. The host waits for the GPU
where the step reads a value back: fp16's loss scaling checks for overflow
before the optimizer (`SYNC_PRECISIONS`), whose ops then start on an empty
queue. A measured time covers the step, or what its script timed (`WINDOWS`).

The free parameters (compute efficiency of fp32 matmuls, of fp32 convolutions, of
half-precision tensor cores; memory efficiency; launch cost; kernel overhead) are fitted per
device from *Exact* runs only (`calibrate`): momlab's own records of the
device, and for the paper's V100 its Exact throughput curves
(momlab/reference). MOM runs never enter a fit: their cost is what the model
must predict, from first principles on top of the fitted device:

- recomputation (ckpt, ckpt-selective) is ops of the traced step like any other;
- quantization's encode and decode are one compiled kernel each on CUDA
  (torch.compile): the trace marks their ops as a group, costed as one kernel
  moving the group's inputs and outputs at memory bandwidth (plus a launch);
  the ops around them (casts, the rounding noise, copies) stay ops. The paper's
  stack ran GACT's CUDA kernels (`Stack.quantizer`): there every op of a pack
  or unpack is in a group, one per GACT kernel, with the bytes it moves
  (`momlab.moms.quant.gact_traffic`) and the SM cycles its instructions take
  (`momlab.moms.quant.gact_cycles`): such a kernel takes the longer of its
  bytes at the fitted bandwidth and its cycles at the GPU's multiprocessors
  times clock (`Gpu.sm_clock_hz`; nothing fitted: GACT sets up Philox noise
  and 64-bit indices per thread, and on every catalog GPU its pack and unpack
  are bound by their instructions, not their bytes);
- swap's copies move the host bytes each way at the link's effective pinned
  bandwidth (`Gpu.pinned_bandwidth`); how they share the GPU with compute is
  the swap implementation's (`SWAP_SCHEDULES`, `swap_phases`). momlab's swap
  copies on side streams, device-to-host beside forward compute and the
  prefetches beside backward compute: each phase takes ``max(its compute,
  its copies)``. The paper's (GACT) issues its copies on the compute stream,
  where they add to it. The optimizer step comes after them;
- combinations are these parts applied to the combination's own trace.

Without records of a device, defaults are used and the estimate says
``calibrated=False``. On `cpu` (this machine), one thing runs at a time: the
ops' times and per-op costs add, and swap copies are ops of the trace.

A step here is anything with the per-op arrays of `momlab.estimate.Probe`
(``flops``, ``extra_flops``, ``bytes``, ``fmt``, ``group``, ``group_bytes``, ``group_cycles``),
its phase boundaries (``forward_ops``, ``backward_ops``) and ``host_bytes``; the
traces themselves come from momlab.estimate, which hands its tracer in
(``trace=``) where a calibration needs the steps of measured records.
"""

from __future__ import annotations

import glob
import math
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from momlab.errors import check_choice
from momlab.gpus import DEFAULT_EFFICIENCY, Gpu
from momlab.gpus import get as get_gpu

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"

_LOCK = threading.RLock()  # the calibration cache; a calibration traces, the tracer keeps its own lock


# the free parameters of a GPU: compute efficiency of fp32 matmuls (plain CUDA cores), fp32 convolutions,
# half-precision (bf16/fp16) tensor cores; memory efficiency; seconds of host time per op; seconds of device time
# every kernel takes beyond its roofline time (its start and drain on the GPU)
PARAMS = ("fp32", "conv32", "half", "memory", "launch", "kernel")
# the compute efficiency applying to each number format of the trace (estimate's FMT_* order)
_FMT_PARAM = ("fp32", "conv32", "half", "half")
# a parameter is fitted only where the records spend at least this share of their time in what it governs;
# otherwise the records say nothing about it and it keeps its default
_MIN_SHARE = 0.02
# the seconds-valued parameters' physical range: host time per op, device time per kernel beyond its roofline
_BOUNDS = {"launch": (1e-7, 1e-3), "kernel": (1e-8, 2e-5)}
# fewer Exact records than this: one common scale of every cost is fitted (6 free parameters need more)
_MIN_FULL_FIT = 6


# -- time ------------------------------------------------------------------------------------

def _peaks(gpu: Gpu, tf32: bool) -> np.ndarray:
    """Peak FLOP/s indexed by FMT_*: fp32 matmul, fp32 convolution, bf16, fp16."""
    fp32 = gpu.peak("fp32")
    t32 = gpu.peak("tf32")
    # PyTorch's defaults: cuDNN convolutions may use tf32, matmuls only with allow_tf32 (our `tf32`)
    conv = t32 if (t32 and gpu.kernels == "cuda") else fp32
    mm = t32 if (tf32 and t32) else fp32
    return np.array([mm, conv, gpu.peak("bf16") or fp32, gpu.peak("fp16") or fp32], dtype=np.float64)


@dataclass(frozen=True)
class StepTime:
    """Predicted step time and its parts (seconds).

    ``forward_s``, ``backward_s``, ``optimizer_s``: the ops of each phase
    (fused quantization kernels included, swap copies not); ``transfer_s``:
    both directions of swap's copies at the link's pinned bandwidth;
    ``exposed_transfer_s``: the part of them compute did not hide;
    ``window``: what ``step_time_s`` covers (`WINDOWS`); ``busy_s``: the
    seconds the GPU runs kernels in the whole step (every phase, whatever the
    window), so `gpu_utilization` is what nvidia-smi's utilization samples.
    """

    step_time_s: float
    ideal_s: float  # sum over ops of the roofline time, at 100% efficiency
    compute_bound_s: float  # part of ideal_s in ops limited by FLOP/s
    memory_bound_s: float  # part of ideal_s in ops limited by bandwidth
    launch_s: float  # op count times the per-op launch cost
    transfer_s: float  # swap traffic over the host link
    ops: int
    bytes_moved: float = 0.0  # bytes the ops that run a kernel read and write
    overhead_s: float = 0.0  # kernel count times each kernel's device overhead (GPU only; in the kernels' times)
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    fused_s: float = 0.0  # quantization's encode/decode kernels
    exposed_transfer_s: float = 0.0
    window: str = "step"
    busy_s: float = 0.0  # GPU only: the kernels' device seconds over the whole step (swap copies not)

    @property
    def gpu_utilization(self) -> float:
        """The share of the whole step (every phase, whatever the window) in which a kernel runs on the GPU:
        nvidia-smi's utilization of a training loop. NaN on a CPU."""
        wall = self.step_time_s + (self.optimizer_s if self.window == "forward-backward" else 0.0)
        return self.busy_s / wall if self.busy_s > 0 and wall > 0 else math.nan


# aten ops a trace logs that run no kernel on any device: `_unsafe_view` (the view that reshape and matmul take of
# a fresh result; its schema declares no alias, so the trace logs it, where every other view is left out),
# `as_strided_` (new sizes and strides on the same storage) and the allocations without values (the caching
# allocator hands out a block, no kernel writes it). They cost neither bytes, nor a kernel, nor a launch.
NO_KERNEL = frozenset({"aten._unsafe_view.default", "aten.as_strided_.default", "aten.empty.memory_format",
                       "aten.empty_strided.default", "aten.empty_like.default", "aten.new_empty.default",
                       "aten.new_empty_strided.default", "aten.lift_fresh.default"})


# a trace's ops as ids (``Probe.ops``): aten op name -> id, numbered in the order this process first meets them
# (momlab.estimate's tracer numbers them; its traces on disk keep the names)
OP_IDS: dict = {}


def _launched(p) -> np.ndarray:
    """Per op of trace `p`, whether it runs a kernel (not one of `NO_KERNEL`); every op of a trace without op
    ids (a hand-built one)."""
    ops = getattr(p, "ops", None)
    if ops is None or len(ops) != len(p.flops):
        return np.ones(len(p.flops), dtype=bool)
    return ~np.isin(ops, [i for name, i in list(OP_IDS.items()) if name in NO_KERNEL])


def _roofline(p, gpu, tf32: bool, run: np.ndarray | None = None):
    """Per op, seconds at the peak FLOP/s of its format and at the peak bandwidth (0 for an op `run` (default
    `_launched`) says runs no kernel)."""
    peaks = _peaks(gpu, tf32)
    run = _launched(p) if run is None else run
    compute = np.where(run, (p.flops + p.extra_flops) / peaks[p.fmt.astype(np.int64)], 0.0)
    memory = np.where(run, p.bytes / gpu.memory_bandwidth, 0.0)
    return compute, memory


def _compute_eff(cal: "Calibration") -> np.ndarray:
    return np.array([cal.compute_efficiency[k] for k in _FMT_PARAM], dtype=np.float64)


def _fused(p) -> np.ndarray | None:
    """Per op of trace `p`, the fused quantization kernel it belongs to (-1: none), or None without any."""
    group = getattr(p, "group", None)
    return group if group is not None and len(group) and (group >= 0).any() else None


def _kernels(p, gpu: Gpu, cal: "Calibration", tf32: bool = False,
             run: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Device seconds of each op's kernel (a fused kernel's time on its first op, its other ops 0), host
    seconds to issue each op (a fused kernel is one launch; an op `run` says runs no kernel, none), and the
    fused kernels' total."""
    run = _launched(p) if run is None else run
    compute, memory = _roofline(p, gpu, tf32, run)
    overhead = cal.kernel_s if gpu.kernels == "cuda" else 0.0  # a CPU op's fixed cost is its launch
    k = np.maximum(compute / _compute_eff(cal)[p.fmt.astype(np.int64)], memory / cal.memory_efficiency) + overhead * run
    h = cal.launch_s * run
    fused = 0.0
    group = _fused(p)
    if gpu.kernels == "cuda" and group is not None:  # compiled on CUDA only
        inside = group >= 0
        ids, first = np.unique(group[inside], return_index=True)
        first = np.flatnonzero(inside)[first]
        kernel = p.group_bytes[ids] / (gpu.memory_bandwidth * cal.memory_efficiency)
        cycles = getattr(p, "group_cycles", None)
        if cycles is not None and gpu.sm_clock_hz > 0:  # an instruction-bound kernel (GACT's): its cycles
            kernel = np.maximum(kernel, cycles[ids] / gpu.sm_clock_hz)
        kernel = kernel + overhead
        k = np.where(inside, 0.0, k)
        h = np.where(inside, 0.0, h)
        k[first] = kernel
        h[first] = cal.launch_s
        fused = float(kernel.sum())
    return k, h, fused


def queue_ends(kernel_s: np.ndarray, host_s: np.ndarray, starts=None) -> np.ndarray:
    """When each op's kernel ends on a GPU fed asynchronously by one host thread (seconds from the start).

    The host issues the ops one after another, `host_s` each; the GPU runs
    each kernel once it is issued and the one before it has ended:
    ``end[i] = max(end[i-1], issued[i]) + kernel[i]``, in closed form
    ``end[i] = S[i] + max over j <= i of (issued[j] - S[j-1])`` with ``S`` the
    running sum of kernel times. A step of long kernels takes their sum (the
    host runs ahead), one of short kernels the host's time (the GPU waits),
    and a mix of both less than the sum of per-op maxima. `starts`: indices
    where a new queue begins, empty, with the host starting afresh (the host
    waited for the GPU there, or another step begins); each queue's ends count
    from its own start.

    >>> queue_ends(np.array([1.0, 1.0, 0.1, 0.1]), np.array([0.5, 0.5, 0.5, 0.5])).tolist()
    [1.5, 2.5, 2.6, 2.7]
    >>> queue_ends(np.array([0.25, 0.25, 0.25]), np.array([1.0, 1.0, 1.0])).tolist()
    [1.25, 2.25, 3.25]
    >>> queue_ends(np.array([1.0, 1.0, 0.25, 0.25]), np.array([0.5, 0.5, 0.5, 0.5]), starts=[0, 2]).tolist()
    [1.5, 2.5, 0.75, 1.25]
    """
    s = np.cumsum(kernel_s)
    issued = np.cumsum(host_s)
    v = issued - (s - kernel_s)
    if starts is None or len(starts) <= 1:
        return s + np.maximum.accumulate(v)
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.diff(np.append(starts, len(s)))
    # each queue's origin: the host's and the GPU's time before it
    origin_issued = np.repeat(issued[starts] - host_s[starts], lengths)
    origin_s = np.repeat(s[starts] - kernel_s[starts], lengths)
    v = v - origin_issued + origin_s
    # one running maximum over all queues, each kept out of the next by an offset larger than any of them
    big = 2.0 * float(np.abs(v).max()) + 1.0
    off = np.repeat(np.arange(len(starts)) * big, lengths)
    return (s - origin_s) + np.maximum.accumulate(v + off) - off


def op_seconds(p, gpu: Gpu, cal: "Calibration", *, tf32: bool = False,
               sync: int | None = None) -> tuple[np.ndarray, float]:
    """Seconds each op adds to the step on `gpu` (the increments of `queue_ends` on a GPU, the host waiting
    for the GPU before op `sync` when given; kernel plus issue time on a CPU, which does one thing at a time)
    and the fused kernels' total."""
    k, h, fused = _kernels(p, gpu, cal, tf32)
    return _added(k, h, gpu, sync), fused


def _added(k: np.ndarray, h: np.ndarray, gpu: Gpu, sync: int | None) -> np.ndarray:
    """`op_seconds` from the ops' kernel and host seconds (`_kernels`)."""
    if gpu.kernels != "cuda":
        return k
    starts = [0, sync] if sync is not None and 0 < sync < len(k) else [0]
    ends = queue_ends(k, h, starts)
    added = np.diff(ends, prepend=0.0)
    added[starts] = ends[starts]  # a queue's first op adds its own end
    return added


# How swap's copies share the GPU with compute (`step_time`'s `swap`), per implementation:
# "overlap": momlab's swap (momlab/moms/swap.py): side streams, device-to-host beside forward compute, the
#   prefetches beside backward compute (`swap_overlap`);
# "serial": the paper's vanilla swap (GACT-ICML gact/controller.py, level "swap"): each saved tensor is copied
#   with `copy_(non_blocking=True)` on the compute stream in forward and `.cuda(non_blocking=True)` on it when
#   backward unpacks it, no prefetch: both directions add to compute;
# "serial-forward": the paper's quantize+swap (gact/quantizer.py, level "L4bit-swap"): the device-to-host copy
#   is issued on the compute stream (its side-stream lines are commented out), the copies back are prefetched
#   one tensor ahead on a side stream: forward's copies add to compute, backward's overlap it.
SWAP_SCHEDULES = ("overlap", "serial", "serial-forward")

# precisions whose step makes the host wait for the GPU before the optimizer: fp16's loss scaling reads whether
# any gradient overflowed (torch.amp.GradScaler.step: ``found_inf.item()``; apex amp and fairseq's FP16Optimizer
# do the same) before it may step
SYNC_PRECISIONS = ("fp16",)

# what a measured step time covers: the whole step, or (a training script that stops its timer after
# ``loss.backward()``, as the paper's BERT script does) forward and backward only
WINDOWS = ("step", "forward-backward")


def swap_phases(forward_s: float, backward_s: float, copy_s: float,
                schedule: str = "overlap", backward_copy_s: float = 0.0) -> tuple[float, float]:
    """Forward and backward phase times with swap's copies of `copy_s` seconds per direction, under a
    `SWAP_SCHEDULES` schedule; `backward_copy_s`: seconds per direction of tensors swapped out *and back*
    within backward (a reentrant checkpoint's recomputation under hooks that stay on, `Probe.backward_host`),
    issued where the forward's copies out are and brought back as the forward's are.

    >>> swap_phases(1.0, 2.0, 1.5, "serial-forward")
    (2.5, 2.0)
    >>> swap_phases(1.0, 2.0, 1.5, "serial")
    (2.5, 3.5)
    >>> swap_phases(1.0, 2.0, 1.5, "serial", backward_copy_s=0.5)
    (2.5, 4.5)
    """
    check_choice("swap schedule", schedule, SWAP_SCHEDULES)
    extra = backward_copy_s
    if schedule == "overlap":  # side streams: every copy of backward beside its compute
        return max(forward_s, copy_s), max(backward_s, copy_s + 2 * extra)
    if schedule == "serial":  # both directions on the compute stream
        return forward_s + copy_s, backward_s + copy_s + 2 * extra
    # serial-forward: copies out on the compute stream, copies back prefetched beside it
    return forward_s + copy_s, max(backward_s + extra, copy_s + extra)


def swap_overlap(forward_s: float, backward_s: float, copy_s: float) -> tuple[float, float]:
    """Forward and backward phase times with swap's copies of `copy_s` seconds per direction.

    Device-to-host copies start as forward produces each tensor and run
    beside forward compute only (backward needs them all on the host first:
    they cannot hide behind it); host-to-device prefetches run beside
    backward compute only (nothing is left to fetch before backward starts).
    A phase lasts as long as the longer of its compute and its copies.

    >>> swap_overlap(1.0, 2.0, 1.5)
    (1.5, 2.0)
    """
    return max(forward_s, copy_s), max(backward_s, copy_s)


def step_time(p, gpu: Gpu, cal: "Calibration", *, tf32: bool = False, swap: str = "overlap",
              sync: bool = False, window: str = "step") -> StepTime:
    """The predicted step of trace `p` on `gpu` (module docstring); `swap`: how its swap copies share the GPU
    with compute (`SWAP_SCHEDULES`); `sync`: the host waits for the GPU before the optimizer step (loss
    scaling's check for overflow, `SYNC_PRECISIONS`), so the optimizer's ops start on an empty queue;
    `window`: what ``step_time_s`` covers (`WINDOWS`; "forward-backward" leaves the optimizer's time out of it,
    ``optimizer_s`` still says what it would take)."""
    check_choice("swap schedule", swap, SWAP_SCHEDULES)
    check_choice("timed window", window, WINDOWS)
    run = _launched(p)  # once: every part below reads it
    compute, memory = _roofline(p, gpu, tf32, run)
    per_op = np.maximum(compute, memory)
    ideal = float(per_op.sum())
    n = len(per_op)
    launched = int(run.sum())
    parts = dict(ideal_s=ideal, compute_bound_s=float(per_op[compute >= memory].sum()),
                 memory_bound_s=float(per_op[compute < memory].sum()), launch_s=launched * cal.launch_s,
                 ops=launched, bytes_moved=float(p.bytes[run].sum()))
    if gpu.kernels == "cuda":  # a fused quantization kernel's ops are one kernel
        group = _fused(p)
        kernels = launched if group is None else int(((group < 0) & run).sum()) + len(np.unique(group[group >= 0]))
        parts["overhead_s"] = kernels * cal.kernel_s
    fwd_n, bwd_n = getattr(p, "forward_ops", 0), getattr(p, "backward_ops", 0)
    if not 0 < fwd_n <= bwd_n <= n:  # phases unknown (a trace from before they were recorded): one phase
        fwd_n = bwd_n = n
    k, h, fused = _kernels(p, gpu, cal, tf32, run)
    t = _added(k, h, gpu, bwd_n if sync else None)
    fwd, bwd, opt = float(t[:fwd_n].sum()), float(t[fwd_n:bwd_n].sum()), float(t[bwd_n:].sum())
    if gpu.kernels != "cuda":  # a CPU does one thing at a time (swap copies are ops of the trace here)
        # each op in the window pays its launch; the optimizer's only when the window covers it
        timed, timed_ops = (opt, launched) if window == "step" else (0.0, int(run[:bwd_n].sum()))
        total = fwd + bwd + timed + timed_ops * cal.launch_s
        return StepTime(total, **parts, transfer_s=0.0, forward_s=fwd, backward_s=bwd, optimizer_s=opt,
                        window=window)
    copy = p.host_bytes / gpu.pinned_bandwidth
    again = getattr(p, "backward_host", 0) / gpu.pinned_bandwidth
    busy = float(k.sum())
    if fwd_n == bwd_n == n:
        f, b = (max(fwd, 2 * (copy + again)) if swap == "overlap" else fwd + 2 * (copy + again)), 0.0
    else:
        f, b = swap_phases(fwd, bwd, copy, swap, again)
    timed = opt if window == "step" else 0.0
    total = f + b + timed
    return StepTime(total, **parts, transfer_s=2 * (copy + again), forward_s=fwd, backward_s=bwd, optimizer_s=opt,
                    fused_s=fused, exposed_transfer_s=total - (fwd + bwd + timed), window=window, busy_s=busy)


# -- calibration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """A device's fitted time-model parameters, and where they come from.

    ``compute_efficiency`` (per `PARAMS` format: fp32, conv32, half) and
    ``memory_efficiency``: the fraction of the datasheet peak reached;
    ``launch_s``: host seconds per op; ``kernel_s``: device seconds every
    kernel takes beyond its roofline time. ``efficiency``: the compute efficiency
    of the format the records spent most time in (a one-number summary).
    ``calibrated``: fitted from Exact measurements of this device
    (``source`` says which files, ``fitted_on`` which configurations,
    ``fitted`` which parameters they determined; the others kept defaults);
    False: defaults. ``residuals``: (predicted - measured) / measured per
    record of ``fitted_on``; ``error``: their median absolute value;
    ``curves``: the curve each of them belongs to in the fit.
    """

    gpu: str
    efficiency: float
    launch_s: float
    calibrated: bool
    source: str
    records: int = 0
    error: float = math.nan
    compute_efficiency: dict = field(default_factory=dict)
    memory_efficiency: float = DEFAULT_EFFICIENCY
    fitted: tuple = ()
    fitted_on: tuple = ()
    residuals: tuple = ()
    kernel_s: float = 0.0
    curves: tuple = ()  # per record of ``fitted_on``, the curve it weighed in (`fit_gpu`'s ``groups``)

    def params(self) -> dict:
        return {**self.compute_efficiency, "memory": self.memory_efficiency, "launch": self.launch_s,
                "kernel": self.kernel_s}

    def describe(self) -> str:
        """Where the step times come from, in one line (what-if shows it under its figure)."""
        if not self.calibrated:
            return self.source
        fitted = ", ".join(f"{k} {self.params()[k] * 1e6:.1f} us" if k in _BOUNDS else f"{k} {self.params()[k]:.3g}"
                           for k in self.fitted if k in self.params())
        return (f"calibrated on {self.source}; fitted {fitted or ', '.join(self.fitted)}; "
                f"median fit error {self.error:.0%}")


def default_calibration(g: Gpu, source: str | None = None) -> Calibration:
    """The uncalibrated parameters of `g`: `DEFAULT_EFFICIENCY` everywhere, the catalog's launch cost."""
    return Calibration(g.name, DEFAULT_EFFICIENCY, g.launch_s, False,
                       source or f"uncalibrated: no measured Exact records of this device (default efficiency "
                                 f"{DEFAULT_EFFICIENCY}, {g.kernel_s * 1e6:g} us a kernel)",
                       compute_efficiency={k: DEFAULT_EFFICIENCY for k in PARAMS[:3]},
                       memory_efficiency=DEFAULT_EFFICIENCY, kernel_s=g.kernel_s)


def _with_params(g: Gpu, params: dict, **kw) -> Calibration:
    comp = {k: float(params[k]) for k in PARAMS[:3]}
    return Calibration(g.name, kw.pop("efficiency", comp["fp32"]), float(params["launch"]), True,
                       compute_efficiency=comp, memory_efficiency=float(params["memory"]),
                       kernel_s=float(params.get("kernel", 0.0)), **kw)


_CALIBRATIONS: dict[tuple, Calibration] = {}

# the quick calibration of `cpu`: one tiny step (launch-bound) and one small one (compute-bound)
QUICK_CPU = (("bert-base", {"num_layers": 2, "hidden_size": 64, "num_heads": 2, "seq_len": 32}, 4),
             ("bert-base", {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}, 8))


def _result_files(results) -> list[str]:
    if results is None:
        return sorted(glob.glob(str(RESULTS / "*.jsonl")))
    if isinstance(results, (str, os.PathLike)):
        p = Path(results)
        return sorted(glob.glob(str(p / "*.jsonl"))) if p.is_dir() else [str(p)]
    return [str(p) for p in results]


def _records_of(gpu_name: str, files: list[str]) -> list[dict]:
    """The Exact records of the device in `files` that fitted and were timed (one per configuration)."""
    from momlab.catalog import models
    from momlab.results import read_records

    gpu = get_gpu(gpu_name)
    device = "cpu" if gpu_name == "cpu" else "cuda"
    catalog = set(models())
    out, seen = [], set()
    for path in files:
        for rec in read_records(path):
            env = rec.get("env") or {}
            if env.get("device") != device or not gpu.matches(env.get("device_name")):
                continue
            if gpu_name == "cpu" and env.get("threads") not in (None, torch.get_num_threads()):
                continue
            if rec.get("mom") != "exact":  # a MOM's time is what the model predicts, never what it is fitted to
                continue
            if rec.get("model") not in catalog:  # a user's module or a transformers config, stored by its name:
                continue                          # nothing to trace it again from
            t = rec.get("step_time_s")
            if not rec.get("fits") or t is None or not math.isfinite(t) or t <= 0:
                continue
            key = (rec["model"], rec["mom"], rec["precision"], tuple(sorted((rec.get("size") or {}).items())),
                   rec["batch_size"])
            if key not in seen:  # the first record of a configuration (a sweep records each once)
                seen.add(key)
                out.append({**rec, "_from": _short(path)})
    return out


# the paper's scaling study `momlab.validation` checks (S2', `validation.depth_curves`): its Exact runs calibrate
PAPER_DEPTH_STUDY = "bert-large"


def reference_records(gpu_name: str) -> list[dict]:
    """The paper's Exact runs on one GPU (momlab/reference) as records of `gpu_name`, when it is that GPU.

    The Exact runs of every study `momlab.validation` checks, each timed
    batch size of each: the paper's S1 sweeps at its precision and default
    size, its sweeps at another precision (`momlab.reference.OTHER_PRECISIONS`:
    BERT-L in fp32, the only fp32 matmul curve it has), and its BERT-L depth
    study (`PAPER_DEPTH_STUDY`, 2 to 42 layers; one curve in the fit, as one
    model's many runs must not set the parameters of all). Traced
    with the paper's software stack (``setup="paper"``,
    `momlab.workload.stack`). Every MOM row is left out: those are the test.
    Its other scaling studies (width, ResNet depth) are checked by nothing
    and stay out (their traces would cost minutes a calibration).
    """
    import pandas as pd

    from momlab import catalog, reference
    from momlab.workload import stack

    g = get_gpu(gpu_name)
    if not g.matches(reference.GPU):
        return []
    other = [reference.paper_s1_runs(precision=p).query("model == @model") for model, p in reference.other_sweeps()]
    runs = pd.concat([reference.paper_s1_runs(), *other], ignore_index=True)
    runs = runs[(runs["mom"] == "exact") & runs["fits"] & runs["throughput"].notna()]
    depth = reference.paper_scaling_runs("num_layers", PAPER_DEPTH_STUDY)
    depth = depth[(depth["mom"] == "exact") & depth["fits"] & depth["throughput"].notna()]
    out = []
    for r, size, study in [*((r, {}, "") for r in runs.to_dict("records")),
                           *((r, {"num_layers": int(r["size.num_layers"])}, " depth study")
                             for r in depth.to_dict("records"))]:
        if r["model"] not in catalog.models():
            continue
        bs = int(r["batch_size"])
        out.append({"model": r["model"], "mom": "exact", "precision": r["precision"], "size": size, "batch_size": bs,
                    "setup": "paper", "window": stack(r["model"], "paper").timed,
                    "step_time_s": bs / float(r["throughput"]), "_from": f"paper {reference.GPU} ({r['source']})",
                    "_curve": f"{r['model']} {r['precision']}{study}"})  # the depth study weighs as one model
    return out


def _pick(records: list[dict], n: int) -> list[dict]:
    """Up to `n` records spread over the range of work (cheapest configurations first among ties)."""
    records = sorted(records, key=lambda r: (r.get("flops") or 0, r["batch_size"]))
    if len(records) <= n:
        return records
    idx = np.unique(np.linspace(0, len(records) - 1, n).round().astype(int))
    return [records[i] for i in idx]


def _fit(gpu: Gpu, points: list[tuple[float, int, float]], name: str, source: str) -> Calibration:
    """`cpu`: fit one efficiency and the per-op cost to (ideal_s, ops, measured_s) points."""
    ideal = np.array([p[0] for p in points])
    ops = np.array([p[1] for p in points], dtype=np.float64)
    measured = np.array([p[2] for p in points])
    if len(points) >= 2 and np.ptp(ideal / ops) > 0:
        # measured = ideal / eff + ops * launch: least squares on the relative error, both terms >= 0
        A = np.stack([ideal, ops], axis=1) / measured[:, None]
        (k, launch), *_ = np.linalg.lstsq(A, np.ones_like(measured), rcond=None)
        if k <= 0 or launch < 0:
            k, launch = float(np.median(measured / ideal)), 0.0
    else:
        launch = gpu.launch_s
        k = float(np.median((measured - ops * launch) / ideal))
    k = max(k, 1e-3)
    pred = ideal * k + ops * launch
    res = (pred - measured) / measured
    eff = 1.0 / k
    return Calibration(name, eff, float(launch), True, source, len(points), float(np.median(np.abs(res))),
                       compute_efficiency={p: eff for p in PARAMS[:3]}, memory_efficiency=eff,
                       fitted=("efficiency", "launch"), residuals=tuple(float(r) for r in res))


class _Points:
    """Exact records as one long op array, for a fast vectorized prediction of all their step times
    (`queue_ends` of every record at once; Exact steps have no fused kernels)."""

    def __init__(self, probes, measured, gpu: Gpu, syncs=None, windows=None):
        comp, mem, fmt, lengths, record, run = [], [], [], [], [], []
        for i, p in enumerate(probes):
            if _fused(p) is not None:
                raise ValueError("a calibration record must be an Exact step (this one has fused quantization "
                                 "kernels): MOM runs are what the model predicts, never what it is fitted to")
            r = _launched(p)
            c, m = _roofline(p, gpu, False, r)
            n, cut = len(c), getattr(p, "backward_ops", 0)
            if windows is not None and windows[i] == "forward-backward" and 0 < cut < n:  # its optimizer untimed
                n = cut
            comp.append(c[:n])
            mem.append(m[:n])
            run.append(r[:n])
            fmt.append(p.fmt[:n].astype(np.int64))
            # a record is one queue, or two when the host waits for the GPU before the optimizer step
            parts = [cut, n - cut] if syncs is not None and syncs[i] and 0 < cut < n else [n]
            lengths += parts
            record += [i] * len(parts)
        self.compute, self.memory, self.fmt = np.concatenate(comp), np.concatenate(mem), np.concatenate(fmt)
        self.run = np.concatenate(run).astype(np.float64)  # 1 for an op that runs a kernel, 0 for `NO_KERNEL`'s
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.ends = np.cumsum(lengths) - 1
        self.record_starts = np.flatnonzero(np.diff(np.asarray(record), prepend=-1))  # first queue of each record
        self.measured = np.asarray(measured, dtype=np.float64)

    def predict(self, params: dict, scale: float = 1.0) -> np.ndarray:
        """Each record's step: the sum of `queue_ends` over its queues, every queue of every record at once."""
        eff = np.array([params[k] for k in _FMT_PARAM])
        k = np.maximum(self.compute / eff[self.fmt], self.memory / params["memory"]) + params["kernel"] * self.run
        ends = queue_ends(k, params["launch"] * self.run, self.starts)
        return scale * np.add.reduceat(ends[self.ends], self.record_starts)

    def shares(self, params: dict) -> dict:
        """The share of the records' predicted kernel and issue time each parameter governs."""
        eff = np.array([params[k] for k in _FMT_PARAM])
        c, m = self.compute / eff[self.fmt], self.memory / params["memory"]
        k = np.maximum(c, m) + params["kernel"] * self.run
        host = params["launch"] * self.run.sum()
        total = k.sum() + host
        out = {name: 0.0 for name in PARAMS}
        for f, name in enumerate(_FMT_PARAM):
            out[name] += float(k[(c >= m) & (self.fmt == f)].sum() / total)
        out["memory"] = float(k[c < m].sum() / total)
        out["launch"] = float(host / total)
        out["kernel"] = float(params["kernel"] * self.run.sum() / total)
        return out


def _nelder_mead(f, x0: np.ndarray, step: float = 0.5, iters: int = 600, tol: float = 1e-10) -> np.ndarray:
    """Minimize `f` from `x0` (Nelder and Mead, 1965; numpy has no optimizer and scipy is not a dependency)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink toward the best
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit_gpu(g: Gpu, probes, measured, labels=(), source: str = "", syncs=None, windows=None,
            groups=None) -> Calibration:
    """Fit `PARAMS` of GPU `g` to Exact steps `probes` that took `measured` seconds (least squares in log time).

    Efficiencies stay in (0, 1] (no kernel beats the datasheet peak) and the
    launch cost in [0.1 us, 1 ms]. A parameter the records barely exercise
    (under `_MIN_SHARE` of their time) keeps its default; with fewer than
    `_MIN_FULL_FIT` records one common scale of every cost is fitted instead.
    `syncs`, `windows`: per record, `step_time`'s ``sync`` and ``window``.
    `groups`: per record, the curve it belongs to (its model, precision and
    size; a scaling study is one curve); each curve weighs the same in the
    fit however many batch sizes it sampled, so the model measured most often
    does not set the parameters of all.
    """
    pts = _Points(probes, measured, g, syncs, windows)
    if groups is None:
        weight = np.full(len(probes), 1.0 / len(probes))
    else:
        count = Counter(groups := list(groups))
        weight = np.array([1.0 / count[k] for k in groups]) / len(count)
    base = default_calibration(g).params()
    shares = pts.shares(base)
    # the host's time per op is always free (every step launches its ops), a format's efficiency only
    # where the records spend time in its compute-bound ops (else nothing determines it)
    free = [k for k in PARAMS if k in ("memory", "launch", "kernel") or shares[k] >= _MIN_SHARE] \
        if len(probes) >= _MIN_FULL_FIT else []
    log_meas = np.log(pts.measured)

    def unpack(x):
        params = dict(base)
        for k, v in zip(free, x):
            params[k] = float(np.clip(np.exp(v), *_BOUNDS[k])) if k in _BOUNDS else float(min(1.0, np.exp(v)))
        return params

    lo = np.array([np.log(_BOUNDS[k][0]) if k in _BOUNDS else -np.inf for k in free])
    hi = np.array([np.log(_BOUNDS[k][1]) if k in _BOUNDS else 0.0 for k in free])

    def loss(x):
        # past a bound the clipped parameter no longer moves the fit: the penalty leads the simplex back, where
        # a flat loss would let it stall outside while the other parameters compensate
        out = np.maximum(x - hi, 0.0) + np.maximum(lo - x, 0.0)
        return float(np.sum(weight * (np.log(pts.predict(unpack(x))) - log_meas) ** 2)) + float(np.sum(out ** 2))

    if free:
        x = np.log([base[k] for k in free])
        for _ in range(3):  # restarts: a simplex can stall where one parameter's ops stop setting the max
            x = _nelder_mead(loss, x)
        params = unpack(x)
        fitted = tuple(free)
    else:  # one scale s of every cost: s * pred0 = measured in the (weighted) geometric mean
        s = float(np.exp(np.sum(weight * (log_meas - np.log(pts.predict(base))))))
        params = {k: (v * s if k in _BOUNDS else min(1.0, v / s)) for k, v in base.items()}
        fitted = ("scale",)
    pred = pts.predict(params)
    res = (pred - pts.measured) / pts.measured
    main = max(PARAMS[:3], key=lambda k: shares[k])
    return _with_params(g, params, efficiency=params[main], source=source, records=len(probes),
                        error=float(np.median(np.abs(res))), fitted=fitted, fitted_on=tuple(labels),
                        residuals=tuple(float(r) for r in res), curves=() if groups is None else tuple(groups))


def _ideal(model, mom, precision, size, batch_size, gpu, trace, tf32=False, setup="default") -> tuple[float, int]:
    """Roofline seconds (at 100% efficiency) and op count of one configuration; `trace` gives its step:
    ``trace(model, mom, precision, size, batch_size, kernels, setup)``."""
    p = trace(model, mom, precision, size, batch_size, gpu.kernels, setup)
    run = _launched(p)
    compute, memory = _roofline(p, gpu, tf32, run)
    return float(np.maximum(compute, memory).sum()), int(run.sum())


def _label(r: dict) -> str:
    return f"{_sized(r)} {r['precision']} batch {r['batch_size']}"


def _sized(r: dict) -> str:
    size = ",".join(f"{k}={v}" for k, v in sorted((r.get("size") or {}).items()))
    return f"{r['model']}{'[' + size + ']' if size else ''}"


def _curve(r: dict) -> str:
    """The curve a record belongs to in a fit: its own ``_curve`` (a study), else its model, size and precision."""
    return r.get("_curve") or f"{_sized(r)} {r['precision']}"


def calibrate(gpu: str, *, trace, results=None, max_records: int = 4, quick: bool = True,
              reference: bool = True) -> Calibration:
    """The time-model parameters of `gpu`, fitted from its measured Exact runs (cached per process).

    Records: momlab's own in `results` (default results/*.jsonl) whose
    ``env.device_name`` matches the device (for `cpu`: this machine's CPU
    model and thread count), fitted and timed, Exact only; for the paper's
    GPU (V100 16 GB) also the paper's Exact runs when `reference`
    (`reference_records`). On a GPU every such record is fitted (`fit_gpu`);
    on `cpu` up to `max_records` spread over the range of work, and without
    any, `QUICK_CPU` is measured (a few seconds) when `quick`. A GPU without
    records gets the defaults, ``calibrated=False``. `trace`: the step of a
    configuration (see `_ideal`; momlab.estimate's traces).
    """
    g = get_gpu(gpu)
    files = _result_files(results)
    stamp = tuple((f, os.path.getmtime(f), os.path.getsize(f)) for f in files if os.path.exists(f))
    key = (gpu, stamp, max_records, quick, reference, torch.get_num_threads() if gpu == "cpu" else None)
    with _LOCK:
        if key in _CALIBRATIONS:
            return _CALIBRATIONS[key]
        own = _records_of(gpu, files)
        if g.kernels == "cpu":
            records = _pick(own, max_records)
            points = []
            for r in records:
                ideal, n = _ideal(r["model"], r["mom"], r["precision"], r.get("size") or {}, r["batch_size"], g,
                                  trace, setup=r.get("setup") or "default")
                points.append((ideal, n, float(r["step_time_s"])))
            if points:
                cal = _fit(g, points, gpu, f"{len(points)} measured Exact record(s) in "
                                           f"{', '.join(sorted({r['_from'] for r in records}))}")
                cal = _replace(cal, fitted_on=tuple(map(_label, records)))
            elif quick:
                cal = _quick_cpu(g, trace)
            else:
                cal = default_calibration(g)
        else:
            records = own + (reference_records(gpu) if reference else [])
            records = [r for r in records if g.peak(r["precision"])]
            if records:
                probes = [trace(r["model"], "exact", r["precision"], r.get("size") or {}, r["batch_size"], g.kernels,
                                r.get("setup") or "default") for r in records]
                sources = sorted({r["_from"].split(" (")[0] for r in records})
                cal = fit_gpu(g, probes, [float(r["step_time_s"]) for r in records], map(_label, records),
                              f"{len(records)} measured Exact record(s): {', '.join(sources)}",
                              syncs=[r["precision"] in SYNC_PRECISIONS for r in records],
                              windows=[r.get("window") or "step" for r in records],
                              groups=list(map(_curve, records)))
            else:
                cal = default_calibration(g)
        _CALIBRATIONS[key] = cal
    return cal


def _replace(cal: Calibration, **kw) -> Calibration:
    from dataclasses import replace

    return replace(cal, **kw)


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _quick_cpu(g: Gpu, trace) -> Calibration:
    from momlab.measure import measure

    points = []
    for model, size, batch in QUICK_CPU:
        m = measure(model, batch_size=batch, steps=3, warmup=1, **size)
        ideal, n = _ideal(model, "exact", "fp32", size, batch, g, trace)
        points.append((ideal, n, m.step_time_s))
    return _fit(g, points, "cpu", "quick calibration: measured " + ", ".join(
        f"{m} batch {b} ({s['hidden_size']} wide)" for m, s, b in QUICK_CPU))


def clear_cache() -> None:
    """Forget every calibration made in this process."""
    with _LOCK:
        _CALIBRATIONS.clear()
