"""The GPU catalog: what a device can hold and how fast it computes and moves bytes.

Estimates (momlab.estimate) predict a training step on a device we are not
running on. Memory comes from tracing the step; time from a roofline per
operation with the constants here: peak *dense* FLOP/s per number format
(tensor cores where the format has them; the datasheets' "with sparsity"
figures are twice these and never apply to training), memory bandwidth, and
the host link a swapping MOM moves activations over. Every number is the
vendor's datasheet value, cited beside it; none is measured here.

What a datasheet cannot give is how close eager PyTorch gets to those peaks.
That is the `efficiency` factor of momlab.estimate: fitted from measured
records of the same device in results/*.jsonl when there are any (a record's
``env.device_name`` says which device ran it), and otherwise a default that
the estimate labels *uncalibrated*.

`cpu` is this machine. Its peaks are measured, not looked up (`cpu_peaks`:
a large matmul per number format, a large copy), and its efficiency is fitted
from this machine's own runs, so ``estimate(..., gpu="cpu")`` can be checked
against ``measure(...)`` on the spot.

Number formats: ``fp32`` (plain CUDA cores), ``tf32`` (fp32 storage, tensor
cores: PyTorch's default for convolutions, opt-in for matmuls), ``bf16`` and
``fp16`` (mixed precision). `None` means the device has no fast path for the
format, and an estimate in it is refused.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field

import torch

from momlab.device import meminfo
from momlab.errors import check_choice

GiB = 2 ** 30
MiB = 2 ** 20
TERA = 1e12
GB_S = 1e9

FORMATS = ("fp32", "tf32", "bf16", "fp16")

# PCIe x16 payload rate per direction: gen3 ~15.75 GB/s, gen4 ~31.5, gen5 ~63
# (the datasheets quote 32 / 64 / 128 GB/s counting both directions).
PCIE = {3: 15.75 * GB_S, 4: 31.5 * GB_S, 5: 63.0 * GB_S}
# What a pinned-memory copy (cudaMemcpyAsync from page-locked host memory) reaches per direction over
# PCIe x16: about 80% of the payload rate, the rest going to packet headers, flow control and DMA setup.
# Source: NVIDIA's CUDA samples `bandwidthTest --memory=pinned`, whose published runs on x16 links report
# about 12-13 GB/s (gen3), 24-26 (gen4) and 50-55 (gen5); not measured by momlab. Swap's copies run at
# this rate (momlab.timemodel), not at the link's peak.
PINNED = {3: 12.0 * GB_S, 4: 25.0 * GB_S, 5: 50.0 * GB_S}

# Eager PyTorch launches one kernel per aten op and spends host time per op
# (Python, autograd, dispatcher). A few microseconds on a current server CPU;
# a step is launch-bound when its kernels are shorter than that.
LAUNCH_S = 6e-6

# Every kernel also occupies the GPU for a few microseconds beyond its arithmetic and memory traffic (its
# start and drain): null kernels launched back to back take about 3 us each on recent hardware and drivers
# (NVIDIA developer forums, "Too much time for kernel launch latency", 2022). The default of an uncalibrated
# device; a calibration fits it (momlab.timemodel, "kernel").
KERNEL_S = 3e-6

# Efficiency of an uncalibrated device: the fraction of the per-op roofline
# eager training reaches. 0.6 is the middle of what large matmuls (70-90% of
# peak) and elementwise kernels (60-85% of bandwidth) reach on datacenter GPUs.
DEFAULT_EFFICIENCY = 0.6


@dataclass(frozen=True)
class Gpu:
    """One device: capacity, peak dense FLOP/s per format, bandwidths, how to recognize it.

    - ``memory_bytes``: device memory (datasheet capacity; the CUDA context
      and the driver take a few hundred MiB of it, not counted by a peak).
    - ``flops``: peak dense FLOP/s per format (`FORMATS`); None: no fast path.
    - ``memory_bandwidth``: device memory bytes/s.
    - ``host_bandwidth``: bytes/s per direction over ``host_link`` (its peak payload rate).
    - ``pinned_bandwidth``: bytes/s per direction a pinned host copy reaches
      over that link (what swap's copies get; `PINNED` says where from).
    - ``kernels``: "cuda" or "cpu": whose kernels decide what a step saves
      (attention saves different tensors on each; momlab.estimate).
    - ``patterns``: regular expressions matching ``env.device_name`` of
      records measured on this device (``torch.cuda.get_device_name``).
    - ``sm_clock_hz``: multiprocessors times the boost clock (SM cycles a
      second): the ceiling of a kernel bound by its instructions rather than
      its bytes or FLOPs (`momlab.moms.quant.gact_cycles`); 0: not known.
      Each catalog value agrees with its datasheet's fp32 peak (FP32 lanes
      per SM x 2 FLOPs x SM cycles a second).
    """

    name: str
    memory_bytes: int
    flops: dict
    memory_bandwidth: float
    host_link: str
    host_bandwidth: float
    kernels: str = "cuda"
    patterns: tuple = ()
    pinned_bandwidth: float = 0.0
    launch_s: float = LAUNCH_S
    kernel_s: float = KERNEL_S  # device seconds each kernel takes beyond its roofline time (`KERNEL_S`)
    source: str = ""
    notes: str = ""
    sm_clock_hz: float = 0.0  # multiprocessors x boost clock: SM cycles a second

    def peak(self, fmt: str) -> float | None:
        return self.flops.get(fmt)

    def formats(self) -> list[str]:
        return [f for f in FORMATS if self.flops.get(f)]

    def matches(self, device_name: str | None) -> bool:
        return bool(device_name) and any(re.search(p, device_name, re.IGNORECASE) for p in self.patterns)

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "flops": dict(self.flops),
                "memory_bandwidth": self.memory_bandwidth, "host_link": self.host_link,
                "host_bandwidth": self.host_bandwidth, "pinned_bandwidth": self.pinned_bandwidth, "kernels": self.kernels, "source": self.source,
                "notes": self.notes, "sm_clock_hz": self.sm_clock_hz}


def _sm(multiprocessors: int, boost_mhz: float) -> float:
    """SM cycles a second of a GPU with that many multiprocessors at that boost clock."""
    return multiprocessors * boost_mhz * 1e6


def _tf(fp32=None, tf32=None, bf16=None, fp16=None) -> dict:
    return {k: (None if v is None else v * TERA) for k, v in
            (("fp32", fp32), ("tf32", tf32), ("bf16", bf16), ("fp16", fp16))}


# Multiprocessors and boost clock (`Gpu.sm_clock_hz`), from NVIDIA's datasheets and architecture whitepapers:
# V100 SXM2 80 SMs at 1530 MHz, T4 40 at 1590, A10 72 at 1695, L4 58 at 2040, A100 SXM4 108 at 1410, H100 and
# H200 SXM 132 at 1980, RTX 4090 128 at 2520 (each times its FP32 lanes per SM, 64 on Volta, Turing and A100,
# 128 on GA102, Ada and Hopper, times 2 is its datasheet's fp32 peak; `test_sm_clocks_agree_with_fp32_peaks`).
_CATALOG: dict[str, Gpu] = {g.name: g for g in (
    # NVIDIA V100 Tensor Core GPU datasheet (2020), SXM2: FP32 15.7 TFLOPS, Tensor 125 TFLOPS (fp16),
    # HBM2 900 GB/s; the host link is PCIe gen3 x16 (NVLink connects GPUs only, except on POWER9).
    # Volta has no tf32 or bf16 tensor cores. Memory as the cards report it (what the allocator can have
    # before the CUDA context), not the marketing GiB: nvidia-smi's total is 16160 MiB on a
    # V100-SXM2-16GB (github.com/4paradigm/k8s-vgpu-scheduler/issues/7) and 32480 MiB on a V100-SXM2-32GB
    # (github.com/godweiyang/GrabGPU/issues/5)
    Gpu("V100-16", 16160 * MiB, _tf(fp32=15.7, fp16=125), 900 * GB_S, "PCIe gen3 x16", PCIE[3],
        pinned_bandwidth=PINNED[3], patterns=(r"V100.*16\s*GB",),
        sm_clock_hz=_sm(80, 1530), source="NVIDIA V100 datasheet (SXM2)"),
    Gpu("V100-32", 32480 * MiB, _tf(fp32=15.7, fp16=125), 900 * GB_S, "PCIe gen3 x16", PCIE[3],
        pinned_bandwidth=PINNED[3], patterns=(r"V100.*32\s*GB",),
        sm_clock_hz=_sm(80, 1530), source="NVIDIA V100 datasheet (SXM2)"),
    # NVIDIA T4 datasheet: FP32 8.1 TFLOPS, mixed precision (fp16/fp32) 65 TFLOPS, GDDR6 320 GB/s,
    # 16 GB, PCIe gen3 x16. Turing has no tf32 or bf16 tensor cores.
    Gpu("T4", 16 * GiB, _tf(fp32=8.1, fp16=65), 320 * GB_S, "PCIe gen3 x16", PCIE[3],
        pinned_bandwidth=PINNED[3], patterns=(r"\bT4\b",), sm_clock_hz=_sm(40, 1590), source="NVIDIA T4 datasheet"),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 | 125*, BF16 125 | 250*, FP16 125 | 250* TFLOPS
    # (* with sparsity), GDDR6 600 GB/s, 24 GB, PCIe gen4 x16.
    Gpu("A10", 24 * GiB, _tf(fp32=31.2, tf32=62.5, bf16=125, fp16=125), 600 * GB_S, "PCIe gen4 x16", PCIE[4],
        pinned_bandwidth=PINNED[4], patterns=(r"\bA10\b(?!0)",),
        sm_clock_hz=_sm(72, 1695), source="NVIDIA A10 datasheet"),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16 242*, FP16 242* TFLOPS (* with sparsity: dense is
    # half), GDDR6 300 GB/s, 24 GB, PCIe gen4 x16.
    Gpu("L4", 24 * GiB, _tf(fp32=30.3, tf32=60, bf16=121, fp16=121), 300 * GB_S, "PCIe gen4 x16", PCIE[4],
        pinned_bandwidth=PINNED[4], patterns=(r"\bL4\b",), sm_clock_hz=_sm(58, 2040), source="NVIDIA L4 datasheet"),
    # NVIDIA A100 datasheet (SXM): FP32 19.5, TF32 156 | 312*, BF16 312 | 624*, FP16 312 | 624* TFLOPS;
    # HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB); PCIe gen4 x16 to the host.
    Gpu("A100-40", 40 * GiB, _tf(fp32=19.5, tf32=156, bf16=312, fp16=312), 1555 * GB_S, "PCIe gen4 x16",
        PCIE[4], pinned_bandwidth=PINNED[4], patterns=(r"A100.*40\s*GB",),
        sm_clock_hz=_sm(108, 1410), source="NVIDIA A100 datasheet (SXM4 40GB)"),
    Gpu("A100-80", 80 * GiB, _tf(fp32=19.5, tf32=156, bf16=312, fp16=312), 2039 * GB_S, "PCIe gen4 x16",
        PCIE[4], pinned_bandwidth=PINNED[4], patterns=(r"A100.*80\s*GB",),
        sm_clock_hz=_sm(108, 1410), source="NVIDIA A100 datasheet (SXM4 80GB)"),
    # NVIDIA H100 datasheet (SXM): FP32 67, TF32 989*, BF16 1,979*, FP16 1,979* TFLOPS (* with
    # sparsity: dense is half), HBM3 3.35 TB/s, 80 GB, PCIe gen5 x16 to the host.
    Gpu("H100-80", 80 * GiB, _tf(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4), 3350 * GB_S, "PCIe gen5 x16",
        PCIE[5], pinned_bandwidth=PINNED[5], patterns=(r"H100.*80\s*GB", r"H100 SXM"),
        sm_clock_hz=_sm(132, 1980), source="NVIDIA H100 datasheet (SXM5)"),
    # NVIDIA H200 datasheet (SXM): same compute as H100 SXM (FP32 67, TF32 989*, BF16/FP16 1,979*
    # TFLOPS, * with sparsity), HBM3e "141 GB" at 4.8 TB/s, PCIe gen5 x16 to the host. Capacity as
    # the card reports it: nvidia-smi read 143771 MiB on this workplace's H200s (2026-10-27, driver
    # 580.159); the datasheet's rounded "141 GB" read as GiB overstated it by 0.6 GiB.
    Gpu("H200-141", 143771 * MiB, _tf(fp32=67, tf32=494.7, bf16=989.4, fp16=989.4), 4800 * GB_S,
        "PCIe gen5 x16", PCIE[5], pinned_bandwidth=PINNED[5], patterns=(r"H200",),
        sm_clock_hz=_sm(132, 1980), source="NVIDIA H200 datasheet (SXM)"),
    # NVIDIA Ada Lovelace architecture whitepaper (v1.1), GeForce RTX 4090: FP32 82.6 TFLOPS; tensor
    # FP16 and BF16 with FP32 accumulate (what PyTorch uses) 165.2 dense, TF32 82.6 dense;
    # GDDR6X 1,008 GB/s, 24 GB, PCIe gen4 x16.
    Gpu("RTX-4090", 24 * GiB, _tf(fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2), 1008 * GB_S, "PCIe gen4 x16",
        PCIE[4], pinned_bandwidth=PINNED[4], patterns=(r"RTX 4090",),
        sm_clock_hz=_sm(128, 2520), source="NVIDIA Ada Lovelace whitepaper (RTX 4090)"),
)}


def gpus() -> list[str]:
    """Names of the devices an estimate can target: the GPU catalog, then `cpu` (this machine).

    >>> "A100-40" in gpus() and gpus()[-1] == "cpu"
    True
    """
    return [*_CATALOG, "cpu"]


def get(name: str) -> Gpu:
    """The catalog entry of `name` (`cpu`: this machine, its peaks measured once per process)."""
    check_choice("gpu", name, gpus())
    return cpu() if name == "cpu" else _CATALOG[name]


def for_device_name(device_name: str | None) -> str | None:
    """The catalog name of the device a record ran on (its ``env.device_name``), or None."""
    for g in _CATALOG.values():
        if g.matches(device_name):
            return g.name
    return None


# -- this machine ------------------------------------------------------------------

@dataclass(frozen=True)
class CpuPeaks:
    """Measured peaks of this machine with torch's current thread count."""

    flops: dict = field(default_factory=dict)  # format -> FLOP/s of a large matmul
    memory_bandwidth: float = 0.0  # bytes/s of a large copy (read + write)
    threads: int = 1
    seconds: float = 0.0  # how long measuring took


