"""One configuration, checked once at the public edge and passed on frozen.

`Config.of(...)` takes what `momlab.measure` takes, checks every value (a
ValueError names what is valid) and returns a frozen `Config`: the model
resolved, its size with defaults filled in, the MOM parsed (`momlab.moms.Mom`),
the device normalized, the budget in bytes, the parallel strategy split from
its offload, the software stack resolved (`momlab.workload.stack`: the
attention kernel a setup gives the model). measure, measure_distributed and the searches build on it; the
layers below take its fields as they are and do not check or parse again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from momlab import catalog
from momlab.device import check_device
from momlab.errors import check_choice
from momlab.moms import Mom, parse_mom
from momlab.units import parse_bytes
from momlab.usermodel import resolve
from momlab.workload import PRECISIONS, Stack, check_batch_size, stack

# the spellings `parallel` accepts; "+offload" only where weights are sharded
PARALLEL = ("none", "ddp", "fsdp", "zero2", "fsdp+offload", "zero2+offload")


def parse_parallel(parallel: str, offload: bool = False) -> tuple[str, bool]:
    """(strategy, offload) from a `parallel` spelling; ValueError naming the valid ones.

    >>> parse_parallel("fsdp+offload"), parse_parallel("zero2", offload=True), parse_parallel("ddp")
    (('fsdp', True), ('zero2', True), ('ddp', False))
    """
    if not isinstance(parallel, str):
        raise ValueError(f"parallel must be a string, one of {', '.join(PARALLEL)}; got {parallel!r}")
    name = parallel.strip().lower()
    check_choice("parallel", name, PARALLEL)
    strategy, _, extra = name.partition("+")
    offload = bool(offload) or extra == "offload"
    if offload and strategy not in ("fsdp", "zero2"):
        raise ValueError(f"offload moves sharded weights, gradients and optimizer state to the host; it needs "
                         f"parallel 'fsdp' or 'zero2', not {strategy!r}")
    return strategy, offload


def parallel_name(strategy: str, offload: bool) -> str:
    return strategy + ("+offload" if offload else "")


def check_ranks(ranks, strategy: str, device: torch.device) -> int:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    if strategy == "none" and ranks != 1:
        raise ValueError(f"parallel='none' trains on one rank (ranks=1); with ranks={ranks} use 'ddp', 'fsdp' "
                         f"or 'zero2'")
    if device.type == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"ranks={ranks} needs one GPU per rank; this machine has {torch.cuda.device_count()}")
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"rank r runs on cuda:r; give device='cuda', not {device}")
    return ranks


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Config:
    """A checked training configuration (see the module docstring); build it with `Config.of`."""

    model: object  # a catalog name, or a resolved ConfigModel / UserModel
    mom: Mom
    batch_size: int  # per rank
    device: torch.device
    precision: str
    size: dict = field(default_factory=dict)
    budget: int | None = None  # bytes, per rank
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    ranks: int = 1
    parallel: str = "none"  # the strategy: none, ddp, fsdp or zero2
    offload: bool = False
    attention: str | None = None  # as resolved by the setup (`stack`); None: a model without attention
    setup: str = "default"

    @classmethod
    def of(cls, model, mom="exact", *, batch_size: int, device: str = "cpu", budget=None, precision: str = "fp32",
           steps: int = 3, warmup: int = 1, seed: int = 0, ranks: int = 1, parallel: str = "none",
           offload: bool = False, attention: str | None = None, setup: str = "default", what: str = "measure",
           **size) -> Config:
        """Check everything once; `what` names the caller in the errors that depend on it."""
        if isinstance(model, cls):
            return model
        model = resolve(model)
        catalog.spec(model)
        size = catalog.resolve_size(model, size)
        st = stack(model, setup, attention)
        mom = parse_mom(mom)
        strategy, offload = parse_parallel(parallel, offload)
        check_batch_size(batch_size)
        check_choice("precision", precision, PRECISIONS)
        dev = check_device(device)
        if dev.type == "meta":
            raise ValueError(f"{what} runs on a real device (cpu or cuda); use momlab.estimate for predictions")
        ranks = check_ranks(ranks, strategy, dev)
        if mom.has("ckpt-auto") and (strategy != "none" or ranks != 1):
            raise ValueError(f"{mom!r} on ranks: ckpt-auto searches its plan by steps that may run out of memory, "
                             f"and a rank out of memory in a collective ends the run; measure ckpt-auto on one "
                             f"rank (its plan is in options['ckpt_plan']) or use 'ckpt' on ranks")
        return cls(model=model, mom=mom, batch_size=batch_size, device=dev, precision=precision, size=size,
                   budget=None if budget is None else parse_bytes(budget), steps=_count("steps", steps),
                   warmup=_count("warmup", warmup), seed=seed, ranks=ranks, parallel=strategy, offload=offload,
                   attention=st.attention, setup=st.setup)

    @property
    def stack(self) -> Stack:
        """The software stack (`momlab.workload.Stack`) of this configuration."""
        return stack(self.model, self.setup, self.attention)

    @property
    def distributed(self) -> bool:
        """Whether this runs on ranks (a parallel strategy), not as plain one-process training."""
        return self.parallel != "none" or self.ranks != 1
