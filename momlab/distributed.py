"""Data-parallel and sharded training over ranks: the paper's GPU-count context.

The paper's "context" scenario compares a MOM with Exact at 1, 2, 4 and 8
GPUs under data parallelism (its ``2v100``..``8v100`` runs). Here the number
of ranks and the parallel strategy are two more dimensions of a scenario:

| parallel        | what each rank holds (ZeRO stage)                                           |
|-----------------|-----------------------------------------------------------------------------|
| ``none``        | one rank, plain training (the 1-GPU baseline, run in a worker like the rest) |
| ``ddp``         | full weights, gradients and optimizer state; gradients all-reduced (ZeRO-0) |
| ``fsdp``        | 1/ranks of each, every block re-gathered in forward and backward (ZeRO-3)   |
| ``zero2``       | 1/ranks of each, blocks stay gathered from forward to backward (ZeRO-2)     |
| ``+offload``    | fsdp / zero2 with sharded weights, gradients and optimizer on the host       |

The recipe (`parallelize`, torchtitan's order) applies the MOM first (build()
does, through momlab.moms.apply), then wraps: DDP around the model, or FSDP2's
`fully_shard` on every block (`catalog.blocks` after the MOM, so a
checkpointed block is sharded in its wrapper) and then on the root. The
optimizer is created after wrapping, on the sharded parameters.

Ranks are processes started from a fork server (torch.multiprocessing's
"forkserver" context: a clean process that imported torch and transformers
once, so a launch costs a fork, not a 5-10 s import; CUDA-safe, because the
server never touches CUDA), joined by torch.distributed: gloo on CPU, nccl on
CUDA (one GPU per rank). The parent supervises: a rank that dies (killed, a
segfault) or fails stops every other rank at once and raises `RankFailed`;
the whole run is bounded by ``timeout_s`` (also the process-group timeout).

Each rank measures itself exactly as `momlab.measure` does (warm-up steps,
one probe step with memory accounting and FLOP counting, timed steps with
accounting off): on CPU the emulated device of momlab.accounting, per rank,
made aware of DTensor shards (counted by their local storage) and of storage
resizes (FSDP frees and re-allocates gathered weights with
``UntypedStorage.resize_``, which no dispatch mode sees; torch's own
MemTracker patches the same method); on CUDA the allocator's counters.
Data: every rank draws the same seeded global batch of ``ranks *
batch_size`` samples on the host and keeps its own slice, so a distributed
step sees exactly the batch one rank would see at the global batch size.
On CPU each rank runs one thread: a rank stands for one device of fixed
speed, so up to the core count more ranks add compute, as more GPUs do; past
it ranks share cores and CPU throughput stops scaling (gloo's collectives
over shared memory are also no NVLink): read CPU rank scans for memory and
for a MOM's relative overheads, not for GPU speed-ups.

Per rank, the usual categories, plus one: ``comm_bytes``, communication
buffers resident at the end of forward that are no weight, gradient or
optimizer state: FSDP's gathered weights of units not resharded after
forward (the root's; every block's under zero2), which are all-gather
outputs. DDP's buckets would be one, but with ``gradient_as_bucket_view``
they are the gradients' storage, so they count once, as ``grads_bytes``
(resident all step long: they are taken out of the activations too).
Transient buffers (all-gather inputs, reduce-scatter inputs, a block's
gathered weights while it runs) are in ``workspace_bytes``.

References: PyTorch DDP (Li et al., VLDB 2020); ZeRO (Rajbhandari et al.,
SC 2020) for the stages; PyTorch FSDP (Zhao et al., VLDB 2023) and torchtitan
(Liang et al., 2024) for per-block sharding and the order of the recipe.

    >>> m = measure_distributed("vit-base", ranks=2, parallel="fsdp", batch_size=2,
    ...                         **tiny("vit-base"))  # doctest: +SKIP
    >>> m.options["ranks"], len(m.options["per_rank"])  # doctest: +SKIP
    (2, 2)

A running fork server keeps the momlab it imported: after editing momlab,
restart the interpreter (or kernel) that launches the ranks.
"""

from __future__ import annotations

import datetime
import functools
import gc
import inspect
import math
import os
import shutil
import signal
import statistics
import tempfile
import time
import traceback
import weakref
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import wait as wait_for

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from momlab import catalog
from momlab.accounting import StorageTracker, host_allocation
from momlab.device import CudaMemory, empty_cache, is_oom, synchronize
from momlab.config import PARALLEL, Config, parallel_name, parse_parallel  # noqa: F401  (re-exported)
from momlab.errors import OutOfMemory
from momlab.provenance import environment
from momlab import steps
from momlab.record import Measurement
from momlab.usermodel import name_of
from momlab.workload import Workload, build

