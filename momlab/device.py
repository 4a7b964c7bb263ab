"""Everything that differs between devices, in one place.

cpu: the device is emulated by exact storage accounting (momlab.accounting);
     there is no allocator to ask, so memory comes from the tracker.
cuda: the caching allocator's own counters (allocated, never reserved), its
     peak reset after warm-up; a budget caps the allocator with
     set_per_process_memory_fraction so a big GPU can stand in for a small one.
meta: no data at all; used for estimates with the same accounting as cpu.
Everything above this module is device-agnostic.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from momlab.errors import OutOfMemory, check_choice

DEVICES = ("cpu", "cuda", "meta")


def check_device(device: str) -> torch.device:
    """Validate a device name; 'cuda' without a GPU says so plainly."""
    kind = str(device).split(":")[0]
    check_choice("device", kind, DEVICES)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available on this machine (torch "
                         f"{torch.__version__}); valid here: cpu, meta")
    return torch.device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    """True for a real or emulated out-of-memory, however the framework wrapped it."""
    if isinstance(exc, (OutOfMemory, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def total_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


class CudaMemory:
    """The CUDA caching allocator's counters, with an optional budget cap."""

    def __init__(self, device: torch.device, budget: int | None):
        self.device = device
        self.budget = budget

    def capped(self):
        """The budget as the allocator's per-process memory fraction (no cap without a budget)."""
        return self._fraction(lambda total: min(1.0, self.budget / total), lambda total: 1.0)

    def uncapped(self):
        """The whole device inside `capped`, for a step the budget must not cut (ckpt-auto's costs)."""
        return self._fraction(lambda total: 1.0, lambda total: min(1.0, self.budget / total))

    @contextmanager
    def _fraction(self, inside, after):
        if self.budget is None:
            yield
            return
        total = total_memory(self.device)
        torch.cuda.set_per_process_memory_fraction(inside(total), self.device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(after(total), self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


@contextmanager
def autocast(device: torch.device, precision: str):
    """Mixed precision by autocast; master weights stay fp32."""
    if precision == "fp32":
        yield
        return
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
