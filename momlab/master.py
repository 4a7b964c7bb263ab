"""A half model with fp32 master weights: fairseq's ``--fp16`` (its FP16Optimizer), which trained the paper's GPT.

Autocast keeps the weights in fp32 and runs chosen ops in half precision, so
layer norms, softmax and the residual stream stay fp32 and several tensors
backward needs are kept as fp32. fairseq instead converts the whole model to
fp16 (``model.half()``): every op computes and saves fp16, except where its
code upcasts (the loss's log-softmax, GELU). The optimizer updates one flat fp32
copy of the weights, then copies it back into the fp16 model; its gradient is a
second flat fp32 buffer that stays allocated (fairseq ``FP16Optimizer`` with
flattened parameters, fairseq/optim/fp16_optimizer.py). Loss scaling is its
``DynamicLossScaler``: scale the loss, unscale the fp32 gradient, check it for
inf/NaN on the host (a sync before the update), skip the step and halve the
scale on overflow, double it after `SCALE_WINDOW` clean steps.

`MasterWeights` is the optimizer (``.step()``, ``.zero_grad()``, ``.state`` of
its inner fp32 optimizer, so a warm-up knows when the first step happened) and
`LossScaler` the scaler a `momlab.workload.Workload` calls as it calls torch's
GradScaler.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

INIT_SCALE = 2.0 ** 7  # fairseq --fp16-init-scale
SCALE_WINDOW = 2000  # clean steps before the scale doubles (fairseq --fp16-scale-window, one GPU)
SCHEMES = ("autocast", "half-model")  # how a model trains in fp16/bf16 (`momlab.workload.Stack.mixed`)


class MasterWeights:
    """One flat fp32 copy of `params` (half precision), updated by `inner` (an optimizer class) with `options`."""

    def __init__(self, params, inner: type[torch.optim.Optimizer], **options):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterWeights needs at least one parameter that requires grad")
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float() for p in self.params])
        self.master = nn.Parameter(flat)
        # fairseq allocates the fp32 gradient once, next to the master copy, and zeroes it each step
        self.master.grad = torch.zeros_like(flat)
        self.inner = inner([self.master], **options)
        self.defaults = self.inner.defaults
        self._gathered = False  # the half gradients are in the fp32 one (a LossScaler gathered them to check)

    @property
    def state(self):
        return self.inner.state

    @property
    def param_groups(self):
        return self.inner.param_groups

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 copy of the weights and its gradient: resident state beside the model's own."""
        return [self.master, self.master.grad]

    def gather_grads(self, scale: float) -> torch.Tensor:
        """Copy the half gradients into the fp32 one, unscaled; returns its norm (inf/NaN on overflow)."""
        grad = self.master.grad
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is None:
                grad[offset:offset + n].zero_()
            else:
                grad[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        grad.mul_(1.0 / scale)
        self._gathered = True
        return torch.linalg.vector_norm(grad)

    def step(self) -> None:
        if not self._gathered:  # bf16: no loss scale, nothing checked
            self.gather_grads(1.0)
        self._gathered = False
        self.inner.step()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(self.master[offset:offset + n].view_as(p))
                offset += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        # fairseq frees the half gradients (``p.grad = None``) whatever the trainer asks, and zeroes its fp32 one
        for p in self.params:
            p.grad = None
        self.master.grad.zero_()
        self._gathered = False


class LossScaler:
    """fairseq's DynamicLossScaler, called as a Workload calls torch's GradScaler (scale, step, update)."""

    def __init__(self, init_scale: float = INIT_SCALE, window: int = SCALE_WINDOW):
        self.scale_factor = float(init_scale)
        self.window = window
        self._clean = 0
        self._overflow = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_factor

    def step(self, optimizer: MasterWeights) -> None:
        norm = optimizer.gather_grads(self.scale_factor)
        self._overflow = not math.isfinite(float(norm.item()))  # the host waits for the GPU here
        if not self._overflow:
            optimizer.step()
        else:
            optimizer.zero_grad()

    def update(self) -> None:
        if self._overflow:
            self.scale_factor /= 2
            self._clean = 0
        else:
            self._clean += 1
            if self._clean % self.window == 0:
                self.scale_factor *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale_factor, "clean": self._clean}

    def load_state_dict(self, state: dict) -> None:
        self.scale_factor, self._clean, self._overflow = float(state["scale"]), int(state["clean"]), False


class Fp32Gelu(nn.Module):
    """GELU computed in fp32 and cast back, as fairseq's ``gelu`` (fairseq/modules/gelu.py) runs it in a half
    model: it keeps the fp32 copy of its input for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x.float()).type_as(x)