def _best_rate(fn, work: float, repeats: int) -> float:
    fn()  # warm-up: thread pool, packing buffers
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


@functools.lru_cache(maxsize=None)
def cpu_peaks(threads: int | None = None) -> CpuPeaks:
    """Measure this machine's matmul FLOP/s per format and its copy bandwidth (about a second).

    The best of a few repeats: a peak, as datasheets give, not a typical rate.
    Cached per thread count for the life of the process.
    """
    threads = torch.get_num_threads() if threads is None else threads
    t0 = time.perf_counter()
    flops = {}
    # fp32 at 1024 reaches the BLAS plateau; bf16/fp16 without AMX/AVX512-BF16 run about 100x slower
    # (docs/ENVIRONMENT), so they get a smaller matrix to keep this short
    for fmt, dtype, n, reps in (("fp32", torch.float32, 1024, 5), ("bf16", torch.bfloat16, 256, 2),
                                ("fp16", torch.float16, 256, 2)):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        flops[fmt] = _best_rate(lambda: torch.mm(a, b), 2.0 * n ** 3, reps)
    flops["tf32"] = None  # no tf32 path on a CPU
    src = torch.empty(32 * 2 ** 20 // 4)  # 32 MiB: well past the last-level cache
    dst = torch.empty_like(src)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, 5)  # read + write
    return CpuPeaks(flops, bandwidth, threads, time.perf_counter() - t0)


def _memory_total() -> int:
    return meminfo("MemTotal")


def cpu() -> Gpu:
    """This machine as a device: its RAM, its measured peaks (`cpu_peaks`), CPU kernels."""
    from momlab.provenance import environment

    peaks = cpu_peaks()
    name = environment("cpu")["device_name"]
    return Gpu("cpu", _memory_total(), dict(peaks.flops), peaks.memory_bandwidth, "none (host memory)",
               peaks.memory_bandwidth, kernels="cpu", pinned_bandwidth=peaks.memory_bandwidth, patterns=(re.escape(name),),
               launch_s=0.0,  # fitted per machine (momlab.estimate.calibrate)
               kernel_s=0.0,  # one thing at a time: an op's cost is its time plus its launch
               source=f"measured on this machine ({name}, {peaks.threads} threads)",
               notes="memory is the machine's RAM; a budget stands in for a GPU's capacity")


class _CallableModule(types.ModuleType):
    """`momlab.gpus()` lists the devices, while `momlab.gpus.get` stays this module's."""

    def __call__(self) -> list[str]:
        return gpus()


sys.modules[__name__].__class__ = _CallableModule
