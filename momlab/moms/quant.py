"""quant8 / quant4 / quant2: activation-compressed training.

Every activation saved for backward is stored in 8, 4 or 2 bits and restored
(approximately) when backward needs it; ActNN (Chen et al., 2021) and GACT
(Liu et al., 2022). Each group of 256 consecutive values gets its own minimum
and scale, codes are rounded *stochastically* so the restored value is
unbiased (E[dequant(quant(x))] = x, hence unbiased gradients of the linear
ops that use it), and codes are bit-packed into uint8: 4 bits really cost
half a byte per value. Trade-off: about 32/bits less activation memory (plus
8 bytes of metadata per group) for extra gradient variance and the
(de)quantization kernels' time.

Which saved tensors are packed:
- floating-point tensors of at least ``min_numel`` (1024) values. Below that
  the 8-byte group metadata, the kernel launches and the Python overhead cost
  more than the bytes saved (a 256-value fp32 group is 1 KiB);
- boolean tensors (dropout masks) of at least ``min_numel`` values are
  bit-packed *losslessly*, 1 bit per value;
- per-row statistics (a last dimension of 1, e.g. layer norm's mean and rstd)
  stay exact: they are 1/hidden of an activation, so keeping them costs
  almost nothing, and an error in one scales a whole row;
- floating tensors saved without requiring grad stay exact (decided in
  ``momlab.moms.compose``, which sees them before they are detached): fused
  attention's fp32 log-sum-exp (a per-row statistic whose last dimension is
  not 1; an error in it biases every attention probability backward rebuilds
  from it) and the input data;
- integer tensors (indices) and tiny tensors stay as they are (a tiny view of
  a large tensor is stored as a compact copy, so it does not pin the rest).
Model parameters and buffers are never packed: that is decided outside this
module (``momlab.moms.compose``), which sees the model.

Randomness for stochastic rounding comes from a dedicated ``torch.Generator``
per device, so the model's own RNG stream (dropout) is the same as without
quantization and runs stay comparable to ``exact``.

Apply it through ``momlab.moms.apply(model, "quant4")``; this module exposes
the `Quantizer` (the pack/unpack pair, and its parameters) and the
`quantize` / `dequantize` functions it is built on.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from momlab.device import is_oom

__all__ = ["BITS", "GROUP_SIZE", "KERNELS", "MIN_NUMEL", "Packed", "Quantizer", "dequantize", "gact_cycles",
           "gact_traffic", "pack_mask", "packed_bytes", "quantize"]

BITS = (8, 4, 2)
GROUP_SIZE = 256  # values sharing one (min, scale): ActNN/GACT's granularity
MIN_NUMEL = 1024  # smaller saved tensors are kept as they are (see above)
META_DTYPE = torch.float32  # min and scale: fp32 so the offset is exact and no range overflows
# values (de)quantized per step: the float32 temporaries then take a few MiB
# whatever the tensor's size, instead of several copies of, say, GPT-2's logits
CHUNK = 1 << 20
# whose kernels a GPU runs to pack and unpack (what a trace for a GPU charges; memory is momlab's either way):
# "momlab" (this module's programs, `_encode`/`_decode` compiled, the casts, noise and copies around them
# separate kernels), "gact" (the paper's quantizer, `gact_traffic`)
KERNELS = ("momlab", "gact")

# A traced step (momlab.estimate) runs the chunk loops *folded*: one pass over the first chunk stands for
# all of them. The passes are alike and each frees its temporaries, so memory is the same op by op, and the
# ops no longer depend on the batch size (the chunk count grows with it), so traces at two batch sizes
# align; `REPEAT` says how many passes the one stands for (a tracer scales that pass's traffic by it, but
# not the padding copy's: a real step pads one chunk at most, `_pad`).
FOLD = False
REPEAT = 1.0


def _folded(n: int) -> bool:
    """Whether a loop over `n` values runs folded: in a trace, and only where it has several chunks (one
    chunk runs as it always does, so a traced small tensor is packed op for op as a real step packs it)."""
    return FOLD and n > CHUNK


def _passes(n: int) -> range:
    global REPEAT
    if not _folded(n):
        return range(0, n, CHUNK)
    REPEAT = n / CHUNK
    return range(0, 1)


class Packed(NamedTuple):
    """A saved tensor in packed form; its tensors are all that is stored."""

    data: torch.Tensor  # uint8: bit-packed codes (bits 8/4/2) or mask bits (bits 1)
    meta: torch.Tensor | None  # [groups, 2]: (min, scale) per group, META_DTYPE (GACT: the tensor's dtype); None: masks
    shape: tuple
    dtype: torch.dtype
    bits: int


def packed_bytes(p: Packed) -> int:
    """Bytes the packed form stores: codes plus metadata."""
    meta = 0 if p.meta is None else p.meta.numel() * p.meta.element_size()
    return p.data.numel() * p.data.element_size() + meta


def gact_traffic(n: int, itemsize: int, bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Bytes each CUDA kernel of the paper's quantizer reads and writes to pack, then to unpack, `n` values
    of `itemsize` bytes into `bits` bits (GACT-ICML gact/ops.py ``no_scheme_quantize_pack`` and
    ``dequantize_and_unpack``, gact/cpp_extension/quantization_cuda_kernel.cu; groups of `GROUP_SIZE`).

    Pack: the tensor padded to whole groups (``torch.cat`` with zeros, a copy, only where `n` is not a multiple
    of the group; its bytes go with the next kernel's), ``minimax`` (reads every value in the tensor's own
    dtype, writes a min and a max per group), ``compute_scale`` (min and max in, a scale per group out),
    ``pack_single_precision`` (reads the values, scale and min, draws its rounding noise inside the kernel,
    writes the codes). Unpack: ``unpack_single_precision`` (reads codes, scale and min, writes the values in
    the tensor's dtype; the padding is cut off as a view). Bits 1 is a uint8 dropout mask: GACT's check reads
    it for its max and its min, ``act_quantize_dropout_mask`` packs it 8 values a byte; unpack zero-fills an
    output and sets it.

    >>> gact_traffic(512, 2, 4)
    ((1032.0, 12.0, 1288.0), (1288.0,))
    """
    if bits == 1:
        packed = -(-n // 8)
        return (float(n), float(n), float(n + packed)), (float(n), float(packed + n))
    groups = -(-n // GROUP_SIZE)
    padded = groups * GROUP_SIZE
    stats = groups * itemsize  # one value per group, in the tensor's dtype
    codes = padded * bits / 8
    pad = (n + padded) * itemsize if padded != n else 0
    return ((float(pad + padded * itemsize + 2 * stats), float(3 * stats), padded * itemsize + 2 * stats + codes),
            (codes + 2 * stats + padded * itemsize,))


# SM cycles GACT's kernels spend per thread and per value on their instructions, at the throughput the CUDA C++
# Programming Guide gives per multiprocessor and clock for compute capability 7.x to 9.0 (its table "Throughput of
# Native Arithmetic Instructions": 64 results for 32-bit integer and float add, multiply(-add), logic, shift and
# compare; 16 for type conversions and special functions; 32 for warp shuffles; memory and control instructions
# counted at 32, uniform-datapath ones at 64). Counted in the SASS nvcc 13.0 made for sm_75 (the oldest target it
# has) of kernels with the algorithm, types and launch shape of GACT-ICML's quantization_cuda_kernel.cu and
# minimax kernel: one thread per value position of a 256-value group and 8 / bits groups a thread, Philox noise
# initialised per thread (`curand_init` with the thread's subsequence, one Philox4x32-10 evaluation), 64-bit
# indices, the bit count and so the values a thread known only at run time, an IEEE division per value in
# unpack; one 32-thread warp a group with shuffles for min and max; 512-thread blocks packing a uint8 mask through
# shared-memory atomics. Per thread (prologue and epilogue) and per value; docs/LOG.md 2026-12-07 01:30.
_GACT_PACK_CYCLES = (3.22, 0.84)  # per thread, per value: pack_single_precision (fp16 and fp32 within 1%)
_GACT_UNPACK_CYCLES = (1.34, 0.90)  # unpack_single_precision
_GACT_MINIMAX_CYCLES = 0.36  # per value: minimax (8 values a thread, 12 shuffles a warp)
_GACT_SCALE_CYCLES = 0.8  # per group: compute_scale (one IEEE division a thread)
_GACT_MASK_CYCLES = (0.55, 0.45)  # per value: act_quantize_dropout_mask, act_dequantize_dropout_mask


def gact_cycles(n: int, bits: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """SM cycles the paper's quantizer's kernels issue to pack, then to unpack, `n` values into `bits` bits: the
    instructions of `gact_traffic`'s kernels, one number per kernel in the same order (0 for PyTorch's own
    kernels there: the padding copy, a mask's max and min, the zero fill; their bytes bound them). A kernel
    takes at least its cycles over the GPU's ``sm_clock_hz`` (multiprocessors x clock): with Philox set up
    per thread and 64-bit index arithmetic, pack and unpack issue 60-130 instructions per value, several
    times their bytes' time on any GPU (`momlab.timemodel`).

    >>> [round(c) for c in gact_cycles(512, 4)[0]], [round(c) for c in gact_cycles(512, 4)[1]]
    ([184, 2, 1254], [804])
    """
    if bits == 1:
        return (0.0, 0.0, _GACT_MASK_CYCLES[0] * n), (0.0, _GACT_MASK_CYCLES[1] * n)
    groups = -(-n // GROUP_SIZE)
    padded = groups * GROUP_SIZE
    threads = -(-padded // (8 // bits))
    return ((_GACT_MINIMAX_CYCLES * padded, _GACT_SCALE_CYCLES * groups,
             _GACT_PACK_CYCLES[0] * threads + _GACT_PACK_CYCLES[1] * padded),
            (_GACT_UNPACK_CYCLES[0] * threads + _GACT_UNPACK_CYCLES[1] * padded,))


# -- the tensor programs (pure functions of tensors: torch.compile can take them) --

def _encode(flat: torch.Tensor, noise: torch.Tensor, bits: int):
    """Codes and (min, scale) of a flat float32 tensor padded to whole groups."""
    groups = flat.view(-1, GROUP_SIZE)
    lo = groups.amin(dim=1, keepdim=True)  # (torch.aminmax over a dim is ~10x slower on CPU)
    hi = groups.amax(dim=1, keepdim=True)
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels
    # a constant group has scale 0: every code is 0 and decodes to lo, exactly
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # stochastic rounding: floor(v + u), u ~ U[0, 1), is v on average; the
    # value is >= 0 after the clamp, so the cast to uint8 is the floor
    v = (groups - lo).div_(scale).add_(noise.view_as(groups)).clamp_(0, levels)
    return _pack_bits(v.to(torch.uint8).view(-1), bits), torch.cat([lo, scale], dim=1).to(META_DTYPE)


def _decode(data: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    codes = _unpack_bits(data, bits).view(-1, GROUP_SIZE)
    lo, scale = meta.float().split(1, dim=1)
    return torch.addcmul(lo, codes, scale)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits each -> 8/bits codes per byte.

    Byte i holds codes i, i + m, i + 2m, ... (m = n * bits / 8), lowest bits
    first: every operation then reads and writes contiguous memory.
    """
    if bits == 8:
        return codes
    rows = codes.view(8 // bits, -1)
    packed = rows[0].clone()
    for j in range(1, rows.shape[0]):  # over the 2-8 codes of a byte, not over values
        packed |= rows[j] << (bits * j)
    return packed


def _unpack_bits(data: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return data
    mask = (1 << bits) - 1
    return torch.stack([(data >> (bits * j)) & mask for j in range(8 // bits)]).view(-1)


# momlab.estimate's tracer sets this while it traces a step for a GPU: there `_encode` and `_decode` run as
# one compiled kernel each (torch.compile), so the time model costs each call as one kernel, not as the CPU
# ops a trace runs; it is called as TRACE_KERNEL(fn, *args). None: run the function itself.
TRACE_KERNEL = None


# ... and this: a step packs many tensors of one shape (every block saves the same ones), whose ops, traffic and
# memory are the same each time, so the tracer may replay a recorded pack (or unpack) of the same signature
# rather than dispatch its ops again; it is called as TRACE_CALL(fn, key, arg), `key` naming everything the
# call's ops depend on. None: run fn(arg).
TRACE_CALL = None

# ... and this, to a list, while a trace's sizing step runs: `pack` appends the value count of each tensor it
# would quantize (a chunk loop that folds, see `FOLD`) and keeps the tensor as it is, from which the tracer
# picks two batch sizes whose traces align (no tensor crosses `CHUNK` between them). None: pack packs.
TRACE_SIZES = None


def _pad(chunk: torch.Tensor, pad: int, folded: bool) -> torch.Tensor:
    """`chunk` padded to whole groups with its last value. A real step pads at most one chunk of a tensor
    (its last); a folded pass stands for every chunk, so its padding copy counts once, not `REPEAT` times."""
    global REPEAT
    repeat = REPEAT
    if folded:
        REPEAT = 1.0
    try:
        return torch.cat([chunk, chunk[-1:].expand(pad)])
    finally:
        REPEAT = repeat


# -- public functions -------------------------------------------------------------

def _done() -> None:
    global REPEAT
    REPEAT = 1.0


def quantize(x: torch.Tensor, bits: int, *, generator: torch.Generator | None = None,
             encode=_encode, meta_dtype: torch.dtype = META_DTYPE) -> Packed:
    """Pack a floating-point tensor into `bits`-bit codes (stochastic rounding).

    The flat tensor is padded to a whole number of 256-value groups with its
    own last value (so padding never widens a group's range); the codes take
    ``ceil(n / 256) * 256 * bits / 8`` bytes and the metadata, a minimum and a
    scale in `meta_dtype`, 8 bytes a group in the default fp32.

    >>> p = quantize(torch.randn(4096), 4)
    >>> packed_bytes(p) == 4096 // 2 + 16 * 8
    True
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if not x.is_floating_point():
        raise ValueError(f"quantize takes a floating-point tensor, got {x.dtype}")
    with torch.no_grad():
        flat = x.detach().reshape(-1)
        n = flat.numel()
        groups = -(-n // GROUP_SIZE)
        data = torch.empty(groups * GROUP_SIZE * bits // 8, dtype=torch.uint8, device=x.device)
        meta = torch.empty(groups, 2, dtype=meta_dtype, device=x.device)
        folded = _folded(n)
        for start in _passes(n):
            chunk = flat[start:start + CHUNK].float()
            pad = (-chunk.numel()) % GROUP_SIZE
            if pad or folded:  # folded: the same ops whether or not this batch size needs padding
                chunk = _pad(chunk, pad, folded)
            noise = torch.rand(chunk.shape, generator=generator, device=chunk.device)
            codes, stats = encode(chunk, noise, bits)
            data[start * bits // 8:][:codes.numel()].copy_(codes)
            meta[start // GROUP_SIZE:][:stats.shape[0]].copy_(stats)
        _done()
    return Packed(data, meta, tuple(x.shape), x.dtype, bits)


def pack_mask(x: torch.Tensor) -> Packed:
    """Bit-pack a boolean tensor losslessly: 8 values per byte."""
    with torch.no_grad():
        flat = x.detach().reshape(-1)
        pad = (-flat.numel()) % 8
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        data = _pack_bits(flat.to(torch.uint8), 1)
    return Packed(data, None, tuple(x.shape), x.dtype, 1)


def dequantize(p: Packed, *, decode=_decode) -> torch.Tensor:
    """The tensor `p` was packed from (exact for masks, unbiased estimate otherwise)."""
    n = 1
    for d in p.shape:
        n *= d
    with torch.no_grad():
        if p.bits == 1:
            return _unpack_bits(p.data, 1)[:n].to(torch.bool).view(p.shape)
        out = torch.empty(n, dtype=p.dtype, device=p.data.device)
        for start in _passes(n):
            values = decode(p.data[start * p.bits // 8:][:CHUNK * p.bits // 8],
                            p.meta[start // GROUP_SIZE:][:CHUNK // GROUP_SIZE], p.bits)
            out[start:start + CHUNK].copy_(values.view(-1)[:n - start])
        _done()
        return out.view(p.shape)


class Quantizer:
    """The pack/unpack pair of quant8 / quant4 / quant2 for ``saved_tensors_hooks``.

    Parameters: `bits` (8, 4 or 2); `min_numel`, the smallest tensor packed;
    `seed` of the rounding generators; `compile`: run the encode/decode
    programs through ``torch.compile`` (default: only on CUDA, where they are
    memory-bound kernels worth fusing; the plain ops elsewhere); `kernels`:
    whose kernels a trace for a GPU charges (`KERNELS`; it packs the same
    either way).

    >>> q = Quantizer(4)
    >>> x = torch.randn(64, 64)
    >>> (q.unpack(q.pack(x)) - x).abs().max() < (x.max() - x.min()) / 15
    tensor(True)
    """

    lossy = True  # momlab.moms.compose keeps statistics exact from lossy stages

    def __init__(self, bits: int, *, min_numel: int = MIN_NUMEL, seed: int = 0, compile: bool | None = None,
                 kernels: str = "momlab"):
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.bits = bits
        self.kernels = kernels
        self.min_numel = min_numel
        self.seed = seed
        self.compile = compile
        self._generators: dict[torch.device, torch.Generator | None] = {}
        self._programs: dict[str, tuple] = {}

    def pack(self, x: torch.Tensor):
        sizes = TRACE_SIZES
        if sizes is not None:
            if x.is_floating_point() and not self._kept_exact(x):
                sizes.append(x.numel())
            return x
        hook = TRACE_CALL
        if hook is None:
            return self._pack(x)
        key = ("pack", self.bits, self.min_numel, self.compile, self.kernels, CHUNK, GROUP_SIZE, FOLD, x.device.type,
               x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.untyped_storage().nbytes())
        return hook(self._pack, key, x)

    def unpack(self, h):
        hook = TRACE_CALL
        if hook is None or not isinstance(h, Packed):
            return self._unpack(h)
        key = ("unpack", self.compile, self.kernels, CHUNK, GROUP_SIZE, FOLD, h.data.device.type, h.shape, h.dtype,
               h.bits, tuple(h.data.shape), h.data.dtype,
               None if h.meta is None else (tuple(h.meta.shape), h.meta.dtype))
        return hook(self._unpack, key, h)

    def _kept_exact(self, x: torch.Tensor) -> bool:
        """Too small to pack, or per-row statistics (a last dimension of 1): kept as they are."""
        return x.numel() < self.min_numel or (x.dim() > 1 and x.shape[-1] == 1)

    def _pack(self, x: torch.Tensor):
        if self._kept_exact(x):
            # kept exact; but a small view (BERT's pooler saves hidden[:, 0])
            # would pin its whole storage: a compact copy lets that go
            if x.untyped_storage().nbytes() > 2 * x.numel() * x.element_size():
                with torch.no_grad():
                    return x.detach().clone()
            return x
        if x.dtype == torch.bool:
            return self._run(lambda t, _: pack_mask(t), x, None, x.numel(), 1, 1, 0)
        if not x.is_floating_point():
            return x
        encode, _ = self._program(x.device)
        generator = self._generator(x.device)
        # GACT kept a group's minimum and scale in the tensor's own dtype (its kernels take fp16 and fp32)
        meta = x.dtype if self.kernels == "gact" and x.dtype in (torch.float16, torch.float32) else META_DTYPE
        return self._run(lambda t, e: quantize(t, self.bits, generator=generator, encode=e, meta_dtype=meta), x,
                         encode, x.numel(), x.element_size(), self.bits, 0)

    def _unpack(self, h):
        if not isinstance(h, Packed):
            return h
        n = math.prod(h.shape)
        if h.bits == 1:
            return self._run(lambda p, _: dequantize(p), h, None, n, 1, 1, 1)
        _, decode = self._program(h.data.device)
        return self._run(lambda p, d: dequantize(p, decode=d), h, decode, n, h.dtype.itemsize, h.bits, 1)

    def _run(self, fn, arg, program, n: int, itemsize: int, bits: int, phase: int):
        """`fn(arg, program)`. In a trace for a GPU (`TRACE_KERNEL`): with momlab's kernels, `program` (encode
        or decode) is one kernel; with GACT's, all of `fn` is the kernels of `gact_traffic` (`phase` 0: pack,
        1: unpack)."""
        hook = TRACE_KERNEL
        if hook is not None and self.kernels == "gact":
            return hook(lambda a: fn(a, program), arg, traffic=gact_traffic(n, itemsize, bits)[phase],
                        cycles=gact_cycles(n, bits)[phase])
        if hook is not None and program is not None:
            program = functools.partial(hook, program)
        return fn(arg, program)

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if device not in self._generators:
            # the meta device has no generator (and no values to round)
            gen = None if device.type == "meta" else torch.Generator(device=device)
            if gen is not None:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return self._generators[device]

    def compile_state(self) -> dict:
        """Per device kind: whether encode and decode ran compiled ("compiled", "not run", "failed: ...")."""
        return {kind: {"encode": getattr(enc, "state", "plain"), "decode": getattr(dec, "state", "plain")}
                for kind, (enc, dec) in self._programs.items()}

    def _program(self, device: torch.device) -> tuple:
        kind = device.type
        if kind not in self._programs:
            use = self.compile if self.compile is not None else kind == "cuda"
            if use:
                self._programs[kind] = (_Compiled(_encode), _Compiled(_decode))
            else:
                self._programs[kind] = (_encode, _decode)
        return self._programs[kind]


class _Compiled:
    """`fn` through torch.compile (one full graph); if compiling fails, say so once and run `fn` as it is.

    The compiled program runs outside any TorchDispatchMode: Dynamo refuses a
    frame called under a non-infra dispatch mode (momlab's storage accounting
    is one) and would run it eagerly, so a measured step would never compile.
    The mode only loses sight of the program's own outputs, which the caller
    copies into buffers allocated under it at once (a fused kernel's
    temporaries, which the CUDA allocator sees and a host tracker does not
    care about). An out-of-memory while compiling or running is the step's
    answer and propagates; any other failure turns compiling off. `state`
    says which happened: "not run", "compiled", or "failed: ...".
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.state = "not run"

    def __call__(self, *args):
        if self.compiled is None or any(
                isinstance(a, torch.Tensor) and (is_fake(a) or a.device.type == "meta") for a in args):
            return self.fn(*args)  # a trace (momlab.estimate): nothing to run
        try:
            with _disable_current_modes():
                out = self.compiled(*args)
            self.state = "compiled"
            return out
        except Exception as e:  # noqa: BLE001 - no compiler toolchain on this machine (e.g. triton missing)
            if is_oom(e):
                raise
            warnings.warn(f"quant: torch.compile of {self.fn.__name__} failed ({e!r}); "
                          "using the plain ops", stacklevel=2)
            self.compiled = None
            self.state = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return self.fn(*args)
