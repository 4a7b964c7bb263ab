"""The Measurement record: one training configuration, measured once.

Every field is defined here, once. Sizes are int bytes, times seconds,
throughput samples per second. A record also says where and how it was
measured (`env`: device name, CPU/GPU model, versions, commit) and whether its
memory figure came from a real device allocator ("cuda"), the exact storage
accounting of the emulated CPU device ("cpu-emulated"), or a prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """The fields of one training step that a `Measurement` measures and a `momlab.estimate.Estimate`
    predicts: what ran, whether it fits, its memory breakdown, time and FLOPs (see `Measurement`)."""

    model: str
    mom: str
    batch_size: int
    precision: str
    size: dict
    fits: bool
    peak_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    workspace_bytes: int
    host_bytes: int
    step_time_s: float
    throughput: float
    flops: int


@dataclass(frozen=True)
class Measurement(StepRecord):
    """One configuration of (model, MOM, batch, size, device, precision), measured.

    Memory fields are device bytes during a steady-state step (after `warmup`
    steps, so optimizer state exists):

    - ``peak_bytes``: the highest device allocation during the step (forward,
      loss, backward, optimizer step, zero grads).
    - ``params_bytes``: weights (parameters and buffers), unique storages.
    - ``grads_bytes``: gradients of the parameters after backward.
    - ``optimizer_bytes``: optimizer state (AdamW moments, SGD momentum).
    - ``activation_bytes``: device bytes alive at the end of forward beyond the
      three above: tensors saved for backward (after any MOM packed them), the
      input batch and the model output.
    - ``workspace_bytes``: ``peak_bytes`` minus the four above, never negative:
      temporaries of forward, backward and the optimizer at the peak moment.
    - ``host_bytes``: bytes a MOM keeps in host memory (swap) at the end of forward.

    Time fields: ``step_time_s`` is the median of ``steps`` steady-state steps
    timed with memory tracking off (synchronized on CUDA); ``throughput`` is
    ``batch_size / step_time_s``, NaN when the step does not fit. ``flops``
    are the floating-point operations of one step counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (recomputation included).

    CUDA records also keep the allocator's other peaks of the probe step:
    ``active_peak_bytes`` (allocated plus blocks still in use by another
    stream, such as swap's copies) and ``reserved_peak_bytes`` (segments held
    from the driver: what a budget caps and what a real card runs out of);
    None on the emulated device, which has no allocator.
    ``options["cuda_memory"]`` adds the bytes held outside the allocator (the
    CUDA context), the allocator configuration and pinned host memory;
    ``options["cuda_allocator_events"]`` what the timed steps asked of the
    driver, per step (segments reserved and released, allocations retried
    after releasing the cache: `momlab.device.ALLOCATOR_EVENTS`).

    ``attention``: the attention kernel (transformers' attn_implementation,
    "eager" or "sdpa"; None for models without attention); ``setup``: the
    named software stack it came from ("default", "paper": `momlab.workload.stack`).

    ``fits`` is False when the step ran out of memory (a real device OOM or the
    budget exceeded); then memory fields hold what was known at the failure
    (``peak_bytes`` the allocation that failed) and timings are NaN.
    """

    device: str
    budget: int | None = None
    attention: str | None = None
    setup: str = "default"
    # how the memory figure was obtained: "cuda", "cpu-emulated", "predicted"
    memory_source: str = "cpu-emulated"
    step_times_s: tuple = ()
    error: str | None = None
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    active_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Measurement":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["step_times_s"] = tuple(kw.get("step_times_s") or ())
        for k in ("step_time_s", "throughput"):
            if kw.get(k) is None:
                kw[k] = math.nan
        return cls(**kw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=True, sort_keys=True)
