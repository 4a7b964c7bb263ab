"""The steps every measurement runs, in one place: warm-up, the FLOP step, the timed steps.

`momlab.measure` runs them on one process's `Workload`, `momlab.distributed`
on each rank's; both hand in the step to run (a rank's counts its steps and
can be killed by the test hook), so the two cannot drift apart: the FLOP
step is a step of its own outside the measured one and outside the budget,
warm-up continues while fp16's GradScaler skips the optimizer step, and a
timed step draws its batch before the clock starts.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from momlab.device import synchronize

# fp16: at most this many warm-up steps more while GradScaler skips the optimizer step
MAX_SKIPPED_STEPS = 16


def warm_up(step: Callable[[], float], optimizer: torch.optim.Optimizer, steps: int) -> None:
    """`steps` steps, and more while the optimizer has no state yet: fp16's GradScaler skips the optimizer
    step while its first scales overflow, and the probe step must start with the optimizer state resident
    (not be the step that creates it)."""
    for _ in range(steps):
        step()
    for _ in range(MAX_SKIPPED_STEPS):
        if optimizer.state:
            return
        step()


def count_flops(step: Callable[[], float], room=None) -> int:
    """FLOPs of one step, counted by FlopCounterMode in a step of its own: its module tracking keeps
    checkpoint-recomputed tensors alive, so it must not run in the step whose memory is measured
    (checkpointing's peak rose 40%), nor under the budget (`room`: a context that lifts it, e.g. the CUDA
    cap's `uncapped`): a step that fits would be recorded as not fitting."""
    with room if room is not None else nullcontext():
        with FlopCounterMode(display=False) as counter:
            step()
    return int(counter.get_total_flops())


def timed_steps(step: Callable[[dict], float], batch: Callable[[], dict], device: torch.device, steps: int,
                before: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of `steps` steps; the batch is drawn before the clock starts, `before` (ranks: a
    barrier, so a step lasts as long as its slowest rank) runs outside it too."""
    times = []
    for _ in range(steps):
        inputs = batch()
        if before is not None:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        step(inputs)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        del inputs
    return times
