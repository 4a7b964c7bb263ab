"""ckpt-auto: checkpoint the fewest blocks that make the step fit a budget.

Full checkpointing (`ckpt`) pays a second forward of every block even at
batch sizes where a few checkpointed blocks, or none, would fit. ckpt-auto
plans per configuration (model, MOM, batch size, budget), like the
checkpoint planners of Checkmate (Jain et al., 2020) and torch's own
memory-budget partitioner, but over whole blocks:

1. *Costs.* One step with no block checkpointed (budget lifted) records, per
   block, the bytes its forward leaves alive beyond its output (what
   checkpointing it would free: `BlockCosts`) and its forward FLOPs (what
   recomputing it costs).
2. *Order.* Blocks by bytes saved per recompute FLOP, best first; ties go to
   the earlier block, whose recomputation happens late in backward, when
   later blocks' activations are gone and its transient costs nothing
   (`order`).
3. *Prediction.* Checkpointing the first k blocks of the order lowers the
   peak by their savings, plus the transient of rebuilding one block in
   backward, and never below the fully checkpointed step's peak
   (`predict_peak`); the smallest k predicted to fit is the first guess.
4. *Verification.* Real steps under the budget, from that guess down while
   fewer blocks fit and up while they do not, by doubling then bisection
   (`fewest`): the plan is the fewest blocks of the order that *measured*
   to fit, in O(log blocks) steps.

A plan is a subset of what `ckpt` checkpoints, so at every batch size it
recomputes no more than `ckpt` does: it is as fast as Exact where Exact
fits, never slower than `ckpt`, and fits wherever `ckpt` fits. That is how
a MOM can beat both on S1 (maximum throughput under a budget).

The orchestration that runs steps lives in `momlab.measure`; this module
has the parts that do not touch a device: block costs, order, prediction
and the search over k. `MomHandle.checkpoint(indices)` applies a plan.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["BlockCosts", "order", "predict_peak", "fewest", "cpu_attention_flops"]

_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _query_heads(query, shape):
    """A key or value shape with the query's head count: grouped-query attention (Llama, Qwen2: a key/value
    head shared by a group of query heads) costs what one key/value head per query head costs. torch 2.13's
    counter takes the grouped shapes and counts that; 2.11's asserts equal head counts."""
    return (shape[0], query[1], *shape[2:]) if len(query) == 4 and len(shape) == 4 else shape


def cpu_attention_flops(packet, args) -> int:
    """FLOPs of the CPU's fused attention op (forward or backward; torch's FlopCounterMode does not count
    it), 0 for any other op."""
    if packet is _CPU_SDPA:
        q, k, v = (a.shape for a in args[:3])
        return sdpa_flop_count(q, _query_heads(q, k), _query_heads(q, v))
    if packet is _CPU_SDPA_BACKWARD:
        g, q, k, v = (a.shape for a in args[:4])
        return sdpa_backward_flop_count(g, q, _query_heads(q, k), _query_heads(q, v))
    return 0


class BlockCosts(TorchDispatchMode):
    """Per block: bytes its forward leaves alive beyond its output, and its forward FLOPs.

    `live()` reads the device bytes alive now (the emulated device's account,
    or the CUDA allocator's). Enter it around one forward with no block
    checkpointed; read `.saving` and `.flops` (lists, one per block) after.
    FLOPs are torch's FlopCounterMode formulas per op, plus CPU fused
    attention, which that registry does not count.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], live: Callable[[], int]):
        super().__init__()
        self.blocks, self.live = list(blocks), live
        self.saving = [0] * len(self.blocks)
        self.flops = [0] * len(self.blocks)
        self._current: int | None = None
        self._before = 0
        self._handles: list = []

    def __enter__(self):
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._enter(i)))
            self._handles.append(block.register_forward_hook(self._leave(i)))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _enter(self, index: int):
        def hook(module, args):
            self._current, self._before = index, self.live()
        return hook

    def _leave(self, index: int):
        def hook(module, args, output):
            self._current = None
            if not torch.is_grad_enabled():
                return
            out = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)}
            self.saving[index] += max(0, self.live() - self._before - sum(out.values()))
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._current is not None:
            packet = func._overloadpacket
            if packet in flop_registry:
                self.flops[self._current] += flop_registry[packet](*args, **kwargs, out_val=out)
            else:
                self.flops[self._current] += cpu_attention_flops(packet, args)
        return out


def order(saving: Sequence[int], flops: Sequence[int]) -> list[int]:
    """Block indices by bytes saved per recompute FLOP, best first; ties: earlier block first.

    >>> order([100, 400, 400], [10, 10, 20])
    [1, 2, 0]
    """
    def ratio(i):
        return math.inf if flops[i] <= 0 else saving[i] / flops[i]
    return sorted(range(len(saving)), key=lambda i: (-ratio(i), i))


def predict_peak(chosen: Sequence[int], saving: Sequence[int], exact_peak: int, floor: int) -> int:
    """Predicted peak when the blocks `chosen` are checkpointed (the rest are not).

    The exact peak less what the chosen blocks free, plus the transient of
    rebuilding a chosen block j in backward: its bytes come back, less what
    the unchecked blocks after it have already freed by then. Never below
    `floor`, the fully checkpointed step's peak.

    >>> predict_peak([0], [10, 10, 10], 100, 50)   # block 0 rebuilt after 1 and 2 freed 20
    90
    >>> predict_peak([2], [10, 10, 10], 100, 50)   # block 2 rebuilt first: nothing freed yet
    100
    """
    chosen_set = set(chosen)
    transient = 0
    for j in chosen_set:
        freed_after = sum(saving[i] for i in range(j + 1, len(saving)) if i not in chosen_set)
        transient = max(transient, saving[j] - freed_after)
    return max(floor, exact_peak - sum(saving[i] for i in chosen_set) + transient)


def fewest(fits: Callable[[int], bool], guess: int, n: int) -> tuple[int | None, list[tuple[int, bool]]]:
    """The smallest k in 0..n with ``fits(k)``, starting at `guess`; (None, trials) if even n does not fit.

    Assumes fewer checkpointed blocks never use less memory (monotone). From
    the guess it steps 1, 2, 4, ... down while steps fit (or up while they do
    not), then bisects the last gap: a right guess costs two calls. Returns
    the answer and the calls made, as (k, fits) in order.

    >>> fewest(lambda k: k >= 5, 6, 12)[0], len(fewest(lambda k: k >= 5, 5, 12)[1])
    (5, 2)
    """
    trials: list[tuple[int, bool]] = []
    known: dict[int, bool] = {}

    def test(k: int) -> bool:
        if k not in known:
            known[k] = fits(k)
            trials.append((k, known[k]))
        return known[k]

    guess = min(max(guess, 0), n)
    step = 1
    if test(guess):
        hi, lo = guess, -1  # hi fits; lo does not (-1: below every plan)
        while hi > 0:
            k = max(0, hi - step)
            if test(k):
                hi, step = k, step * 2
            else:
                lo = k
                break
    else:
        lo, hi = guess, None
        while hi is None:
            if lo == n:
                return None, trials
            k = min(n, lo + step)
            if test(k):
                hi = k
            else:
                lo, step = k, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            hi = mid
        else:
            lo = mid
    return hi, trials
