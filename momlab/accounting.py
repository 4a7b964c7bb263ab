"""Exact storage accounting: the emulated device memory of a CPU (or meta) step.

There is no memory-stats API for CPU tensors, and process RSS is about twice
the tensor total, so momlab emulates a GPU allocator by counting tensor
*storages*. A `TorchDispatchMode` sees the output of every aten op; each new
storage is counted once (views and in-place results share it) with its
`nbytes`, and a weak reference on the storage takes it off the books when the
storage is really freed (PyTorch preserves a storage's Python object while the
storage lives, so the callback fires on the real free).

Two accounts are kept: *device* (what a GPU would hold) and *host* (storages
created inside `host_allocation()`, which is how a swapping MOM on CPU says
"this copy lives in host memory"). A budget on the device account turns the
allocation that crosses it into `OutOfMemory`, right after the op that made
it, so a search on CPU behaves like one on a GPU.

What it cannot see: temporaries a kernel allocates inside C++ without
returning them (e.g. a matmul's internal packing buffers). On a GPU those are
largely the library workspaces the caching allocator does not see either.
The same mode runs on the `meta` device, which is how estimates are made.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from momlab.errors import HostOutOfMemory, OutOfMemory

_state = threading.local()


@contextmanager
def host_allocation():
    """Storages created inside this block are counted as host memory, not device."""
    previous = getattr(_state, "host", False)
    _state.host = True
    try:
        yield
    finally:
        _state.host = previous


def _allocating_on_host() -> bool:
    return getattr(_state, "host", False)


def storage_key(t: torch.Tensor) -> int:
    """A key that identifies the storage behind `t` while it lives."""
    return t.untyped_storage()._cdata


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (each counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class StorageTracker(TorchDispatchMode):
    """Count every tensor storage created while active, freed when it dies.

    >>> with StorageTracker() as tr:
    ...     x = torch.ones(256)          # 1 KiB
    ...     y = x.view(16, 16)           # a view: same storage, not counted again
    ...     tr.device_bytes
    1024
    """

    def __init__(self, budget: int | None = None, devices: tuple[str, ...] = ("cpu", "meta"),
                 host_budget: int | None = None):
        super().__init__()
        self.budget = budget
        self.host_budget = host_budget  # what host copies (swap) may hold; beyond it HostOutOfMemory
        self.devices = devices
        self._live: dict[int, list] = {}  # key -> [nbytes, is_host, weakref]
        self.device_bytes = 0
        self.host_bytes = 0
        self.host_copied = 0  # host bytes ever allocated (swap's copies out), never decreased
        self.peak_bytes = 0
        self.peak_host_bytes = 0
        self.enforce = True
        # the round-up an allocator handing out blocks of `granule` bytes would add to the live device
        # storages (CUDA's caching allocator: 512; 1: none), kept apart as `padding_bytes`
        self.granule = 1
        self.padding_bytes = 0

    # -- registration -----------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor], *, host: bool = False) -> None:
        """Put storages that already exist (weights, optimizer state) on the books."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t, host=host, check=False)

    def _register(self, t: torch.Tensor, *, host: bool, check: bool) -> None:
        if t.device.type not in self.devices:
            return
        st = t.untyped_storage()
        key = st._cdata
        nbytes = st.nbytes()
        # what an allocator would add by rounding this storage up to whole blocks: counted apart from
        # `device_bytes`, which stays the tensors' bytes (so a traced step stays affine in the batch)
        pad = 0 if host or self.granule == 1 else -(-nbytes // self.granule) * self.granule - nbytes
        entry = self._live.get(key)
        if entry is not None:
            grown = nbytes - entry[0]
            if grown == 0:
                return
            # an out= op resized an existing storage
            entry[0] = nbytes
            self.padding_bytes += pad - entry[3]
            entry[3] = pad
            self._add(grown, entry[1], check)
            return
        ref = weakref.ref(st, self._finalizer(key))
        self._live[key] = [nbytes, host, ref, pad]
        self.padding_bytes += pad
        self._add(nbytes, host, check)

    def _finalizer(self, key: int):
        def free(_ref, self_ref=weakref.ref(self)):
            tracker = self_ref()
            if tracker is None:
                return
            entry = tracker._live.pop(key, None)
            if entry is not None:
                if entry[1]:
                    tracker.host_bytes -= entry[0]
                else:
                    tracker.device_bytes -= entry[0]
                    tracker.padding_bytes -= entry[3] if len(entry) > 3 else 0  # subclasses book 3 fields
        return free

    def _add(self, nbytes: int, host: bool, check: bool) -> None:
        if host:
            self.host_bytes += nbytes
            self.host_copied += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
            if check and self.enforce and self.host_budget is not None and self.host_bytes > self.host_budget:
                raise HostOutOfMemory(
                    f"host memory out of memory: {self.host_bytes} bytes of host copies after an allocation "
                    f"of {nbytes}, host limit {self.host_budget}",
                    requested=nbytes, live=self.host_bytes, budget=self.host_budget)
            return
        self.device_bytes += nbytes
        if self.device_bytes > self.peak_bytes:
            self.peak_bytes = self.device_bytes
        if check and self.enforce and self.budget is not None and self.device_bytes > self.budget:
            raise OutOfMemory(
                f"emulated device out of memory: {self.device_bytes} bytes live "
                f"after an allocation of {nbytes}, budget {self.budget}",
                requested=nbytes, live=self.device_bytes, budget=self.budget,
            )

    def check_budget(self) -> None:
        """Raise OutOfMemory if what is on the books already exceeds the budget."""
        if self.budget is not None and self.device_bytes > self.budget:
            raise OutOfMemory(
                f"emulated device out of memory: {self.device_bytes} bytes resident exceed budget {self.budget}",
                live=self.device_bytes, budget=self.budget,
            )

    # -- queries ------------------------------------------------------------
    def reset_peak(self) -> None:
        self.peak_bytes = self.device_bytes
        self.peak_host_bytes = self.host_bytes

    def tracked_bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        """Device bytes of the distinct tracked storages behind `tensors`."""
        seen: dict[int, int] = {}
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                entry = self._live.get(key)
                if entry is not None and not entry[1]:
                    seen[key] = entry[0]
        return sum(seen.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = _allocating_on_host()
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._register(t, host=host, check=True)
        return out