DEFAULT_TIMEOUT_S = 900.0
CPU_THREADS_PER_RANK = 1
# after one rank failed (died, ran out of memory, raised), how long the others
# get to report before they are stopped: a peer blocked in a collective with
# the failed rank reports a broken connection within this time, or never
SETTLE_S = 3.0
# DDP re-orders its gradient buckets in its second iteration (in the order
# gradients arrived) and allocates new ones then: a DDP measurement warms up
# at least this many steps, so the probe step sees the final buckets
DDP_MIN_WARMUP = 2
# how long a CPU rank yields before reading its account at the end of forward (see _RankProbe.forward_end);
# the peak itself can still include such a buffer (docs/LOG.md, 2026-12-03 14:20)
GLOO_SETTLE_S = 0.01
# modules a rank needs, imported once by the fork server
_PRELOAD = ["momlab.distributed", "transformers.modeling_utils"] + [
    f"transformers.models.{m}" for m in ("bert.modeling_bert", "gpt2.modeling_gpt2", "swin.modeling_swin",
                                         "vit.modeling_vit", "resnet.modeling_resnet")]
# keys of a per-rank record (Measurement.options["per_rank"][r])
RANK_FIELDS = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
               "workspace_bytes", "comm_bytes", "host_bytes")


class RankFailed(RuntimeError):
    """A rank died, failed or hung; every other rank was stopped."""


# -- names and checks ------------------------------------------------------------------

def threads_per_rank(ranks: int, device: torch.device) -> int:
    """CPU threads of each rank. On CPU one (torchrun's default), so that a rank stands for one device of
    fixed speed, as a GPU does, and ranks up to the core count add compute. (Splitting the cores instead
    made one rank fast and many ranks slow, and oversubscribed OpenMP on a shared machine.)"""
    if device.type == "cpu":
        return CPU_THREADS_PER_RANK
    # on CUDA the CPU feeds the GPU and, with offload, runs the optimizer step: share the cores out
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks)


# -- the recipe: MOM first (build), then the parallel wrapper, then the optimizer ------------------

def apply_ddp(net: nn.Module, device: torch.device) -> nn.Module:
    """DistributedDataParallel, gradients as views of the all-reduce buckets.

    With ``gradient_as_bucket_view=True`` the buckets *are* the gradients'
    storage: one gradient-sized allocation, resident for the whole step (DDP
    keeps it between steps even when grads are set to None), and no second
    copy. momlab reports it as ``grads_bytes``, and takes it out of the
    activations it would otherwise inflate at the end of forward.
    """
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(net, device_ids=ids, gradient_as_bucket_view=True)


