"""The command line: python -m momlab measure|search|sweep|estimate|figures|gpu-check ...

Every flag of every subcommand is declared here, and only here; the
commands call the Python API (the same functions notebooks use). Bad input
is a one-line error on stderr and exit code 2; a run that failed (a rank
died, a sweep left points unmeasured) exits 1; --json prints the same
dictionary the Python API's `to_dict()` gives.

MODEL is a catalog name, a transformers ``config.json`` (a path ending in
.json), or ``module:attribute`` naming a config, a `momlab.UserModel` or a
function returning one (`momlab.usermodel.from_text`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from momlab.catalog import SIZE_KEYWORDS
from momlab.config import PARALLEL
from momlab.distributed import RANK_FIELDS, RankFailed
from momlab.launch import LAUNCHERS
from momlab.units import format_bytes

LAUNCH_FLAGS = ("workers", "launcher", "threads", "partition", "time_min", "gpus_per_job", "array_parallelism")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"{self.prog}: error: {message}\n")


# -- shared flags ----------------------------------------------------------------------------------

def add_size_flags(p: argparse.ArgumentParser) -> None:
    for name in SIZE_KEYWORDS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="use the model's tiny preset (tests, smoke runs)")


def add_run_flags(p: argparse.ArgumentParser, *, steps: int = 3) -> None:
    """Where and how a configuration runs: the flags measure and search share."""
    p.add_argument("--mom", default="exact")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", default=None, help="e.g. 2GiB, 512MiB, 16GB or bytes")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1, help="ranks (processes; one GPU each on cuda)")
    p.add_argument("--parallel", default=None, choices=PARALLEL,
                   help="data-parallel strategy (default: ddp with --ranks > 1, else none)")
    p.add_argument("--offload", action="store_true", help="fsdp/zero2: shards and optimizer state on the host")
    p.add_argument("--json", action="store_true")
    add_size_flags(p)


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    """Workers for sweeps (momlab.launch): python -m momlab sweep and python -m momlab figures."""
    g = p.add_argument_group("workers (see momlab.launch)")
    g.add_argument("--workers", type=int, default=None, help="run the configurations on N workers (one GPU each)")
    g.add_argument("--launcher", default=None, choices=LAUNCHERS, help="local processes (default) or a slurm array")
    g.add_argument("--threads-per-worker", dest="threads", type=int, default=None,
                   help="torch threads per worker (default: cores // workers)")
    g.add_argument("--partition", default=None, help="slurm partition")
    g.add_argument("--time-min", type=int, default=None, help="slurm time limit per job, minutes")
    g.add_argument("--gpus-per-job", type=int, default=None, help="slurm: GPUs (workers) per array job")
    g.add_argument("--array-parallelism", type=int, default=None, help="slurm: array jobs running at once")


def model_from(args):
    """The MODEL argument as a model (parsed once; see the module docstring)."""
    from momlab.usermodel import from_text

    args.model = from_text(args.model) if isinstance(args.model, str) else args.model
    return args.model


def size_from(args, model) -> dict:
    from momlab import catalog

    size = catalog.tiny(model) if args.tiny else {}
    size.update({k: getattr(args, k) for k in SIZE_KEYWORDS if getattr(args, k) is not None})
    return size


def parallel_from(args) -> str:
    """--parallel and --offload as one strategy name of `PARALLEL`."""
    parallel = args.parallel or ("fsdp" if args.offload else "ddp" if args.ranks > 1 else "none")
    if args.offload and not parallel.endswith("+offload"):
        parallel += "+offload"
    return parallel


def launch_from(args):
    """The Launch the flags ask for, or None (no --workers and no --launcher: run in this process)."""
    given = {k: getattr(args, k) for k in LAUNCH_FLAGS if getattr(args, k) is not None}
    if not given:
        return None
    from momlab.launch import Launch

    return Launch.of(given)


def _table(d: dict) -> str:
    rows = []
    for k, v in d.items():
        if k in ("env", "step_times_s"):
            continue
        if k.endswith("_bytes") or k == "budget":
            v = format_bytes(v) if v is not None else "-"
        elif isinstance(v, float):
            v = f"{v:.4g}" if not math.isnan(v) else "nan"
        rows.append(f"{k:18s} {v}")
    return "\n".join(rows)


def _run(args) -> dict:
    return dict(device=args.device, budget=args.budget, precision=args.precision, steps=args.steps,
                warmup=args.warmup, seed=args.seed, ranks=args.ranks, parallel=parallel_from(args))


# -- commands --------------------------------------------------------------------------------------

def cmd_measure(args) -> int:
    """python -m momlab measure MODEL --batch-size N [--mom M --ranks 2 --parallel fsdp ...]"""
    from momlab.measure import measure

    try:
        m = measure(args.model, args.mom, batch_size=args.batch_size, **_run(args),
                    **size_from(args, args.model))
    except RankFailed as exc:
        print(f"python -m momlab measure: error: {exc}", file=sys.stderr)
        return 1
    d = m.to_dict()
    if args.json:
        print(json.dumps(d, allow_nan=True))
        return 0
    per_rank = d["options"].pop("per_rank", None) if m.options.get("ranks") else None
    d["options"].pop("losses", None)
    print(_table(d))
    for r in per_rank or []:
        print(f"rank {r['rank']}: " + ", ".join(f"{k[:-6]} {format_bytes(r[k])}" for k in RANK_FIELDS if k in r))
    return 0


def cmd_search(args) -> int:
    """python -m momlab search MODEL --mom M --budget 2GiB [--dim num_layers --batch-size 8]"""
    from momlab.search import max_batch_size, max_model_size

    size = size_from(args, args.model)
    common = dict(**_run(args), step=args.step, start=args.start, limit=args.limit,
                  fresh_process=args.fresh_process)
    if args.dim is None:
        if args.batch_size is not None:
            raise ValueError("--batch-size fixes the batch of a model-size search; give --dim too")
        s = max_batch_size(args.model, args.mom, **{**common, "step": args.step or 1}, **size)
    else:
        if args.batch_size is None:
            raise ValueError(f"a search over --dim {args.dim} needs --batch-size")
        size.pop(args.dim, None)
        s = max_model_size(args.model, args.mom, dim=args.dim, batch_size=args.batch_size, **common, **size)
    if args.json:
        print(json.dumps(s.to_dict(), allow_nan=True))
        return 0
    for v, m in zip(s.tried, s.trials):
        t = "" if math.isnan(m.throughput) else f"{m.throughput:10.2f}/s"
        print(f"{s.dim}={v:<8d} {'fits' if m.fits else 'OOM ':4s}  peak {format_bytes(m.peak_bytes):>12s}  {t}")
    tail = ("(every value up to the limit fits)" if s.capped
            else f"({s.first_failure} does not fit)")
    print(f"max {s.dim}: {s.value} {tail}, {len(s.trials)} trials, budget {args.budget}")
    return 0


def cmd_sweep(args) -> int:
    """python -m momlab sweep params/FILE.yaml [--store PATH] [--no-progress] [--workers N [--launcher slurm ...]]"""
    from momlab.sweep import SweepIncomplete, sweep_from_file

    overrides = {"progress": not args.no_progress}
    if args.store is not None:
        overrides["store"] = args.store
    launch = launch_from(args)
    if launch is not None:
        overrides["launch"] = launch
    try:
        df = sweep_from_file(args.params, **overrides)
    except SweepIncomplete as exc:
        print(f"python -m momlab sweep: {exc}", file=sys.stderr)
        return 1
    fits = int(df["fits"].sum()) if len(df) else 0
    print(f"{len(df)} points ({fits} fit, {len(df) - fits} out of memory) in {df.attrs['store']}; "
          f"{df.attrs['measured']} measured now, {df.attrs['skipped']} already recorded")
    return 0


def cmd_estimate(args) -> int:
    """python -m momlab estimate MODEL --gpu A100-40 --mom ckpt --batch-size 256 [--json]"""
    from momlab.estimate import estimate, predict_max_batch

    size = size_from(args, args.model)
    e = estimate(args.model, args.mom, batch_size=args.batch_size, gpu=args.gpu, precision=args.precision,
                 budget=args.budget, tf32=args.tf32, **size)
    d = e.to_dict()
    if args.max_batch:
        d["max_batch_size"] = predict_max_batch(args.model, args.mom, gpu=args.gpu, precision=args.precision,
                                                budget=args.budget, **size)
    if args.json:
        print(json.dumps(d, allow_nan=True))
    else:
        print(_table({k: v for k, v in d.items() if k not in ("time", "calibration", "ckpt_plan")}))
        if e.ckpt_plan is not None:  # ckpt-auto: the plan in one line (--json has all of it)
            plan, k = e.ckpt_plan, len(e.ckpt_plan["checkpointed"])
            share = plan.get("recompute_share", k / max(1, plan["blocks"]))  # a bound: none or every block
            print(f"{'ckpt_plan':18s} {k} of {plan['blocks']} blocks checkpointed {plan['checkpointed']}, "
                  f"recompute share {share:.3f}")
        print(f"{'calibration':18s} {e.calibration}")
        if not e.calibrated:
            print("note: uncalibrated device: step time uses the default efficiency; measure on it to calibrate")
    return 0


def cmd_figures(args) -> int:
    """python -m momlab figures params/default.yaml notebooks/*.ipynb [--workers N]"""
    from momlab.figures import run

    run(args.params, args.notebooks, launch=launch_from(args))
    return 0


def cmd_gpu_check(args) -> int:
    from momlab.gpucheck import main

    return main(args)


def parser() -> argparse.ArgumentParser:
    from momlab.gpus import gpus
    from momlab.sweep import FILE_KEYS

    p = _Parser(prog="python -m momlab", description="momlab: evaluate memory optimization methods")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("measure", help="measure one configuration (on one rank or many)")
    m.add_argument("model")
    m.add_argument("--batch-size", type=int, required=True, help="per rank")
    add_run_flags(m)
    m.set_defaults(func=cmd_measure)

    s = sub.add_parser("search", help="largest batch (or model size with --dim) that fits a budget")
    s.add_argument("model")
    s.add_argument("--dim", default=None, choices=SIZE_KEYWORDS, help="search this size keyword instead of batch")
    s.add_argument("--batch-size", type=int, default=None, help="fixed batch of a --dim search")
    s.add_argument("--step", type=int, default=None, help="grid step (batch: 1; sizes: the model's natural step)")
    s.add_argument("--start", type=int, default=None, help="first value tried (default: one grid step)")
    s.add_argument("--limit", type=int, default=None, help="largest value tried")
    s.add_argument("--fresh-process", action="store_true", help="run each trial in a new process")
    add_run_flags(s, steps=1)
    s.set_defaults(func=cmd_search)

    q = sub.add_parser("sweep", help="run a sweep parameter file into its results store")
    q.add_argument("params", help="YAML parameter file (keys: " + ", ".join(FILE_KEYS) + ")")
    q.add_argument("--store", default=None, help="results store path (overrides the file)")
    q.add_argument("--no-progress", action="store_true")
    add_launch_flags(q)
    q.set_defaults(func=cmd_sweep)

    e = sub.add_parser("estimate", help="predict memory and speed on a GPU without running on it")
    e.add_argument("model")
    e.add_argument("--gpu", required=True, help="one of: " + ", ".join(gpus()))
    e.add_argument("--mom", default="exact")
    e.add_argument("--batch-size", type=int, required=True)
    e.add_argument("--precision", default="fp32")
    e.add_argument("--budget", default=None, help="judge fits against this many bytes instead of the GPU's memory")
    e.add_argument("--tf32", action="store_true", help="fp32 matmuls on tf32 tensor cores")
    e.add_argument("--max-batch", action="store_true", help="also print the predicted largest batch that fits")
    e.add_argument("--json", action="store_true")
    add_size_flags(e)
    e.set_defaults(func=cmd_estimate)

    f = sub.add_parser("figures", help="run notebooks with papermill under a figures parameter file")
    f.add_argument("params", help="figures parameter file (params/*.yaml)")
    f.add_argument("notebooks", nargs="*")
    add_launch_flags(f)
    f.set_defaults(func=cmd_figures)

    g = sub.add_parser("gpu-check", help="prove every CUDA path on this GPU in one run (evidence into OUT)")
    g.add_argument("out", help="folder for the evidence (at most 8 files)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dry-run", action="store_true", help="the same phases at tiny sizes (CPU tests)")
    g.add_argument("--time-limit", type=float, default=450.0,
                   help="seconds for all phases (default 450: with start-up, within 8 minutes)")
    g.add_argument("--phases", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="comma-separated phase numbers to run (default: all)")
    g.set_defaults(func=cmd_gpu_check)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        if hasattr(args, "model"):
            model_from(args)
        return args.func(args)
    except ValueError as exc:
        print(f"{p.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
