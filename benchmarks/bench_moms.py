"""Benchmark: every MOM against exact on one workload, side by side in one run.

Default: bert-base, batch 8, fp32, CPU (emulated device). For each MOM the
activation ratio and step-time ratio to exact, next to the ideal:
checkpointing costs one extra forward (about 1.33x the step's FLOPs) and keeps
only block inputs; 4-bit quantization keeps 1/8 of fp32's bytes plus group
metadata (8 bytes per 256 values: 0.133 of fp32). Exact is measured first and
last; the ratio uses their mean, which also shows the drift of the machine.
Usage: python benchmarks/bench_moms.py [--model M] [--batch-size N] [--device cuda] [--precision fp16]
"""

import argparse

from momlab.measure import measure
from momlab.units import format_bytes

MOMS = ["ckpt", "ckpt-selective", "swap", "quant8", "quant4", "quant2", "quant4+ckpt", "swap+ckpt", "quant4+swap"]
IDEAL = {"ckpt": "time 1.33x (one more forward)", "quant8": "act 0.258 (1 B/value + meta)",
         "quant4": "act 0.133 (0.5 B/value + meta)", "quant2": "act 0.070", "swap": "act ~0 (all to host)"}
TARGET = {"ckpt": 1.45, "quant4": 1.6}  # the CPU targets, step time vs exact


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--moms", nargs="*", default=MOMS)
    a = ap.parse_args()
    kw = dict(batch_size=a.batch_size, device=a.device, precision=a.precision, steps=a.steps)
    first = measure(a.model, "exact", **kw)
    rows = [(m, measure(a.model, m, **kw)) for m in a.moms]
    last = measure(a.model, "exact", **kw)
    base_t = (first.step_time_s + last.step_time_s) / 2
    base_a = first.activation_bytes
    print(f"{a.model} batch {a.batch_size} {a.precision} on {a.device}; exact step {first.step_time_s:.2f} s "
          f"then {last.step_time_s:.2f} s (drift), activations {format_bytes(base_a)}, peak "
          f"{format_bytes(first.peak_bytes)}")
    print(f"{'mom':16s} {'act ratio':>9s} {'host':>10s} {'peak ratio':>10s} {'time ratio':>10s} "
          f"{'flops ratio':>11s}  ideal / target")
    for m, r in rows:
        note = IDEAL.get(m, "")
        if m in TARGET:
            note += f"; target time <= {TARGET[m]}x: {'met' if r.step_time_s / base_t <= TARGET[m] else 'MISSED'}"
        print(f"{m:16s} {r.activation_bytes / base_a:9.3f} {format_bytes(r.host_bytes):>10s} "
              f"{r.peak_bytes / first.peak_bytes:10.3f} {r.step_time_s / base_t:10.2f} "
              f"{r.flops / first.flops:11.2f}  {note}")


if __name__ == "__main__":
    main()