def apply_fsdp(net: nn.Module, blocks: list[nn.Module], *, device: torch.device, reshard_after_forward: bool = True,
               offload: bool = False) -> nn.Module:
    """FSDP2 `fully_shard` on every block, then on the root (ZeRO-3; ZeRO-2 without resharding).

    Each block is one all-gather / reduce-scatter unit; the root takes what
    is left (embeddings, head). `offload` keeps the shards, their gradients
    and the optimizer step on the host (`CPUOffloadPolicy`, pinned on CUDA).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    # the root's parameters are needed first in backward: FSDP keeps them gathered after forward ("auto")
    fully_shard(net, mesh=mesh, reshard_after_forward=None if reshard_after_forward else False,
                offload_policy=policy)
    return net


def parallelize(w: Workload, strategy: str, *, offload: bool = False) -> Workload:
    """Wrap a built workload (MOM already applied) for `strategy`; a new optimizer on the wrapped parameters."""
    if strategy == "none":
        w.options.update(parallel="none")
        return w
    if w.half_model:
        raise ValueError(f"{w.name} trains as a half model with fp32 master weights (the paper setup's fairseq "
                         f"fp16); parallel strategies ({strategy}) run autocast: use setup='default', or one rank")
    # the strategy's own gradient buffers replace the one-GPU DDP buckets a setup emulates (`Stack.ddp_buckets`)
    w.ddp_buckets = False
    w.options["ddp_buckets"] = False
    if strategy == "ddp":
        w.model = apply_ddp(w.model, w.device)
        w.options.update(parallel="ddp", gradient_as_bucket_view=True)
    else:
        apply_fsdp(w.model, catalog.blocks(w.name, w.model), device=w.device,
                   reshard_after_forward=strategy == "fsdp", offload=offload)
        w.options.update(parallel=parallel_name(strategy, offload), reshard_after_forward=strategy == "fsdp",
                         fsdp_units=len(catalog.blocks(w.name, w.model)) + 1,
                         mixed_precision="autocast, fp32 all-gather and reduce-scatter")
        _keep_gathered_weights(w)
        if w.scaler is not None:
            # each rank sees only its gradient shard: inf/NaN must be agreed on by all ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            w.scaler = ShardedGradScaler(w.device.type)
    # sharding replaced the parameters: the optimizer build() made (no state yet) points at the old ones
    w.optimizer = _same_optimizer(w.optimizer, w.model.parameters())
    return w


def _keep_gathered_weights(w: Workload) -> None:
    """Tell the MOM's saved-tensor hooks that FSDP's gathered weights are weights, not activations.

    A hook-based MOM (quant, swap) passes the model's parameters through
    untouched, recognizing them by storage, collected when it was applied.
    FSDP replaces them: the weights a block computes with are gathered into
    buffers FSDP creates on the first all-gather and re-fills in place
    afterwards. Gather each unit once now, hand those weights to the MOM,
    and shard again; otherwise quant would quantize the weights saved for
    backward and swap would copy them to the host on every forward.
    """
    hooks = getattr(w.handle, "hooks", None)
    if hooks is None:
        return
    from torch.distributed.fsdp import FSDPModule

    gathered = []
    for module in [m for m in w.model.modules() if isinstance(m, FSDPModule)]:
        module.unshard()
        gathered += [p for p in module.parameters() if not is_sharded(p)]
        module.reshard()
    keep = getattr(w.handle, "keep", None)
    if keep is not None:  # the MOM library's own way, once it has one
        keep(gathered)
    else:
        hooks._state.update(t.untyped_storage()._cdata for t in gathered)
        hooks._state_refs += gathered
    w.options["mom_keeps_gathered_weights"] = True


def _same_optimizer(opt: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """A fresh optimizer of `opt`'s class and settings over `params`."""
    accepted = inspect.signature(type(opt).__init__).parameters
    return type(opt)(params, **{k: v for k, v in opt.defaults.items() if k in accepted})


# -- the emulated device of one rank -----------------------------------------------------

def local_tensors(tensors) -> list[torch.Tensor]:
    """Plain tensors behind `tensors`: a DTensor (or other wrapper subclass) by its inner tensors."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += local_tensors(getattr(t, n) for n in names)
        else:
            out.append(t)
    return out


def local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`, shards by their local storage."""
    seen = {}
    for t in local_tensors(tensors):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def is_sharded(t: torch.Tensor) -> bool:
    return is_traceable_wrapper_subclass(t)


class RankTracker(StorageTracker):
    """`StorageTracker` for one rank of a distributed step.

    Two things the single-device tracker does not meet: DTensor (FSDP2's
    sharded parameters, gradients and optimizer state), whose own "storage"
    is a placeholder of the global size, so shards are counted by their local
    storage; and ``UntypedStorage.resize_`` (FSDP frees a gathered weight by
    resizing its storage to 0 and re-allocates it in place), which no
    dispatch mode sees: while active, resizes of tracked storages are booked
    (as torch.distributed._tools.mem_tracker does). `to_host` moves storages
    to the host account (CPU offload on the emulated device, where "host"
    and "device" are the same memory).
    """

    def _register(self, t: torch.Tensor, *, host: bool, check: bool) -> None:
        for local in local_tensors([t]):
            if local.device.type in self.devices:
                self._book(local.untyped_storage(), host, check)

    def _book(self, st, host: bool, check: bool) -> None:
        key, nbytes = st._cdata, st.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, host, weakref.ref(st, self._finalizer(key))]
            self._add(nbytes, host, check)
        elif nbytes != entry[0]:
            grown = nbytes - entry[0]
            entry[0] = nbytes
            self._add(grown, entry[1], check and grown > 0)

    def tracked_bytes(self, tensors) -> int:
        return super().tracked_bytes(local_tensors(tensors))

    def to_host(self, tensors) -> None:
        """Book the storages behind `tensors` as host memory from now on."""
        for t in local_tensors(tensors):
            entry = self._live.get(t.untyped_storage()._cdata)
            if entry is not None and not entry[1]:
                entry[1] = True
                self.device_bytes -= entry[0]
                self.host_bytes += entry[0]
                self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        @functools.wraps(original)
        def resize_(st, size):
            out = original(st, size)
            entry = tracker._live.get(st._cdata)
            if entry is not None:
                tracker._book(st, entry[1], True)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


