"""Benchmark: per-rank memory and global throughput of exact vs ckpt under DDP and FSDP.

A small BERT (4 layers, hidden 256, seq 128; the activations matter, the
weights are still big enough to shard), batch 8 per rank, 2 gloo ranks on
CPU, one thread each, beside the same model on one rank (parallel none).
Every configuration runs in fresh rank processes; memory is the emulated
device's exact account (the maximum over ranks), time the median of the
timed steps of the slowest rank. The last column is ckpt's throughput over
exact's under the same strategy: the paper's ratio at this rank count.
Usage: python benchmarks/bench_distributed.py [--model M] [--batch-size N] [--ranks R] [--steps K]
"""

import argparse
import time

from momlab.distributed import measure_distributed
from momlab.units import format_bytes

SIZE = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "seq_len": 128}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    plan = [("none", 1)] + [(p, a.ranks) for p in ("ddp", "fsdp")]
    rows, start = [], time.perf_counter()
    for parallel, ranks in plan:
        exact = None
        for mom in ("exact", "ckpt"):
            m = measure_distributed(a.model, mom, ranks=ranks, parallel=parallel, batch_size=a.batch_size,
                                    steps=a.steps, **SIZE)
            exact = m.throughput if mom == "exact" else exact
            rows.append((parallel, ranks, mom, m, m.throughput / exact))
    print(f"{a.model} {SIZE}, batch {a.batch_size} per rank, {a.steps} timed steps, cpu (gloo), "
          f"1 thread per rank; memory per rank (max over ranks)")
    head = ("parallel", "ranks", "mom", "peak", "weights", "grads", "optim", "activ", "comm", "workspace",
            "step s", "samples/s", "vs exact")
    print(("{:8s} {:>5s} {:5s}" + " {:>10s}" * 7 + " {:>7s} {:>9s} {:>8s}").format(*head))
    for parallel, ranks, mom, m, ratio in rows:
        memory = [m.peak_bytes, m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.activation_bytes,
                  m.options["comm_bytes"], m.workspace_bytes]
        print(("{:8s} {:>5d} {:5s}" + " {:>10s}" * 7 + " {:>7.3f} {:>9.1f} {:>8.2f}").format(
            parallel, ranks, mom, *map(format_bytes, memory), m.step_time_s, m.throughput, ratio))
    print(f"total {time.perf_counter() - start:.0f} s (including rank start-up)")


if __name__ == "__main__":
    main()
