"""Benchmark: the cost of exact memory accounting, and the spread of step times.

bert-base, batch 8, fp32, CPU. Side by side in one run: 10 steps with the
storage tracker (+ FLOP counter, as in measure's probe step) and 10 steps
without. The tracking overhead is why measure() times steps with tracking off.
Usage: python benchmarks/bench_measure.py [--model M] [--batch-size N] [--steps K]
"""

import argparse
import statistics
import time

from torch.utils.flop_counter import FlopCounterMode

from momlab.accounting import StorageTracker
from momlab.workload import build


def timed(w, steps, tracked):
    times = []
    for _ in range(steps):
        inputs = w.batch()
        t0 = time.perf_counter()
        if tracked:
            with StorageTracker() as tr, FlopCounterMode(display=False):
                tr.track(w.state_tensors()["params"])
                w.step(inputs)
        else:
            w.step(inputs)
        times.append(time.perf_counter() - t0)
        del inputs
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    w = build(a.model, batch_size=a.batch_size)
    w.step()  # warm-up: optimizer state, allocator, thread pools
    off, on = [], []
    # interleave the two so drift in machine load hits both equally
    for _ in range(a.steps):
        off += timed(w, 1, False)
        on += timed(w, 1, True)
    print(f"{a.model} batch {a.batch_size}, {a.steps} steps each, interleaved")
    print(f"{'':18s} {'min':>8s} {'median':>8s} {'max':>8s}   (seconds)")
    for name, t in (("tracking off", off), ("tracking on", on)):
        print(f"{name:18s} {min(t):8.3f} {statistics.median(t):8.3f} {max(t):8.3f}")
    print(f"tracking overhead (median on / median off): {statistics.median(on) / statistics.median(off):.2f}x")
    print(f"spread off (max / min): {max(off) / min(off):.2f}x")


if __name__ == "__main__":
    main()