# -- one rank ---------------------------------------------------------------------------

class _Rank:
    """Builds, wraps and measures the workload of one rank (runs inside the worker)."""

    def __init__(self, rank: int, cfg: dict, tell):
        self.rank, self.cfg, self.tell = rank, cfg, tell
        self.world = cfg["ranks"]
        self.device = torch.device(f"cuda:{rank}") if cfg["device"] == "cuda" else torch.device(cfg["device"])
        self.strategy, self.offload = cfg["strategy"], cfg["offload"]
        self.losses: list[float] = []
        self.step_index = 0

    # data: the seeded global batch, drawn on the host, this rank's slice on the device
    def batch(self) -> dict:
        w, b = self.w, self.cfg["batch_size"]
        with host_allocation():
            full = catalog.batch(w.name, w.size, self.world * b, w.generator, "cpu")
        lo = self.rank * b
        return {k: v[lo:lo + b].to(self.device, copy=True) for k, v in full.items()}

    def budget(self) -> int | None:
        """The run's per-rank budget, or the test hook's own for this rank."""
        fault = self.cfg.get("fault") or {}
        if fault.get("rank") == self.rank and "budget" in fault:
            return int(fault["budget"])
        return self.cfg["budget"]

    def step(self, inputs: dict | None = None, **probe) -> float:
        self.tell("phase", f"step {self.step_index}")
        fault = self.cfg.get("fault") or {}
        if fault.get("rank") == self.rank and fault.get("step") == self.step_index:
            os.kill(os.getpid(), getattr(signal, fault.get("signal", "SIGKILL")))
        loss = self.w.step(inputs, **probe)
        self.losses.append(loss)
        self.step_index += 1
        return loss

    def build(self) -> None:
        c = self.cfg
        w = build(c["model"], batch_size=c["batch_size"], mom=c["mom"], device=str(self.device),
                  precision=c["precision"], seed=c["seed"], attention=c.get("attention"),
                  setup=c.get("setup", "default"), **c["size"])
        self.w = parallelize(w, self.strategy, offload=self.offload)
        self.w.batch = self.batch  # Workload.step draws its batch through this

    def _offload_hooks(self, tracker: RankTracker) -> None:
        """CPU offload on the emulated device: optimizer step and gradient shards live on the host."""
        host = ExitStack()
        self.w.optimizer.register_step_pre_hook(lambda *a: host.enter_context(host_allocation()))
        self.w.optimizer.register_step_post_hook(lambda *a: host.close())
        for p in self.w.model.parameters():
            # FSDP calls these after it set the reduced gradient shard (its own post-backward)
            p.register_post_accumulate_grad_hook(lambda p: tracker.to_host([p.grad]))

    def run(self) -> dict:
        self.tell("phase", "build")
        self.build()
        warmup = self.cfg["warmup"]
        if self.strategy == "ddp":
            warmup = max(warmup, DDP_MIN_WARMUP)
        if self.device.type == "cuda":
            out = self._measure_cuda(warmup)
        else:
            out = self._measure_emulated(warmup)
        self.tell("phase", "timed steps")
        out["step_times_s"] = self._timed_steps(self.cfg["steps"])
        out["losses"] = list(self.losses)
        out["warmup_steps"] = self.warmup_steps
        out["options"] = {k: v for k, v in self.w.options.items() if _plain(v)}
        return out

    def _params(self):
        return self.w.state_tensors()["params"]

    def _bucket_probe(self, tracker: RankTracker | None):
        """A backward-end callback that remembers (and books) DDP's bucket storages, the gradients' storage."""
        self.buckets: list[torch.Tensor] = []

        def capture():
            grads = self.w.state_tensors()["grads"]
            if tracker is not None:
                tracker.track(grads)
            self.buckets = grads
        return capture

    def _measure_emulated(self, warmup: int) -> dict:
        tracker = RankTracker(budget=self.budget())
        w = self.w
        with tracker:
            tracker.track(self._params())
            if self.offload:
                tracker.to_host(p for p in w.model.parameters() if is_sharded(p))
                self._offload_hooks(tracker)
            tracker.check_budget()
            capture = self._bucket_probe(tracker)
            self._warm_up(warmup, capture)
            gc.collect()
            tracker.reset_peak()
            probe = _RankProbe(self, lambda: tracker.device_bytes, lambda: tracker.host_bytes, tracker.tracked_bytes)
            self.step(on_forward_end=probe.forward_end, on_backward_end=probe.backward_end)
            peak = tracker.peak_bytes
            state = w.state_tensors()
            out = probe.breakdown(peak, tracker.tracked_bytes(state["params"]),
                                  tracker.tracked_bytes(state["optimizer"]))
        out.update(flops=self._count_flops(), memory_source="cpu-emulated")
        return out

    def _count_flops(self, room=None) -> int:
        return steps.count_flops(self.step, room)

    def _measure_cuda(self, warmup: int) -> dict:
        mem = CudaMemory(self.device, self.budget())
        empty_cache(self.device)
        w = self.w
        with mem.capped():
            capture = self._bucket_probe(None)
            self._warm_up(warmup, capture)
            gc.collect()
            synchronize(self.device)
            mem.reset_peak()
            # what a MOM keeps in host memory (swap's copies, made inside host_allocation()): CPU tensors
            host = StorageTracker(devices=("cpu",))

            def device_bytes(tensors):
                return local_bytes(t for t in local_tensors(tensors) if t.device.type == "cuda")

            probe = _RankProbe(self, mem.allocated, lambda: host.host_bytes + self._offloaded_bytes(), device_bytes)
            with host:
                self.step(on_forward_end=probe.forward_end, on_backward_end=probe.backward_end)
            synchronize(self.device)
            state = w.state_tensors()
            out = probe.breakdown(mem.peak(), device_bytes(state["params"]), device_bytes(state["optimizer"]))
            peaks = mem.peaks()
            out.update(flops=self._count_flops(mem.uncapped()), memory_source="cuda",
                       active_peak_bytes=peaks["active"], reserved_peak_bytes=peaks["reserved"])
        return out

    def _warm_up(self, n: int, capture) -> None:
        hook = capture if self.strategy == "ddp" else None
        steps.warm_up(lambda: self.step(on_backward_end=hook), self.w.optimizer, n)
        self.warmup_steps = self.step_index

    def _offloaded_bytes(self) -> int:
        """Host bytes of offloaded shards and optimizer state (CUDA; the emulated device books them itself)."""
        if not self.offload:
            return 0
        state = self.w.state_tensors()
        return local_bytes(t for t in local_tensors(state["params"] + state["grads"] + state["optimizer"])
                           if t.device.type == "cpu")

    def _timed_steps(self, n: int) -> list[float]:
        # every rank starts the step together: a step is as slow as its slowest rank
        barrier = dist.barrier if dist.is_initialized() else None
        return steps.timed_steps(self.step, self.batch, self.device, n, before=barrier)


