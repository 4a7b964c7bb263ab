"""The time model with its calibration: a traced step's ops -> predicted seconds on a device.

Time is a roofline per operation, summed: each op costs ``max(flops / peak
FLOP/s of its number format, bytes read and written / memory bandwidth)``,
divided by an efficiency factor, plus a per-op launch cost; recomputation
(checkpointing) and quantization kernels are ops of the trace like any other,
and swapping adds ``2 * host_bytes`` over the host link (overlapped with
compute, as swap prefetches). The efficiency is fitted from measured records
of the same device (`calibrate`); without any, a default is used and the
estimate says ``calibrated=False``. It is the approach of Paleo (Qi et al.,
2017) with the graph traced rather than described by hand.

A step here is anything with the per-op arrays of `momlab.estimate.Probe`
(``flops``, ``extra_flops``, ``bytes``, ``fmt``) and ``host_bytes``; the
traces themselves come from momlab.estimate, which hands its tracer in
(``trace=``) where a calibration needs the steps of measured records.
"""

from __future__ import annotations

import glob
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from momlab.gpus import DEFAULT_EFFICIENCY, Gpu
from momlab.gpus import get as get_gpu

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"

_LOCK = threading.RLock()  # the calibration cache; a calibration traces, the tracer keeps its own lock


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
    """Predicted step time and its parts (seconds)."""

    step_time_s: float
    ideal_s: float  # sum over ops of the roofline time, at 100% efficiency
    compute_bound_s: float  # part of ideal_s in ops limited by FLOP/s
    memory_bound_s: float  # part of ideal_s in ops limited by bandwidth
    launch_s: float  # op count times the per-op launch cost
    transfer_s: float  # swap traffic over the host link
    ops: int


def _roofline(p, gpu, tf32: bool):
    peaks = _peaks(gpu, tf32)
    compute = (p.flops + p.extra_flops) / peaks[p.fmt.astype(np.int64)]
    memory = p.bytes / gpu.memory_bandwidth
    return compute, memory


def step_time(p, gpu: Gpu, cal: "Calibration", *, tf32: bool = False) -> StepTime:
    """Roofline per op, over the efficiency, plus launches and swap traffic (module docstring)."""
    compute, memory = _roofline(p, gpu, tf32)
    per_op = np.maximum(compute, memory)
    ideal = float(per_op.sum())
    n = len(per_op)
    launch = n * cal.launch_s
    transfer = 2.0 * p.host_bytes / gpu.host_bandwidth if gpu.kernels == "cuda" else 0.0
    busy = ideal / cal.efficiency
    if gpu.kernels == "cuda":  # the host launches asynchronously; copies run on their own streams
        total = max(busy, launch, transfer)
    else:  # a CPU does one thing at a time (swap copies are ops of the trace here)
        total = busy + launch
    return StepTime(total, ideal, float(per_op[compute >= memory].sum()), float(per_op[compute < memory].sum()),
                    launch, transfer, n)


