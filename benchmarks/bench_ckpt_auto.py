"""Benchmark: ckpt-auto against exact and ckpt under one budget, batch by batch, side by side.

The claim to check: at every batch size ckpt-auto is no slower than ckpt
(it recomputes a subset of ckpt's blocks), it fits wherever ckpt fits, and
so its maximum throughput under the budget is at least the better of exact's
and ckpt's (S1). At each batch the three MOMs are measured one after the
other (interleaved, so drift of the machine hits all three alike); the
ratio ckpt-auto / ckpt of step time is printed with the plan (blocks
checkpointed) and the FLOP ratio, which is what the time ratio should follow.

Default: the small BERT of params/default.yaml's S1 notebook (4 layers,
hidden 128, sequence 64) under its 104 MiB emulated budget on the CPU.
Usage: python benchmarks/bench_ckpt_auto.py [--batch-sizes 8 16 24 ...] [--budget 104MiB] [--steps 5]
"""

import argparse

from momlab.measure import measure
from momlab.units import parse_bytes

SIZE = {"num_layers": 4, "hidden_size": 128, "num_heads": 2, "seq_len": 64}
MOMS = ("exact", "ckpt", "ckpt-auto")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--budget", default="104MiB")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 16, 20, 28, 36, 44, 52])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    budget = parse_bytes(a.budget)
    best = {m: (0.0, None) for m in MOMS}
    print(f"{a.model} {SIZE} on {a.device}, budget {a.budget} ({'emulated' if a.device == 'cpu' else 'capped'}); "
          f"median of {a.steps} steps")
    print(f"{'batch':>5s} {'exact s':>8s} {'ckpt s':>8s} {'auto s':>8s} {'auto/ckpt':>9s} {'flops a/c':>9s}  plan")
    for b in a.batch_sizes:
        r = {m: measure(a.model, m, batch_size=b, budget=budget, steps=a.steps, device=a.device, **SIZE)
             for m in MOMS}
        for m, x in r.items():
            if x.fits and x.throughput > best[m][0]:
                best[m] = (x.throughput, b)

        def t(m):
            return f"{r[m].step_time_s:8.3f}" if r[m].fits else f"{'OOM':>8s}"

        auto, full = r["ckpt-auto"], r["ckpt"]
        ratio = f"{auto.step_time_s / full.step_time_s:9.2f}" if auto.fits and full.fits else f"{'-':>9s}"
        flops = f"{auto.flops / full.flops:9.2f}" if auto.fits and full.fits else f"{'-':>9s}"
        plan = auto.options.get("ckpt_plan", {})
        print(f"{b:5d} {t('exact')} {t('ckpt')} {t('ckpt-auto')} {ratio} {flops}  "
              f"{len(plan.get('checkpointed', []))}/{plan.get('blocks', '?')} blocks, trials {plan.get('trials')}")
    print("max throughput (samples/s) and its batch:",
          ", ".join(f"{m} {tp:.1f} @ {b}" for m, (tp, b) in best.items()))
    top = max(best["exact"][0], best["ckpt"][0])
    print(f"ckpt-auto / max(exact, ckpt) max throughput: {best['ckpt-auto'][0] / top:.2f}")


if __name__ == "__main__":
    main()