class _RankProbe:
    """The probe step of one rank: the account at the end of forward and of backward."""

    def __init__(self, rank: _Rank, live, host, bytes_of):
        self.r, self.live, self.host, self.bytes_of = rank, live, host, bytes_of
        self.forward_live = self.forward_host = self.grads = self.comm = self.forward_grads = 0

    def forward_end(self):
        r = self.r
        if r.device.type == "cpu" and dist.is_initialized():
            # gloo's worker thread drops a finished collective's buffers a moment after the rank moved on,
            # and that free needs the GIL: let it run before reading (it was once counted as activations)
            time.sleep(GLOO_SETTLE_S)
        self.forward_live = self.live()
        self.forward_host = self.host()
        if r.strategy == "ddp":
            # the buckets (the gradients' storage) stay resident between steps
            self.comm = self.bytes_of(r.buckets)
        elif r.strategy in ("fsdp", "zero2"):
            # parameters still gathered after forward: the root's always (FSDP does not reshard
            # what backward needs first), every block's under zero2. They are all-gather outputs.
            self.comm = self.bytes_of([p for p in r.w.model.parameters() if not is_sharded(p)])
        if r.strategy != "ddp":
            # gradients zeroed in place (setup="paper") stay resident through forward: not activations
            self.forward_grads = self.bytes_of(r.w.state_tensors()["grads"])

    def backward_end(self):
        self.grads = self.bytes_of(self.r.w.state_tensors()["grads"])

    def breakdown(self, peak: int, params: int, optimizer: int) -> dict:
        # DDP's buckets are the gradients: counted once, as grads_bytes, and
        # not again as a communication buffer (see apply_ddp)
        ddp = self.r.strategy == "ddp"
        comm = 0 if ddp else self.comm
        activation = max(0, self.forward_live - params - optimizer - self.comm - self.forward_grads)
        workspace = max(0, peak - params - self.grads - optimizer - activation - comm)
        return dict(fits=True, peak_bytes=peak, params_bytes=params, grads_bytes=self.grads,
                    optimizer_bytes=optimizer, activation_bytes=activation, workspace_bytes=workspace,
                    comm_bytes=comm, host_bytes=self.forward_host)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _worker(rank: int, cfg: dict, conn) -> None:
    """Entry point of one rank process: result, out-of-memory or error goes back through `conn`."""

    def tell(kind, payload=None):
        conn.send((kind, payload))

    code = 0
    try:
        torch.set_num_threads(cfg["threads"])
        if cfg["device"] == "cuda":
            torch.cuda.set_device(rank)
        if cfg["strategy"] != "none":
            dist.init_process_group("nccl" if cfg["device"] == "cuda" else "gloo", init_method=cfg["init_method"],
                                    rank=rank, world_size=cfg["ranks"],
                                    timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
        tell("result", _Rank(rank, cfg, tell).run())
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        code = 1
        if is_oom(exc):
            live = exc.live if isinstance(exc, OutOfMemory) else (
                torch.cuda.memory_allocated(rank) if cfg["device"] == "cuda" else 0)
            tell("oom", {"live": int(live), "error": str(exc).splitlines()[0]})
        else:
            tell("error", "".join(traceback.format_exception(exc)))
    finally:
        conn.close()
    if code:
        # a failed rank must not wait for its peers in a collective or at shutdown
        os._exit(code)
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the supervisor ---------------------------------------------------------------------------

def _context():
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _process_state(pid: int | None) -> str:
    """The kernel's word for a process (running, sleeping, stopped...), where /proc has it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    return {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "traced",
            "Z": "exited"}.get(code, f"state {code}")


def _stop(procs, grace_s: float = 0.0) -> None:
    """Let ranks exit on their own for `grace_s`, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


@contextmanager
def _main_without_missing_file():
    """A rank re-imports the parent's main script, as multiprocessing does; one read from stdin
    (``python -``) has no file to import, and the ranks need nothing from it."""
    import sys

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def launch(cfg: dict, *, timeout_s: float) -> tuple[dict[int, dict], dict[int, dict]]:
    """Run `cfg["ranks"]` workers; return (results by rank, out-of-memory reports by rank).

    Raises `RankFailed` when a rank dies or fails (everyone else stopped
    first), or when the run outlives `timeout_s`.
    """
    ranks = cfg["ranks"]
    ctx = _context()
    rendezvous = tempfile.mkdtemp(prefix="momlab-dist-")
    cfg = {**cfg, "init_method": "file://" + os.path.join(rendezvous, "store"), "timeout_s": timeout_s}
    procs, readers = [], []
    grace = 0.0
    try:
        with _main_without_missing_file():
            for r in range(ranks):
                receive, send = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(r, cfg, send), name=f"momlab-rank{r}", daemon=True)
                p.start()
                send.close()
                procs.append(p)
                readers.append(receive)
        out = _supervise(procs, readers, cfg, timeout_s)
        grace = 5.0  # every rank answered: let them shut their process group down
        return out
    finally:
        _stop(procs, grace)
        for c in readers:
            c.close()
        shutil.rmtree(rendezvous, ignore_errors=True)


