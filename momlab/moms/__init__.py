"""Memory optimization methods (MOMs) and the one place that composes them.

Atomic MOMs, one module each:

| name             | module         | what it does to activation memory              |
|------------------|----------------|------------------------------------------------|
| `exact`          | -              | nothing: the baseline                          |
| `ckpt`           | ckpt.py        | keep block inputs, recompute blocks            |
| `ckpt-selective` | selective.py   | keep linear outputs, recompute attention etc.  |
| `ckpt-auto`      | auto.py        | checkpoint the fewest blocks that fit a budget |
| `swap`           | swap.py        | saved tensors to host memory and back          |
| `quant8/4/2`     | quant.py       | saved tensors stored in 8/4/2 bits             |

A combination joins atomic names with ``+``; order does not matter. The
canonical spelling lists them in this order: quantization, swap,
checkpointing, e.g. ``"ckpt+swap+quant4"`` -> ``"quant4+swap+ckpt"``.

`compose` alone fixes how they stack: checkpointing wraps the blocks first
(it changes which tensors are saved at all: only block inputs, or linear
outputs), then one pair of saved-tensor hooks handles what is still saved:
pack = swap(quant(x)), unpack = dequant(unswap(h)), so quant shrinks what
swap moves. Parameters and buffers of the model pass through untouched, and
a tensor saved several times (one input of Q, K and V projections) is
packed once (``saved_once``; the paper's GACT packed it once per save:
`momlab.workload.Stack.saved_once`).

    >>> handle = apply(model, "quant4+ckpt")      # doctest: +SKIP
    >>> with handle.context():                    # doctest: +SKIP
    ...     loss = loss_fn(model(x), y)            # model(...) is covered by apply's hooks
"""

from __future__ import annotations

import sys
import types
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from momlab.moms import auto, ckpt, quant, selective, swap

# the canonical order of a combination (see the module docstring)
ORDER = ("exact", "quant8", "quant4", "quant2", "swap", "ckpt", "ckpt-selective", "ckpt-auto")
_ATOMIC = ("exact", "ckpt", "ckpt-selective", "ckpt-auto", "swap", "quant8", "quant4", "quant2")
_QUANT = {"quant8": 8, "quant4": 4, "quant2": 2}
_CHECKPOINTING = ("ckpt", "ckpt-selective", "ckpt-auto")


def moms() -> list[str]:
    """The atomic MOM names; combine them with ``+``."""
    return list(_ATOMIC)


class Mom(str):
    """A parsed MOM: its canonical spelling (a ``str``, so records, keys and comparisons are plain
    strings) with its atomic parts in canonical order, `.parts`.

    Parsing happens once, at the public edge (`parse_mom`); every layer below
    takes the `Mom` it is handed and does not parse again (`parse` of a
    `Mom` returns its parts as they are).

    >>> m = Mom.of("ckpt+quant4")
    >>> m, m.parts, m.has("ckpt")
    ('quant4+ckpt', ('quant4', 'ckpt'), True)
    """

    parts: tuple[str, ...]

    def __new__(cls, parts: tuple[str, ...]):
        self = super().__new__(cls, "+".join(parts))
        self.parts = tuple(parts)
        return self

    def __getnewargs__(self):  # pickles (ranks, fresh-process trials) as its parts
        return (self.parts,)

    @classmethod
    def of(cls, mom) -> Mom:
        """`mom` parsed (checked, in canonical order); a `Mom` is returned as it is."""
        return mom if isinstance(mom, Mom) else cls(_check_parts(mom))

    def has(self, atom: str) -> bool:
        return atom in self.parts

    @property
    def checkpointing(self) -> str | None:
        """The checkpointing MOM of the combination (ckpt, ckpt-selective, ckpt-auto), or None."""
        return next((p for p in self.parts if p in _CHECKPOINTING), None)


def parse_mom(mom) -> Mom:
    """`mom` (a string such as ``"ckpt+quant4"``) as a `Mom`; ValueError naming the valid ones."""
    return Mom.of(mom)


def parse(mom: str) -> tuple[str, ...]:
    """The atomic MOMs of `mom`, in canonical order; ValueError says what is wrong.

    >>> parse("ckpt+quant4")
    ('quant4', 'ckpt')
    """
    return Mom.of(mom).parts


