"""Predict memory and speed of a training step on a GPU we are not running on.

Memory is not modelled, it is *traced*: the workload's own step (the same
``build()``, MOMs included, and the same `StorageTracker` accounting as
`momlab.measure` on CPU) runs with weights that are CPU ``FakeTensor``s:
tensors with shapes and dtypes but no data, so nothing is allocated and any
size can be asked (bert-large at batch 1024 on a laptop). FakeTensorMode
is not left on the mode stack: what does not touch a weight (token ids,
attention masks, position ids, optimizer step counts) runs for real, so a
traced step takes exactly the branches a real one takes (transformers
checks that an all-ones attention mask is all ones before skipping it, a
``.item()`` the ``meta`` device cannot answer). Fake CPU tensors, unlike
meta ones, also get CPU autocast (bf16/fp16) and the CPU's kernel choices.

The target's kernels decide part of what is saved: on CUDA, attention with
dropout runs in one fused kernel (memory-efficient attention) that keeps
only its output and log-sum-exp, while the CPU falls back to the math path
that materializes the attention probabilities and dropout mask. For a GPU the
trace runs sdpa as CUDA does, through that kernel's own meta implementation
(`_cuda_sdpa`); with eager attention (``attention="eager"``, the paper's
setup) the model's own matmul-softmax-dropout-matmul runs and saves what it
saves on any device, but for its dropout, which runs as CUDA's does
(`_cuda_dropout`: one kernel keeping a bool mask, where the CPU's draws and
keeps a float noise tensor of 2 or 4 bytes a value). Mixed precision follows CUDA's autocast op lists, not the
CPU's (`_CUDA_AUTOCAST`, from torch's documented "CUDA Ops that can autocast
to float32 / float16"): softmax, log-softmax, layer norm, pow, exp, sums and
the losses run in fp32 on CUDA where the CPU lists keep bf16/fp16. Each
device allocation is counted rounded up to the caching allocator's 512-byte
blocks; the cuBLAS workspace (allocated through the caching allocator, so in
the allocator's peak) and the CUDA context (outside it, but taking device
memory) are named fields of an `Estimate` (`CudaOverheads`). The caching
allocator's fragmentation (reserved beyond allocated) is modelled on request
(``allocator="caching"``): a fresh process traced at the batch in question,
its every allocation and free replayed through the allocator's rules
(`momlab.allocator`). Not modelled: cuDNN's per-convolution workspaces.

Memory is affine in batch size for a fixed graph, operation by operation:
the live bytes after the i-th operation are ``a_i + b_i * batch``. Two
traces (batch 2 and 4) give every a_i and b_i, so any batch is read off
without tracing again, and the peak is ``max_i(a_i + b_i * batch)`` (the
moment of the peak may move: weights-heavy optimizer step at small batches,
end of forward at large ones). The largest batch that fits follows in closed
form. Traces are cached per (model, MOM, precision, size, kernels), in the
process and on disk (build/cache/traces, see `TRACE_CACHE`): a trace costs
about half a millisecond an op, reading it back about ten milliseconds (a
new process: a notebook kernel, the CLI). A deep stack of identical blocks
is traced 3 and 4 blocks deep and unrolled to its depth (`_depth_profile`),
and a quantization pack or unpack already traced for a tensor of the same
signature is replayed, not dispatched again (`_Tracer.replay`); both give the
full trace to the byte; on Linux the deeper of the two shallow copies is
traced in a forked child beside the other (`_deeper_beside`). A trace's
warm-up primes the workload rather than stepping it (`Workload.prime`): a
first bert-large estimate in the paper's stack takes 0.8-1.8 s here, 1.2-1.6x
less than with the two copies traced one after the other; quant4 2.0-3.1 s,
1.0-1.5x less (`benchmarks/bench_validation.py`).

``ckpt-auto`` (alone or with quantization) checkpoints a plan of blocks
chosen per batch and budget, so it is no one configuration to trace: its
estimate plans as `momlab.measure` does (`momlab.moms.auto`), between the
traces of its two bounds, the MOM with no block checkpointed and with every
block checkpointed (`_auto_estimate`): block costs from a forward traced
with none checkpointed, blocks in order of bytes saved per recompute FLOP,
the fewest whose predicted peak (measure's first guess, `auto.predict_peak`)
fits the capacity. Its time adds to the no-checkpoint bound's the share of
full checkpointing's extra time that the chosen blocks' forward FLOPs are
of all blocks'. Measure then verifies its guess with steps; the estimate
has none to run, so it is that guess (`Estimate.ckpt_plan`).

Time comes from momlab.timemodel (a roofline per traced op, calibrated on
measured records of the device); the traces here are its input.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import platform
import signal
import sys
import threading
import time
import types
import warnings
import weakref
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from momlab import allocator, catalog, legacy
from momlab.gpus import Gpu
from momlab.gpus import get as get_gpu
from momlab.accounting import StorageTracker, unique_storage_bytes
from momlab import metrics, timemodel
from momlab.errors import check_choice
from momlab.moms import auto as _auto
from momlab.moms import quant as _quant
from momlab.record import StepRecord
from momlab.units import format_bytes, parse_bytes
from momlab.timemodel import Calibration, step_time
from momlab.usermodel import name_of, resolve
from momlab.workload import PRECISIONS, build, check_batch_size, parse_mom, stack

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parent.parent

# the batch sizes a profile is traced at: the first two that run the same ops (a batch of one is
# avoided: some code squeezes it; quantization packs only tensors of >= 1024 values, so a tiny model's
# smallest batches can differ in ops, and runs its chunk loop folded only for tensors of several chunks, so
# a tensor crossing that size between two batches changes the ops: resnet50's align from 64)
TRACE_BATCHES = (2, 4, 8, 16, 32, 64, 128)

_LOCK = threading.RLock()  # traces change global state (dispatch modes, seeds): one at a time

# PyTorch's CUDA caching allocator rounds every allocation up to 512 bytes (kMinBlockSize in
# c10/cuda/CUDACachingAllocator.cpp; torch.cuda.memory_allocated counts the rounded sizes)
ALLOCATOR_BLOCK = 512


@dataclass(frozen=True)
class CudaOverheads:
    """Device memory a CUDA training process uses beyond its tensors, the same for every model.

    ``cublas_workspace_bytes``: cuBLAS's workspace, allocated once per
    handle and stream through the caching allocator (so inside the
    allocator's peak): PyTorch's default ``CUBLAS_WORKSPACE_CONFIG``
    ``:4096:2:16:8`` (2 x 4096 KiB + 8 x 16 KiB) before Hopper, and
    ``:4096:8`` (8 x 4 MiB) from Hopper on (c10/cuda/CublasHandlePool.cpp).
    ``context_bytes``: the CUDA context with the kernel images of PyTorch,
    cuBLAS and cuDNN, outside the allocator, so device memory the allocator
    cannot have. NVIDIA documents no figure. Today's stack loads kernels
    lazily (CUDA >= 11.7, PyTorch >= 1.13 sets ``CUDA_MODULE_LOADING=LAZY``):
    512 MiB, the order reported for such processes ("around 400MB",
    pytorch/pytorch#109888), an assumption until measured on the target
    (``make gpu-check`` records it). The paper's stack (2022: PyTorch 1.12,
    CUDA 11.x before lazy loading) loaded every kernel image when a library
    loaded, "which took >1000MB" (pytorch/pytorch#107667, a PyTorch CUDA
    maintainer; PR #86509 measured 667 MB eager vs 287 MB lazy before cuBLAS
    or cuDNN load): `PAPER_CONTEXT_BYTES`, that lower bound.
    """

    cublas_workspace_bytes: int
    context_bytes: int


CONTEXT_BYTES = 512 * 2 ** 20  # lazy module loading (today's stack)
PAPER_CONTEXT_BYTES = 1000 * 2 ** 20  # eager module loading (the paper's 2022 stack): "took >1000MB"


def cuda_overheads(g: Gpu, setup: str = "default") -> CudaOverheads:
    """The `CudaOverheads` of a GPU (none on the cpu target) under a software `setup` (`momlab.workload.stack`)."""
    if g.kernels != "cuda":
        return CudaOverheads(0, 0)
    hopper = g.name.startswith(("H100", "H200"))  # sm90 gets the larger workspace
    cublas = 8 * 4 * 2 ** 20 if hopper else 2 * 4096 * 1024 + 8 * 16 * 1024
    return CudaOverheads(cublas, PAPER_CONTEXT_BYTES if setup == "paper" else CONTEXT_BYTES)


# -- tensors without data ------------------------------------------------------------------

def _dataless(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) or t.device.type == "meta"


class _AssumeScalars(TorchDispatchMode):
    """Answer ``.item()`` of a data-less tensor with zero (False).

    Used where the value cannot matter to memory: weight initializers that
    redraw until a random sample passes a test (values are never used by a
    trace), and the GradScaler's overflow check (a trace assumes the steady
    state: finite gradients, the optimizer steps).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default and _dataless(args[0]):
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


class _FiniteScaler:
    """A GradScaler whose overflow check assumes finite gradients (see `_AssumeScalars`)."""

    def __init__(self, scaler):
        self._scaler = scaler

    def scale(self, loss):
        return self._scaler.scale(loss)

    def step(self, optimizer):
        with _AssumeScalars():
            return self._scaler.step(optimizer)

    def update(self):
        with _AssumeScalars():
            return self._scaler.update()


_NORM_STATS = frozenset({aten.native_layer_norm.default, aten.native_batch_norm.default})


def _cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
               enable_gqa=False):
    """scaled_dot_product_attention as CUDA runs it: the fused memory-efficient kernel.

    CUDA runs attention (dropout included) in one fused kernel that saves its
    inputs, output and log-sum-exp for backward: memory-efficient attention
    for fp32 and wherever flash cannot run; flash, chosen for bf16/fp16 on
    Ampere and later, saves the same up to padding. Head dims the fused
    kernels refuse (not a multiple of 8) and grouped-query attention take the
    math path, as on CUDA, except grouped-query attention in bf16/fp16
    without a mask: flash runs it natively (Ampere and later; a V100 would
    take the math path), saving q, k, v unexpanded, output and log-sum-exp.
    Autocast has already cast q, k, v (sdpa is on CUDA's lower-precision
    list, as on the CPU's).
    """
    if (enable_gqa and attn_mask is None and query.dim() == 4 and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256):
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if query.shape[-1] % 8 or enable_gqa or query.dim() != 4:
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # sdpa turns a boolean mask into an additive one first
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(attn_mask.logical_not(),
                                                                                  float("-inf"))
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, grad, dropout_p, is_causal,
                                                        scale=scale)[0]


# CUDA autocast's op lists as torch documents them ("Autocast Op Reference", CUDA Op-Specific Behavior),
# for the ops whose CUDA treatment differs from the CPU's lists (the matmuls and convolutions, on both
# lower-precision lists, need nothing). fp32: inputs cast to float32.
_CUDA_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
              "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
              "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
              "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
              "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
              "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
              "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
              "logsumexp")
# fp32 by an output dtype: a float input is reduced / normalized into a float32 result
_CUDA_FP32_DTYPE = ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "prod", "prod.dim_int",
                    "cumsum", "cumprod", "linalg_vector_norm")
# lower precision on CUDA, on no CPU list
_CUDA_LOWER = ("addmv", "addr", "mv", "chain_matmul", "linalg_multi_dot")
# on the CPU's fp32 list but on none of CUDA's: CUDA decomposes it (its log_softmax then runs in fp32)
_CUDA_DECOMPOSED = ("cross_entropy_loss",)
_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _cuda_dropout(input, p, train):
    """``dropout`` as CUDA runs it: one kernel that saves a bool mask (`native_dropout`), where the CPU's
    composite draws a float noise tensor of the input's dtype and saves that (2 or 4 bytes a value, not 1)."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p >= 1:
        return input * torch.zeros_like(input)
    return aten.native_dropout.default(input, p, train)[0]


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _cast_kernel(op, lower: bool):
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if lower else torch.float32
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))
    return kernel


def _dtype_kernel(op):
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")
    kw_only = op._schema.arguments[at].kwarg_only

    def kernel(*args, **kwargs):
        args = list(args)
        given = kwargs.get("dtype") if kw_only or len(args) <= at else args[at]
        if given is None and args[0].is_floating_point():
            if kw_only or len(args) <= at:
                kwargs["dtype"] = torch.float32
            else:
                args[at] = torch.float32
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return op(*args, **kwargs)
    return kernel


def _cross_entropy(self, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    """CUDA's cross entropy under autocast: its decomposition, each part through autocast."""
    if label_smoothing or target.is_floating_point():  # composite paths momlab's models never take
        with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            return aten.cross_entropy_loss(_cast(self, torch.float32), target, weight, reduction, ignore_index,
                                           label_smoothing)
    return aten.nll_loss_nd(aten.log_softmax.int(self, 1), target, weight, reduction, ignore_index)


