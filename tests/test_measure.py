"""The measurement every figure stands on: exact bytes, OOM as data, clear errors."""

import json
import math
import subprocess
import sys

import pytest
import torch

import momlab
from momlab import catalog
from momlab.accounting import StorageTracker, unique_storage_bytes
from momlab.errors import OutOfMemory
from momlab.measure import measure
from momlab.record import Measurement
from momlab.workload import build

MODELS = catalog.models()


def _nbytes(tensors):
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("model", MODELS)
def test_model_state_bytes_are_exact(model):
    size = catalog.tiny(model)
    m = measure(model, batch_size=2, steps=1, **size)
    assert m.fits
    # the same tensors, counted independently: a fresh workload after one step
    w = build(model, batch_size=2, **size)
    params = list(w.model.parameters()) + list(w.model.buffers())
    assert m.params_bytes == _nbytes(params)
    assert m.grads_bytes == sum(p.numel() * p.element_size() for p in w.model.parameters() if p.requires_grad)
    w.step()
    opt = [v for s in w.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert m.optimizer_bytes == _nbytes(opt) > 0
    assert m.peak_bytes >= m.params_bytes + m.optimizer_bytes + m.grads_bytes
    assert m.flops > 0 and m.step_time_s > 0 and m.throughput == pytest.approx(2 / m.step_time_s)


@pytest.mark.parametrize("model", ["bert-base", "gpt2", "swin-tiny", "resnet50", "vit-base", "llama-1b", "qwen2-0.5b",
                                   "mixtral-8x7b"])
def test_activation_bytes_are_the_saved_tensors(model):
    """activation_bytes == unique non-parameter storages saved for backward, plus the loss."""
    size = catalog.tiny(model)
    m = measure(model, batch_size=3, steps=1, **size)
    w = build(model, batch_size=3, **size)
    w.step()
    params = {p.untyped_storage()._cdata for p in list(w.model.parameters()) + list(w.model.buffers())}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = catalog.loss(model, w.model, w.batch())
    # Mixtral's grouped expert op (`catalog.grouped_mm`) keeps its offsets, one int32 per
    # expert and layer, on its autograd context rather than through saved-tensor hooks: held all the same
    spec = catalog.spec(model)
    offsets = size["num_layers"] * spec.extra["experts"] * 4 if spec.family == "mixtral" else 0
    assert m.activation_bytes == sum(saved.values()) + loss.untyped_storage().nbytes() + offsets


@pytest.mark.parametrize("model", ["bert-base", "gpt2", "swin-tiny", "resnet50", "vit-base", "llama-1b", "qwen2-0.5b",
                                   "mixtral-8x7b"])
def test_activation_bytes_grow_linearly_with_batch(model):
    size = catalog.tiny(model)
    a = [measure(model, batch_size=b, steps=1, **size).activation_bytes for b in (2, 3, 4, 6)]
    per_sample = a[1] - a[0]
    assert per_sample > 0
    assert a[2] - a[1] == per_sample
    assert a[3] - a[2] == 2 * per_sample


F32 = 4


@pytest.mark.parametrize("model", ["bert-base", "vit-base", "resnet50", "qwen2-0.5b"])
def test_an_optimizer_bound_peak_is_the_state_and_one_gradient_sized_temporary(model):
    """These tiny steps peak in the optimizer step, where the peak is known without measuring it.

    Activations are freed by then; what is live is the parameters, gradients and
    optimizer state, the loss (one fp32 scalar, held until the step returns), and
    the one temporary per parameter the foreach optimizers allocate: AdamW the
    square root of its second moment, SGD the gradient plus weight decay. So the
    workspace is what the definition (peak less the four parts) makes of that:
    one gradient's bytes and the loss, less the activations, never negative
    (qwen2's tiny step holds more activations than gradients: 0).
    """
    size = catalog.tiny(model)
    m = measure(model, batch_size=2, steps=1, **size)
    w = build(model, batch_size=2, **size)
    grads = sum(p.numel() * p.element_size() for p in w.model.parameters() if p.requires_grad)
    assert m.grads_bytes == grads
    assert m.peak_bytes == m.params_bytes + m.optimizer_bytes + grads + grads + F32
    assert m.workspace_bytes == max(0, grads + F32 - m.activation_bytes)


def test_checkpointing_frees_activations_not_an_optimizer_bound_peak():
    """ckpt holds less for backward, but where the optimizer step sets the peak the peak stays: the freed
    activations show up as workspace (the paper's point: memory saved is not memory that buys anything)."""
    size = catalog.tiny("bert-base")
    exact, ckpt = (measure("bert-base", mom, batch_size=2, steps=1, **size) for mom in ("exact", "ckpt"))
    # only the two block inputs and the head's activations stay: 0.11 of exact's (84776 of 742184 bytes)
    assert ckpt.activation_bytes < 0.2 * exact.activation_bytes
    assert ckpt.peak_bytes == exact.peak_bytes
    assert ckpt.workspace_bytes - exact.workspace_bytes == exact.activation_bytes - ckpt.activation_bytes > 0


def test_budget_below_peak_is_data_and_leaves_nothing_behind():
    size = catalog.tiny("bert-base")
    before = measure("bert-base", batch_size=4, steps=1, **size)
    oom = measure("bert-base", batch_size=4, steps=1, budget=before.peak_bytes - 1, **size)
    assert not oom.fits and math.isnan(oom.throughput) and math.isnan(oom.step_time_s)
    assert oom.peak_bytes > oom.budget and "out of memory" in oom.error
    after = measure("bert-base", batch_size=4, steps=1, **size)
    for field in ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
                  "workspace_bytes", "flops"):
        assert getattr(after, field) == getattr(before, field), field
    fits = measure("bert-base", batch_size=4, steps=1, budget=before.peak_bytes, **size)
    assert fits.fits