def _check_parts(mom: str) -> tuple[str, ...]:
    """The one parser: `mom`'s atomic parts in canonical order, or a ValueError saying what is wrong."""
    if not isinstance(mom, str):
        raise ValueError(f"a MOM is a string such as 'quant4+ckpt', got {mom!r}")
    parts = [p.strip().lower() for p in mom.split("+")]
    if any(not p for p in parts):
        raise ValueError(f"empty MOM name in {mom!r}; join atomic MOMs with '+', e.g. 'quant4+ckpt'")
    unknown = [p for p in parts if p not in _ATOMIC]
    if unknown:
        raise ValueError(f"unknown MOM {unknown[0]!r} in {mom!r}; valid atomic MOMs: {', '.join(_ATOMIC)} "
                         f"(combine them with '+')")
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise ValueError(f"MOM {twice[0]!r} appears more than once in {mom!r}")
    if "exact" in parts and len(parts) > 1:
        raise ValueError(f"'exact' means no MOM and cannot be combined with others (got {mom!r})")
    checkpointing = [p for p in _CHECKPOINTING if p in parts]
    if len(checkpointing) > 1:
        raise ValueError(f"{' and '.join(repr(p) for p in checkpointing)} both decide what each block "
                         f"recomputes; choose one (got {mom!r})")
    if "ckpt-auto" in parts and "swap" in parts:
        raise ValueError(f"'ckpt-auto' changes which blocks are checkpointed between steps and 'swap' tags "
                         f"saved tensors by block; they do not combine (got {mom!r}); use 'swap+ckpt'")
    levels = [p for p in parts if p in _QUANT]
    if len(levels) > 1:
        raise ValueError(f"{' and '.join(levels)} are two bit widths for the same saved tensors; "
                         f"choose one (got {mom!r})")
    return tuple(sorted(parts, key=ORDER.index))


def canonical(mom: str) -> str:
    """The canonical spelling of `mom` (quantization, swap, checkpointing).

    >>> canonical("ckpt+swap+quant4")
    'quant4+swap+ckpt'
    """
    return str(Mom.of(mom))


@dataclass(eq=False)
class MomHandle:
    """What `apply` did to a model.

    `.mom` the canonical MOM, `.blocks` the blocks it used (as passed or
    found, unwrapped), `.context()` a context manager installing its
    saved-tensor hooks (a nullcontext when it has none): enter it around
    computation outside the model, such as the loss. `.remove()` undoes it.
    Under ``ckpt-auto``, `.checkpointed` lists the indices (into `.blocks`)
    of the blocks checkpointed now and `.checkpoint(indices)` changes them
    (see `momlab.moms.auto`).
    """

    mom: str
    blocks: list[nn.Module]
    module: nn.Module
    hooks: _SavedTensors | None = None
    reentrant: bool = False  # checkpoint blocks with torch < 2.0's reentrant checkpoint (`ckpt.wrap`)
    _wrappers: list[nn.Module] = field(default_factory=list, repr=False)
    _handles: list = field(default_factory=list, repr=False)
    checkpointed: tuple[int, ...] = ()

    def checkpoint(self, indices) -> None:
        """Checkpoint exactly the blocks at `indices` (ckpt-auto's plan); the others run as they are."""
        if not Mom.of(self.mom).has("ckpt-auto"):
            raise ValueError(f"checkpoint(indices) changes ckpt-auto's plan; this model has MOM {self.mom!r}")
        chosen = sorted({int(i) for i in indices})
        if chosen and not 0 <= chosen[0] <= chosen[-1] < len(self.blocks):
            raise ValueError(f"block indices must be in 0..{len(self.blocks) - 1}, got {list(indices)}")
        ckpt.unwrap(self.module, self._wrappers)
        self._wrappers = ckpt.wrap(self.module, [self.blocks[i] for i in chosen], reentrant=self.reentrant)
        self.checkpointed = tuple(chosen)

    def compile_state(self) -> dict | None:
        """Quantization's torch.compile state per device kind (None without quantization)."""
        for stage in self.hooks.stages if self.hooks is not None else ():
            if hasattr(stage, "compile_state"):
                return stage.compile_state()
        return None

    def context(self):
        if self.hooks is None:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.hooks.pack, self.hooks.unpack)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        ckpt.unwrap(self.module, self._wrappers)
        self._handles, self._wrappers, self.checkpointed = [], [], ()
        self.module.__dict__.pop("_momlab_mom", None)


