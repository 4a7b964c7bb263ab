"""ckpt-selective: selective activation recomputation (transformers only).

Megatron-LM's selective recomputation (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models"): keep the outputs of
the linear layers, which are expensive to recompute and small per token, and
recompute the rest of each transformer block in backward (attention core:
scores, softmax, dropout, the attention-weighted sum; and the elementwise
ops and norms), which is cheap in FLOPs but holds the large
(heads x seq x seq) attention tensors. Most of the memory of checkpointing
for a few percent of extra compute, where full checkpointing pays a whole
forward.

Implemented with torch.utils.checkpoint's selective policies
(``create_selective_checkpoint_contexts``): the policy is data, `SAVE_OPS`
are saved (MUST_SAVE), everything else is recomputed (PREFER_RECOMPUTE);
``preserve_rng_state=True`` makes recomputed dropout draw the same masks.

A ResNet has no linear layers in its blocks and no attention: there the
policy would save nothing and recompute everything (plain ``ckpt``), so it
is refused.

The saved linear outputs are kept in the checkpoint's own cache, out of
reach of ``saved_tensors_hooks``; when quant or swap is combined with this
MOM, ``momlab.moms.compose`` passes their pack/unpack pair as `cache`, and
the cache stores what that pack returns.

Apply it through ``momlab.moms.apply(model, "ckpt-selective", blocks=...)``;
this module exposes `wrap`, `policy` and `SAVE_OPS`.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from momlab.moms import ckpt

__all__ = ["SAVE_OPS", "policy", "wrap"]

aten = torch.ops.aten

# matmul outputs of the linear layers (nn.Linear lowers to addmm or mm,
# GPT-2's Conv1D to addmm); attention's bmm / sdpa are deliberately absent
SAVE_OPS = frozenset({aten.mm.default, aten.addmm.default})


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save linear-layer outputs; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def wrap(module: nn.Module, blocks: list[nn.Module], *, cache: tuple | None = None) -> list[nn.Module]:
    """Checkpoint each block with the selective policy; `cache` = (pack, unpack) for saved outputs."""
    _check_transformer(blocks)
    return ckpt.wrap(module, blocks, context_fn=partial(_contexts, cache))


def _check_transformer(blocks: list[nn.Module]) -> None:
    linear = any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"  # GPT-2's linear layer
                 for block in blocks for m in block.modules())
    if not linear:
        kinds = sorted({type(b).__name__ for b in blocks})
        raise ValueError(
            f"ckpt-selective is for transformers (it keeps linear-layer outputs and recomputes attention); "
            f"the blocks ({', '.join(kinds)}) have no linear layers, e.g. a ResNet's conv bottlenecks: "
            f"use ckpt there")


def _contexts(cache: tuple | None, block: nn.Module) -> tuple:
    forward, recompute = create_selective_checkpoint_contexts(policy)
    if cache is not None:
        _pack_cache(forward, recompute, *cache)
    return forward, recompute


def _pack_cache(forward, recompute, pack, unpack) -> None:
    # torch keeps the saved outputs in a defaultdict shared by the two modes, op -> its calls' wrapped outputs:
    # a list in call order (torch 2.11, which the lent GPU machine runs) or a dict by call index (2.13); ours
    # stores packed values in the same kind of container
    storage = getattr(forward, "storage", None)
    entries = {list: _PackedList, dict: _PackedEntries}.get(getattr(storage, "default_factory", None))
    if entries is None or storage is not getattr(recompute, "storage", None):
        raise RuntimeError(
            "this torch version keeps selective checkpointing's cache where momlab cannot reach it; "
            "ckpt-selective cannot be combined with quant or swap here")
    forward.storage = recompute.storage = defaultdict(partial(entries, pack, unpack))


def _packed(entry, pack, unpack):
    """A cached call's outputs with each wrapped tensor packed: entries are torch's version-checking wrappers
    (with .val and .get_val) or its sentinels; only wrapped tensors are packed."""
    def one(wrapper):
        val = getattr(wrapper, "val", None)
        if isinstance(val, torch.Tensor) and hasattr(wrapper, "get_val"):
            return _PackedValue(pack(val), unpack)
        return wrapper
    return tree_map_only(_wrapper_type(), one, entry)


class _PackedEntries(dict):
    """One op's cached outputs by call index, stored as `pack` returns them."""

    def __init__(self, pack, unpack):
        super().__init__()
        self.pack, self.unpack = pack, unpack

    def __setitem__(self, index, entry):
        super().__setitem__(index, _packed(entry, self.pack, self.unpack))


class _PackedList(list):
    """One op's cached outputs in call order, stored as `pack` returns them."""

    def __init__(self, pack, unpack):
        super().__init__()
        self.pack, self.unpack = pack, unpack

    def append(self, entry):
        super().append(_packed(entry, self.pack, self.unpack))


class _PackedValue:
    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack

    def get_val(self, allow_cache_entry_mutation):
        # the version check of torch's wrapper needs the original tensor, which
        # is gone: packing copies it, so a later in-place change cannot reach it
        return self.unpack(self.packed)


def _wrapper_type():
    from torch.utils import checkpoint

    return getattr(checkpoint, "_VersionWrapper", object)
