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
half input: on CUDA, and in a trace for a CUDA target (`HALF_TO_FLOAT`, set
by `momlab.estimate`), the composite calls it directly, as torch's own does
for a CUDA tensor (aten/src/ATen/native/SoftMax.cpp, ``input_.is_cuda()``),
with no fp32 copy of the input in forward and no fp32 gradient of it in
backward; on the CPU, which has no such kernel, the input is converted first.
A half model's loss, ``log_softmax(logits, dtype=float32)``, is the case
(fairseq's GPT: one such copy is 4 bytes per logit, 103 MB a sample at 512
tokens and 50257 words).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

aten = torch.ops.aten

# True while tracing for a CUDA target (`momlab.estimate._kernels`): its fake tensors sit on the CPU
HALF_TO_FLOAT = False


def _half_to_float(x: torch.Tensor, dtype) -> bool:
    """Whether CUDA's softmax kernel reads the half `x` and writes float (torch's composite: a CUDA half input
    with dtype float), or a CUDA trace's fake `x` stands for one (a real CPU tensor has no such kernel)."""
    return (x.dtype == torch.half and dtype == torch.float32
            and (x.is_cuda or (HALF_TO_FLOAT and is_fake(x))))


def _forward(x: torch.Tensor, dim: int, dtype, log: bool) -> torch.Tensor:
    """torch's composite softmax / log_softmax of `x` over `dim` in `dtype` (None: `x`'s)."""
    fn = aten._log_softmax if log else aten._softmax
    if _half_to_float(x, dtype):
        return fn(x, dim, True)
    return fn(x if dtype is None else x.to(dtype), dim, False)


class _SavesInput(torch.autograd.Function):
    """softmax / log_softmax over `dim` of `x` (computed in `dtype`), saving `x` and the result."""

    @staticmethod
    def forward(ctx, x, dim, dtype, log):
        ctx.dim, ctx.log, ctx.fused = dim, log, _half_to_float(x, dtype)
        y = _forward(x, dim, dtype, log)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        back = aten._log_softmax_backward_data if ctx.log else aten._softmax_backward_data
        if ctx.fused:  # CUDA's half-to-float backward: writes the half gradient itself
            return back(grad, y, ctx.dim, x.dtype), None, None, None
        return back(grad, y, ctx.dim, y.dtype).to(x.dtype), None, None, None


def _make(log: bool):
    def run(x, dim, dtype=None):
        if not (torch.is_grad_enabled() and x.requires_grad):
            return _forward(x, dim, dtype, log)
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