def _overload(name: str):
    base, _, over = name.partition(".")
    packet = getattr(aten, base)
    return getattr(packet, over or "default")


def _register_cuda_autocast(lib) -> None:
    """CUDA's autocast lists at the CPU's autocast key: active only while a traced step runs under autocast
    (the forward, and checkpointed blocks' recomputation, which restores it), and seen by autograd, which
    sits below autocast, so backward saves the cast copies as on CUDA."""
    for name in _CUDA_FP32:
        lib.impl(name, _cast_kernel(_overload(name), lower=False), "AutocastCPU")
    for name in _CUDA_FP32_DTYPE:
        lib.impl(name, _dtype_kernel(_overload(name)), "AutocastCPU")
    for name in _CUDA_LOWER:
        lib.impl(name, _cast_kernel(_overload(name), lower=True), "AutocastCPU")
    for name in _CUDA_DECOMPOSED:
        lib.impl(name, _cross_entropy, "AutocastCPU")


@contextmanager
def _kernels(kernels: str, tracer=None):
    """While tracing for a GPU, `scaled_dot_product_attention` runs CUDA's kernel (`_cuda_sdpa`), ``dropout``
    CUDA's (`_cuda_dropout`), and the paper stack's softmax (`momlab.legacy`) CUDA's half-to-float kernel for a
    half input with dtype float (`legacy.HALF_TO_FLOAT`: the fake tensors sit on the CPU, which has none).

    The CPU kernel choice is not an op a dispatch mode sees, and a torch
    function mode around sdpa is not active while backward recomputes a
    checkpointed block; overriding sdpa's composite kernel at the dispatcher
    is seen by both. CUDA's autocast lists replace the CPU's the same way
    (`_register_cuda_autocast`), and quantization's chunk loops run folded
    (`momlab.moms.quant.FOLD`; on the cpu target they run as measured). The overrides are process-wide
    while they last (`_LOCK` keeps traces one at a time) and removed on exit.
    It also hands `tracer` to quant (`quant.TRACE_KERNEL`), whose encode and
    decode are one compiled kernel each on CUDA.
    """
    if kernels != "cuda":
        yield
        return
    _quant.FOLD = legacy.HALF_TO_FLOAT = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("scaled_dot_product_attention", _cuda_sdpa, "CompositeImplicitAutograd")
        lib.impl("dropout", _cuda_dropout, "CompositeImplicitAutograd")
        _register_cuda_autocast(lib)
    _quant.TRACE_KERNEL = tracer.kernel if tracer is not None else None
    _quant.TRACE_CALL = tracer.replay if tracer is not None else None
    try:
        yield
    finally:
        _quant.TRACE_KERNEL = _quant.TRACE_CALL = None
        lib._destroy()
        _quant.FOLD = legacy.HALF_TO_FLOAT = False


# number formats of an op's compute, as indices into a device's peak FLOP/s (see _peaks)
FMT_FP32, FMT_CONV32, FMT_BF16, FMT_FP16 = 0, 1, 2, 3
_FORMATS = {torch.bfloat16: FMT_BF16, torch.float16: FMT_FP16}
_CONV = frozenset({aten.convolution, aten.convolution_backward, aten._convolution})
_NO_TRAFFIC = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                         aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default})
_EMPTY = frozenset({aten.empty.memory_format, aten.empty_strided.default})  # factories of no values


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_QUERIES: dict = {}


def _is_query(func) -> bool:
    """An op that neither returns a tensor nor writes one (``prim.device``, ``.item()``): nothing to account.

    C++ asks a fake tensor its device through the dispatcher (``prim.device``):
    about 12,000 times a bert-large step, six for every op the tracer logs, a
    seventh of a trace's time when each went through the accounting.
    """
    query = _QUERIES.get(func)
    if query is None:
        schema = func._schema
        query = _QUERIES[func] = not any("Tensor" in str(r.type) for r in schema.returns) and not any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return query


# recorded quantization calls of traces for a GPU (`_Tracer.replay`): key -> what the call logged and returned
_REPLAYS: dict = {}


def _tensor_spec(t):
    """(shape, dtype, device) of a tensor that is its whole storage, contiguous; None for any other."""
    if not (isinstance(t, torch.Tensor) and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size() and not t.requires_grad):
        return None
    return tuple(t.shape), t.dtype, t.device


def _result_spec(out):
    """How to allocate `out` (a tensor, or quant's Packed) afresh; None where it cannot be."""
    if isinstance(out, _quant.Packed):
        data = _tensor_spec(out.data)
        meta = None if out.meta is None else _tensor_spec(out.meta)
        if data is None or (out.meta is not None and meta is None):
            return None
        return "packed", data, meta, out.shape, out.dtype, out.bits
    t = _tensor_spec(out)
    return None if t is None else ("tensor", t)


def _from_spec(spec):
    empty = lambda t: torch.empty(t[0], dtype=t[1], device=t[2])  # noqa: E731
    if spec[0] == "tensor":
        return empty(spec[1])
    _, data, meta, shape, dtype, bits = spec
    return _quant.Packed(empty(data), None if meta is None else empty(meta), shape, dtype, bits)