# -- calibration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """How a device's roofline maps to measured step times.

    ``efficiency``: measured time = ideal roofline time / efficiency (plus
    ``launch_s`` per op). ``calibrated``: fitted from measurements of this
    device (``source`` says which); False: defaults. ``error``: the median
    relative error of the fit on the records it used.
    """

    gpu: str
    efficiency: float
    launch_s: float
    calibrated: bool
    source: str
    records: int = 0
    error: float = math.nan


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
    from momlab.results import read_records

    gpu = get_gpu(gpu_name)
    device = "cpu" if gpu_name == "cpu" else "cuda"
    out, seen = [], set()
    for path in files:
        for rec in read_records(path):
            env = rec.get("env") or {}
            if env.get("device") != device or not gpu.matches(env.get("device_name")):
                continue
            if gpu_name == "cpu" and env.get("threads") not in (None, torch.get_num_threads()):
                continue
            t = rec.get("step_time_s")
            if not rec.get("fits") or t is None or not math.isfinite(t) or t <= 0:
                continue
            key = (rec["model"], rec["mom"], rec["precision"], tuple(sorted((rec.get("size") or {}).items())),
                   rec["batch_size"])
            if key not in seen:  # the first record of a configuration (a sweep records each once)
                seen.add(key)
                out.append(rec)
    return out


def _pick(records: list[dict], n: int) -> list[dict]:
    """Up to `n` records spread over the range of work (cheapest configurations first among ties)."""
    records = sorted(records, key=lambda r: (r.get("flops") or 0, r["batch_size"]))
    if len(records) <= n:
        return records
    idx = np.unique(np.linspace(0, len(records) - 1, n).round().astype(int))
    return [records[i] for i in idx]


def _fit(gpu: Gpu, points: list[tuple[float, int, float]], name: str, source: str) -> Calibration:
    """Fit efficiency (and on cpu the per-op cost) to (ideal_s, ops, measured_s) points."""
    ideal = np.array([p[0] for p in points])
    ops = np.array([p[1] for p in points], dtype=np.float64)
    measured = np.array([p[2] for p in points])
    if gpu.kernels == "cpu" and len(points) >= 2 and np.ptp(ideal / ops) > 0:
        # measured = ideal / eff + ops * launch: least squares on the relative error, both terms >= 0
        A = np.stack([ideal, ops], axis=1) / measured[:, None]
        (k, launch), *_ = np.linalg.lstsq(A, np.ones_like(measured), rcond=None)
        if k <= 0:
            k, launch = float(np.median(measured / ideal)), 0.0
        elif launch < 0:
            k, launch = float(np.median(measured / ideal)), 0.0
    else:
        launch = gpu.launch_s
        k = float(np.median((measured - (ops * launch if gpu.kernels == "cpu" else 0)) / ideal))
    k = max(k, 1e-3)
    pred = ideal * k + (ops * launch if gpu.kernels == "cpu" else 0)
    if gpu.kernels == "cuda":
        pred = np.maximum(ideal * k, ops * launch)
    err = float(np.median(np.abs(pred - measured) / measured))
    return Calibration(name, 1.0 / k, float(launch), True, source, len(points), err)


def _ideal(model, mom, precision, size, batch_size, gpu, trace, tf32=False) -> tuple[float, int]:
    """Roofline seconds (at 100% efficiency) and op count of one configuration; `trace` gives its step:
    ``trace(model, mom, precision, size, batch_size, kernels)``."""
    p = trace(model, mom, precision, size, batch_size, gpu.kernels)
    compute, memory = _roofline(p, gpu, tf32)
    return float(np.maximum(compute, memory).sum()), len(p.flops)


def calibrate(gpu: str, *, trace, results=None, max_records: int = 4, quick: bool = True) -> Calibration:
    """The efficiency of `gpu`, fitted from measured records of it in `results` (default results/*.jsonl).

    A record counts when its ``env.device_name`` matches the device (for
    `cpu`: this machine's CPU model and thread count), it fitted and has a
    step time. Up to `max_records` configurations, spread over the range of
    work, are traced and fitted. `cpu` without records is calibrated by
    measuring `QUICK_CPU` (a few seconds) when `quick`; a GPU without records
    gets the default efficiency, ``calibrated=False``. Cached per process.
    `trace`: the step of a configuration (see `_ideal`; momlab.estimate's traces).
    """
    g = get_gpu(gpu)
    files = _result_files(results)
    stamp = tuple((f, os.path.getmtime(f), os.path.getsize(f)) for f in files if os.path.exists(f))
    key = (gpu, stamp, max_records, quick, torch.get_num_threads() if gpu == "cpu" else None)
    with _LOCK:
        if key in _CALIBRATIONS:
            return _CALIBRATIONS[key]
        records = _pick(_records_of(gpu, files), max_records)
        points = []
        for r in records:
            ideal, n = _ideal(r["model"], r["mom"], r["precision"], r.get("size") or {}, r["batch_size"], g,
                              trace)
            points.append((ideal, n, float(r["step_time_s"])))
        if points:
            cal = _fit(g, points, gpu, f"{len(points)} measured record(s) in {', '.join(map(_short, files))}")
        elif gpu == "cpu" and quick:
            cal = _quick_cpu(g, trace)
        else:
            cal = Calibration(gpu, DEFAULT_EFFICIENCY, g.launch_s, False,
                              "uncalibrated: no measured records of this device (default efficiency "
                              f"{DEFAULT_EFFICIENCY})")
        _CALIBRATIONS[key] = cal
    return cal


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
