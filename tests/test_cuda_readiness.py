"""What a first GPU run would hit (issue 11), exercised on the CPU wherever the logic allows.

The CUDA-only halves are at the end, skipped without a GPU; `make gpu-check`
runs them all on a GPU machine (its dry run is tested here too).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import momlab
from momlab import catalog, device
from momlab.accounting import StorageTracker
from momlab.distributed import measure_distributed
from momlab.errors import HostOutOfMemory, OutOfMemory
from momlab.measure import _try, _warm_up, count_flops
from momlab.moms import apply, attention_modules
from momlab.moms import quant
from momlab.workload import build

ROOT = Path(__file__).resolve().parents[1]
TINY = catalog.tiny("bert-base")
GiB, MiB = 1 << 30, 1 << 20


# -- 1. a budgeted CUDA run needs an indexed device -----------------------------------------

def test_cuda_device_gets_an_index_others_stay():
    assert device.with_index(torch.device("cuda"), current=3) == torch.device("cuda", 3)
    assert device.with_index(torch.device("cuda", 1), current=3) == torch.device("cuda", 1)
    assert device.with_index(torch.device("cpu")) == torch.device("cpu")


def test_a_budget_stands_for_a_whole_card_context_included():
    # 16 GiB asked, 512 MiB held by the context: the allocator may take the rest of the 16, not 16
    assert device.cap_fraction(16 * GiB, 140 * GiB, 512 * MiB) == (16 * GiB - 512 * MiB) / (140 * GiB)
    assert device.cap_fraction(200 * GiB, 140 * GiB, 0) == 1.0
    with pytest.raises(OutOfMemory, match="context"):
        device.cap_fraction(256 * MiB, 140 * GiB, 512 * MiB)


# -- 3. FLOPs are counted outside the measured step and outside the budget --------------------

def test_flop_step_runs_in_the_room_it_is_given():
    w = build("bert-base", batch_size=2, **TINY)
    entered = []

    class Room:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    flops = count_flops(w, Room())
    assert entered == ["in", "out"] and flops > 0


def test_ranks_measure_what_measure_measures_ckpt_included():
    # the copy in distributed.py counted FLOPs inside its probe step: ckpt's peak rose above exact's
    for mom in ("exact", "ckpt"):
        one = momlab.measure("bert-base", mom, batch_size=4, steps=1, **TINY)
        ranked = measure_distributed("bert-base", mom, ranks=1, parallel="none", batch_size=4, steps=1, **TINY)
        for f in ("peak_bytes", "activation_bytes", "workspace_bytes", "flops"):
            assert getattr(ranked, f) == getattr(one, f), (mom, f)


# -- 4. quantization compiles under the accounting mode; an OOM is not a compile failure ------

@pytest.mark.slow
def test_quantization_compiles_inside_the_accounting_mode():
    q = quant.Quantizer(8, compile=True)
    x = torch.randn(4096)
    with StorageTracker():
        y = q.unpack(q.pack(x))
    assert q.compile_state() == {"cpu": {"encode": "compiled", "decode": "compiled"}}
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 + 1e-6


def test_an_oom_while_compiled_propagates_and_compiling_stays_on():
    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    c = quant._Compiled(lambda x: x)
    c.compiled = oom
    with pytest.raises(torch.OutOfMemoryError):
        c(torch.ones(4))
    assert c.compiled is oom


def test_another_compile_failure_falls_back_and_says_so():
    def broken(*args):
        raise RuntimeError("no triton")

    c = quant._Compiled(lambda x: x + 1)
    c.compiled = broken
    with pytest.warns(UserWarning, match="no triton"):
        assert c(torch.ones(2)).tolist() == [2.0, 2.0]
    assert c.state.startswith("failed: RuntimeError: no triton") and c.compiled is None


# -- 6. fused attention's log-sum-exp is never quantized ----------------------------------------

class SelfAttention(nn.Module):
    """One fused-attention layer: dropout off, so the CPU runs the flash kernel that saves the log-sum-exp."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(128, 384)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 4, 32).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 128)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([SelfAttention(), SelfAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _saved(net, x):
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype, t.requires_grad))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x)
    return seen