def _supervise(procs, readers, cfg, timeout_s):
    ranks = len(procs)
    what = (f"{cfg['model']} {cfg['mom']} {parallel_name(cfg['strategy'], cfg['offload'])} on {ranks} "
            f"{cfg['device']} rank(s), batch {cfg['batch_size']} per rank")
    deadline = time.monotonic() + timeout_s
    phase = {r: "start-up" for r in range(ranks)}
    outcome: dict[int, tuple[str, object]] = {}  # rank -> (result | oom | error | died, payload)
    settle = None  # after the first failure, until when the other ranks' outcomes are collected
    while len(outcome) < ranks:
        now = time.monotonic()
        if now >= deadline or (settle is not None and now >= settle):
            break
        pending = [r for r in range(ranks) if r not in outcome]
        wait_for([readers[r] for r in pending] + [procs[r].sentinel for r in pending],
                 timeout=min(min(deadline, settle or deadline) - now, 1.0))
        for r in pending:
            try:
                while readers[r].poll():
                    kind, payload = readers[r].recv()
                    if kind == "phase":
                        phase[r] = payload
                        continue
                    outcome[r] = (kind, payload)
                    break
            except (EOFError, OSError):  # its end of the pipe closed without a word: the process is gone
                procs[r].join(5)
                outcome[r] = ("died", procs[r].exitcode)
            if r not in outcome and procs[r].exitcode is not None:  # gone, and everything it sent was read
                outcome[r] = ("died", procs[r].exitcode)
            if r in outcome and outcome[r][0] != "result" and settle is None:
                # a peer's failure is usually noticed by the others as a broken collective a moment
                # later: collect those before naming the cause
                settle = time.monotonic() + SETTLE_S
    results = {r: p for r, (k, p) in outcome.items() if k == "result"}
    ooms = {r: p for r, (k, p) in outcome.items() if k == "oom"}
    died = {r: p for r, (k, p) in outcome.items() if k == "died"}
    errors = {r: p for r, (k, p) in outcome.items() if k == "error"}

    def also() -> str:
        lines = [f"rank {r} then failed: {str(e).strip().splitlines()[-1]}" for r, e in sorted(errors.items())]
        return ("; " + "; ".join(lines)) if lines else ""

    if died:
        r, code = min(died.items())
        raise RankFailed(f"rank {r} of {ranks} died ({_describe_exit(code)}) during {phase[r]} of {what}; "
                         f"stopped the other ranks{also()}")
    if ooms:
        return results, ooms  # the others failing in a collective with it is a consequence
    if errors:
        r, text = min(errors.items())
        errors.pop(r)
        raise RankFailed(f"rank {r} of {ranks} failed during {phase[r]} of {what}; stopped the other ranks"
                         f"{also()}. Its error:\n{text}")
    if len(results) < ranks:
        late = ", ".join(f"rank {r} in {phase[r]} ({_process_state(procs[r].pid)})"
                         for r in range(ranks) if r not in results)
        raise RankFailed(f"{what}: no result within timeout_s={timeout_s:g} s: {late}; stopped every rank")
    return results, ooms


