"""What torch < 1.11's autograd kept for backward that today's does not: the paper's software stack.

The paper's code ran torch 1.10.1 (GACT's stated requirement). There,
``softmax`` and ``log_softmax`` saved their *input* for backward beside their
output, though the backward kernels read only the output
(pytorch/pytorch#49600; the formula changed to keep the output alone in
pytorch/pytorch#66018, first released in torch 1.11). An eager attention
layer therefore kept one more attention-sized tensor: the scores before the
softmax, in the dtype the softmax read them (fp32 under autocast, whose lists
run softmax in fp32; fp16 in a half model), and a GACT hook packed it like any
other saved tensor.

`softmax_saves_input` brings that back while it is active, for the paper's
stack (`momlab.workload.Stack.softmax_saves_input`): it overrides the
composite ``softmax.int`` and ``log_softmax.int`` at the dispatcher (below
autocast, which has cast the input by then; also seen while backward reruns
a checkpointed block) with a function that saves both tensors. Values and
gradients are today's; only what is kept differs. A ``dtype`` of float for a
half input is CUDA's half-to-float kernel, which reads (and here keeps) the
half input.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

aten = torch.ops.aten


class _SavesInput(torch.autograd.Function):
    """softmax / log_softmax over `dim` of `x` (computed in `dtype`), saving `x` and the result."""

    @staticmethod
    def forward(ctx, x, dim, dtype, log):
        ctx.dim, ctx.log = dim, log
        y = (aten._log_softmax if log else aten._softmax)(x.to(dtype), dim, False)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        back = aten._log_softmax_backward_data if ctx.log else aten._softmax_backward_data
        return back(grad, y, ctx.dim, y.dtype).to(x.dtype), None, None, None


def _make(log: bool):
    def run(x, dim, dtype=None):
        if not (torch.is_grad_enabled() and x.requires_grad):
            fn = aten._log_softmax if log else aten._softmax
            return fn(x if dtype is None else x.to(dtype), dim, False)
        return _SavesInput.apply(x, dim, x.dtype if dtype is None else dtype, log)
    return run


@contextmanager
def softmax_saves_input(active: bool = True):
    """While active (and `active`), softmax and log_softmax save their input for backward, as torch < 1.11's did."""
    if not active:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("softmax.int", _make(False), "CompositeImplicitAutograd")
        lib.impl("log_softmax.int", _make(True), "CompositeImplicitAutograd")
    try:
        yield
    finally:
        lib._destroy()