def test_log_sum_exp_stays_exact_under_quantization(monkeypatch):
    torch.manual_seed(0)
    net, x = Stack(), torch.randn(4, 64, 128, requires_grad=True)
    lse = (4, 4, 64)  # batch, heads, length: 1024 values, above quantization's minimum size
    assert (lse, torch.float32, False) in _saved(net, x), "the CPU kernel no longer saves a log-sum-exp"
    assert attention_modules(net) == list(net.layers)
    apply(net, "quant4")
    packed = []
    original = quant.Quantizer.pack

    def spy(self, t):
        packed.append(tuple(t.shape))
        return original(self, t)

    monkeypatch.setattr(quant.Quantizer, "pack", spy)
    net(x).sum().backward()
    # (stages see a tensor in its memory order: the log-sum-exp arrives as (4, 64, 4))
    assert not [s for s in packed if len(s) == 3 and math.prod(s) == math.prod(lse)], packed
    assert (4, 4, 64, 32) in packed  # q, k, v and the output are quantized as before


# -- 7. host memory is bounded, and running out of it is said to be the host's ------------------

def test_host_copies_beyond_the_host_limit_are_host_out_of_memory():
    from momlab.accounting import host_allocation

    with StorageTracker(host_budget=4096) as tr:
        with host_allocation():
            a = torch.ones(512)  # 2 KiB
            with pytest.raises(HostOutOfMemory, match="host limit 4096"):
                b = torch.ones(1024)  # noqa: F841 - 4 KiB more
    assert a.numel() == 512 and tr.device_bytes == 0


def test_swap_past_the_host_limit_is_recorded_as_host_oom(monkeypatch):
    monkeypatch.setattr(sys.modules["momlab.measure"], "host_limit", lambda: 64 * 1024)
    m = momlab.measure("bert-base", "swap", batch_size=4, steps=1, **TINY)
    assert not m.fits and m.options["oom"] == "host" and "host" in m.error
    m = momlab.measure("bert-base", "exact", batch_size=4, steps=1, budget="1MiB", **TINY)
    assert not m.fits and m.options["oom"] == "device"


def test_host_limit_is_a_share_of_what_is_available():
    assert device.host_limit(available=10 * GiB) == int(device.HOST_FRACTION * 10 * GiB)
    assert 0 < device.host_limit() < device.meminfo()


# -- 8. an OOM inside the GradScaler's step leaves the next step trainable ----------------------

def test_oom_in_scaler_step_does_not_poison_the_next_step():
    # before the fix the scaler thought the gradients already unscaled and stepped with them
    # scaled by 65536: an SGD update (resnet) 65536 times too large
    def update(w, batch):
        before = [p.detach().clone() for p in w.model.parameters()]
        w.step(batch)
        return sum((p.detach() - b).abs().sum().item() for p, b in zip(w.model.parameters(), before))

    size = catalog.tiny("resnet50")
    hit, clean = (build("resnet50", batch_size=2, precision="fp16", **size) for _ in range(2))
    for w in (hit, clean):
        _warm_up(w, 1)  # until fp16's scale stops overflowing and SGD steps
    batches = [clean.batch() for _ in range(3)]
    real, calls = hit.optimizer.step, []

    def oom_once(*args, **kw):
        if not calls:
            calls.append(1)
            raise OutOfMemory("emulated device out of memory in the optimizer step")
        return real(*args, **kw)

    hit.optimizer.step = oom_once
    assert _try(hit, lambda: hit.step(batches[1])) is None and calls  # inside scaler.step, after unscale_
    assert hit.scaler.get_scale() == clean.scaler.get_scale()
    ratio = update(hit, batches[2]) / update(clean, batches[2])
    assert 0.5 < ratio < 2, ratio


# -- the one-command GPU check, at tiny sizes on the CPU ----------------------------------------

def _gpu_check(tmp_path, *extra):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "momlab", "gpu-check", str(out), "--device", "cpu", "--dry-run",
                        *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return r, out


