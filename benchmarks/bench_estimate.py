"""Benchmark: how fast an estimate is, and how far it is from the measured peak, beside two usual methods.

Side by side in one run:

1. Time per estimate for bert-large (real size) on an A100-40, for each MOM
   of notebook 06 and quant4's combinations: the first point, traced in a
   new process with nothing on disk (24 layers unrolled from copies 3 and
   4 blocks deep, each a warm-up step and two or more traced steps; the
   process's one-off start-up, imports and a tiny trace, reported apart);
   the first point of another process whose traces are on disk
   (build/cache; here a temporary directory); and every later point (read
   off the cached traces), at batch sizes from 1 to 1024. Target: under
   2 s a point, for any MOM.
2. Error against the measured peak on this CPU (small and medium configs,
   `momlab.measure`), for three predictors on the same configurations:
   - momlab: ``estimate(..., gpu="cpu")`` (a traced step);
   - accelerate's approach: weights + gradients + optimizer state, by formula
     (what ``accelerate estimate-memory`` reports for training: 4 bytes a
     parameter for weights, 4 for gradients, 8 for Adam's two moments, 4 for
     SGD's momentum; computed here, accelerate is not installed);
   - torchinfo's ``summary(...).total_*`` (params + input + forward/backward
     pass = 2 x the sum of module outputs), when torchinfo is installed.
3. The widget update of notebook 06 (`momlab.whatif.App.update`, what a
   slider move runs): batch slider moves and GPU switches on cached traces.
   Target: under 0.5 s.

Usage: python benchmarks/bench_estimate.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import momlab.estimate
from momlab import catalog
from momlab.estimate import clear_cache, estimate, profile
from momlab.measure import measure

CONFIGS = [  # (model, mom, batch, size): small and medium, CPU-measurable in seconds
    ("bert-base", "exact", 8, catalog.tiny("bert-base")),
    ("bert-base", "exact", 8, {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}),
    ("bert-base", "ckpt", 8, {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}),
    ("gpt2", "exact", 4, {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}),
    ("gpt2", "quant4", 4, {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "seq_len": 128}),
    ("vit-base", "exact", 8, {"num_layers": 2, "hidden_size": 256, "num_heads": 4, "image_size": 64}),
    ("resnet50", "exact", 8, catalog.tiny("resnet50")),
    ("resnet50", "swap", 8, catalog.tiny("resnet50")),
]


# notebook 06's MOMs (params/default.yaml)
WIDGET_MOMS = ("exact", "ckpt", "ckpt-selective", "swap", "quant4")
# the first point of each, traced (issue 13: under 2 s for any MOM)
FIRST_POINT_MOMS = (*WIDGET_MOMS, "quant4+ckpt", "quant4+swap")


def accelerate_formula(m) -> int:
    """Weights + gradients + optimizer state: what a parameter-count formula can know."""
    per_param = {"adamw": 4 + 4 + 8, "sgd": 4 + 4 + 4}[catalog.spec(m.model).optimizer]
    params = m.params_bytes // 4  # fp32 weights (buffers included: the formula cannot tell them apart)
    return params * per_param


def torchinfo_estimate(model, batch, size):
    try:
        import torchinfo
    except ImportError:
        return None
    from momlab.workload import build

    w = build(model, batch_size=batch, **size)
    inputs = {k: v for k, v in w.batch().items() if k != "labels"}
    s = torchinfo.summary(w.model, input_data=inputs, mode="train", verbose=0)
    return s.total_input + s.total_output_bytes + s.total_param_bytes


# a new process: imports, one tiny trace (the process's start-up), then the first point of bert-large with `mom`,
# traced (the cache directory is empty); prints both times
FIRST_POINT = """
import sys, time
from pathlib import Path
import momlab.estimate
from momlab import catalog
momlab.estimate.TRACE_CACHE = Path(sys.argv[2])
t0 = time.perf_counter()
momlab.estimate.estimate("bert-base", batch_size=2, gpu="A100-40", **catalog.tiny("bert-base"))
t1 = time.perf_counter()
momlab.estimate.estimate("bert-large", sys.argv[1], batch_size=256, gpu="A100-40")
print(t1 - t0, time.perf_counter() - t1)
"""


def time_per_point(quick: bool, cache: Path):
    print("== time per estimate, bert-large (real size) on A100-40")
    firsts = {}
    for mom in (("exact",) if quick else FIRST_POINT_MOMS):
        here = cache / mom
        here.mkdir()
        run = subprocess.run([sys.executable, "-c", FIRST_POINT, mom, str(here)], capture_output=True, text=True,
                             check=True)
        startup, cold = map(float, run.stdout.split())
        firsts[mom] = cold
        momlab.estimate.TRACE_CACHE = here
        clear_cache()  # what a new process (a notebook kernel, the command line) finds: the traces on disk
        t0 = time.perf_counter()
        estimate("bert-large", mom, batch_size=256, gpu="A100-40")
        disk = time.perf_counter() - t0
        prof = profile("bert-large", mom)
        # read, not traced: the profile's traces (an unrolled one's: those of its shallow copies) came from disk
        assert all(p.disk is not None for p in momlab.estimate._PROFILES.values() if p.depths is None)
        warm = []
        for b in (1, 8, 64, 256, 1024):
            t0 = time.perf_counter()
            e = estimate("bert-large", mom, batch_size=b, gpu="A100-40")
            warm.append(time.perf_counter() - t0)
        how = (f"unrolled from depths {prof.depths[0]} and {prof.depths[1]}, traced at batches {prof.lo.batch_size} "
               f"and {prof.hi.batch_size}" if prof.depths else
               f"traced at full depth, batches {prof.lo.batch_size} and {prof.hi.batch_size}")
        print(f"  {mom:12s} first point {cold:5.2f} s in a new process (its start-up {startup:.2f} s apart; {how}, "
              f"{len(prof.lo.ops)} ops a step); from disk {disk * 1e3:.1f} ms; later points median "
              f"{statistics.median(warm) * 1e3:.1f} ms, max {max(warm) * 1e3:.1f} ms "
              f"(batch 1024: peak {e.peak_bytes / 2 ** 30:.1f} GiB, fits={e.fits})")
    under = [m for m, t in firsts.items() if t < 2.0]
    print(f"  first points under 2 s: {len(under)} of {len(firsts)} MOMs; slowest "
          f"{max(firsts, key=firsts.get)} {max(firsts.values()):.2f} s (target < 2 s for any MOM)")
    momlab.estimate.TRACE_CACHE = cache / "widgets"


def errors(quick: bool):
    print("== error against the measured peak on this CPU (relative, signed)")
    print(f"  {'config':54s} {'measured':>10s} {'momlab':>8s} {'accel.':>8s} {'torchinfo':>9s}")
    rows = CONFIGS[:3] if quick else CONFIGS
    errs = {"momlab": [], "accelerate": [], "torchinfo": []}
    for model, mom, batch, size in rows:
        m = measure(model, mom, batch_size=batch, steps=1, **size)
        e = estimate(model, mom, batch_size=batch, gpu="cpu", **size)
        acc = accelerate_formula(m)
        ti = torchinfo_estimate(model, batch, size) if mom == "exact" else None
        rel = lambda x: (x - m.peak_bytes) / m.peak_bytes  # noqa: E731
        errs["momlab"].append(abs(rel(e.peak_bytes)))
        errs["accelerate"].append(abs(rel(acc)))
        if ti is not None:
            errs["torchinfo"].append(abs(rel(ti)))
        name = f"{model} {mom} b{batch} " + ",".join(f"{k[:1]}{v}" for k, v in size.items())
        print(f"  {name:54s} {m.peak_bytes / 2 ** 20:8.1f}Mi {rel(e.peak_bytes):+8.1%} {rel(acc):+8.1%} "
              + (f"{rel(ti):+9.1%}" if ti is not None else f"{'-':>9s}"))
    for k, v in errs.items():
        if v:
            print(f"  mean |error| {k:10s} {statistics.mean(v):7.1%}  (n={len(v)})")
    if not errs["torchinfo"]:
        print("  torchinfo: not installed (pip install torchinfo==1.8.0 to include it)")


def widget_updates():
    from momlab import whatif

    print("== what-if widget updates: App.update after a slider move (estimates, figure, PNG; cached traces)")
    app = whatif.app(model="bert-large", gpu="A100-40", precision="fp32", moms=WIDGET_MOMS, batch_size=64)
    moves = (("batch -> 256", app.batch, 256), ("batch -> 1024", app.batch, 1024), ("batch -> 64", app.batch, 64),
             ("GPU -> H100-80", app.gpu, "H100-80"), ("GPU -> V100-32", app.gpu, "V100-32"),
             ("GPU -> A100-40", app.gpu, "A100-40"))
    times = {label: [] for label, _, _ in moves}
    for _ in range(3):
        for label, widget, value in moves:
            widget.value = value
            times[label].append(app.last_update_s)
    for label, t in times.items():
        print(f"  {label:16s} median {statistics.median(t) * 1e3:6.1f} ms, max {max(t) * 1e3:6.1f} ms")
    print(f"  {len(WIDGET_MOMS)} MOMs ({', '.join(WIDGET_MOMS)}); slowest update "
          f"{max(max(t) for t in times.values()):.2f} s (target < 0.5 s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        time_per_point(a.quick, Path(cache))
        widget_updates()
        errors(a.quick)


if __name__ == "__main__":
    main()
