"""ckpt: activation checkpointing, one checkpoint per block.

Forward keeps only each block's inputs; backward runs the block's forward
again to rebuild what it needs (Chen et al., 2016, "Training Deep Nets with
Sublinear Memory Cost"). Activation memory drops from all layers' saved
tensors to one block input per block plus one block's worth during its
recomputation; the price is a second forward of every block (about a third
more compute for a step).

Each block is replaced in its parent by torch's ``checkpoint_wrapper``
(non-reentrant ``torch.utils.checkpoint``, what torchtitan uses; its
state_dict keeps the unwrapped names). ``preserve_rng_state=True`` replays
the forward's RNG state, so recomputed dropout masks equal the original ones.
Non-reentrant checkpointing saves the block inputs through the ordinary
saved-tensor mechanism, outside its own hooks, so an outer
``saved_tensors_hooks`` (quant, swap) still sees and can compress or move
them: that is how ``quant4+ckpt`` and ``swap+ckpt`` compose.

BatchNorm inside a checkpointed block would update its running statistics a
second time during recomputation; the recomputation runs with them frozen,
so running statistics match training without checkpointing.

``reentrant=True`` runs torch < 2.0's default instead (``use_reentrant=True``,
what transformers 4.x's ``gradient_checkpointing``, Microsoft's Swin and
fairseq ran): forward saves each block's inputs through ``save_for_backward``,
and backward reruns the block with grad enabled and backpropagates through it
on its own. Its recomputation saves tensors the ordinary way, so any
saved-tensor hooks active during backward (GACT's, installed once for the
whole run) compress or move them too. It takes no context managers: a block
with BatchNorm must stay non-reentrant.

Apply it through ``momlab.moms.apply(model, "ckpt", blocks=...)``; this module
exposes `wrap` (wrap the blocks of a model) and `unwrap`.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

__all__ = ["wrap", "unwrap", "frozen_norm_statistics"]


def wrap(module: nn.Module, blocks: list[nn.Module], *,
         context_fn: Callable[[nn.Module], tuple] | None = None, reentrant: bool = False) -> list[nn.Module]:
    """Replace each of `blocks` in its parent inside `module` by a checkpointed wrapper.

    `context_fn(block)`, if given, returns torch.utils.checkpoint's pair of
    (forward, recompute) context managers for one call of that block (how
    selective checkpointing plugs in its policy). `reentrant`: torch < 2.0's
    reentrant checkpoint (module docstring). Returns the wrappers, in the
    order of `blocks`.
    """
    if reentrant:
        if context_fn is not None:
            raise ValueError("a reentrant checkpoint takes no context managers (selective checkpointing's "
                             "policy): use reentrant=False")
        norms = [b for b in blocks if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in b.modules())]
        if norms:
            raise ValueError(f"block {type(norms[0]).__name__} has BatchNorm, whose running statistics a reentrant "
                             f"recomputation would update twice: use reentrant=False")
    parents = _parents(module)
    wrappers = []
    for block in blocks:
        if block is module:
            raise ValueError("a block cannot be the whole model: pass its repeated layers as blocks")
        if isinstance(block, CheckpointWrapper):
            raise ValueError(f"block {type(block._checkpoint_wrapped_module).__name__} is already checkpointed")
        places = parents.get(id(block))
        if not places:
            raise ValueError(f"block {type(block).__name__} is not a submodule of the model")
        if reentrant:
            wrapper = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT, preserve_rng_state=True)
        else:
            contexts = (lambda b=block: context_fn(b)) if context_fn is not None else (lambda b=block: _default(b))
            wrapper = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                preserve_rng_state=True,  # recomputed dropout must draw the same masks
                context_fn=contexts,
            )
        for parent, name in places:
            setattr(parent, name, wrapper)
        wrappers.append(wrapper)
    return wrappers


def unwrap(module: nn.Module, wrappers: list[nn.Module]) -> None:
    """Undo `wrap`: put each wrapped block back in its parent."""
    parents = _parents(module)
    for wrapper in wrappers:
        for parent, name in parents.get(id(wrapper), []):
            setattr(parent, name, wrapper._checkpoint_wrapped_module)


def frozen_norm_statistics(block: nn.Module):
    """A context in which the block's BatchNorm layers do not update running statistics."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.training and m.track_running_stats]
    return _frozen(norms) if norms else nullcontext()


@contextmanager
def _frozen(norms: list):
    # momentum 0 leaves running = 1 * running + 0 * batch exactly; the batch
    # counter is put back by hand
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)


def _default(block: nn.Module) -> tuple:
    return nullcontext(), frozen_norm_statistics(block)


def _parents(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    places: dict[int, list] = {}
    for parent in module.modules():
        for name, child in parent.named_children():
            places.setdefault(id(child), []).append((parent, name))
    return places
