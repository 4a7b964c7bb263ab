"""A workload's steps: reproducible whatever else runs in the process."""

import pytest

from momlab import catalog
from momlab.workload import build


def test_two_workloads_stepped_alternately_train_as_each_would_alone():
    # dropout draws from the global generator: without each workload's own stream the
    # exact and ckpt runs below disagreed from the first step
    size = catalog.tiny("gpt2")

    def make(mom):
        return build("gpt2", batch_size=2, mom=mom, seed=7, **size)

    exact, ckpt = make("exact"), make("ckpt")
    together = [(exact.step(), ckpt.step()) for _ in range(3)]
    alone = {mom: [w.step() for _ in range(3)] for mom, w in (("exact", make("exact")), ("ckpt", make("ckpt")))}
    assert [a for a, _ in together] == alone["exact"]
    assert [b for _, b in together] == alone["ckpt"]
    assert alone["exact"] == alone["ckpt"]  # ckpt is lossless: bit-identical losses


def _state(w) -> dict:
    """Every resident tensor by category as (shape, strides, dtype, storage bytes), the loss scaler's state and the
    optimizer's step counts: what a step leaves for the next one."""
    def spec(t):
        return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()

    out = {k: [spec(t) for t in ts] for k, ts in w.state_tensors().items()}
    out["grads None"] = [p.grad is None for p in w.model.parameters()]
    out["scaler"] = None if w.scaler is None else w.scaler.state_dict()
    out["steps"] = [float(s["step"]) for s in w.optimizer.state.values() if "step" in s]
    return out


@pytest.mark.parametrize("model,setup,precision,mom", [
    ("bert-base", "default", "fp32", "exact"),  # AdamW (foreach), gradients freed
    ("bert-base", "paper", "fp16", "quant4"),  # GradScaler, gradients zeroed in place
    ("gpt2", "paper", "fp16", "ckpt"),  # fairseq: half model, fp32 master copy, its loss scaler
    ("swin-tiny", "paper", "bf16", "swap"),  # DDP's gradient buckets
    ("resnet50", "default", "fp32", "ckpt"),  # SGD with momentum
])
def test_prime_leaves_what_a_first_step_leaves(model, setup, precision, mom):
    """A trace's warm-up (momlab.estimate) primes the workload instead of stepping it: the state the next step
    starts from must be the same tensors."""
    def make():
        return build(model, batch_size=2, mom=mom, precision=precision, setup=setup, **catalog.tiny(model))

    stepped, primed = make(), make()
    stepped.step()
    primed.prime()
    assert _state(primed) == _state(stepped)
    assert sum(len(ts) for ts in stepped.state_tensors().values()) > 0
    primed.step()  # and it trains on from there