def apply(module: nn.Module, mom: str, blocks: list[nn.Module] | None = None, *,
          seed: int = 0, prefetch: bool = True, compile: bool | None = None, checkpoint=()) -> MomHandle:
    """Apply `mom` to `module` in place; returns its `MomHandle`.

    `blocks`: the repeated submodules checkpointing wraps (transformer
    layers, Swin blocks, ResNet bottlenecks); found automatically when None
    (see `find_blocks`). Options of the atomic MOMs: `seed` of quantization's
    rounding generator, `prefetch` of swap (CUDA), `compile` of quantization
    (default: on CUDA only), `checkpoint` the indices of the blocks
    ``ckpt-auto`` starts with (none: its plan is chosen by measuring, see
    `momlab.moms.auto`). Calling `module(...)` afterwards runs under the
    MOM's saved-tensor hooks; enter ``handle.context()`` around anything
    else that saves tensors for backward (the loss).
    """
    return apply_stack(module, mom, blocks, seed=seed, prefetch=prefetch, compile=compile, checkpoint=checkpoint)


def apply_stack(module: nn.Module, mom: str, blocks: list[nn.Module] | None = None, *,
                seed: int = 0, prefetch: bool = True, compile: bool | None = None, checkpoint=(),
                reentrant: bool = False, kernels: str = "momlab", saved_once: bool = True) -> MomHandle:
    """`apply`, choosing how ckpt checkpoints: `reentrant` runs torch < 2.0's reentrant checkpoint
    (`momlab.moms.ckpt`), the paper's stack (`momlab.workload.Stack.checkpoint`). Enter
    ``handle.context()`` around backward too and its recomputation passes the MOM's hooks, as GACT's
    hooks, pushed once for a whole run, made it. `kernels`: whose quantization kernels a trace for a GPU
    charges (`momlab.moms.quant.KERNELS`, `Stack.quantizer`); with "gact", quantize+swap moves only the codes
    to the host, as GACT did (`momlab.moms.swap.Swapper`). `saved_once`: False packs a tensor once per
    op that saves it, as GACT did (`Stack.saved_once`)."""
    mom = Mom.of(mom)
    parts = mom.parts
    if getattr(module, "_momlab_mom", None) is not None:
        raise ValueError(f"the model already has MOM {module._momlab_mom!r} applied; "
                         f"build a fresh model or call handle.remove() first")
    if blocks is None:
        blocks = find_blocks(module)
        if not blocks and any(p in _CHECKPOINTING for p in parts):
            raise ValueError(
                f"{mom} checkpoints blocks, and no repeated layers were found in "
                f"{type(module).__name__} (an nn.ModuleList / nn.Sequential of same-class layers): "
                f"pass blocks=[...] explicitly")
    else:
        blocks = list(blocks)
        if not blocks and any(p in _CHECKPOINTING for p in parts):
            raise ValueError(f"{mom} needs at least one block; blocks=[] was passed")
    if reentrant and "ckpt-selective" in parts:
        raise ValueError(f"{mom}: selective checkpointing's policy needs the non-reentrant checkpoint; "
                         f"reentrant=True takes 'ckpt' or 'ckpt-auto'")
    handle = compose(module, mom, blocks, seed=seed, prefetch=prefetch, compile=compile, reentrant=reentrant,
                     kernels=kernels, saved_once=saved_once)
    if "ckpt-auto" in parts:
        handle.checkpoint(checkpoint)
    elif checkpoint:
        raise ValueError(f"checkpoint=[...] is ckpt-auto's plan; MOM {handle.mom!r} does not take one")
    module._momlab_mom = handle.mom
    return handle


