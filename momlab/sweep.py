"""Sweeps: grids of configurations measured into a resumable results store.

A sweep crosses models x MOMs x precisions x budgets with either batch sizes
(S1: an explicit list, or ``"auto"``) or model sizes (S2, S2': a list of
values per size keyword, one keyword at a time, at explicit batch sizes or
each at its best batches via ``"auto"``; or ``sizes: {dim: auto}``, which
searches the largest size at each batch, as the paper's "binary search, then
rerun at the maximum").

``"auto"`` first finds the maximum with momlab.search (trials with
``search_steps`` timed steps, since only the fit matters), then measures a
geometric grid (one grid step, 2, 4, ... below the maximum), the maximum
itself and the first value that does not fit, so a throughput curve ends
where the paper put its out-of-memory x.

Every finished point is appended to the store at once (momlab.results:
atomic lines, one key per configuration and environment fingerprint); a
rerun skips what is recorded, so a sweep killed at any moment resumes where
it stopped with nothing lost, partial or duplicated. Search trials go to a
second store beside it (``<name>.search.jsonl``), so a resumed "auto" sweep
replays its searches instead of measuring them again, and they never mix
with points measured at full ``steps``.

The parameter-file form (`sweep_from_file`) takes the same keywords as
`sweep`, in YAML; see `FILE_KEYS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

from momlab.record import Measurement
from momlab.results import OPTIONAL_PARAMS, PARAM_KEYS, Store, config_key, environment, make_record, to_frame
from momlab.search import (SIZE_KEYWORDS, Search, max_batch_size, max_model_size, measure_in_fresh_process,
                           resolve_measure)
from momlab.units import format_bytes, parse_bytes
from momlab.errors import check_choice
from momlab.workload import ATTENTIONS, SETUPS, stack

# The keys of a parameter file, each a keyword of `sweep`, with what it means.
FILE_KEYS = {
    "name": "store name: records go to results/<name>.jsonl unless `store` is given",
    "store": "path of the results store (JSON lines), relative to the working directory",
    "models": "model name or list of names (momlab.models())",
    "moms": "MOM name or list; combinations join names with '+' (default: exact)",
    "batch_sizes": "'auto' (search the maximum per MOM, measure a geometric grid up to it) or a list",
    "batch_step": "grid step of the 'auto' batch search (default 1; the paper used 4)",
    "size": "size keywords fixed for every point, 'tiny' for each model's tiny preset, or {model: either}",
    "sizes": "{size keyword: list of values, or 'auto'}: scanned one keyword at a time",
    "budget": "memory budget, bytes or '2GiB', or a list (default: none; cpu searches need one)",
    "device": "cpu or cuda[:N] (default cpu)",
    "precision": "fp32, bf16 or fp16, or a list (default fp32)",
    "steps": "timed steps per point (default 3)",
    "warmup": "warm-up steps per point (default 1)",
    "seed": "seed of weights and synthetic batches (default 0)",
    "search_steps": "timed steps per search trial (default 1: only whether it fits matters)",
    "fresh_process": "measure each configuration in a new process (default false)",
}
REQUIRED_FILE_KEYS = ("models",)


def search_store_path(store) -> Path:
    """Where a sweep keeps its search trials: beside the store, ``<stem>.search.jsonl``."""
    p = Path(store)
    return p.with_name((p.name[:-6] if p.name.endswith(".jsonl") else p.name) + ".search.jsonl")


def auto_points(search: Search) -> list[int]:
    """Grid values to measure for a search's answer: 1, 2, 4... grid steps below it, it, and its first failure.

    >>> from types import SimpleNamespace
    >>> from momlab.search import find_max
    >>> auto_points(find_max(lambda b: SimpleNamespace(fits=b <= 12)))
    [1, 2, 4, 8, 12, 13]
    """
    step, top = search.step, search.value // search.step
    points, k = [], 1
    while k < top:
        points.append(k * step)
        k *= 2
    if top:
        points.append(top * step)
    if search.first_failure is not None:
        points.append(search.first_failure)
    return points


def _as_list(name: str, value, kind=str) -> list:
    values = [value] if isinstance(value, kind) or value is None else list(value)
    if not values:
        raise ValueError(f"{name} must not be empty")
    return values


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class _Runner:
    """Measures configurations once each, into the points store and the search-trials store."""

    def __init__(self, store, env, measure_fn, fresh_process, run, bar):
        self.points = Store(store)
        self.trials = Store(search_store_path(store))
        self.env, self.fn, self.fresh, self.run, self.bar = env, resolve_measure(measure_fn), fresh_process, run, bar
        self.keys: list[str] = []
        self.measured = self.skipped = 0

    def _measure(self, params: dict) -> Measurement:
        kwargs = {k: v for k, v in params.items() if k != "size"}  # optional stack settings included
        kwargs.update(params["size"])
        return measure_in_fresh_process(self.fn, **kwargs) if self.fresh else self.fn(**kwargs)

    def _record(self, m: Measurement, params: dict, **extra) -> dict:
        return make_record(m, params, {**self.env, "date": _now()}, run=self.run, **extra)

    def point(self, params: dict, scan: str) -> None:
        key = config_key(params, self.env)
        self.keys.append(key)
        size = ",".join(f"{k}={v}" for k, v in params["size"].items())
        self.bar.set_description(f"{params['model']} {params['mom']} {params['precision']} "
                                 f"bs={params['batch_size']} {size}".strip())
        if self.points.get(key) is None:
            m = self._measure(params)
            # False when a concurrent sweep recorded it meanwhile: its record stands, ours is dropped
            self.points.append(self._record(m, params, scan=scan, role="point"))
            self.measured += 1
        else:
            self.skipped += 1
        self.bar.update(1)

    def cached_measure(self, scan: str):
        """A measure function for momlab.search that replays recorded trials and records new ones."""

        def measure(**kwargs) -> Measurement:
            params = {k: kwargs.pop(k) for k in PARAM_KEYS if k != "size"}
            params.update({k: kwargs.pop(k) for k in OPTIONAL_PARAMS if k in kwargs})
            params["size"] = kwargs
            key = config_key(params, self.env)
            rec = self.trials.get(key)
            self.bar.set_description(f"search {params['model']} {params['mom']} {params['precision']} "
                                     f"{scan}={params['batch_size'] if scan == 'batch_size' else kwargs[scan]}")
            if rec is not None:
                return Measurement.from_dict(rec)
            m = self._measure(params)
            self.trials.append(self._record(m, params, scan=scan, role="search-trial"))
            return m

        return measure

    def frame(self):
        seen, records = set(), []
        for k in self.keys:
            rec = self.points.get(k)
            if rec is not None and k not in seen:
                seen.add(k)
                records.append(rec)
        return to_frame(records)


def model_size(size, model: str) -> dict:
    """The fixed size keywords of `model`: `size` is None, "tiny", a mapping of
    size keywords, or a mapping {model name: any of those} (one per model)."""
    from momlab import catalog

    if isinstance(size, dict) and size and set(size) <= set(catalog.models()):
        size = size.get(model)
    if size == "tiny":
        return catalog.tiny(model)
    return dict(size or {})


def _check(models, moms, batch_sizes, budgets, device, precisions, size, sizes, steps, warmup, seed, batch_step,
           search_steps, validate_names):
    for name, v, low in (("steps", steps, 1), ("warmup", warmup, 1), ("seed", seed, 0),
                         ("batch_step", batch_step, 1), ("search_steps", search_steps, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    if isinstance(batch_sizes, str):
        if batch_sizes != "auto":
            raise ValueError(f"batch_sizes must be 'auto' or a list of positive ints, got {batch_sizes!r}")
    elif not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be 'auto' or a non-empty list of positive ints, got {batch_sizes!r}")
    if not (size is None or size == "tiny" or isinstance(size, dict)):
        raise ValueError(f"size must be a mapping of size keywords, 'tiny', or a mapping of model names to "
                         f"either, got {size!r}")
    if sizes is not None and not isinstance(sizes, dict):
        raise ValueError(f"sizes must be a mapping {{size keyword: list of values or 'auto'}}, got {sizes!r}")
    for dim, values in (sizes or {}).items():
        if dim not in SIZE_KEYWORDS:
            raise ValueError(f"unknown size keyword {dim!r} in sizes; valid: {', '.join(SIZE_KEYWORDS)}")
        if values == "auto":
            if batch_sizes == "auto":
                raise ValueError(f"sizes: {{{dim}: auto}} searches the largest {dim} at given batch sizes; "
                                 "give batch_sizes as a list")
        elif isinstance(values, str) or not values or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"sizes[{dim!r}] must be 'auto' or a non-empty list of positive ints, got {values!r}")
    for b in budgets:
        if b is not None:
            parse_bytes(b)
    searching = batch_sizes == "auto" or any(v == "auto" for v in (sizes or {}).values())
    if searching and device.split(":")[0] == "cpu" and None in budgets:
        raise ValueError("an 'auto' sweep on cpu needs a budget (the emulated device has no capacity of its own)")
    if validate_names:
        from momlab import catalog
        from momlab.errors import check_choice
        from momlab.workload import PRECISIONS, parse_mom

        for model in models:
            check_choice("model", model, catalog.models())
        for mom in moms:
            parse_mom(mom)
        for p in precisions:
            check_choice("precision", p, PRECISIONS)


def sweep(models, moms="exact", *, batch_sizes="auto", budget=None, device: str = "cpu", precision="fp32",
          size=None, sizes=None, steps: int = 3, warmup: int = 1, seed: int = 0, batch_step: int = 1,
          search_steps: int = 1, fresh_process: bool = False, store=None, name: str = "sweep",
          params_file=None, progress: bool = True, measure_fn=None, attention: str | None = None,
          setup: str = "default"):
    """Measure a grid of configurations into a resumable store; return its records as a DataFrame.

    `models`, `moms`, `precision` and `budget` take one value or a list;
    `batch_sizes` a list or "auto"; `size` fixes size keywords (or "tiny");
    `sizes` scans ``{keyword: [values] | "auto"}``; `setup` and `attention`
    pick the software stack of every point (`momlab.workload.stack`). The store defaults to
    ``results/<name>.jsonl``. The frame has one row per point of this sweep
    (recorded now or before), in plan order, as `momlab.results.load` gives;
    ``df.attrs`` says the store and how many points were measured now or skipped.

    >>> df = sweep(["bert-base"], ["exact", "ckpt"], batch_sizes="auto", budget="64MiB",
    ...            size="tiny", name="smoke")  # doctest: +SKIP
    """
    models = _as_list("models", models)
    moms = _as_list("moms", moms)
    precisions = _as_list("precision", precision)
    budgets = [budget] if budget is None or isinstance(budget, (str, int)) else list(budget)
    _check(models, moms, batch_sizes, budgets, device, precisions, size, sizes, steps, warmup, seed, batch_step,
           search_steps, validate_names=measure_fn is None)
    store = Path(store) if store is not None else Path("results") / f"{name}.jsonl"
    run = {"name": name, "params_file": None if params_file is None else str(params_file)}

    from tqdm.auto import tqdm

    env = environment(device)
    bar = tqdm(total=0, disable=not progress, unit="point", dynamic_ncols=True)
    runner = _Runner(store, env, measure_fn, fresh_process, run, bar)
    sizes = sizes or {}
    # a bad setting fails before anything is measured (model names only where momlab measures them)
    check_choice("setup", setup, SETUPS)
    if attention is not None:
        check_choice("attention", attention, ATTENTIONS)
    for model in models if measure_fn is None else ():
        stack(model, setup, attention)
    # the stack settings travel with every point, and are part of its key only when not the default
    stack_kw = {k: v for k, v in (("attention", attention), ("setup", setup)) if v != OPTIONAL_PARAMS[k]}
    listed = [(dim, v) for dim, values in sizes.items() if values != "auto" for v in values]
    searched = [dim for dim, values in sizes.items() if values == "auto"]

    def grow(n: int) -> None:
        bar.total += n
        bar.refresh()

    configs = len(models) * len(precisions) * len(budgets) * len(moms) * (
        (len(listed) if sizes else 1) + len(searched) * (0 if batch_sizes == "auto" else len(batch_sizes)))
    done = 0

    def next_config() -> None:
        nonlocal done
        done += 1
        bar.set_postfix_str(f"configuration {done}/{configs}")

    try:
        for model in models:
            fixed = model_size(size, model)
            # a scanned keyword replaces the fixed one; S1 sweeps scan only the batch
            scans = [(dim, {**fixed, dim: v}) for dim, v in listed] if sizes else [("batch_size", fixed)]
            for prec in precisions:
                for bud in budgets:
                    for mom in moms:
                        base = dict(model=model, mom=mom, device=device, precision=prec, budget=bud, steps=steps,
                                    warmup=warmup, seed=seed, **stack_kw)
                        for scan, sz in scans:
                            next_config()
                            if batch_sizes == "auto":
                                s = max_batch_size(model, mom, budget=bud, device=device, precision=prec,
                                                   step=batch_step, steps=search_steps, warmup=warmup,
                                                   seed=seed, measure_fn=runner.cached_measure("batch_size"),
                                                   **stack_kw, **sz)
                                batches = auto_points(s)
                            else:
                                batches = list(batch_sizes)
                            grow(len(batches))
                            for b in batches:
                                runner.point({**base, "batch_size": b, "size": sz}, scan)
                        for dim in searched:
                            rest = {k: v for k, v in fixed.items() if k != dim}
                            for b in batch_sizes:
                                next_config()
                                s = max_model_size(model, mom, dim=dim, batch_size=b, budget=bud, device=device,
                                                   precision=prec, steps=search_steps, warmup=warmup,
                                                   seed=seed, measure_fn=runner.cached_measure(dim),
                                                   **stack_kw, **rest)
                                values = auto_points(s)
                                grow(len(values))
                                for v in values:
                                    runner.point({**base, "batch_size": b, "size": {**rest, dim: v}}, dim)
    finally:
        bar.close()
    df = runner.frame()
    df.attrs.update(store=str(store), measured=runner.measured, skipped=runner.skipped)
    return df


def read_params(path) -> dict:
    """A sweep parameter file (YAML), validated: unknown keys raise ValueError naming the valid ones."""
    import yaml

    with open(path) as f:
        params = yaml.safe_load(f)
    if not isinstance(params, dict):
        raise ValueError(f"{path}: a sweep parameter file is a mapping of keys: {', '.join(FILE_KEYS)}")
    unknown = [k for k in params if k not in FILE_KEYS]
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(FILE_KEYS)}")
    missing = [k for k in REQUIRED_FILE_KEYS if k not in params]
    if missing:
        raise ValueError(f"{path}: missing required key(s) {', '.join(missing)}")
    if "name" not in params:
        params["name"] = Path(path).stem
    return params


def sweep_from_file(path, **overrides):
    """Run the sweep a YAML parameter file describes (see `FILE_KEYS`); `overrides` win over the file.

    >>> df = sweep_from_file("params/s1_tiny_cpu.yaml")  # doctest: +SKIP
    """
    params = {**read_params(path), **overrides}
    return sweep(params_file=str(path), **params)


# -- command line (wired into python -m momlab by momlab.cli) -------------------

def _size_flags(p: argparse.ArgumentParser) -> None:
    for name in SIZE_KEYWORDS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="start from the model's tiny preset (tests, smoke runs)")


def _size_from(args) -> dict:
    size = {}
    if args.tiny:
        from momlab import catalog

        size = catalog.tiny(args.model)
    size.update({k: getattr(args, k) for k in SIZE_KEYWORDS if getattr(args, k) is not None})
    return size


def cli_search(args) -> int:
    """python -m momlab search MODEL --mom M --budget 2GiB [--dim num_layers --batch-size 8]"""
    size = _size_from(args)
    common = dict(budget=args.budget, device=args.device, precision=args.precision, step=args.step,
                  start=args.start, limit=args.limit, steps=args.steps, warmup=args.warmup, seed=args.seed,
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


def cli_sweep(args) -> int:
    """python -m momlab sweep params/FILE.yaml [--store PATH] [--no-progress]"""
    overrides = {"progress": not args.no_progress}
    if args.store is not None:
        overrides["store"] = args.store
    df = sweep_from_file(args.params, **overrides)
    fits = int(df["fits"].sum()) if len(df) else 0
    print(f"{len(df)} points ({fits} fit, {len(df) - fits} out of memory) in {df.attrs['store']}; "
          f"{df.attrs['measured']} measured now, {df.attrs['skipped']} already recorded")
    return 0


def add_subparsers(subparsers) -> None:
    """Add the ``search`` and ``sweep`` subcommands to python -m momlab's parser."""
    p = subparsers.add_parser("search", help="largest batch (or model size with --dim) that fits a budget")
    p.add_argument("model")
    p.add_argument("--mom", default="exact")
    p.add_argument("--budget", default=None, help="e.g. 2GiB, 512MiB, 16GB or bytes (cpu: required)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--dim", default=None, choices=SIZE_KEYWORDS, help="search this size keyword instead of batch")
    p.add_argument("--batch-size", type=int, default=None, help="fixed batch of a --dim search")
    p.add_argument("--step", type=int, default=None, help="grid step (batch: 1; sizes: the model's natural step)")
    p.add_argument("--start", type=int, default=None, help="first value tried (default: one grid step)")
    p.add_argument("--limit", type=int, default=None, help="largest value tried")
    p.add_argument("--steps", type=int, default=1, help="timed steps per trial (only the fit matters)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh-process", action="store_true", help="run each trial in a new process")
    p.add_argument("--json", action="store_true", help="print the Search as JSON")
    _size_flags(p)
    p.set_defaults(func=cli_search)

    q = subparsers.add_parser("sweep", help="run a sweep parameter file into its results store")
    q.add_argument("params", help="YAML parameter file (keys: " + ", ".join(FILE_KEYS) + ")")
    q.add_argument("--store", default=None, help="results store path (overrides the file)")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(func=cli_sweep)