@pytest.mark.slow
def test_gpu_check_dry_run_proves_every_phase(tmp_path):
    r, out = _gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files
    assert {"env.json", "invariants.jsonl", "measurements.jsonl", "summary.md", "estimates.csv",
            "s1.jsonl"} <= set(files)
    invariants = [json.loads(line) for line in (out / "invariants.jsonl").read_text().splitlines()]
    assert invariants and all(i["ok"] for i in invariants)
    phases = {i["phase"] for i in invariants}
    assert {"tiny", "big", "oom", "ckpt-auto", "ranks", "estimate", "vision", "paper", "s1"} <= phases
    summary = (out / "summary.md").read_text()
    assert summary.count("| done |") == 10 and "0 failed" in summary
    # the paper's vision first step: every point measured and predicted, both ways of choosing cuDNN's algorithms
    vision = summary.split("## Phase 8")[1].split("## Phase 9")[0]
    assert vision.count("| exact |") == vision.count("| swap |") == 6, vision  # 4 points and 2 slopes each
    measured = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines()]
    searched = sorted(m["options"]["cudnn_benchmark"] for m in measured if m["phase"] == "vision")
    assert searched == [False] * 4 + [True] * 4
    # the paper's stack: every planned point measured in that setup and estimated, with a slope per MOM
    paper = summary.split("## Phase 9")[1].split("## Phase 10")[0]
    assert all(m["setup"] == "paper" for m in measured if m["phase"] == "paper")
    assert sum(m["phase"] == "paper" for m in measured) == paper.count("| +0.000 |") // 2 == 10, paper
    assert paper.count("| swin-large |") == 2 * 2 + 2 and "| gpt3-small | exact |" in paper
    moms = {json.loads(line)["mom"] for line in (out / "measurements.jsonl").read_text().splitlines()}
    assert set(momlab.moms()) <= moms
    s1 = momlab.results.load(out / "s1.jsonl")
    assert set(s1["mom"]) == {"exact", "quant4", "ckpt", "ckpt-auto"}


def test_gpu_check_out_of_time_keeps_what_it_finished(tmp_path):
    r, out = _gpu_check(tmp_path, "--time-limit", "8", "--phases", "1,2,3")
    summary = (out / "summary.md").read_text()
    assert "1 environment | done" in summary
    assert "stopped at its time limit" in summary or "skipped: out of time" in summary
    for line in (out / "measurements.jsonl").read_text().splitlines():
        json.loads(line)  # whole lines only
    assert r.returncode in (0, 1)


def test_gpu_check_probes_the_context_in_a_process_per_module_loading_mode():
    """Phase 1's context probe: each CUDA_MODULE_LOADING mode in a fresh process started under it (CUDA reads the
    mode once, when it starts), one JSON answer each; without a GPU the probe says so instead of a number."""
    from momlab import gpucheck

    for mode in gpucheck.MODULE_LOADING:
        r = gpucheck._context_probe(0, mode, 0)
        assert r["module_loading"] == mode, r
        if torch.cuda.is_available():
            assert r["context_bytes"] > 0 and r["load_s"] > 0, r
        else:
            assert r == {"module_loading": mode, "error": "no CUDA device"}


def test_allocator_events_are_the_documented_counters_per_reading(monkeypatch):
    """What a CUDA measurement records of its timed steps' calls into the driver is read from
    torch.cuda.memory_stats' documented counters (segments from cudaMalloc allocated and freed, retries after a
    cache release); a reading is cumulative, so the record is the difference of two."""
    stats = {"segment.all.allocated": 40, "segment.all.freed": 12, "num_alloc_retries": 3, "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda dev=None: dict(stats))
    mem = device.CudaMemory(torch.device("cuda", 0), None)
    assert mem.events() == {"segments_reserved": 40, "segments_released": 12, "alloc_retries": 3}
    stats.pop("num_alloc_retries")  # an allocator that never retried may not report the counter
    assert mem.events()["alloc_retries"] == 0


# -- CUDA: what only a GPU can show (make gpu-check runs the full set) --------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_budgeted_measure_runs_and_keeps_three_peaks():
    m = momlab.measure("bert-base", "exact", batch_size=4, device="cuda", budget="1GiB", **TINY)
    assert m.fits and m.peak_bytes <= m.active_peak_bytes <= m.reserved_peak_bytes <= 1 * GiB
    assert m.options["cuda_memory"]["outside_allocator"] > 0
    events = m.options["cuda_allocator_events"]
    assert set(events) == set(device.ALLOCATOR_EVENTS) and all(v >= 0 for v in events.values())


@cuda
def test_cuda_cap_holds_after_ckpt_auto_lifted_it():
    m = momlab.measure("bert-base", "ckpt-auto", batch_size=64, device="cuda", budget="160MiB", **TINY)
    assert m.fits and m.reserved_peak_bytes <= 160 * MiB


@cuda
def test_cuda_quantization_compiles_in_a_measurement():
    m = momlab.measure("bert-base", "quant4", batch_size=4, device="cuda", budget="1GiB", **TINY)
    assert m.options["quant_compile"]["cuda"] == {"encode": "compiled", "decode": "compiled"}