def compose(module: nn.Module, mom: Mom, blocks: list[nn.Module], *,
            seed: int = 0, prefetch: bool = True, compile: bool | None = None, reentrant: bool = False,
            kernels: str = "momlab", saved_once: bool = True) -> MomHandle:
    """The one place that orders MOMs: checkpoint wrapping, then saved-tensor hooks."""
    mom = Mom.of(mom)
    parts = mom.parts
    handle = MomHandle(mom, list(blocks), module, reentrant=reentrant)
    stages = []
    bits = [_QUANT[p] for p in parts if p in _QUANT]
    if bits:
        stages.append(quant.Quantizer(bits[0], seed=seed, compile=compile, kernels=kernels))
    # the paper's GACT (kernels "gact") copied only a quantized tensor's codes to the host
    swapper = swap.Swapper(prefetch=prefetch, codes_only=bool(bits) and kernels == "gact") if "swap" in parts else None
    if swapper is not None:
        stages.append(swapper)
    if stages:
        handle.hooks = _SavedTensors(stages, module, saved_once=saved_once)

    # 1. checkpointing decides what is saved at all; it replaces the blocks
    run_blocks = list(blocks)
    if "ckpt" in parts:
        handle._wrappers = run_blocks = ckpt.wrap(module, blocks, reentrant=reentrant)
    elif "ckpt-selective" in parts:
        cache = (handle.hooks.pack, handle.hooks.unpack) if handle.hooks is not None else None
        handle._wrappers = run_blocks = selective.wrap(module, blocks, cache=cache)

    # 2. one pair of hooks handles whatever is still saved (swap(quant(x)))
    if handle.hooks is not None:
        if swapper is not None and run_blocks:
            handle._handles += swapper.attach(run_blocks)
        entered: list = []

        def enter(mod, args):
            if not entered:
                handle.hooks.new_pass()
            ctx = handle.context()
            ctx.__enter__()
            entered.append(ctx)

        def leave(mod, args, output):
            if entered:  # always_call: also after a failed forward
                entered.pop().__exit__(None, None, None)

        handle._handles.append(module.register_forward_pre_hook(enter))
        handle._handles.append(module.register_forward_hook(leave, always_call=True))
        if any(getattr(stage, "lossy", False) for stage in stages):
            handle._handles += _watch_attention(module, handle.hooks)
    return handle


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The innermost submodules whose class name ends in 'Attention' (where the attention kernel runs)."""
    found = [m for m in module.modules() if type(m).__name__.endswith("Attention")]
    ids = {id(m) for m in found}
    return [m for m in found if not any(id(d) in ids for d in m.modules() if d is not m)]


def _watch_attention(module: nn.Module, hooks: "_SavedTensors") -> list:
    def enter(mod, args):
        hooks.attention_depth += 1

    def leave(mod, args, output):
        hooks.attention_depth -= 1

    out = []
    for m in attention_modules(module):
        out.append(m.register_forward_pre_hook(enter))
        out.append(m.register_forward_hook(leave, always_call=True))
    return out


class _SavedTensors:
    """The composed pack/unpack pair: model state passes, duplicates pack once (`saved_once`; False: once
    per save, as GACT's controller did), stages in order."""

    def __init__(self, stages: list, module: nn.Module, *, saved_once: bool = True):
        self.stages = stages
        self.saved_once = saved_once
        # parameters and buffers stay resident whatever a MOM does: packing or
        # moving them would only add a copy. Collected once, at apply time.
        self._state = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
        self._state_refs = [*module.parameters(), *module.buffers()]  # keeps those keys valid
        self._cache: dict[int, dict] = {}  # storage key -> {layout: packed}, this forward pass
        self._watched: set[int] = set()  # storage keys with a finalizer
        self.attention_depth = 0  # > 0 inside an attention module's forward (see `attention_modules`)

    def pack(self, x: torch.Tensor):
        state = self._is_state(x)
        # fused attention's fp32 log-sum-exp (B, heads, L) is a per-row softmax
        # statistic: an error in it would bias every attention probability that
        # backward rebuilds from it, so lossy stages (quantization) leave it
        # exact. It is the one 3-D floating tensor an attention module saves
        # that does not require grad (its inputs do; its 4-D outputs are others)
        exact = (self.attention_depth > 0 and x.dim() == 3 and x.is_floating_point()
                 and not x.requires_grad)
        # detached: holding a saved output together with its grad_fn would
        # make a reference cycle (autograd avoids it for its own saves)
        x = x.detach()
        if state:
            return _Kept(x)
        # a dense tensor is handed to the stages as the contiguous view of its
        # memory: two views of the same memory (sdpa's output and the next
        # linear layer's reshaped input) are then one entry, packed once
        dense = _memory_order(x)
        target = x if dense is None else dense
        key = _key(x, dense is not None) if self.saved_once else None
        entries = self._cache.get(key[0]) if key is not None else None
        if entries is not None and key[1] in entries:
            h = entries[key[1]]
        else:
            h = target
            for stage in self.stages:
                if not (exact and getattr(stage, "lossy", False)):
                    h = stage.pack(h)
            if key is not None and h is not target:  # caching x itself would keep it alive
                storage, layout = key
                self._cache.setdefault(storage, {})[layout] = h
                if storage not in self._watched:
                    self._watched.add(storage)
                    # entries live exactly as long as the storage they describe
                    weakref.finalize(x.untyped_storage(), self._forget, storage)
        return _Shared(h, tuple(x.shape), x.stride() if dense is not None else None)

    def new_pass(self) -> None:
        """A new forward pass: earlier packings are not reused (fresh rounding noise)."""
        self._cache.clear()

    def _forget(self, storage: int) -> None:
        self._cache.pop(storage, None)
        self._watched.discard(storage)

    def unpack(self, h):
        if isinstance(h, _Kept):
            return h.tensor
        x = h.packed
        for stage in reversed(self.stages):
            x = stage.unpack(x)
        if h.stride is None:
            return x
        # x holds the memory in order (contiguous); lay it out as the saved view
        return x.as_strided(h.shape, h.stride, x.storage_offset())

    def _is_state(self, x: torch.Tensor) -> bool:
        try:
            if x.untyped_storage()._cdata in self._state:
                return True
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return False
        # under autocast a linear layer saves a cast copy of its weight
        # (weight.to(bf16)); it is the weight all the same, held in autocast's cache
        fn = x.grad_fn
        for _ in range(4):
            if fn is None or fn.name() not in _CASTS_AND_VIEWS:
                break
            nexts = [f for f, _ in fn.next_functions if f is not None]
            if len(nexts) != 1:
                break
            fn = nexts[0]
            var = getattr(fn, "variable", None)  # AccumulateGrad of a leaf
            if var is not None:
                return var.untyped_storage()._cdata in self._state
        return False


_CASTS_AND_VIEWS = frozenset({"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                              "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0"})


class _Kept:
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class _Shared:
    __slots__ = ("packed", "shape", "stride")

    def __init__(self, packed, shape, stride):
        self.packed, self.shape, self.stride = packed, shape, stride


def _memory_order(x: torch.Tensor) -> torch.Tensor | None:
    """`x` permuted to the order of its memory, if that is contiguous (None if not dense)."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # stable: ties keep their order
    y = x.permute(order)
    return y if y.is_contiguous() else None


def _key(x: torch.Tensor, dense: bool):
    """(storage key, layout) identifying the data of `x`; None when it has no plain storage.

    Dense tensors with the same start and length hold the same memory
    whatever their shape and strides; others match only the same view. The
    version makes an in-place change a new entry.
    """
    try:
        storage = x.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None
    if dense:
        layout = (x.storage_offset(), x.numel(), x.dtype, x._version)
    else:
        layout = (x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x._version)
    return storage, layout


# -- finding blocks -----------------------------------------------------------------

def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated layers of `module`, in forward order, or [] when there are none.

    Candidates are the items of every nn.ModuleList / nn.Sequential whose
    items all share one class. Items with nested structure (a transformer
    layer, a ResNet bottleneck) are preferred to flat ones (a conv+norm+act
    unit, a plain nn.Linear), and among those the innermost level wins:
    Swin's stages contain its SwinLayers, ResNet's stages its bottlenecks,
    and a bottleneck's own Sequential of conv layers is flat. Flat items are
    used only when nothing nested repeats (a user's stack of simple layers).
    """
    deep, flat = [], []
    for container in module.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        items = list(container)
        if not items or len({type(m) for m in items}) != 1:
            continue
        if any(any(True for _ in child.children()) for child in items[0].children()):
            deep.append(items)
        elif len(items) >= 2:
            flat.append(items)
    chosen = _innermost(deep) if deep else _innermost(flat)
    return [m for items in chosen for m in items]


def _innermost(groups: list[list[nn.Module]]) -> list[list[nn.Module]]:
    def inside(items):
        return {id(d) for m in items for d in m.modules() if d is not m}

    # a group is too coarse when another group's items sit inside its items
    return [items for items in groups
            if not any(id(other[0]) in inside(items) for other in groups if other is not items)]


class _CallableModule(types.ModuleType):
    """`momlab.moms()` lists the MOMs while `momlab.moms.apply` stays this module's."""

    def __call__(self) -> list[str]:
        return moms()


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["moms", "parse", "canonical", "apply", "apply_stack", "compose", "find_blocks", "MomHandle", "ORDER"]
