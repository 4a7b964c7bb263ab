"""Points per second of one tiny sweep on 1 and on 2 local workers (one torch thread each).

The same sweep (tiny presets, CPU, explicit batch sizes) into a fresh store
each time; points/s is from the call to `sweep` to its return, so it includes
starting the workers (a fresh Python that imports torch and transformers:
seconds on this machine) and compacting their shards. The goal on a 2-core
machine is 2 workers >= 1.7x one; other processes on the machine take cores
too, so the load average before and after is printed beside the numbers.

    python benchmarks/bench_sweep_workers.py [--models bert-base gpt2] [--batch-sizes 1 2 4 8] [--steps 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

from momlab.sweep import sweep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert-base", "gpt2", "vit-base", "swin-tiny"])
    p.add_argument("--moms", nargs="+", default=["exact", "ckpt"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    a = p.parse_args()
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.workers:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            df = sweep(a.models, a.moms, batch_sizes=a.batch_sizes, size="tiny", steps=a.steps, progress=False,
                       store=Path(tmp) / f"w{n}.jsonl", launch=dict(workers=n, threads=1))
            wall = time.perf_counter() - t0
            rates[n] = df.attrs["measured"] / wall
            # records are stamped to the second: first to last record, the workers' start excluded
            dates = sorted(datetime.datetime.fromisoformat(d) for d in df["env.date"])
            span = (dates[-1] - dates[0]).total_seconds()
            print(f"{n} worker(s), 1 thread each: {df.attrs['measured']} points in {wall:6.1f} s = "
                  f"{rates[n]:.3f} points/s; first to last record {span:.0f} s "
                  f"(load average {load:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} cores)",
                  flush=True)
    if 1 in rates:
        for n in rates:
            if n != 1:
                print(f"speed-up of {n} workers over 1: {rates[n] / rates[1]:.2f}x (goal on 2 cores: 1.7x)")


if __name__ == "__main__":
    main()