class _Tracer(StorageTracker):
    """The storage accounting of `momlab.measure`, on a traced step, with a log of every op.

    One dispatch mode (each mode layer costs Python time per op) does two
    things around each op before the accounting sees its outputs:

    - *Random floats without data.* What does not touch a weight runs for
      real (that keeps every branch real); random integers (token ids,
      labels) stay real for that. Random floats (synthetic images,
      quantization's rounding noise) only ever meet weights and activations:
      they are made fake, drawing them would cost time and memory for nothing.
    - *Meta kernels' dtypes.* torch's meta kernels of layer norm and batch
      norm return the saved statistics in the input's dtype; the CPU and
      CUDA kernels keep them in float32 for bf16/fp16 inputs (tiny resnet50
      in bf16 differed from measure by those bytes until corrected).

    The log, for each op that is not a view: device bytes live after it,
    the FLOPs torch's FlopCounterMode counts for it, the attention FLOPs it
    does not count on CPU kernels, the bytes read and written, the format.
    """

    def __init__(self, fake_mode: FakeTensorMode, kernels: str):
        super().__init__()
        self.fake_mode = fake_mode
        self.kernels = kernels
        self.log = None
        self.events = None  # a list: every device allocation and free, in order (`allocation_events`)
        self.group = -1  # the fused kernel being traced (`kernel`); -1: none
        self._update_entries = None  # the log of the first update logged, to replay (`update`)
        if kernels == "cuda":
            self.granule = ALLOCATOR_BLOCK

    def _register(self, t, *, host, check):
        if self.events is not None and not host and t.device.type in self.devices:
            st = t.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            entry = self._live.get(key)
            old = 0 if entry is None else entry[0]
            if old != nbytes:  # new, or resized by an out= op: the allocator frees and allocates
                if old:
                    self.events.append((key, allocator.FREE))
                if nbytes:
                    self.events.append((key, nbytes))
        super()._register(t, host=host, check=check)

    def _finalizer(self, key: int):
        base = super()._finalizer(key)

        def free(ref, self_ref=weakref.ref(self)):
            tracer = self_ref()
            if tracer is not None and tracer.events is not None:
                entry = tracer._live.get(key)
                if entry is not None and not entry[1] and entry[0]:
                    tracer.events.append((key, allocator.FREE))
            base(ref)
        return free

    def start(self) -> None:
        self.log = {"live": [self.device_bytes], "flops": [], "extra": [], "bytes": [], "fmt": [], "op": [],
                    "group": [], "group_bytes": [], "group_cycles": [], "pad": [self.padding_bytes]}
        self.group = -1

    def stop(self) -> dict:
        log, self.log = self.log, None
        return log

    _COLUMNS = ("flops", "extra", "bytes", "fmt", "op")

    def replay(self, fn, key, arg):
        """`fn(arg)` (quant's pack or unpack, `quant.TRACE_CALL`), or a replay of a recorded call of the same `key`:
        its log entries (live and padding bytes relative to the call's start, kernel groups renumbered) and its
        results allocated fresh. Recorded only where the call's lasting effect is exactly its results (new,
        whole, contiguous storages on the device; nothing else freed or kept), and never while allocation
        events are kept (the allocator replay needs every temporary)."""
        if self.events is not None or self.group >= 0:
            return fn(arg)
        # a pack runs in forward, under the step's autocast (fake tensors are CPU tensors)
        key = (key, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        rec = _REPLAYS.get(key)
        if rec is not None:
            return self._replayed(rec)
        log = self.log
        if log is None:  # a step not logged (none runs: a trace's warm-up primes the workload, `Workload.prime`)
            return fn(arg)
        n0, g0 = len(log["flops"]), len(log["group_bytes"])
        live0, pad0, host0, before = self.device_bytes, self.padding_bytes, self.host_bytes, set(self._live)
        out = fn(arg)
        if len(log["flops"]) == n0:
            return out  # nothing ran (a tensor kept as it is)
        spec = _result_spec(out)
        if spec is None or self.host_bytes != host0:
            return out
        results = [t for t in (out if isinstance(out, _quant.Packed) else (out,)) if isinstance(t, torch.Tensor)]
        keys = {t.untyped_storage()._cdata for t in results}
        nbytes = [t.untyped_storage().nbytes() for t in results]
        pads = [0 if self.granule == 1 else -(-n // self.granule) * self.granule - n for n in nbytes]
        if (len(keys) == len(results) and not keys & before and all(t.device.type in self.devices for t in results)
                and self.device_bytes - live0 == sum(nbytes) and self.padding_bytes - pad0 == sum(pads)):
            _REPLAYS[key] = (spec, *self._recorded(n0, g0, live0, pad0))
        return out

    def _replayed(self, rec):
        spec, *entries = rec
        log, live0, pad0 = self.log, self.device_bytes, self.padding_bytes
        self.log = None  # the results are allocated on the books, not logged as ops
        try:
            out = _from_spec(spec)
        finally:
            self.log = log
        if log is not None:
            self._extend(entries, live0, pad0)
        return out

    def _recorded(self, n0: int, g0: int, live0: int, pad0: int) -> list:
        """The log's entries from op `n0` and kernel group `g0` on, live and padding bytes relative to `live0` and
        `pad0`, groups renumbered from 0 (`_extend` appends them again)."""
        log = self.log
        return [[log[k][n0:] for k in self._COLUMNS], [v - live0 for v in log["live"][n0 + 1:]],
                [v - pad0 for v in log["pad"][n0 + 1:]], [g - g0 if g >= 0 else g for g in log["group"][n0:]],
                log["group_bytes"][g0:], log["group_cycles"][g0:]]

    def _extend(self, entries, live0: int, pad0: int) -> None:
        columns, live, pad, groups, group_bytes, group_cycles = entries
        log = self.log
        g0 = len(log["group_bytes"])
        for k, values in zip(self._COLUMNS, columns):
            log[k].extend(values)
        log["live"].extend(live0 + d for d in live)
        log["pad"].extend(pad0 + d for d in pad)
        log["group"].extend(g + g0 if g >= 0 else g for g in groups)
        log["group_bytes"].extend(group_bytes)
        log["group_cycles"].extend(group_cycles)

    def update(self, fn) -> None:
        """`fn()` (the optimizer's update, `Workload.update_hook`), or a replay of the first update this tracer
        logged: no tensor an update touches depends on the batch size, so its ops, traffic and memory are the
        same at every batch, and its writes, in place into tensors without data, change nothing a later op
        reads. Recorded only where it leaves the books as it found them (no storage made or freed, the same
        device, padding and host bytes: the optimizer's state exists from the warm-up, `Workload.prime`), and
        never while allocation events are kept (the allocator replay needs every temporary). An update is a
        quarter of a traced bert-large step's time (single-tensor AdamW: about ten ops a parameter)."""
        log = self.log
        if log is None or self.events is not None or self.group >= 0:
            return fn()
        live0, pad0 = self.device_bytes, self.padding_bytes
        if self._update_entries is not None:
            return self._extend(self._update_entries, live0, pad0)
        n0, g0 = len(log["flops"]), len(log["group_bytes"])
        host0, before = self.host_bytes, set(self._live)
        fn()
        if (self.device_bytes == live0 and self.padding_bytes == pad0 and self.host_bytes == host0
                and set(self._live) == before):
            self._update_entries = self._recorded(n0, g0, live0, pad0)

    def kernel(self, fn, *args, traffic: tuple[float, ...] | None = None, cycles: tuple[float, ...] | None = None):
        """Run `fn` (a function of tensors a GPU runs as one compiled kernel: quant's encode and decode) and
        log its ops as one group, whose traffic is its tensor arguments and results (`quant.TRACE_KERNEL`).
        `traffic`: the bytes of the kernels a GPU runs for `fn` instead, one group each, in order (the paper's
        quantizer, `quant.gact_traffic`): the first ones take one op each, the last the rest; `cycles`: the SM
        cycles of their instructions, in the same order (`quant.gact_cycles`; 0: bound by their bytes)."""
        if self.log is None or self.group >= 0:
            return fn(*args)
        log = self.log
        n0 = len(log["group"])
        self.group = len(log["group_bytes"])
        log["group_bytes"].append(0.0)
        log["group_cycles"].append(0.0)
        try:
            out = fn(*args)
        finally:
            gid, self.group = self.group, -1
        if traffic is None:
            tensors = [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)]
            # a folded quantization pass stands for `REPEAT` passes (momlab.moms.quant.FOLD)
            log["group_bytes"][gid] = float(sum(map(_nbytes, tensors))) * _quant.REPEAT
            return out
        ops, last = len(log["group"]) - n0, len(traffic) - 1
        if ops <= last:
            raise RuntimeError(f"{len(traffic)} kernels over {ops} traced ops")
        log["group_bytes"][gid:] = [float(b) for b in traffic]
        log["group_cycles"][gid:] = [float(c) for c in (cycles or (0.0,) * len(traffic))]
        log["group"][n0:] = [gid + min(i, last) for i in range(ops)]
        return out

    def _run(self, func, args, kwargs):
        if func in _EMPTY:
            # no tensor argument, so no fake tensor to carry the op: made with data, it would hold real memory
            # (quantization's packed codes, copied again by swap: gigabytes in a trace at a large batch)
            with self.fake_mode:
                return func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags and not any(
                isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0]):
            with self.fake_mode:  # first without data, to learn the dtype (randint's default is int64)
                out = func(*args, **kwargs)
            if all(t.is_floating_point() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
                return out
        out = func(*args, **kwargs)
        if func in _NORM_STATS and args[0].dtype in (torch.bfloat16, torch.float16):
            # a norm's saved mean and inverse std for a half input: CUDA's kernels keep them in fp32; the CPU's
            # batch norm in its weight's dtype, its layer norm in fp32 when its weight is fp32 (autocast: a "mixed
            # type" layer norm) and in the input's dtype otherwise (a half model; what the fake kernels give)
            if self.kernels == "cuda":
                dtype = torch.float32
            elif func is aten.native_batch_norm.default:
                dtype = None if args[1] is None else args[1].dtype
            else:
                weight = args[2] if len(args) > 2 else None
                dtype = torch.float32 if weight is not None and weight.dtype == torch.float32 else None
            if dtype is not None:
                main, *stats = out
                out = (main, *(x.new_empty(x.shape, dtype=dtype) for x in stats))
        if func is aten.native_layer_norm_backward.default and out[0] is not None and not out[0].is_contiguous():
            # both devices' kernels return the input's gradient contiguous (empty_like of the contiguous input);
            # the fake kernel copies the incoming gradient's strides, and a transposed one (Swin's pooler) then
            # costs the trace a copy the real step never makes
            out = (out[0].new_empty(out[0].shape), *out[1:])
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_query(func):
            return func(*args, **kwargs)
        out = super().__torch_dispatch__(lambda *a, **k: self._run(func, a, k), types, args, kwargs)
        log = self.log
        if log is None or func.is_view:
            return out
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not flat_out and not any(a.alias_info is not None and a.alias_info.is_write
                                    for a in func._schema.arguments):
            return out  # an op whose optional tensors all came back None
        flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        packet = func._overloadpacket
        flops = extra = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            extra = _auto.cpu_attention_flops(packet, args)
        moved = 0 if func in _NO_TRAFFIC else sum(map(_nbytes, flat_in)) + sum(map(_nbytes, flat_out))
        if _quant.REPEAT != 1.0:  # one folded pass of a quantization loop stands for REPEAT of them
            flops, moved = flops * _quant.REPEAT, moved * _quant.REPEAT
        fmt = FMT_FP32
        for t in flat_in:
            if t.is_floating_point():
                fmt = _FORMATS.get(t.dtype, FMT_CONV32 if packet in _CONV else FMT_FP32)
                break
        log["live"].append(self.device_bytes)
        log["flops"].append(flops)
        log["extra"].append(extra)
        log["bytes"].append(moved)
        log["fmt"].append(fmt)
        log["op"].append(timemodel.OP_IDS.setdefault(str(func), len(timemodel.OP_IDS)))
        log["group"].append(self.group)
        log["pad"].append(self.padding_bytes)
        return out


@dataclass
class Probe:
    """One traced steady-state step at one batch size (the fields of `Measurement`'s probe)."""

    batch_size: int
    params_bytes: int
    optimizer_bytes: int
    grads_bytes: int
    forward_live: int  # device bytes at the end of forward
    forward_host: int  # host bytes at the end of forward (swap)
    live: np.ndarray  # device bytes at the start, then after each op
    flops: np.ndarray  # per op, as FlopCounterMode counts
    extra_flops: np.ndarray  # per op, attention on CPU kernels (not counted by torch)
    bytes: np.ndarray  # per op, read + written
    fmt: np.ndarray  # per op, FMT_*
    ops: np.ndarray  # per op, an id of the aten op (to check two traces align)
    seconds: float = 0.0  # how long tracing took
    forward_ops: int = 0  # how many of the ops are forward's (then backward's, then the optimizer's)
    backward_ops: int = 0  # how many are forward's and backward's (the optimizer's follow)
    group: np.ndarray | None = None  # per op, the fused kernel it is part of (-1: none; see `_Tracer.kernel`)
    group_bytes: np.ndarray | None = None  # per fused kernel, the bytes it reads and writes
    padding: np.ndarray | None = None  # allocator round-up bytes beside `live` (not in it), at the start and per op
    forward_grads: int = 0  # gradients resident at the end of forward (zeroed in place, not freed)
    # host bytes swapped out during backward (a reentrant checkpoint's recomputation under hooks that stay on
    # through backward, `Stack.hooks`), each brought back before backward ends
    backward_host: int = 0
    group_cycles: np.ndarray | None = None  # per fused kernel, the SM cycles of its instructions (0: not counted)

    @property
    def peak_bytes(self) -> int:
        return int(self.live.max())

    @property
    def rounding_bytes(self) -> int:
        """Of `peak_bytes`, the allocator's round-up to whole blocks (`ALLOCATOR_BLOCK`) at the peak."""
        return 0 if self.padding is None else int(self.padding[int(self.live.argmax())])

    @property
    def activation_bytes(self) -> int:
        return max(0, self.forward_live - self.params_bytes - self.optimizer_bytes - self.forward_grads)

    @property
    def workspace_bytes(self) -> int:
        return max(0, self.peak_bytes - self.params_bytes - self.grads_bytes - self.optimizer_bytes
                   - self.activation_bytes)

    @property
    def host_bytes(self) -> int:
        return self.forward_host


class _ForwardDone(Exception):
    """Ends a step after its forward (`_Session.quantized_sizes`)."""


class _Session:
    """A workload with fake weights, warmed up once, traced at any batch size."""

    def __init__(self, model: str, mom: str, precision: str, size: dict, kernels: str, seed: int = 0,
                 attention: str | None = None, setup: str = "default", batch_size: int = TRACE_BATCHES[0],
                 events: list | None = None, workspace: int = 0):
        self.kernels = kernels
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        t0 = time.perf_counter()
        with _LOCK:
            with fake_mode, _AssumeScalars():
                self.w = build(model, batch_size=batch_size, mom=mom, device="cpu", precision=precision,
                               seed=seed, attention=attention, setup=setup, **size)
            if self.w.scaler is not None:
                self.w.scaler = _FiniteScaler(self.w.scaler)
            self.tracer = _Tracer(fake_mode, kernels)
            self.tracer.events = events
            self.w.update_hook = self.tracer.update
            # as measure: weights on the books, then what a warm-up step leaves (the optimizer state). Where the
            # allocation events are kept, the warm-up is a step, whose allocations the caching allocator's
            # replay starts from; elsewhere `Workload.prime` makes the same state without running the model
            # (a traced forward and backward cost as much as the step that follows)
            with _kernels(kernels, self.tracer), self.tracer:
                self.tracer.track(self.w.state_tensors()["params"])
                if events is None:
                    self.w.prime()
                else:
                    if workspace:  # cuBLAS's workspace: allocated at the first matmul
                        events.append(("cublas-workspace", workspace))
                    self.w.step()
        self.build_seconds = time.perf_counter() - t0

    def quantized_sizes(self, batch_size: int, forward_only: bool | None = None) -> list[int]:
        """The value count of each tensor a step at `batch_size` quantizes, forward and backward (a reentrant
        checkpoint's recomputation packs too, `Stack.hooks`): a step not logged, whose packs only count
        (`quant.TRACE_SIZES`) and whose optimizer update is skipped (its zeroing of the gradients runs), in
        about half a traced step's time; its forward alone (`forward_only`; None: where the MOM recomputes
        nothing, so backward packs nothing), in a fifth."""
        if forward_only is None:
            forward_only = not parse_mom(self.w.mom).checkpointing
        sizes = _quant.TRACE_SIZES = []
        update, self.w.update_hook = self.w.update_hook, lambda fn: None

        def forward_end():
            raise _ForwardDone

        try:
            with self._stepping(batch_size):
                self.w.step(on_forward_end=forward_end if forward_only else None)
        except _ForwardDone:
            pass
        finally:
            _quant.TRACE_SIZES = None
            self.w.update_hook = update
        return sizes

    def block_costs(self, batch_size: int) -> tuple[list[int], list[int]]:
        """ckpt-auto's costs at `batch_size`, as `momlab.measure` takes them (`auto.BlockCosts`): per block, the
        device bytes its forward leaves alive beyond its output and its forward FLOPs, from a forward with no
        block checkpointed (a step not logged, stopped at the end of forward). The workload's MOM has ckpt-auto."""
        handle = self.w.handle
        handle.checkpoint([])
        costs = _auto.BlockCosts(handle.blocks, lambda: self.tracer.device_bytes)
        update, self.w.update_hook = self.w.update_hook, lambda fn: None

        def forward_end():
            raise _ForwardDone

        try:
            with self._stepping(batch_size), costs:
                self.w.step(on_forward_end=forward_end)
        except _ForwardDone:
            pass
        finally:
            self.w.update_hook = update
        return costs.saving, costs.flops

    @contextmanager
    def _stepping(self, batch_size: int):
        """Around a step of the workload at `batch_size`, traced (one at a time): the last step's cycles
        collected, the target's kernels and the tracer's accounting on."""
        with _LOCK:
            self.w.batch_size = batch_size
            gc.collect()
            with _kernels(self.kernels, self.tracer), self.tracer:
                yield

    def probe(self, batch_size: int) -> Probe:
        t0 = time.perf_counter()
        w, tracer = self.w, self.tracer
        state = {}

        def forward_end():
            state["live"], state["host"] = tracer.device_bytes, tracer.host_bytes
            state["copied"] = tracer.host_copied
            state["fwd_ops"] = len(tracer.log["flops"])  # the time model overlaps swap copies per phase
            state["fwd_grads"] = unique_storage_bytes(w.state_tensors()["grads"])

        def backward_end():
            state["grads"] = unique_storage_bytes(w.state_tensors()["grads"])
            state["bwd_host"] = tracer.host_copied - state["copied"]
            state["bwd_ops"] = len(tracer.log["flops"])

        with self._stepping(batch_size):
            tracer.reset_peak()
            tracer.start()
            try:
                w.step(on_forward_end=forward_end, on_backward_end=backward_end)
            finally:
                log = tracer.stop()
        tensors = w.state_tensors()
        return Probe(
            batch_size, unique_storage_bytes(tensors["params"]), unique_storage_bytes(tensors["optimizer"]),
            state["grads"], state["live"], state["host"], np.asarray(log["live"], dtype=np.int64),
            np.asarray(log["flops"], dtype=np.float64), np.asarray(log["extra"], dtype=np.float64),
            np.asarray(log["bytes"], dtype=np.float64), np.asarray(log["fmt"], dtype=np.int8),
            np.asarray(log["op"], dtype=np.int32), time.perf_counter() - t0, state["fwd_ops"], state["bwd_ops"],
            np.asarray(log["group"], dtype=np.int32), np.asarray(log["group_bytes"], dtype=np.float64),
            np.asarray(log["pad"], dtype=np.int64), state["fwd_grads"], state["bwd_host"],
            np.asarray(log["group_cycles"], dtype=np.float64))


# -- profiles: two traces, any batch ------------------------------------------------------

@dataclass
class Profile:
    """Traces of one configuration at two batch sizes; `at(b)` is the step at any batch.

    Memory and costs are affine in the batch size op by op (see the module
    docstring); `aligned` says the two traces ran the same ops in the same
    order, which that needs. Otherwise `at` traces the batch directly.
    """

    model: str
    mom: str
    precision: str
    size: dict
    kernels: str
    lo: Probe
    hi: Probe
    direct: dict = field(default_factory=dict, repr=False)
    disk: Path | None = None  # the file the traces were read from; None: traced in this process
    _session: _Session | None = field(default=None, repr=False)
    attention: str | None = None  # the software stack traced (`momlab.workload.stack`)
    setup: str = "default"
    depths: tuple[int, int] | None = None  # unrolled from traces at these depths (`_unroll`); None: traced
    replays: dict = field(default_factory=dict, repr=False)  # (batch, capacity, workspace) -> allocator.Replay
    # the last replayed batch's ((batch, workspace), allocation events): a search replays them twice
    _events: tuple | None = field(default=None, repr=False)

    @property
    def aligned(self) -> bool:
        return _aligned(self.lo, self.hi)

    @property
    def session(self) -> _Session:
        """The workload that traced `lo` and `hi`; built now for traces read from disk (a direct trace)."""
        if self._session is None:
            self._session = _Session(self.model, self.mom, self.precision, self.size, self.kernels,
                                     attention=self.attention, setup=self.setup)
        return self._session

    def _lerp(self, a, b, batch):
        b1, b2 = self.lo.batch_size, self.hi.batch_size
        return a + (b - a) * ((batch - b1) / (b2 - b1))

    def at(self, batch_size: int, *, trace: bool = False) -> Probe:
        """The step at `batch_size`, read off the two traces (exact at them), or traced when `trace`, when
        the traces do not align, or below them where smaller batches may run other ops: the search found them
        so, or started above them (`_first_batch`; quantization leaves tensors under 1024 values unpacked, so a
        tiny model's smallest batches save other tensors)."""
        check_batch_size(batch_size)
        for p in (self.lo, self.hi):
            if p.batch_size == batch_size:
                return p
        below = batch_size < self.lo.batch_size and self.lo.batch_size != TRACE_BATCHES[0]
        if trace or below or not self.aligned:
            if batch_size not in self.direct:
                self.direct[batch_size] = (None if trace else self._unrolled(batch_size)) or \
                    self.session.probe(batch_size)
            return self.direct[batch_size]
        lo, hi = self.lo, self.hi
        lerp = lambda x, y: self._lerp(x, y, batch_size)  # noqa: E731
        return Probe(
            batch_size, lo.params_bytes, lo.optimizer_bytes, lo.grads_bytes,
            int(round(lerp(lo.forward_live, hi.forward_live))), int(round(lerp(lo.forward_host, hi.forward_host))),
            np.rint(lerp(lo.live.astype(np.float64), hi.live.astype(np.float64))).astype(np.int64),
            np.maximum(0.0, lerp(lo.flops, hi.flops)), np.maximum(0.0, lerp(lo.extra_flops, hi.extra_flops)),
            np.maximum(0.0, lerp(lo.bytes, hi.bytes)), lo.fmt, lo.ops, forward_ops=lo.forward_ops,
            backward_ops=lo.backward_ops, group=lo.group,
            group_bytes=None if lo.group_bytes is None else np.maximum(0.0, lerp(lo.group_bytes, hi.group_bytes)),
            padding=None if lo.padding is None else np.rint(lerp(lo.padding.astype(np.float64),
                                                                 hi.padding.astype(np.float64))).astype(np.int64),
            forward_grads=lo.forward_grads,
            backward_host=int(round(lerp(lo.backward_host, hi.backward_host))),
            group_cycles=None if lo.group_cycles is None else np.maximum(0.0, lerp(lo.group_cycles,
                                                                                   hi.group_cycles)))

    def _unrolled(self, batch_size: int) -> Probe | None:
        """For a profile unrolled from shallow copies (`depths`), the step at `batch_size` unrolled from theirs
        (each traced at that batch: two shallow steps, not one at full depth); None where that is not a stack."""
        if self.depths is None:
            return None
        st = stack(self.model, self.setup, self.attention)
        a, b = (_profile(self.model, self.mom, self.precision, {**self.size, "num_layers": d}, self.kernels, st)
                .at(batch_size) for d in self.depths)
        try:
            return _unroll(a, b, self.size["num_layers"] - self.depths[0])
        except _NotAStack:
            return None

    def peak_bytes(self, batch_sizes) -> np.ndarray:
        """Predicted peak at each of `batch_sizes` (vectorized)."""
        b = np.asarray(batch_sizes, dtype=np.float64)
        a, s = self._line(self.lo.live, self.hi.live)
        return (a[:, None] + s[:, None] * b[None, :]).max(axis=0)

    def _line(self, x1, x2):
        b1, b2 = self.lo.batch_size, self.hi.batch_size
        slope = (x2.astype(np.float64) - x1.astype(np.float64)) / (b2 - b1)
        return x1.astype(np.float64) - slope * b1, slope

    def max_batch_size(self, capacity: int) -> int:
        """Largest batch whose predicted peak is within `capacity` bytes (0: none fits), in closed form."""
        if not self.aligned:
            raise RuntimeError(f"traces of {self.model} ({self.mom}) at batch {self.lo.batch_size} and "
                               f"{self.hi.batch_size} run different ops: the peak is not affine in the batch size")
        a, s = self._line(self.lo.live, self.hi.live)
        grows = s > 1e-9
        if np.any(a[~grows] + s[~grows] > capacity):  # what does not grow with the batch is too big already
            return 0
        if not grows.any():
            return 2 ** 31 - 1
        best = int(max(0, np.floor((capacity - a[grows]) / s[grows] + 1e-9).min()))
        if best < self.lo.batch_size and self.lo.batch_size != TRACE_BATCHES[0]:
            # below the aligned traces other ops ran (see `at`): ask the traces of those batches
            best = max((b for b in range(1, self.lo.batch_size) if self.at(b).peak_bytes <= capacity), default=0)
        return best


_PROFILES: dict[tuple, Profile] = {}


def _aligned(a: Probe, b: Probe) -> bool:
    return len(a.live) == len(b.live) and np.array_equal(a.ops, b.ops) and np.array_equal(a.fmt, b.fmt)


def _kernels_of(gpu: str) -> str:
    return get_gpu(gpu).kernels if gpu != "cpu" else "cpu"


def profile(model: str, mom: str = "exact", *, precision: str = "fp32", kernels: str = "cuda",
            attention: str | None = None, setup: str = "default", **size) -> Profile:
    """The cached two-batch trace of a configuration (`kernels`: "cuda" or "cpu"; `setup`, `attention`: the
    software stack, `momlab.workload.stack`).

    `model` may also be a transformers config or a `momlab.UserModel`; their traces are kept in this
    process only (the disk cache's key knows momlab's source, not a user's code)."""
    model = resolve(model)
    st = stack(model, setup, attention)
    size = catalog.resolve_size(model, size)
    mom = parse_mom(mom)
    if mom.has("ckpt-auto"):
        base, full = _auto_bounds(mom)
        raise ValueError(f"{mom!r} checkpoints a plan chosen per batch and budget, no one configuration to "
                         f"profile: profile {base!r} and {full!r}, which bound it (estimate plans it from them)")
    check_choice("precision", precision, PRECISIONS)
    check_choice("kernels", kernels, ("cuda", "cpu"))
    return _profile(model, mom, precision, size, kernels, st)


def _profile(model, mom, precision, size, kernels, st, pair: tuple[int, int] | None = None) -> Profile:
    """`profile` of checked arguments; `pair`: two batch sizes to trace first (the batches a shallower copy's
    traces aligned at, `_depth_profile`), the usual search from ``TRACE_BATCHES[0]`` when they do not align."""
    key = (model, mom, precision, tuple(sorted(size.items())), kernels, st.attention, st.setup)
    with _LOCK, _old_objects_frozen():
        prof = _PROFILES.get(key)
        if prof is None:
            disk = _disk_path(model, mom, precision, size, kernels, st) if isinstance(model, str) else None
            probes = _load(*disk) if disk is not None else None
            if probes is None:
                prof = _depth_profile(model, mom, precision, size, kernels, st)
                if prof is not None:
                    _PROFILES[key] = prof
                    return prof
            session = None
            if probes is None:
                session = _Session(model, mom, precision, size, kernels, attention=st.attention, setup=st.setup)
                probes = [session.probe(b) for b in pair] if pair is not None else []
                if not (probes and _aligned(*probes)):
                    batches = TRACE_BATCHES[TRACE_BATCHES.index(_first_batch(mom)):]
                    if _quantizes(mom):  # skip batches whose traces cannot align with the next one's
                        batches = _folding_alike(session.quantized_sizes(batches[0]), batches)
                    probes = [session.probe(batches[0])]
                    for b in batches[1:]:
                        probes.append(session.probe(b))
                        if _aligned(probes[-2], probes[-1]):
                            break
                if disk is not None:
                    _save(*disk, probes)
            direct = {p.batch_size: p for p in probes[:-2]}
            prof = Profile(model, mom, precision, size, kernels, probes[-2], probes[-1], direct,
                           disk[0] if session is None else None, session, st.attention, st.setup)
            _PROFILES[key] = prof
    return prof


def _folding_alike(sizes: list[int], batches: tuple) -> tuple:
    """`batches` (doubling batch sizes) from the first whose trace and the next one's quantize alike, or all of
    them where none does: `sizes` are the value counts quantized in a step at ``batches[0]``, taken to grow with
    the batch; two traces align only where no tensor's chunk loop folds in one and not the other (`quant.CHUNK`;
    at real size BERT-L's 262K- and 131K-value tensors a sample cross it between 4 and 8 and between 8 and 16,
    so the search starts at 16). Constant tensors taken to grow only make the answer later, never wrong: the
    traces' alignment is still checked."""
    counts = set(sizes)

    def folded(n: int, b: int) -> bool:
        return n * b / batches[0] > _quant.CHUNK

    for i in range(len(batches) - 1):
        if all(folded(n, batches[i]) == folded(n, batches[i + 1]) for n in counts):
            return batches[i:]
    return batches


def _quantizes(mom) -> bool:
    return any(p.startswith("quant") for p in parse_mom(mom).parts)


def _first_batch(mom) -> int:
    """The batch a profile's search for two aligned traces starts at: TRACE_BATCHES[1] where the MOM quantizes.
    Its traces at 2 and 4 seldom align: at real size a tensor of 256K to 512K values a sample (BERT-L's MLP at
    128 tokens) is packed in one pass at 2 and in folded chunks at 4 (`quant.CHUNK`), and at tiny size tensors
    under `quant.MIN_NUMEL` values at 2 are kept as they are and packed at 4. A smaller batch is then traced
    when asked for, as any batch below the aligned pair. From there `_folding_alike` skips on to the first
    batch whose trace can align with the next one's."""
    return TRACE_BATCHES[1] if _quantizes(mom) else TRACE_BATCHES[0]


@contextmanager
def _old_objects_frozen():
    """Within, the garbage collector skips every object older than the entry (`gc.freeze`): the collection
    before each traced step (`_Session.probe`), which must free the last step's cycles, then scans only what
    tracing made, not the whole process (0.13 s a full collection with transformers imported, four or more a
    profile). Unfrozen on exit. A nested entry (a deep stack's profile makes two shallow ones), or a process that
    froze objects itself, leaves the freeze as it is. Entered under `_LOCK`: one thread at a time."""
    global _FREEZES
    # gc.get_freeze_count() walks the frozen objects (30 ms with transformers imported): asked only outside
    outer = _FREEZES == 0 and gc.get_freeze_count() == 0
    if outer:
        gc.freeze()
    _FREEZES += 1
    try:
        yield
    finally:
        _FREEZES -= 1
        if outer:
            gc.unfreeze()


_FREEZES = 0  # entries of `_old_objects_frozen` open


# -- depth: a stack of identical blocks, traced shallow ---------------------------------------

# Families whose `num_layers` repeats one block (Swin's stage alternates shifted and plain windows, a
# period of two blocks: traced at full depth). A deeper configuration of these is traced at depths
# DEPTH_BASE and DEPTH_BASE + 1 and unrolled (`_unroll`).
DEPTH_FAMILIES = frozenset({"bert", "gpt", "vit", "resnet", "llama", "qwen2"})
# 3: the deeper trace then holds the three blocks in a row that `_unroll_phase` checks (ResNet's too: the first
# block of its stage downsamples, the other three repeat). At 2 and 3 the ops around the stack of BERT, ViT,
# Llama and Qwen2 look like a block's ends and most traces fell back to full depth (docs/LOG.md 2026-12-04).
DEPTH_BASE = 3
EXTRAPOLATE_DEPTH = True  # False: always trace the full depth
# True: a deep stack's two shallow copies are traced side by side, the deeper one in a forked child process
# that leaves its traces in the disk cache (`_deeper_beside`); False: one after the other in this process
PARALLEL_DEPTHS = True
# the longest a forked child's trace is waited for past the parent's own (seconds): a child that takes longer
# is killed and its trace made in this process
CHILD_GRACE_S = 60.0
# set for good once a forked child found autograd unusable: a build of torch with a device backend (CUDA) starts
# autograd's device threads at its first backward, fake tensors' too, even with no GPU, and a child forked after
# that cannot run a backward ("Unable to handle autograd's threading in combination with fork-based
# multiprocessing"); from then on the shallow copies are traced one after the other
_FORK_UNSAFE = False
_AUTOGRAD_FORKED = 3  # the exit code of a child whose autograd did not survive the fork


class _NotAStack(ValueError):
    """Two traces one block apart whose ops are not one sequence with a block inserted."""


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _unroll_phase(ka, kb, va, vb, m: int, all_values: bool = False):
    """One phase (forward, backward or optimizer) at `m` more blocks than trace `a`, `b` having one more.

    ``ka``, ``kb``: per-op keys (op, format, kernel group) of the two traces; ``va``, ``vb``: per-op values
    (rows), affine in the depth. ``b`` is ``a`` with ``k`` ops (one block) inserted at some ``i``; for a
    stack, a value at offset ``t`` of the ``j``-th block of depth ``L`` is ``alpha_t + beta_t L + gamma_t j``
    and outside the blocks ``alpha + beta L``. From the two traces: before ``i`` beta is ``vb - va``; after
    it (shifted by ``k``) beta + gamma of the blocks it holds; the inserted block is block 0 of the new
    ones, the block before it in ``b`` gives gamma_t (their difference) and beta_t (against ``a``).
    Inserting ``m`` blocks there is exact for every ``i`` the ops allow (any rotation of the block), as
    long as the ``k`` ops before ``i`` are blocks too: ``i`` is taken where ``b`` holds three blocks in a
    row around it, whose live bytes grow by the same amount op by op (the ops before the stack may end as a
    block ends, the ops after it begin as a block begins; their bytes do not follow the blocks').
    """
    n, k = len(ka), len(kb) - len(ka)
    if k < 0:
        raise _NotAStack("the deeper trace has fewer ops")
    if k == 0:
        if not np.array_equal(ka, kb):
            raise _NotAStack("same op count, different ops")
        return ka, va + m * (vb - va)
    hi = _common_prefix(ka, kb)
    lo = n - _common_prefix(ka[::-1], kb[::-1])

    def blocks(i):  # the k ops before i and the two k-op runs around them are three consecutive blocks of b
        if i < 2 * k or not (np.array_equal(kb[i - 2 * k:i - k], kb[i - k:i])
                             and np.array_equal(kb[i - k:i], kb[i:i + k])):
            return False
        # the live bytes of consecutive blocks differ by the same amount, op by op (gamma); at an i that
        # reaches into the ops before or after the stack (which may repeat a block's first or last ops) not
        # (`all_values`: every value, not only the live and padding bytes: a part of a phase whose ops all look
        # alike, one zero_ a gradient, may hold other tensors' ops at its ends)
        cols = slice(None) if all_values else slice(0, 2)
        second = vb[i - 2 * k:i - k, cols] - 2 * vb[i - k:i, cols] + vb[i:i + k, cols]
        return not second.any()

    fits = [i for i in range(lo, hi + 1) if blocks(i)]
    if not fits:
        raise _NotAStack("no insertion point after two whole blocks")
    i = min(fits, key=lambda x: abs(2 * x - lo - hi))
    block, before = vb[i:i + k], vb[i - k:i]
    beta, gamma = before - va[i - k:i], block - before
    copies = [block + beta * (m - 1) + gamma * c for c in range(m)]
    keys = np.concatenate([ka[:i], *([kb[i:i + k]] * m), ka[i:]])
    vals = np.concatenate([va[:i] + m * (vb[:i] - va[:i]), *copies, va[i:] + m * (vb[i + k:] - va[i:])])
    return keys, vals


def _unroll_parts(ka, kb, va, vb, m: int):
    """`_unroll_phase`, or where a phase holds more than one stack (the paper stack's optimizer: a loop over
    the parameters, then the loss scaler's update, then a loop zeroing every gradient), each part between
    the ops that run exactly once in both traces, in the same order, unrolled on its own."""
    try:
        return _unroll_phase(ka, kb, va, vb, m)
    except _NotAStack:
        ua, ca = np.unique(ka, return_counts=True)
        ub, cb = np.unique(kb, return_counts=True)
        once = np.intersect1d(ua[ca == 1], ub[cb == 1])
        ia, ib = np.flatnonzero(np.isin(ka, once)), np.flatnonzero(np.isin(kb, once))
        if not len(ia) or not np.array_equal(ka[ia], kb[ib]):
            raise
    cuts_a, cuts_b = np.r_[0, np.c_[ia, ia + 1].ravel(), len(ka)], np.r_[0, np.c_[ib, ib + 1].ravel(), len(kb)]
    parts = [_unroll_phase(ka[a0:a1], kb[b0:b1], va[a0:a1], vb[b0:b1], m, all_values=True)
             for a0, a1, b0, b1 in zip(cuts_a[:-1], cuts_a[1:], cuts_b[:-1], cuts_b[1:])]
    return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])