def test_budget_hit_in_backward_is_caught(monkeypatch):
    """gpt2's tiny step peaks in backward (the logits' gradient): one byte less budget fails there, in
    the probe step's backward (the warm-up's fitted: no optimizer state yet), and the record says so.

    The record does not name the phase; a spy on torch.autograd.backward sees which call the
    out-of-memory went through. (A budget of the end-of-forward footprint plus one byte, this test's
    earlier choice, fails in the warm-up's optimizer step instead: AdamW creating its state.)
    """
    size = catalog.tiny("gpt2")
    m = measure("gpt2", batch_size=2, steps=1, **size)
    forward_end = m.params_bytes + m.optimizer_bytes + m.activation_bytes
    assert forward_end < m.peak_bytes - 1
    calls = []
    backward = torch.autograd.backward

    def spy(*args, **kwargs):
        try:
            backward(*args, **kwargs)
        except OutOfMemory as exc:
            calls.append(exc)
            raise
        calls.append("done")

    monkeypatch.setattr(torch.autograd, "backward", spy)
    oom = measure("gpt2", batch_size=2, steps=1, budget=m.peak_bytes - 1, **size)
    assert len(calls) == 2 and calls[0] == "done" and isinstance(calls[1], OutOfMemory)  # warm-up, then probe
    assert not oom.fits and oom.options["oom"] == "device" and oom.budget == m.peak_bytes - 1
    # live bytes when it failed: the allocation that made the fitting run's peak, the same bytes
    assert oom.peak_bytes == calls[1].live == m.peak_bytes
    assert oom.error == (f"emulated device out of memory: {m.peak_bytes} bytes live after an allocation of "
                         f"{calls[1].requested}, budget {m.peak_bytes - 1}")


def test_weights_over_budget_do_not_fit():
    oom = measure("vit-base", batch_size=1, budget="100KiB", **catalog.tiny("vit-base"))
    assert not oom.fits


def test_tracker_frees_on_release_and_counts_storages_once():
    """Guards the private behaviour the accounting relies on (storage finalizers)."""
    with StorageTracker() as tr:
        x = torch.ones(1024)
        views = [x.view(32, 32), x[:10], x.t() if x.dim() == 2 else x.unsqueeze(0)]
        assert tr.device_bytes == 4096
        y = x * 2
        assert tr.device_bytes == 8192 and tr.peak_bytes == 8192
        del x, views
        assert tr.device_bytes == 4096
        del y
        assert tr.device_bytes == 0 and tr.peak_bytes == 8192
    with pytest.raises(OutOfMemory):
        with StorageTracker(budget=4095):
            torch.ones(1024)


def test_round_trip_to_dict():
    m = measure("resnet50", batch_size=2, steps=2, **catalog.tiny("resnet50"))
    d = m.to_dict()
    assert Measurement.from_dict(json.loads(json.dumps(d))) == m
    assert d["size"] == catalog.tiny("resnet50") and d["options"]["foreach"] is True
    assert d["env"]["torch"] == torch.__version__ and d["memory_source"] == "cpu-emulated"


def test_cli_json_matches_api():
    size = catalog.tiny("vit-base")
    api = measure("vit-base", "exact", batch_size=2, steps=1, **size).to_dict()
    out = subprocess.run([sys.executable, "-m", "momlab", "measure", "vit-base", "--tiny", "--batch-size", "2",
                          "--steps", "1", "--json"], capture_output=True, text=True, check=True).stdout
    cli = json.loads(out)
    timing = {"step_time_s", "throughput", "step_times_s", "env"}
    assert {k: v for k, v in cli.items() if k not in timing} == {k: v for k, v in api.items() if k not in timing}


BAD = [
    (dict(model="bert-xl", batch_size=1), "valid: bert-base"),
    (dict(model="bert-base", mom="magic", batch_size=1), "exact"),
    (dict(model="bert-base", batch_size=1, image_size=224), "valid: num_layers, hidden_size, num_heads, seq_len"),
    (dict(model="bert-base", batch_size=1, precision="fp8"), "valid: fp32, bf16, fp16"),
    (dict(model="bert-base", batch_size=1, device="tpu"), "valid: cpu, cuda, meta"),
    (dict(model="bert-base", batch_size=0), "batch_size must be an int >= 1"),
    (dict(model="bert-base", batch_size=1, budget="lots"), "cannot parse byte size"),
    (dict(model="bert-base", batch_size=1, budget=-5), "must not be negative"),
    (dict(model="bert-base", batch_size=1, budget="-1GiB"), "must not be negative"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_input_names_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        momlab.measure(**kwargs)


def test_cuda_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        momlab.measure("bert-base", batch_size=1, device="cuda")


@pytest.mark.parametrize("argv,message", [
    (["measure", "bert-xl", "--batch-size", "1"], "unknown model"),
    (["measure", "bert-base", "--batch-size", "1", "--image-size", "32"], "not valid for bert-base"),
    (["measure", "bert-base", "--batch-size", "1", "--budget=-2GiB"], "must not be negative"),
    (["measure", "bert-base", "--batch-size", "1", "--device", "cuda"], "cuda"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, "-m", "momlab", *argv], capture_output=True, text=True)
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_units():
    assert momlab.parse_bytes("2GiB") == 2 * 2**30 and momlab.parse_bytes("16GB") == 16 * 10**9
    assert momlab.parse_bytes("512MiB") == 512 * 2**20 and momlab.format_bytes(3 * 2**30) == "3.00 GiB"
    assert unique_storage_bytes([torch.ones(4), torch.ones(4)[:2]]) == 32
