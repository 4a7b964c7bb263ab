"""Errors every layer of momlab shares.

`OutOfMemory` is raised inside a training step when the device (real CUDA, or
the emulated CPU device under a budget) cannot hold one more allocation. The
measurement harness turns it into data (`fits=False`); it never escapes
`momlab.measure`.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfMemory(RuntimeError):
    """A training step needed more device memory than the device (or budget) has."""

    def __init__(self, message: str, *, requested: int = 0, live: int = 0, budget: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.live = live
        self.budget = budget

    where = "device"


class HostOutOfMemory(OutOfMemory):
    """A MOM's host-side copies (swap) would exceed the host memory allowed them: the step does not fit
    this machine, whatever the device holds (`where` tells the two apart in a record)."""

    where = "host"


def check_choice(kind: str, value, valid: Iterable) -> None:
    """Raise ValueError naming the valid choices when `value` is not one of them."""
    valid = list(valid)
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(map(str, valid))}")