def _phase_arrays(p: Probe):
    """Per op of `p`: keys (what must repeat) and values (what grows), and the phase boundaries."""
    n = len(p.ops)
    group = p.group if p.group is not None else np.full(n, -1, dtype=np.int32)
    inside = group >= 0
    start = inside & np.r_[True, group[1:] != group[:-1]]
    gbytes, gcycles = np.zeros(n), np.zeros(n)
    if p.group_bytes is not None and start.any():
        gbytes[start] = p.group_bytes[group[start]]
    if p.group_cycles is not None and start.any():
        gcycles[start] = p.group_cycles[group[start]]
    pad = p.padding if p.padding is not None else np.zeros(n + 1, dtype=np.int64)
    keys = (p.ops.astype(np.int64) * 16 + p.fmt.astype(np.int64) * 4 + inside * 2 + start)
    vals = np.column_stack([p.live[1:], pad[1:], p.flops, p.extra_flops, p.bytes, gbytes, gcycles]).astype(np.float64)
    return keys, vals, (0, p.forward_ops, p.backward_ops, n)


def _unroll(a: Probe, b: Probe, m: int) -> Probe:
    """The step `m` blocks deeper than `a`, from `a` and `b` (one block deeper), at the same batch size."""
    if a.batch_size != b.batch_size:
        raise ValueError("unroll traces of one batch size")
    (ka, va, ea), (kb, vb, eb) = _phase_arrays(a), _phase_arrays(b)
    keys, vals, ends = [], [], [0]
    for ph in range(3):
        k, v = _unroll_parts(ka[ea[ph]:ea[ph + 1]], kb[eb[ph]:eb[ph + 1]], va[ea[ph]:ea[ph + 1]],
                             vb[eb[ph]:eb[ph + 1]], m)
        keys.append(k), vals.append(v), ends.append(ends[-1] + len(k))
    keys, vals = np.concatenate(keys), np.concatenate(vals)
    inside, start = (keys & 2) > 0, (keys & 1) > 0
    group = np.where(inside, np.cumsum(start) - 1, -1).astype(np.int32)
    line = lambda x, y: int(round(x + m * (y - x)))  # noqa: E731
    live0 = line(a.live[0], b.live[0])
    pad0 = line(0 if a.padding is None else a.padding[0], 0 if b.padding is None else b.padding[0])
    return Probe(
        a.batch_size, line(a.params_bytes, b.params_bytes), line(a.optimizer_bytes, b.optimizer_bytes),
        line(a.grads_bytes, b.grads_bytes), line(a.forward_live, b.forward_live),
        line(a.forward_host, b.forward_host), np.rint(np.r_[live0, vals[:, 0]]).astype(np.int64),
        np.maximum(0.0, vals[:, 2]), np.maximum(0.0, vals[:, 3]), np.maximum(0.0, vals[:, 4]),
        (keys // 4 % 4).astype(np.int8), (keys // 16).astype(np.int32), a.seconds + b.seconds, ends[1], ends[2],
        group, np.maximum(0.0, vals[start, 5]), np.rint(np.r_[pad0, vals[:, 1]]).astype(np.int64),
        line(a.forward_grads, b.forward_grads), line(a.backward_host, b.backward_host),
        np.maximum(0.0, vals[start, 6]))


def _depth_profile(model, mom, precision, size, kernels, st) -> Profile | None:
    """The profile of a deep stack unrolled from the profiles at depths DEPTH_BASE and DEPTH_BASE + 1 (cached,
    on disk too, and shared by every depth), or None where that does not apply or the traces are not a stack."""
    if not (EXTRAPOLATE_DEPTH and isinstance(model, str) and catalog.spec(model).family in DEPTH_FAMILIES):
        return None
    if st.mixed == "half-model" and precision != "fp32":
        # the master weights and their gradient are one flat tensor each, whose size grows with the depth:
        # its allocator round-up (`Probe.padding`) is not affine in the depth
        return None
    base = DEPTH_BASE
    if size.get("num_layers", 0) <= base + 1:
        return None
    with _deeper_beside(model, mom, precision, {**size, "num_layers": base + 1}, kernels, st):
        first = _profile(model, mom, precision, {**size, "num_layers": base}, kernels, st)
    if not first.aligned:
        return None
    # one block deeper, the same tensors are quantized in the same chunks: try the batches that aligned first
    # (quant4's traces align from 16 at real size: the sizing pass of the search is saved, `quantized_sizes`)
    shallow = [first, _profile(model, mom, precision, {**size, "num_layers": base + 1}, kernels, st,
                               pair=(first.lo.batch_size, first.hi.batch_size))]
    if not shallow[1].aligned:
        return None
    b1, b2 = max(p.lo.batch_size for p in shallow), max(p.hi.batch_size for p in shallow)
    m = size["num_layers"] - base
    try:
        lo, hi = (_unroll(shallow[0].at(b), shallow[1].at(b), m) for b in (b1, b2))
    except _NotAStack:
        return None
    if not _aligned(lo, hi):
        return None
    return Profile(model, mom, precision, size, kernels, lo, hi, attention=st.attention, setup=st.setup,
                   depths=(base, base + 1))


@contextmanager
def _deeper_beside(model, mom, precision, size, kernels, st):
    """Within, a forked child process traces the configuration `size` (a deep stack's deeper shallow copy) into
    the disk cache, where `_profile` then reads it: the two shallow copies of a first estimate trace side by
    side (1.2-1.6x sooner on the 2-core project machine, docs/LOG.md 2026-12-07). The child's profile is the
    one this process would trace (the same search for two aligned batches, the same code), so every number is
    the same either way. Nothing is forked where that cannot pay or is not safe: `PARALLEL_DEPTHS` off, no disk
    cache, the traces already on disk, a platform other than Linux (fork is unsafe on macOS, missing on
    Windows), one CPU, or CUDA started in this process (a forked child cannot use it, and a traced step may ask
    it a question). A child that fails, or is still tracing `CHILD_GRACE_S` (or as long as this process's own
    trace took) after this process's trace, leaves nothing (it is killed), and `_profile` traces the
    configuration here; where this process's trace raises (an error, an interrupt), the child is killed at
    once. A child whose autograd did not survive the fork (`_FORK_UNSAFE`: torch built for CUDA, after a
    backward) says so at once, and this process forks no more."""
    global _FORK_UNSAFE
    disk = _disk_path(model, mom, precision, size, kernels, st) if PARALLEL_DEPTHS else None
    if (disk is None or disk[0].exists() or _FORK_UNSAFE or not sys.platform.startswith("linux")
            or not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2 or torch.cuda.is_initialized()):
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: trace, leave the traces on disk, exit without the parent's exit handlers
        code = 1
        try:
            torch.set_num_threads(1)  # an OpenMP pool the parent started does not survive a fork
            if _autograd_runs():
                _profile(model, mom, precision, size, kernels, st)
                code = 0
            else:
                code = _AUTOGRAD_FORKED
        finally:
            os._exit(code)
    t0 = time.monotonic()
    try:
        yield
    except BaseException:  # this trace failed or was interrupted: the child's is not wanted either
        _kill(pid, disk[0])
        raise
    deadline = time.monotonic() + max(CHILD_GRACE_S, time.monotonic() - t0)
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
        if time.monotonic() > deadline:
            _kill(pid, disk[0])
            return
        time.sleep(0.005)
    if os.waitstatus_to_exitcode(done[1]) == _AUTOGRAD_FORKED:
        _FORK_UNSAFE = True


def _autograd_runs() -> bool:
    """Whether a backward runs in this process (a forked child's first question: `_FORK_UNSAFE`)."""
    try:
        torch.ones((), requires_grad=True).backward()
    except RuntimeError:
        return False
    return True


def _kill(pid: int, path: Path) -> None:
    """Kill a forked tracing child (`_deeper_beside`), reap it, and remove a save of `path` it left unfinished."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    for tmp in path.parent.glob(f"{path.name}.{pid}.*.tmp"):
        tmp.unlink(missing_ok=True)


def clear_cache() -> None:
    """Forget every trace and calibration cached in this process (the traces on disk stay)."""
    with _LOCK:
        _PROFILES.clear()
        _REPLAYS.clear()
        _AUTO_COSTS.clear()
    timemodel.clear_cache()


# -- traces on disk ------------------------------------------------------------------------

# where traced profiles are kept between processes (a notebook kernel, the command line); None: nowhere
TRACE_CACHE: Path | None = ROOT / "build" / "cache" / "traces"
_DISK_FORMAT = 4
_SCALARS = ("batch_size", "params_bytes", "optimizer_bytes", "grads_bytes", "forward_live", "forward_host",
            "seconds", "forward_ops", "backward_ops", "forward_grads", "backward_host")
_ARRAYS = ("live", "flops", "extra_flops", "bytes", "fmt", "ops", "group", "group_bytes", "padding", "group_cycles")


# modules a trace never runs: the time model reads traces, validation and plots read estimates, reference is
# the paper's data; gpus: a trace depends only on its `kernels`, which is in the key
_UNTRACED = frozenset({"timemodel.py", "validation.py", "plots.py", "whatif.py", "gpus.py", "cli.py", "metrics.py",
                       "figures.py", "launch.py", "gpucheck.py", "reference/__init__.py"})


def _source_digest(package: Path) -> str:
    """sha256 over every .py file of `package` a trace may run, names and contents: any edit of those changes it."""
    h = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*.py") if p.relative_to(package).as_posix() not in _UNTRACED):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# momlab's source as this process imported it: an edit made after import does not run here, so it must not
# name this process's traces
_SOURCE = _source_digest(Path(__file__).resolve().parent)


def _disk_key(model: str, mom: str, precision: str, size: dict, kernels: str, st) -> dict:
    """Everything a trace depends on: the configuration, the code that runs it (momlab's source, torch and
    transformers), the interpreter and the CPU architecture (the CPU's kernel choices)."""
    return {"format": _DISK_FORMAT, "model": model, "mom": mom, "precision": precision,
            "size": dict(sorted(size.items())), "kernels": kernels, "trace_batches": list(TRACE_BATCHES),
            "attention": st.attention, "setup": st.setup,
            "momlab_source": _SOURCE, "torch": torch.__version__, "transformers": version("transformers"),
            "python": platform.python_version(), "machine": platform.machine()}


def _disk_path(model: str, mom: str, precision: str, size: dict, kernels: str, st) -> tuple[Path, dict] | None:
    """The file of a configuration's traces and the key it must hold; None when `TRACE_CACHE` is off."""
    if TRACE_CACHE is None:
        return None
    key = _disk_key(model, mom, precision, size, kernels, st)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(TRACE_CACHE) / f"{model}-{mom}-{precision}-{kernels}-{digest}.npz", key


def _save(path: Path, key: dict, probes: list[Probe]) -> None:
    """Write `probes` to `path` atomically (a reader sees the whole file or none); op ids become names,
    since `timemodel.OP_IDS` numbers ops in the order a process first met them. Unwritable: not kept, no error."""
    names = {i: name for name, i in timemodel.OP_IDS.items()}
    used = sorted({int(i) for p in probes for i in np.unique(p.ops)})
    local = np.zeros(max(used, default=0) + 1, dtype=np.int32)
    local[used] = np.arange(len(used), dtype=np.int32)
    meta = {"key": key, "op_names": [names[i] for i in used],
            "probes": [{k: getattr(p, k) for k in _SCALARS} for p in probes]}
    arrays = {f"{n}.{k}": (local[p.ops] if k == "ops" else getattr(p, k)) for n, p in enumerate(probes)
              for k in _ARRAYS}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _load(path: Path, key: dict) -> list[Probe] | None:
    """The probes saved at `path`, or None when there are none (or the file is not a whole one of this key)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta.get("key") != key:
                return None
            ids = np.array([timemodel.OP_IDS.setdefault(name, len(timemodel.OP_IDS)) for name in meta["op_names"]],
                           dtype=np.int32)
            return [Probe(**scalars, **{k: (ids[z[f"{n}.ops"]] if k == "ops" else z[f"{n}.{k}"]) for k in _ARRAYS})
                    for n, scalars in enumerate(meta["probes"])]
    except (OSError, ValueError, KeyError, IndexError, TypeError, zipfile.BadZipFile):
        return None


def _trace_at(model, mom, precision, size, batch_size, kernels, setup="default") -> Probe:
    """The traced step of one configuration (the time model's `trace`), with its record's software stack."""
    return profile(model, mom, precision=precision, kernels=kernels, setup=setup, **size).at(batch_size)


def calibrate(gpu: str, *, results=None, max_records: int = 4, quick: bool = True,
              reference: bool = True) -> Calibration:
    """`momlab.timemodel.calibrate` with this module's traces (see it)."""
    return timemodel.calibrate(gpu, trace=_trace_at, results=results, max_records=max_records, quick=quick,
                               reference=reference)


# -- estimates -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate(StepRecord):
    """A training configuration on a GPU, predicted (see the module docstring).

    Memory fields mean what they mean in `momlab.Measurement` (peak,
    params, grads, optimizer, activation, workspace, host), predicted from a
    trace. ``fits``: ``peak_bytes <= capacity_bytes`` (the GPU's memory, or a
    budget); with ``allocator="caching"``, PyTorch's caching allocator,
    replayed on the traced allocations (`momlab.allocator`), served every one
    of them within ``capacity_bytes`` (``reserved_bytes``: the most it
    reserved, or would have reserved without the limit). ``step_time_s`` is predicted whether or not it fits;
    ``throughput`` is ``batch_size / step_time_s``, NaN when it does not fit.
    ``flops`` as torch's FlopCounterMode counts them on the target's kernels
    (on `cpu`, attention is not counted: torch's counter does not see the CPU
    attention kernel). ``attention`` and ``setup``: the software stack traced
    (`momlab.workload.stack`). Memory outside tensors: ``peak_bytes`` and
    ``workspace_bytes`` include ``cublas_workspace_bytes`` (allocated through
    the caching allocator, as the allocator's peak counts it) and
    ``rounding_bytes`` (the allocator's 512-byte round-up at the peak);
    ``context_bytes`` (the CUDA context, outside the allocator) is taken off
    the GPU's memory to give ``capacity_bytes`` unless a budget replaces it
    (a budget caps the allocator, as `measure`'s does). ``calibrated``: the
    efficiency was fitted from measurements of this device (``calibration``:
    from what; ``calibration_error``: the fit's median relative error on its
    records, ``calibration_records``: which). ``interpolated``: the batch was
    read off two traces rather than traced itself. ``ckpt_plan`` (ckpt-auto
    only): the blocks checkpointed at this batch and capacity and how they
    were chosen (the module docstring).
    """

    gpu: str
    calibrated: bool
    capacity_bytes: int
    efficiency: float
    bytes_moved: int
    memory_source: str = "predicted"
    kernels: str = "cuda"
    interpolated: bool = True
    time: dict = field(default_factory=dict)
    calibration: str = ""
    calibration_error: float = math.nan  # median relative error of the calibration's fit on its records
    calibration_records: tuple = ()  # the measured configurations the calibration was fitted on
    attention: str | None = None
    setup: str = "default"
    cublas_workspace_bytes: int = 0
    context_bytes: int = 0
    rounding_bytes: int = 0
    allocator: str = "ideal"  # what `fits` asked (`ALLOCATORS`)
    reserved_bytes: int | None = None  # allocator="caching": what the replayed caching allocator reserved
    # ckpt-auto: the plan, as `momlab.measure` records it in ``options["ckpt_plan"]`` (`_auto_estimate`)
    ckpt_plan: dict | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.gpu == "cpu" else "cuda"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["device"] = self.device
        return d


def records(estimates) -> pd.DataFrame:
    """Estimates as records `momlab.metrics` reads like measured ones: the GPU is the device, its capacity
    the budget (so one GPU's estimates are one configuration)."""
    return pd.DataFrame([{**e.to_dict(), "device": e.gpu, "budget": e.capacity_bytes} for e in estimates])


def s1_grid(max_batch: int) -> list[int]:
    """The batches an S1 verdict scans: `batch_grid` and the first batch that does not fit."""
    return sorted(set(batch_grid(max_batch)) | {max_batch + 1})


def _check_gpu_precision(g: Gpu, precision: str, tf32: bool) -> None:
    fmt = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision]
    if not g.peak(fmt):
        raise ValueError(f"{g.name} has no {precision} fast path (its formats: {', '.join(g.formats())}); "
                         f"valid precisions here: {', '.join(p for p in PRECISIONS if g.peak(p))}")
    if tf32 and not g.peak("tf32"):
        raise ValueError(f"{g.name} has no tf32 tensor cores; use tf32=False")


def _capacity(g: Gpu, budget, setup: str = "default") -> int:
    """Bytes the allocator may hold: a budget, else the GPU's memory less the CUDA context of `setup`'s stack."""
    return g.memory_bytes - cuda_overheads(g, setup).context_bytes if budget is None else parse_bytes(budget)


def swap_schedule(mom, setup: str = "default") -> str:
    """How a configuration's swap copies share the GPU with compute (`momlab.timemodel.SWAP_SCHEDULES`):
    momlab's swap overlaps them ("overlap"); the paper's stack ran GACT's, which issues them on the compute
    stream ("serial"), prefetching the copies back only when it quantizes too ("serial-forward")."""
    mom = parse_mom(mom)
    if setup != "paper" or not mom.has("swap"):
        return "overlap"
    return "serial-forward" if any(part.startswith("quant") for part in mom.parts) else "serial"


def _from_probe(p: Probe, *, model, mom, precision, size, g, cal, capacity, kernels, interpolated, tf32,
                prof: Profile):
    # fp16's loss scaling waits for the GPU before the optimizer; the paper's BERT script timed forward and
    # backward only (`momlab.workload.Stack.timed`)
    t = step_time(p, g, cal, tf32=tf32, swap=swap_schedule(prof.mom, prof.setup),
                  sync=precision in timemodel.SYNC_PRECISIONS,
                  window=stack(resolve(model), prof.setup, prof.attention).timed)
    over = cuda_overheads(g, prof.setup)
    peak = p.peak_bytes + over.cublas_workspace_bytes + p.rounding_bytes
    fits = peak <= capacity
    flops = float(p.flops.sum()) + (float(p.extra_flops.sum()) if kernels == "cuda" else 0.0)
    return Estimate(
        model=name_of(model), mom=mom, batch_size=p.batch_size, precision=precision, size=dict(size), gpu=g.name,
        fits=fits, peak_bytes=peak, params_bytes=p.params_bytes, grads_bytes=p.grads_bytes,
        optimizer_bytes=p.optimizer_bytes, activation_bytes=p.activation_bytes,
        workspace_bytes=p.workspace_bytes + over.cublas_workspace_bytes + p.rounding_bytes,
        host_bytes=p.host_bytes,
        step_time_s=t.step_time_s,
        throughput=p.batch_size / t.step_time_s if fits else math.nan, flops=int(round(flops)),
        calibrated=cal.calibrated, capacity_bytes=capacity, efficiency=cal.efficiency,
        bytes_moved=int(t.bytes_moved), kernels=kernels, interpolated=interpolated,
        time={k: v for k, v in asdict(t).items() if k != "step_time_s"}, calibration=cal.source,
        calibration_error=cal.error, calibration_records=tuple(cal.fitted_on),
        attention=prof.attention, setup=prof.setup, cublas_workspace_bytes=over.cublas_workspace_bytes,
        context_bytes=over.context_bytes, rounding_bytes=p.rounding_bytes)


# -- ckpt-auto: a plan per batch between two traced bounds ------------------------------------

def _auto_bounds(mom) -> tuple[str, str]:
    """ckpt-auto's bounds: its MOM with no block checkpointed (the other parts alone, or exact) and with every
    block checkpointed (ckpt in its place)."""
    rest = [p for p in parse_mom(mom).parts if p != "ckpt-auto"]
    return parse_mom("+".join(rest) or "exact"), parse_mom("+".join([*rest, "ckpt"]))


def _fits_as(mom):
    """The MOM whose traces decide where `mom` fits: ckpt-auto's full bound (its plan is a subset of ckpt's
    blocks, so it fits wherever ckpt fits, and only there), any other MOM itself."""
    mom = parse_mom(mom)
    return _auto_bounds(mom)[1] if mom.has("ckpt-auto") else mom


def _interpolated(prof: Profile, p: Probe, batch_size: int) -> bool:
    """Whether `p`, `prof`'s step at `batch_size`, was read off its two traces rather than traced."""
    return p is not prof.lo and p is not prof.hi and batch_size not in prof.direct


_AUTO_COSTS: dict = {}


def _auto_costs(prof: Profile, mom) -> tuple[np.ndarray, ...]:
    """ckpt-auto's block costs (`_Session.block_costs`) at the two batches of `prof` (its no-checkpoint bound):
    bytes saved at each, forward FLOPs at each, per block; cached in this process. Both are affine in the
    batch, as every traced byte and FLOP is, so any batch is read off them (`_costs_at`)."""
    b1, b2 = prof.lo.batch_size, prof.hi.batch_size
    key = (prof.model, mom, prof.precision, tuple(sorted(prof.size.items())), prof.kernels, prof.attention,
           prof.setup, b1, b2)
    with _LOCK, _old_objects_frozen():
        costs = _AUTO_COSTS.get(key)
        if costs is None:
            session = _Session(prof.model, mom, prof.precision, prof.size, prof.kernels, attention=prof.attention,
                               setup=prof.setup)
            (s1, f1), (s2, f2) = (session.block_costs(b) for b in (b1, b2))
            costs = _AUTO_COSTS[key] = tuple(np.asarray(x, dtype=np.float64) for x in (s1, s2, f1, f2))
    return costs


def _costs_at(prof: Profile, costs, batch_size: int) -> tuple[list[int], list[float]]:
    s1, s2, f1, f2 = costs
    saving = np.rint(np.maximum(0.0, prof._lerp(s1, s2, batch_size))).astype(np.int64)
    return [int(x) for x in saving], [float(x) for x in np.maximum(0.0, prof._lerp(f1, f2, batch_size))]


def _auto_estimate(model, mom, batch_size: int, *, g, cal, budget, precision, tf32, attention, setup, size,
                   trace: bool = False) -> Estimate:
    """ckpt-auto at `batch_size` (the module docstring): nothing checkpointed where its no-checkpoint bound
    fits, every block where only its full bound fits (or nothing does), otherwise the fewest blocks of
    measure's order whose predicted peak fits the capacity, with memory from that prediction and time, FLOPs
    and bytes moved from the bounds', the chosen blocks' share of full checkpointing's recomputation added."""
    mom = parse_mom(mom)
    profs = [profile(model, m, precision=precision, kernels=g.kernels, attention=attention, setup=setup, **size)
             for m in _auto_bounds(mom)]
    capacity = _capacity(g, budget, profs[0].setup)
    bounds = []
    for prof in profs:
        p = prof.at(batch_size, trace=trace)
        bounds.append(_from_probe(p, model=model, mom=prof.mom, precision=precision, size=prof.size, g=g, cal=cal,
                                  capacity=capacity, kernels=g.kernels, tf32=tf32, prof=prof,
                                  interpolated=_interpolated(prof, p, batch_size)))
    base_prof, (none, every) = profs[0], bounds
    saving, flops = _costs_at(base_prof, _auto_costs(base_prof, mom), batch_size)
    n = len(saving)
    order = _auto.order(saving, flops)
    if none.fits:
        k = 0
    elif not every.fits:
        k = n
    else:
        k = next(k for k in range(n + 1) if k == n
                 or _auto.predict_peak(order[:k], saving, none.peak_bytes, every.peak_bytes) <= capacity)
    chosen = order[:k]
    plan = {"blocks": n, "order": order, "checkpointed": sorted(chosen), "saving_bytes": saving,
            "recompute_flops": flops, "exact_peak_bytes": none.peak_bytes, "predicted": k}
    if k in (0, n):  # a bound itself
        return replace(none if k == 0 else every, mom=mom, ckpt_plan=plan)
    share = sum(flops[i] for i in chosen) / sum(flops) if sum(flops) > 0 else k / n
    mix = lambda a, b: a + share * (b - a)  # noqa: E731
    peak = _auto.predict_peak(chosen, saving, none.peak_bytes, every.peak_bytes)
    activation = max(every.activation_bytes, none.activation_bytes - sum(saving[i] for i in chosen))
    step_s = mix(none.step_time_s, every.step_time_s)
    return replace(
        none, mom=mom, fits=True, peak_bytes=peak, activation_bytes=activation,
        workspace_bytes=max(0, peak - none.params_bytes - none.grads_bytes - none.optimizer_bytes - activation),
        step_time_s=step_s, throughput=batch_size / step_s, flops=int(round(mix(none.flops, every.flops))),
        bytes_moved=int(round(mix(none.bytes_moved, every.bytes_moved))),
        time={key: mix(v, every.time[key]) if isinstance(v, (int, float)) and not isinstance(v, bool)
              and key in every.time else v for key, v in none.time.items()},
        interpolated=none.interpolated or every.interpolated, ckpt_plan={**plan, "recompute_share": share})


def _checked_gpu(gpu: str, precision: str, tf32: bool) -> Gpu:
    g = get_gpu(gpu)
    check_choice("precision", precision, PRECISIONS)
    _check_gpu_precision(g, precision, tf32)
    return g


def _prepare(model, mom, gpu, precision, tf32, size, attention=None, setup="default"):
    g = _checked_gpu(gpu, precision, tf32)
    prof = profile(model, mom, precision=precision, kernels=g.kernels, attention=attention, setup=setup, **size)
    return g, prof


def _max_batch(g: Gpu, prof: Profile, budget) -> int:
    """Largest batch whose traced peak plus the cuBLAS workspace and the allocator's round-up fits the
    allocator's capacity (the round-up taken at the larger trace: it grows with the count of live tensors,
    not with their size, so it is nearly constant in the batch)."""
    return prof.max_batch_size(_capacity(g, budget, prof.setup) - cuda_overheads(g).cublas_workspace_bytes
                               - prof.hi.rounding_bytes)


# -- the caching allocator: what a step reserves ---------------------------------------------

# "ideal": the live tensors (with the allocator's 512-byte round-up and cuBLAS's workspace) must fit, as if every
# freed byte could be reused; "caching": PyTorch's caching allocator replayed on a traced process
# (`momlab.allocator`), whose cached, split segments can leave no block large enough (fragmentation)
ALLOCATORS = ("ideal", "caching")
# steps of a replayed process: the first creates gradients and optimizer state in the holes its activations
# left, the later ones run in the segments those left
REPLAY_STEPS = 3
UNLIMITED = 2 ** 62  # a capacity no replay reaches: what a step would reserve if it could


def allocation_events(model, mom: str = "exact", *, batch_size: int, precision: str = "fp32",
                      attention: str | None = None, setup: str = "default", steps: int = REPLAY_STEPS,
                      workspace: int = 0, **size) -> list:
    """Every device allocation and free of a fresh CUDA process training at `batch_size`, in order.

    The weights as built (one allocation each, as ``model.cuda()`` makes them), cuBLAS's `workspace` (bytes;
    0: none), then `steps` training steps, traced without data as `profile` traces (a full trace at this
    batch: about a second per thousand ops and step). Items are ``(key, nbytes)`` for an allocation and
    ``(key, momlab.allocator.FREE)`` for a free: the input of `momlab.allocator.replay`.
    """
    check_batch_size(batch_size)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    model = resolve(model)
    st = stack(model, setup, attention)
    size = catalog.resolve_size(model, size)
    events: list = []
    with _LOCK:
        session = _Session(model, parse_mom(mom), precision, size, "cuda", attention=st.attention,
                           setup=st.setup, batch_size=batch_size, events=events, workspace=workspace)
        with _kernels("cuda", session.tracer), session.tracer:
            for _ in range(steps - 1):
                session.w.step()
        session.tracer.events = None  # the process ends here: its teardown is not part of the step
        del session
        gc.collect()
    return events


def _replay(g: Gpu, prof: Profile, batch_size: int, capacity: int) -> allocator.Replay:
    """The caching allocator replayed on a fresh process of `prof`'s configuration at `batch_size` (cached)."""
    workspace = cuda_overheads(g).cublas_workspace_bytes
    key = (batch_size, capacity, workspace)
    if key not in prof.replays:
        last = prof._events
        if last is None or last[0] != (batch_size, workspace):
            last = prof._events = ((batch_size, workspace), allocation_events(
                prof.model, prof.mom, batch_size=batch_size, precision=prof.precision, attention=prof.attention,
                setup=prof.setup, workspace=workspace, **prof.size))
        prof.replays[key] = allocator.replay(last[1], capacity)
    return prof.replays[key]


def _check_caching(g: Gpu) -> None:
    if g.kernels != "cuda":
        raise ValueError(f"allocator='caching' replays CUDA's caching allocator: {g.name} is not a CUDA GPU; "
                         f"valid allocators for it: 'ideal'")


def _max_batch_caching(g: Gpu, prof: Profile, budget) -> int:
    """Largest batch the replayed caching allocator serves within the capacity (`_largest_served`)."""
    capacity = _capacity(g, budget, prof.setup)

    def retry(batch: int) -> int:
        extra = _replay(g, prof, batch, UNLIMITED).peak_reserved - int(prof.at(batch).peak_bytes)
        return min(batch - 1, prof.max_batch_size(capacity - extra))

    return _largest_served(_max_batch(g, prof, budget), 1, lambda b: _replay(g, prof, b, capacity).fits, retry)


def _largest_served(top: int, step: int, serves, retry) -> int:
    """The largest multiple of `step` the replayed caching allocator serves (`serves(value)`), from the ideal
    answer `top`, which bounds it (the allocator's blocks hold at least the live bytes). Below it, each value
    it cannot serve gives the next guess, `retry(value)`: the ideal answer for the capacity less the reserve
    that value wanted beyond its live peak (measured by a replay without a limit), below `value`. A guess it
    serves is refined by bisection."""
    if top == 0 or serves(top):
        return top
    fits, fails = 0, top
    while True:
        guess = retry(fails)
        if guess <= fits:
            break
        if serves(guess):
            fits = guess
            break
        fails = guess
    while fails - fits > step:
        mid = (fits + fails) // 2 // step * step
        if serves(mid):
            fits = mid
        else:
            fails = mid
    return fits


def estimate(model: str, mom: str = "exact", *, batch_size: int, gpu: str, precision: str = "fp32",
             budget=None, tf32: bool = False, trace: bool = False, results=None, attention: str | None = None,
             setup: str = "default", allocator: str = "ideal", **size) -> Estimate:
    """Predict one training configuration on `gpu` (a name from `momlab.gpus()`).

    `budget` replaces the GPU's memory as the capacity `fits` is judged
    against (bytes or "2GiB"); `tf32` runs fp32 matmuls on tf32 tensor cores
    (``torch.backends.cuda.matmul.allow_tf32``); `trace` traces this batch
    size rather than reading it off the cached pair of traces; `results`
    where measured records for calibration are (default results/*.jsonl);
    `setup` and `attention` the software stack (`momlab.workload.stack`);
    `allocator` (`ALLOCATORS`) what `fits` asks: "ideal", the peak of live
    bytes fits; "caching", PyTorch's caching allocator, replayed on a fresh
    traced process at this batch, serves every allocation within the
    capacity (``reserved_bytes``: what it reserved; a full trace, seconds).

    >>> e = estimate("bert-large", "ckpt", batch_size=256, gpu="A100-40")  # doctest: +SKIP
    >>> e.fits, format_bytes(e.peak_bytes), round(e.throughput)            # doctest: +SKIP
    """
    check_batch_size(batch_size)
    check_choice("allocator", allocator, ALLOCATORS)
    if allocator == "caching":
        _check_caching(get_gpu(gpu))  # before any trace
    if parse_mom(mom).has("ckpt-auto"):
        if allocator == "caching":
            raise ValueError(f"{parse_mom(mom)!r}: allocator='caching' replays the allocations of one traced "
                             f"configuration, and ckpt-auto's plan is chosen per batch between two; valid here: "
                             f"allocator='ideal'")
        g = _checked_gpu(gpu, precision, tf32)
        return _auto_estimate(model, mom, batch_size, g=g, cal=calibrate(gpu, results=results), budget=budget,
                              precision=precision, tf32=tf32, attention=attention, setup=setup, size=size, trace=trace)
    g, prof = _prepare(model, mom, gpu, precision, tf32, size, attention, setup)
    cal = calibrate(gpu, results=results)
    p = prof.at(batch_size, trace=trace)
    interpolated = _interpolated(prof, p, batch_size)
    capacity = _capacity(g, budget, prof.setup)
    e = _from_probe(p, model=model, mom=prof.mom, precision=precision, size=prof.size, g=g, cal=cal,
                    capacity=capacity, kernels=g.kernels, interpolated=interpolated, tf32=tf32, prof=prof)
    if allocator == "ideal":
        return e
    r = _replay(g, prof, batch_size, capacity)
    reserved = r.peak_reserved if r.fits else _replay(g, prof, batch_size, UNLIMITED).peak_reserved
    return replace(e, fits=r.fits, throughput=e.throughput if r.fits else math.nan, allocator=allocator,
                   reserved_bytes=reserved)


def predict_max_batch(model: str, mom: str = "exact", *, gpu: str, precision: str = "fp32", budget=None,
                      attention: str | None = None, setup: str = "default", allocator: str = "ideal",
                      **size) -> int:
    """Largest batch size whose predicted peak fits `gpu`'s memory (or `budget`); 0 when none does.

    `allocator` "ideal": exact under the affine model (the closed form of the module docstring), in
    microseconds once traced; "caching": the largest batch PyTorch's caching allocator, replayed on traced
    processes, serves (`_max_batch_caching`; a few full traces, tens of seconds at real size), never more
    than the ideal answer.

    >>> predict_max_batch("bert-large", "ckpt", gpu="A100-40")  # doctest: +SKIP
    """
    check_choice("allocator", allocator, ALLOCATORS)
    if allocator == "caching":
        _check_caching(get_gpu(gpu))  # before any trace
    g, prof = _prepare(model, _fits_as(mom), gpu, precision, False, size, attention, setup)
    if allocator == "caching":
        return _max_batch_caching(g, prof, budget)
    return _max_batch(g, prof, budget)


def throughput_curve(model: str, mom: str = "exact", *, gpu: str, batch_sizes, precision: str = "fp32",
                     budget=None, tf32: bool = False, results=None, attention: str | None = None,
                     setup: str = "default", **size) -> list[Estimate]:
    """Estimates at each of `batch_sizes` from one pair of traces (no tracing per point; ckpt-auto: a plan
    per point from its bounds' pairs, `_auto_estimate`)."""
    if parse_mom(mom).has("ckpt-auto"):
        g, cal = _checked_gpu(gpu, precision, tf32), calibrate(gpu, results=results)
        return [_auto_estimate(model, mom, int(b), g=g, cal=cal, budget=budget, precision=precision, tf32=tf32,
                               attention=attention, setup=setup, size=size) for b in batch_sizes]
    g, prof = _prepare(model, mom, gpu, precision, tf32, size, attention, setup)
    cal = calibrate(gpu, results=results)
    cap = _capacity(g, budget, prof.setup)
    return [_from_probe(prof.at(int(b)), model=model, mom=prof.mom, precision=precision, size=prof.size, g=g,
                        cal=cal, capacity=cap, kernels=g.kernels, interpolated=True, tf32=tf32, prof=prof)
            for b in batch_sizes]


def batch_grid(max_batch: int, points: int = 24) -> list[int]:
    """Batch sizes to scan up to `max_batch`: log-spaced, always including 1 and `max_batch`."""
    if max_batch < 1:
        return []
    grid = np.unique(np.round(np.geomspace(1, max_batch, min(points, max_batch))).astype(int))
    return sorted({int(b) for b in grid} | {1, int(max_batch)})


def best_throughput(model: str, mom: str = "exact", *, gpu: str, precision: str = "fp32", budget=None,
                    tf32: bool = False, results=None, max_batch: int | None = None, attention: str | None = None,
                    setup: str = "default", **size) -> Estimate | None:
    """The fastest configuration (samples/s) among batches that fit; None when none fits (scenario S1)."""
    stack_kw = {"attention": attention, "setup": setup}
    if max_batch is None:
        max_batch = predict_max_batch(model, mom, gpu=gpu, precision=precision, budget=budget, **stack_kw, **size)
    grid = batch_grid(max_batch)
    if not grid:
        return None
    curve = throughput_curve(model, mom, gpu=gpu, batch_sizes=grid, precision=precision, budget=budget,
                             tf32=tf32, results=results, **stack_kw, **size)
    fitting = [e for e in curve if e.fits]
    return max(fitting, key=lambda e: e.throughput) if fitting else None


def predict_max_size(model: str, mom: str = "exact", *, dim: str = "num_layers", batch_size: int, gpu: str,
                     precision: str = "fp32", budget=None, limit: int | None = None, attention: str | None = None,
                     setup: str = "default", allocator: str = "ideal", **size) -> int:
    """Largest value of size keyword `dim` (on its grid) that fits at `batch_size` (scenario S2); 0: none.

    Each trial is a trace at that size; the first guess comes from a
    quadratic through three smaller sizes (memory is quadratic at most in a
    size keyword: width, sequence and image side), then the answer is
    bracketed and bisected with traces, so it is exact on the grid.
    `allocator` as `predict_max_batch`'s: "caching" asks PyTorch's caching
    allocator, replayed on a traced process at each size it tries (tens of
    seconds a size at real size), below the ideal answer.
    """
    from momlab.search import find_max, size_step

    check_choice("allocator", allocator, ALLOCATORS)
    mom = _fits_as(mom)
    model = resolve(model)
    g = get_gpu(gpu)
    _check_gpu_precision(g, precision, False)
    if dim in size:
        raise ValueError(f"predict_max_size searches {dim}; do not also pass {dim}={size[dim]!r}")
    full = catalog.resolve_size(model, size)
    check_choice(f"size keyword of {model}", dim, list(full))
    check_batch_size(batch_size)
    if allocator == "caching":
        _check_caching(g)  # before any trace
    card = _capacity(g, budget, setup)
    step = size_step(model, dim, **size)

    cap = card - cuda_overheads(g).cublas_workspace_bytes

    def prof_at(value: int) -> Profile:
        return profile(model, mom, precision=precision, kernels=g.kernels, attention=attention, setup=setup,
                       **{**size, dim: value})

    def peak(value: int) -> int:
        return prof_at(value).at(batch_size).peak_bytes

    default = full[dim] // step * step or step
    xs = sorted({max(step, default // 4 // step * step), max(step, default // 2 // step * step), default})
    guess = default
    if len(xs) == 3:
        ys = [peak(x) for x in xs]
        c = np.polyfit(xs, ys, 2)
        roots = np.roots([c[0], c[1], c[2] - cap])
        real = [r.real for r in roots if abs(r.imag) < 1e-9 and r.real > 0]
        if real:
            guess = int(max(step, min(real) // step * step))
        elif c[0] == 0 and c[1] > 0:
            guess = int(max(step, (cap - c[2]) / c[1] // step * step))
    if limit is not None:
        guess = min(guess, limit // step * step)

    class _Fit:
        def __init__(self, ok):
            self.fits = ok

    s = find_max(lambda v: _Fit(peak(v) <= cap), step=step, start=max(step, guess), limit=limit, dim=dim)
    if allocator == "ideal":
        return s.value

    def retry(value: int) -> int:
        extra = _replay(g, prof_at(value), batch_size, UNLIMITED).peak_reserved - peak(value)
        return 0 if value <= step else find_max(lambda v: _Fit(peak(v) <= cap - extra), step=step,
                                                start=value - step, limit=value - step, dim=dim).value

    return _largest_served(s.value, step, lambda v: _replay(g, prof_at(v), batch_size, card).fits, retry)


def verdict(model: str, moms=None, *, gpu: str, precision: str = "fp32", batch_size: int | None = None,
            dim: str | None = None, budget=None, results=None, attention: str | None = None,
            setup: str = "default", **size) -> dict:
    """Which MOM wins on `gpu`: S1 (highest throughput at its best batch), and with `dim`, S2.

    S1, for each MOM: the largest batch that fits, the batch with the highest
    predicted throughput under it, and that throughput; the winner and its
    ratio to exact's (inf when exact does not fit at all). With `batch_size`
    the estimate at that batch is included (does it fit, how fast). S2 (when
    `dim` is given, e.g. "num_layers", with `batch_size`): the largest model
    each MOM trains, its ratio to exact's and what it keeps in host memory (swap: nothing bounds
    that here). ``text`` says it in one line each.

    >>> verdict("bert-large", ["exact", "ckpt"], gpu="A100-40", batch_size=256)["text"]  # doctest: +SKIP
    """
    import momlab.moms as moms_module

    model = resolve(model)
    moms = ["exact", *[m for m in moms_module.moms() if m != "exact"]] if moms is None else list(moms)
    if not moms:
        raise ValueError("verdict needs at least one MOM")
    rows, text, curves = [], [], []
    for mom in moms:
        try:
            mom = parse_mom(mom)
            g, prof = _prepare(model, _fits_as(mom), gpu, precision, False, size, attention, setup)
        except ValueError as exc:  # a MOM that does not apply to this model (ckpt-selective on a ResNet)
            rows.append({"mom": mom, "applicable": False, "reason": str(exc).splitlines()[0]})
            continue
        mb = _max_batch(g, prof, budget)
        curve = throughput_curve(model, mom, gpu=gpu, batch_sizes=s1_grid(mb), precision=precision, budget=budget,
                                 results=results, attention=attention, setup=setup, **size)
        curves += curve
        fitting = [e for e in curve if e.fits]
        best = max(fitting, key=lambda e: e.throughput) if fitting else None
        row = {"mom": mom, "applicable": True, "max_batch": mb,
               "best_batch": best.batch_size if best else 0,
               "throughput": best.throughput if best else 0.0,
               "step_time_s": best.step_time_s if best else math.nan,
               "calibrated": calibrate(gpu, results=results).calibrated}
        if batch_size is not None:
            e = estimate(model, mom, batch_size=batch_size, gpu=gpu, precision=precision, budget=budget,
                         results=results, attention=attention, setup=setup, **size)
            row.update(at_batch=batch_size, fits_at_batch=e.fits, peak_at_batch=e.peak_bytes,
                       throughput_at_batch=e.throughput, step_time_at_batch=e.step_time_s)
        rows.append(row)
    if curves:
        s1 = metrics.s1_verdict(metrics.s1_summary(records(curves)), where=gpu)
    else:
        s1 = {"best": None, "ratio_vs_exact": math.nan,
              "text": f"S1: no MOM of {moms} applies to {name_of(model)}."}
    text.append(s1.pop("text"))
    if batch_size is not None:
        for r in rows:
            if r.get("applicable") and "fits_at_batch" in r:
                verb = "fits" if r["fits_at_batch"] else "does not fit"
                speed = f", {r['throughput_at_batch']:.4g} samples/s" if r["fits_at_batch"] else ""
                text.append(f"{r['mom']} at batch {batch_size}: {verb} ({format_bytes(r['peak_at_batch'])} of "
                            f"{format_bytes(_capacity(get_gpu(gpu), budget, setup))}){speed}")
    out = {"model": name_of(model), "gpu": gpu, "precision": precision, "size": catalog.resolve_size(model, size),
           "rows": rows, "s1": s1, "calibrated": calibrate(gpu, results=results).calibrated}
    if dim is not None:
        if batch_size is None:
            raise ValueError("the S2 verdict (largest model) needs a batch_size")
        s2rows = []
        for r in rows:
            if r.get("applicable"):
                v = predict_max_size(model, r["mom"], dim=dim, batch_size=batch_size, gpu=gpu, precision=precision,
                                     budget=budget, attention=attention, setup=setup, **size)
                # what the deepest model keeps in host memory (swap's copies): nothing here bounds it
                deepest = profile(model, _fits_as(r["mom"]), precision=precision, kernels=_kernels_of(gpu),
                                  attention=attention, setup=setup, **{**size, dim: v}) if v else None
                host = deepest.at(batch_size).host_bytes if v else 0
                s2rows.append({"mom": r["mom"], dim: v, "host_bytes": host})
        base = next((r[dim] for r in s2rows if r["mom"] == "exact"), 0)
        best = max(s2rows, key=lambda r: r[dim]) if s2rows else None
        out["s2"] = {"dim": dim, "batch_size": batch_size, "rows": s2rows, "best": best["mom"] if best else None,
                     "ratio_vs_exact": (best[dim] / base if base else math.inf) if best else math.nan}
        if best:
            text.append(f"S2: {best['mom']} trains the largest {model} at batch {batch_size}: {dim}={best[dim]}"
                        + (f" ({best[dim] / base:.2f}x exact's {base})" if base else " (exact fits none)")
                        + (f", with {format_bytes(best['host_bytes'])} in host memory (not bounded here)"
                           if best["host_bytes"] else ""))
    out["text"] = "\n".join(text)
    return out


class _CallableModule(types.ModuleType):
    """`momlab.estimate(...)` is `estimate()`, while `momlab.estimate.verdict` stays this module's."""

    def __call__(self, *args, **kwargs) -> Estimate:
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
