"""Everything that differs between devices, in one place.

cpu: the device is emulated by exact storage accounting (momlab.accounting);
     there is no allocator to ask, so memory comes from the tracker.
cuda: the caching allocator's own counters, its peaks reset after warm-up.
     A budget caps the allocator with set_per_process_memory_fraction so a
     big GPU can stand in for a small one. Three peaks are kept side by side:
     *allocated* (tensor bytes, what the records' memory fields report, the
     same quantity the emulated device counts), *active* (allocated plus
     blocks freed on the compute stream but still in use by another stream,
     e.g. swap's copy streams) and *reserved* (the segments the allocator
     holds from the driver: what the cap limits and what makes a real card
     run out). The allocator runs with its default configuration, or the one
     PYTORCH_CUDA_ALLOC_CONF names (recorded either way): the fraction cap is
     checked when the allocator reserves a new segment, so every change of
     the cap empties the cache first, else blocks cached while the cap was
     lifted would let a capped step run above its budget.
     A budget stands for a whole card: the memory the process holds outside
     the allocator (the CUDA context, library handles), measured once with
     cudaMemGetInfo, is taken from it, so a "16GiB" run on a large GPU is no
     roomier than a 16 GiB card.
meta: no data at all; used for estimates with the same accounting as cpu.
Host memory (swap's copies) is bounded too: `host_limit()` is what a MOM may
keep on the host before the step counts as out of (host) memory.
Everything above this module is device-agnostic.
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch

from momlab.errors import HostOutOfMemory, OutOfMemory, check_choice  # noqa: F401 (re-exported)

DEVICES = ("cpu", "cuda", "meta")

# the part of the host's available memory a MOM may fill with its copies (swap): the rest is
# the process itself, the data loader and the OS; beyond it a search would swap the machine to death
HOST_FRACTION = 0.8


def check_device(device: str) -> torch.device:
    """Validate a device name; 'cuda' without a GPU says so plainly; 'cuda' gets its index."""
    kind = str(device).split(":")[0]
    check_choice("device", kind, DEVICES)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available on this machine (torch "
                         f"{torch.__version__}); valid here: cpu, meta")
    return with_index(torch.device(device))


def with_index(device: torch.device, current: int | None = None) -> torch.device:
    """`cuda` as `cuda:N` (N the current device, or `current`): several CUDA APIs
    (set_per_process_memory_fraction among them) reject a device without an index."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if current is None else current)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Free what Python still holds, then (CUDA) the allocator's cached segments and pinned host blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        release = getattr(torch._C, "_host_emptyCache", None)  # the pinned-memory cache (torch >= 2.5)
        if release is not None:
            release()


def is_oom(exc: BaseException) -> bool:
    """True for a real or emulated out-of-memory, however the framework wrapped it."""
    if isinstance(exc, (OutOfMemory, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_where(exc: BaseException) -> str:
    """'host' for host memory (a MOM's copies), 'device' for everything else."""
    return getattr(exc, "where", "device")


def total_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def meminfo(field: str = "MemAvailable") -> int:
    """A /proc/meminfo field in bytes (Linux); else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_limit(available: int | None = None) -> int:
    """Bytes a MOM may keep in host memory: `HOST_FRACTION` of what is available now."""
    return int(HOST_FRACTION * (meminfo() if available is None else available))


def allocator_conf() -> str:
    """The CUDA allocator configuration in force ('' is torch's default)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


def outside_allocator(device: torch.device) -> int:
    """Device bytes this process holds outside the caching allocator (context, library handles)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def cap_fraction(budget: int, total: int, outside: int) -> float:
    """The allocator fraction that leaves a process `budget` bytes in all, `outside` of them not the allocator's."""
    if budget <= outside:
        raise OutOfMemory(f"budget {budget} bytes is less than the {outside} bytes the CUDA context and "
                          "libraries already hold", live=outside, budget=budget)
    return min(1.0, (budget - outside) / total)


# counters of torch.cuda.memory_stats (documented, cumulative over the process): a segment reserved from the driver
# (cudaMalloc), one released to it (cudaFree, which waits for the device), and an allocation that found no room
# until the allocator released its free cached segments and tried again. A step that does any of them pays host
# time a step on a warm cache does not (a loop that empties its cache every step, or one at the edge of memory).
ALLOCATOR_EVENTS = {"segments_reserved": "segment.all.allocated", "segments_released": "segment.all.freed",
                    "alloc_retries": "num_alloc_retries"}


class CudaMemory:
    """The CUDA caching allocator's counters, with an optional budget cap (see the module docstring)."""

    def __init__(self, device: torch.device, budget: int | None):
        self.device = with_index(device)
        self.budget = budget
        self.outside = outside_allocator(self.device) if budget is not None else 0
        self.conf = allocator_conf()

    @property
    def capacity(self) -> int:
        """What the allocator may reserve: the budget less what lives outside it, or the whole device."""
        total = total_memory(self.device)
        return total if self.budget is None else int(cap_fraction(self.budget, total, self.outside) * total)

    def capped(self):
        """The budget as the allocator's per-process memory fraction (no cap without a budget)."""
        return self._fraction(self._capped_fraction, lambda total: 1.0)

    def uncapped(self):
        """The whole device inside `capped`, for a step the budget must not cut (ckpt-auto's costs, FLOPs)."""
        return self._fraction(lambda total: 1.0, self._capped_fraction)

    def _capped_fraction(self, total: int) -> float:
        return cap_fraction(self.budget, total, self.outside)

    @contextmanager
    def _fraction(self, inside, after):
        if self.budget is None:
            yield
            return
        total = total_memory(self.device)
        empty_cache(self.device)  # the cap is checked on reserving: nothing cached may carry over
        torch.cuda.set_per_process_memory_fraction(inside(total), self.device)
        try:
            yield
        finally:
            empty_cache(self.device)
            torch.cuda.set_per_process_memory_fraction(after(total), self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        reset = getattr(torch._C, "_cuda_resetPeakHostMemoryStats", None)
        if reset is not None:
            reset()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def events(self) -> dict:
        """The allocator's cumulative calls into the driver (`ALLOCATOR_EVENTS`): subtract two readings."""
        stats = torch.cuda.memory_stats(self.device)
        return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_EVENTS.items()}

    def peaks(self) -> dict:
        """Allocated, active and reserved peaks since the last reset, and pinned host memory."""
        stats = torch.cuda.memory_stats(self.device)
        out = {"allocated": stats.get("allocated_bytes.all.peak", 0),
               "active": stats.get("active_bytes.all.peak", 0),
               "reserved": stats.get("reserved_bytes.all.peak", 0),
               "outside_allocator": self.outside, "allocator_conf": self.conf}
        host = host_memory_stats()
        if host:
            out["pinned_host_peak"] = host.get("allocated_bytes.peak", host.get("allocated_bytes.all.peak"))
            out["pinned_host_reserved"] = host.get("reserved_bytes.current", host.get("reserved_bytes.all.current"))
        return out


def host_memory_stats() -> dict:
    """The pinned host allocator's statistics where torch has them (2.6 and later), else {}."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return {}
    try:
        return dict(stats())
    except RuntimeError:
        return {}


@contextmanager
def autocast(device: torch.device, precision: str):
    """Mixed precision by autocast; master weights stay fp32."""
    if precision == "fp32":
        yield
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
