"""What a lossy MOM costs in accuracy: gradient error and training curves.

Activation quantization (ActNN, Chen et al. 2021; GACT, Liu et al. 2022)
computes the backward pass from dequantized activations. Stochastic rounding
makes the gradient unbiased: averaged over rounding draws it converges to the
exact gradient, the error of a k-draw mean shrinking like 1/sqrt(k). Each
single step still carries extra variance, larger for fewer bits. These
functions measure both, against an exact reference with the same weights,
batch and dropout draws.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn

from momlab import catalog
from momlab.moms import apply


def _gradient(model: str, mom: str, size: dict, batch_size: int, device: str, seed: int, draw: int) -> torch.Tensor:
    torch.manual_seed(seed)
    net = catalog.make_model(model, size).to(device).train()
    handle = apply(net, mom, blocks=catalog.blocks(model, net), seed=draw) if mom != "exact" else None
    gen = torch.Generator().manual_seed(seed)
    inputs = catalog.batch(model, size, batch_size, gen, torch.device(device))
    torch.manual_seed(seed + 1)  # the same dropout draws for every MOM
    with handle.context() if handle is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                              lambda t: t):
        loss = catalog.loss(model, net, inputs)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])


def gradient_error(model: str, moms, *, batch_size: int, size="tiny", draws: int = 8, device: str = "cpu",
                   seed: int = 0) -> pd.DataFrame:
    """Relative error ||g - g_exact|| / ||g_exact|| of one draw and of the mean of k draws.

    One row per (mom, k) for k = 1..draws: `error_of_mean` is the error of
    the average of the first k draws' gradients, `single_error` the mean error
    of one draw. Unbiased rounding shows as `error_of_mean` falling with k.
    """
    size = catalog.tiny(model) if size == "tiny" else catalog.resolve_size(model, dict(size or {}))
    exact = _gradient(model, "exact", size, batch_size, device, seed, 0)
    norm = exact.norm()
    rows = []
    for mom in moms:
        total = torch.zeros_like(exact)
        singles = []
        for k in range(1, draws + 1):
            g = _gradient(model, mom, size, batch_size, device, seed, draw=k)
            singles.append(float((g - exact).norm() / norm))
            total += g
            rows.append({"model": model, "mom": mom, "draws": k, "single_error": sum(singles) / len(singles),
                         "error_of_mean": float((total / k - exact).norm() / norm)})
    return pd.DataFrame(rows)


class _Blocks(nn.Module):
    """A small residual MLP: an nn.ModuleList of blocks any MOM can wrap."""

    def __init__(self, width: int, depth: int, classes: int):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def learnable_task(n: int = 1024, width: int = 32, classes: int = 8, seed: int = 0):
    """A fixed classification task a small network can learn: labels from a random teacher."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, width, generator=gen)  # 8 "tokens" per sample, so saved tensors are not tiny
    teacher = torch.randn(width, classes, generator=gen)
    y = (x.mean(dim=1) @ teacher).argmax(dim=-1)
    return x, y


def train_curves(moms, *, steps: int = 200, batch_size: int = 32, width: int = 32, depth: int = 4,
                 lr: float = 3e-3, seed: int = 0) -> pd.DataFrame:
    """Training loss per step of the same network and data under each MOM (one row per step)."""
    x, y = learnable_task(width=width, seed=seed)
    rows = []
    for mom in moms:
        torch.manual_seed(seed)
        net = _Blocks(width, depth, int(y.max()) + 1)
        handle = apply(net, mom, blocks=list(net.layers), seed=seed) if mom != "exact" else None
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
        order = torch.Generator().manual_seed(seed)
        for step in range(steps):
            idx = torch.randint(0, len(x), (batch_size,), generator=order)
            logits = net(x[idx]).mean(dim=1)
            if handle is not None:
                with handle.context():
                    loss = nn.functional.cross_entropy(logits, y[idx])
            else:
                loss = nn.functional.cross_entropy(logits, y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append({"mom": mom, "step": step, "loss": loss.item()})
    return pd.DataFrame(rows)


def final_loss(curves: pd.DataFrame, last: int = 20, baseline: str = "exact") -> pd.DataFrame:
    """Mean loss over the last `last` steps per MOM, and its ratio to the baseline's."""
    tail = curves[curves.step >= curves.step.max() - last + 1]
    out = tail.groupby("mom", sort=False)["loss"].mean().rename("final_loss").reset_index()
    if baseline in set(out.mom):
        out["ratio_to_exact"] = out.final_loss / float(out.loc[out.mom == baseline, "final_loss"].iloc[0])
    return out