# -- measure_distributed -----------------------------------------------------------------------

def measure_distributed(model: str, mom: str = "exact", *, ranks: int, parallel: str = "ddp", batch_size: int,
                        device: str = "cpu", budget=None, precision: str = "fp32", steps: int = 3, warmup: int = 1,
                        seed: int = 0, offload: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, _fault=None,
                        **size) -> Measurement:
    """Measure one configuration trained on `ranks` ranks with `parallel`; see the module docstring.

    `batch_size` is per rank (the global batch is ``ranks * batch_size``);
    `budget` is per rank. The memory fields are per rank, each the maximum
    over ranks; ``options["per_rank"]`` holds every rank's own record
    (`RANK_FIELDS`, ``flops``, ``step_times_s``). ``comm_bytes`` (in
    options and per rank): communication buffers resident at the end of
    forward and not otherwise counted: FSDP's parameters still gathered then
    (the root's; every block's under zero2); 0 for DDP, whose buckets are
    the gradients (``grads_bytes``). ``host_bytes`` includes offloaded
    shards and optimizer state. ``step_time_s``: median over timed steps of
    the slowest rank's step; ``throughput``: ``ranks * batch_size /
    step_time_s`` (samples per second over all ranks); ``flops``: one
    rank's step. ``options["losses"]``: the loss of every step run (warm-up,
    probe, timed), averaged over ranks. A rank out of memory makes the record
    ``fits=False``; a rank that dies or fails raises `RankFailed`, within
    `timeout_s` at the latest. ``_fault`` is a test hook:
    ``{"rank": r, "step": k}`` kills rank r at the start of its step k;
    ``{"rank": r, "budget": b}`` gives rank r a budget of its own.

    >>> m = measure_distributed("vit-base", ranks=2, parallel="ddp", batch_size=2,
    ...                         **tiny("vit-base"))  # doctest: +SKIP
    >>> m.throughput == 2 * 2 / m.step_time_s  # doctest: +SKIP
    True
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return measure_ranks(Config.of(model, mom, ranks=ranks, parallel=parallel, offload=offload, batch_size=batch_size,
                                   device=device, budget=budget, precision=precision, steps=steps, warmup=warmup,
                                   seed=seed, what="measure_distributed", **size),
                         timeout_s=timeout_s, _fault=_fault)


def measure_ranks(config: Config, *, timeout_s: float = DEFAULT_TIMEOUT_S, _fault=None) -> Measurement:
    """`measure_distributed` of a checked `Config` (what `momlab.measure` calls with ranks= / parallel=)."""
    c, dev = config, config.device
    threads = threads_per_rank(c.ranks, dev)
    cfg = dict(model=c.model, mom=c.mom, ranks=c.ranks, strategy=c.parallel, offload=c.offload,
               batch_size=c.batch_size, device=dev.type, precision=c.precision, size=c.size, budget=c.budget,
               steps=c.steps, warmup=c.warmup, seed=c.seed, threads=threads, fault=_fault,
               attention=c.attention, setup=c.setup)
    base = dict(model=name_of(c.model), mom=c.mom, batch_size=c.batch_size, device=dev.type, precision=c.precision,
                size=c.size, budget=c.budget, attention=c.attention, setup=c.setup,
                env={**environment(dev), "threads": threads})
    results, ooms = launch(cfg, timeout_s=float(timeout_s))
    options = {"ranks": c.ranks, "parallel": parallel_name(c.parallel, c.offload), "offload": c.offload,
               "global_batch_size": c.ranks * c.batch_size, "threads_per_rank": threads,
               "launcher": "torch.multiprocessing forkserver",
               "backend": None if c.parallel == "none" else ("nccl" if dev.type == "cuda" else "gloo")}
    ranks = c.ranks
    if ooms:
        return _unfit(base, ranks, results, ooms, options)
    return _combine(base, ranks, results, options)


def _combine(base: dict, ranks: int, results: dict[int, dict], options: dict) -> Measurement:
    per_rank = [results[r] for r in range(ranks)]
    # all ranks step together: a step lasts as long as its slowest rank
    times = [max(r["step_times_s"][i] for r in per_rank) for i in range(len(per_rank[0]["step_times_s"]))]
    step_time = statistics.median(times)
    memory = {k: max(r[k] for r in per_rank) for k in RANK_FIELDS}
    losses = [statistics.fmean(r["losses"][i] for r in per_rank) for i in range(len(per_rank[0]["losses"]))]
    options = {**per_rank[0]["options"], **options, "comm_bytes": memory.pop("comm_bytes"),
               "losses": losses, "warmup_steps": per_rank[0]["warmup_steps"],
               "per_rank": [{"rank": i, **{k: r[k] for k in (*RANK_FIELDS, "flops")},
                             "step_times_s": list(r["step_times_s"])} for i, r in enumerate(per_rank)]}
    allocator = {k: max(r[k] for r in per_rank) for k in ("active_peak_bytes", "reserved_peak_bytes")
                 if k in per_rank[0]}  # CUDA ranks only
    return Measurement(**base, fits=True, **memory, **allocator, step_time_s=step_time,
                       throughput=ranks * base["batch_size"] / step_time,
                       flops=max(r["flops"] for r in per_rank), memory_source=per_rank[0]["memory_source"],
                       step_times_s=tuple(times), options=options)


def _unfit(base: dict, ranks: int, results: dict, ooms: dict, options: dict) -> Measurement:
    r, first = min(ooms.items())
    live = max(o["live"] for o in ooms.values())
    options = {**options, "oom_ranks": sorted(ooms), "comm_bytes": 0,
               "per_rank": [{"rank": i, "fits": i not in ooms and i in results,
                             "live_bytes": ooms[i]["live"] if i in ooms else None} for i in range(ranks)]}
    nan = math.nan
    return Measurement(**base, fits=False, peak_bytes=live, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
                       activation_bytes=0, workspace_bytes=0, host_bytes=0, step_time_s=nan, throughput=nan, flops=0,
                       memory_source="cuda" if base["device"] == "cuda" else "cpu-emulated",
                       error=f"rank {r}: {first['error']}", options=options)


def measurer(ranks: int, parallel: str = "ddp", *, offload: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A `measure`-compatible function at a fixed rank count, for momlab.search and momlab.sweep's `measure_fn`.

    >>> s = max_batch_size("vit-base", budget="64MiB", measure_fn=measurer(2, "fsdp"),
    ...                    **tiny("vit-base"))  # doctest: +SKIP
    """
    strategy, offload = parse_parallel(parallel, offload)
    return functools.partial(measure_distributed, ranks=ranks, parallel=strategy, offload=offload,
                             timeout_s=timeout_s)


__all__ = ["PARALLEL", "RankFailed", "RankTracker", "apply_ddp", "apply_fsdp", "launch", "measure_distributed",
           "measurer", "parallelize", "parse_parallel"]
