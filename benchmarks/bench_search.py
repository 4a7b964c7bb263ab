"""How many trials a maximum-batch search costs: momlab vs the paper vs Lightning.

Strategies, each given only "does batch b fit?":
- momlab: doubling from the first grid value to the first failure, then
  bisection (momlab.search.find_max), on the integer grid and on multiples of 4;
- paper: linear scan on multiples of 4 (4, 8, 12, ... until the first failure);
- Lightning's batch-size finder, mode "binsearch" (init_val=2, max_trials=25),
  re-implemented from lightning/pytorch/tuner/batch_size_scaling.py
  (_run_binary_scaling): double while it fits; after a failure bisect between
  the last success and the failure; stop when they are 1 apart. It counts only
  successes against max_trials and never tries below 1, so when even 2 fails it
  answers 1 untried.

Fake steps have memory = fixed + per_sample * batch, with budgets chosen so
the true answers are the paper's maximum batches (V100) and small edge cases.
`--real` adds one real tiny model on CPU (trials cached across strategies;
seconds are the sum of the measured trials each strategy needed).

    python benchmarks/bench_search.py [--real] [--model bert-base] [--num-layers 8]
"""

from __future__ import annotations

import argparse
import math
import time
from types import SimpleNamespace

from momlab.search import find_max, trial_bound


class Counted:
    """A fits(b) oracle that counts the trials a strategy makes (and their seconds, if known)."""

    def __init__(self, fits, seconds=None):
        self.fits, self.seconds, self.tried = fits, seconds, []

    def __call__(self, b: int) -> bool:
        self.tried.append(b)
        return self.fits(b)

    @property
    def cost(self) -> float:
        return sum(self.seconds(b) for b in self.tried) if self.seconds else math.nan


def momlab_search(fits, step=1) -> int:
    return find_max(lambda b: SimpleNamespace(fits=fits(b)), step=step).value


def linear_scan(fits, step=4) -> int:
    best, b = 0, step
    while fits(b):
        best, b = b, b + step
    return best


def lightning_binsearch(fits, init_val=2, max_trials=25) -> int:
    new_size, low, high, count = init_val, 1, None, 0
    while True:
        if fits(new_size):
            count += 1
            if count > max_trials:
                break
            low = new_size
            if high:
                if high - low <= 1:
                    break
                new_size = (high + low) // 2
            else:
                new_size = new_size * 2
        else:
            high = new_size
            new_size = (high + low) // 2
            if high - low <= 1:
                break
    return new_size


STRATEGIES = {
    "momlab/1": lambda f: momlab_search(f, 1),
    "lightning": lightning_binsearch,
    "momlab/4": lambda f: momlab_search(f, 4),
    "paper-linear/4": linear_scan,
}
GRID = {"momlab/4": 4, "paper-linear/4": 4}  # the grid each answers on (others: every integer)

# true answers: edge cases, then the paper's V100 maximum batches (BERT-L, ResNet-50, Swin-L, ...)
ANSWERS = [0, 1, 2, 3, 7, 19, 32, 44, 168, 480, 784]


def _cell(text: str, timed: bool) -> str:
    return f"{text:>{22 if timed else 15}s}"


def header(timed: bool) -> str:
    names = "".join(_cell(n, timed) for n in STRATEGIES)
    units = "".join(_cell("value trials" + ("   time" if timed else ""), timed) for _ in STRATEGIES)
    return f"{'workload':<24s}{'answer':>7s}{'bound':>6s}{names}\n{'':<37s}{units}"


def row(label: str, truth: int, fits, seconds=None) -> str:
    cells = []
    for name, strategy in STRATEGIES.items():
        oracle = Counted(fits, seconds)
        got = strategy(oracle)
        grid = GRID.get(name, 1)
        mark = " " if got == truth // grid * grid else "!"
        cost = "" if seconds is None else f" {oracle.cost:6.1f}s"
        cells.append(_cell(f"{got}{mark} {len(oracle.tried):6d}{cost}", seconds is not None))
    return f"{label:<24s}{truth:>7d}{trial_bound(truth):>6d}" + "".join(cells)


def fake_table() -> None:
    print("fake steps, memory = 1000 + 37 * batch bytes; value (! = wrong on its grid) and trials;")
    print("bound = 2*ceil(log2(answer)) + 2, momlab's worst case on grid 1")
    print(header(False))
    for truth in ANSWERS:
        budget = 1000 + 37 * truth + 20
        print(row(f"fake, budget {budget}", truth, lambda b, budget=budget: 1000 + 37 * b <= budget))


def real_table(model: str, num_layers: int) -> None:
    from momlab import catalog
    from momlab.measure import measure

    tiny = {**catalog.tiny(model), "num_layers": num_layers}
    # small batches all peak in the optimizer step; set the budget between batch 8 and 16
    p8 = measure(model, batch_size=8, steps=1, **tiny).peak_bytes
    p16 = measure(model, batch_size=16, steps=1, **tiny).peak_bytes
    budget = (p8 + p16) // 2
    cache: dict[int, tuple[bool, float]] = {}

    def run(b):
        if b not in cache:
            t0 = time.perf_counter()
            fits = measure(model, batch_size=b, budget=budget, steps=1, **tiny).fits
            cache[b] = (fits, time.perf_counter() - t0)
        return cache[b]

    truth = find_max(lambda b: SimpleNamespace(fits=run(b)[0])).value
    print(f"\nreal: {model} tiny {tiny}, exact, cpu, budget {budget} bytes (trials cached across strategies)")
    print(header(True))
    print(row(f"{model} tiny", truth, lambda b: run(b)[0], lambda b: run(b)[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true", help="also search a real tiny model on CPU (minutes)")
    p.add_argument("--model", default="bert-base")
    p.add_argument("--num-layers", type=int, default=8, help="layers of the tiny preset used with --real")
    args = p.parse_args()
    fake_table()
    if args.real:
        real_table(args.model, args.num_layers)


if __name__ == "__main__":
    main()
