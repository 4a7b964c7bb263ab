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

Workers (``workers=N`` or ``launch=``; engine and placement in
momlab.launch): the work is split by configuration (model, MOM, precision,
budget and scan: a search and the points it leads to stay on one worker,
since its trials are sequential), ordered largest expected cost first
(`expected_cost`) so the longest does not start last. Each worker walks
that list and claims the next unclaimed configuration, and each point too
(two scans can meet at one point), so a launch measures every point once;
records go to the worker's own shard of the store (momlab.results), with
its provenance in ``worker`` (index, host, GPU, job, pid, threads). A worker
killed loses its point in flight; the others go on, the sweep then raises
`SweepIncomplete`, and the same sweep run again measures only what is not
recorded.
"""

from __future__ import annotations

import datetime
import functools
import json
import hashlib
import math
from pathlib import Path

from momlab import catalog, distributed
from momlab.record import Measurement
from momlab.results import (OPTIONAL_PARAMS, PARAM_KEYS, Store, compact, config_key, environment, make_record,
                            shards_dir, to_frame)
from momlab.search import (SIZE_KEYWORDS, Search, max_batch_size, max_model_size, measure_in_fresh_process,
                           resolve_measure)
from momlab.units import parse_bytes
from momlab.errors import check_choice
from momlab.workload import ATTENTIONS, SETUPS, parse_mom, stack, stack_settings

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
    "setup": "software stack: 'default' (today's) or 'paper' (the paper's own per model; momlab.workload.stack)",
    "attention": "attention kernel of transformers models: eager or sdpa (default: the setup's)",
}
REQUIRED_FILE_KEYS = ("models",)


def _resolve(model):
    from momlab.usermodel import resolve

    return resolve(model)


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

    def __init__(self, store, env, measure_fn, fresh_process, run, bar, shard=None, worker=None, claims=None):
        self.points = Store(store, shard=shard)
        self.trials = Store(search_store_path(store), shard=shard)
        self.env, self.fn, self.fresh, self.run, self.bar = env, resolve_measure(measure_fn), fresh_process, run, bar
        self.worker, self.claims = worker, claims  # a launch's worker: provenance, and where points are claimed
        self.keys: list[str] = []
        self.measured = self.skipped = 0

    def _mine(self, key: str) -> bool:
        if self.claims is None:
            return True
        from momlab.launch import claim

        return claim(self.claims, "point-" + key, self.worker)

    def _measure(self, params: dict) -> Measurement:
        kwargs = {k: v for k, v in params.items() if k != "size"}  # optional stack settings included
        kwargs.update(params["size"])
        return measure_in_fresh_process(self.fn, **kwargs) if self.fresh else self.fn(**kwargs)

    def _record(self, m: Measurement, params: dict, **extra) -> dict:
        if self.worker is not None:
            extra["worker"] = self.worker
        return make_record(m, params, {**self.env, "date": _now()}, run=self.run, **extra)

    def point(self, params: dict, scan: str) -> None:
        key = config_key(params, self.env)
        self.keys.append(key)
        size = ",".join(f"{k}={v}" for k, v in params["size"].items())
        self.bar.set_description(f"{params['model']!s} {params['mom']} {params['precision']} "
                                 f"bs={params['batch_size']} {size}".strip())
        if self.points.get(key) is None and self._mine(key):
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
            self.bar.set_description(f"search {params['model']!s} {params['mom']} {params['precision']} "
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
    name = model if isinstance(model, str) else model.name
    if isinstance(size, dict) and size and set(size) <= {*catalog.models(), name} - set(catalog.SIZE_KEYWORDS):
        size = size.get(name)
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
        from momlab.errors import check_choice
        from momlab.workload import PRECISIONS

        for model in models:
            if isinstance(model, str):
                check_choice("model", model, catalog.models())
        for mom in moms:
            parse_mom(mom)
        for p in precisions:
            check_choice("precision", p, PRECISIONS)


class SweepIncomplete(RuntimeError):
    """A launch ended with workers that failed or were killed; what they finished is recorded: rerun to finish."""


def _plan(models, moms, batch_sizes, budgets, device, precisions, size, sizes, steps, warmup, seed, batch_step,
          search_steps, stack_kw=None) -> list[dict]:
    """The sweep's configurations in plan order, each a unit of work: a scan (and its search, if any)."""
    sizes = sizes or {}
    listed = [(dim, v) for dim, values in sizes.items() if values != "auto" for v in values]
    searched = [dim for dim, values in sizes.items() if values == "auto"]
    units = []
    for model in models:
        fixed = model_size(size, model)
        # a scanned keyword replaces the fixed one; S1 sweeps scan only the batch
        scans = [(dim, {**fixed, dim: v}) for dim, v in listed] if sizes else [("batch_size", fixed)]
        for prec in precisions:
            for bud in budgets:
                for mom in moms:
                    base = dict(model=model, mom=mom, device=device, precision=prec, budget=bud, steps=steps,
                                warmup=warmup, seed=seed, **(stack_kw or {}))
                    for scan, sz in scans:
                        units.append(dict(base=base, scan=scan, size=sz, batch_sizes=batch_sizes,
                                          batch_step=batch_step, search_steps=search_steps))
                    for dim in searched:
                        rest = {k: v for k, v in fixed.items() if k != dim}
                        for b in batch_sizes:
                            units.append(dict(base=base, scan=dim, size=rest, batch_sizes=[b],
                                              search_steps=search_steps, search_dim=dim))
    return units


def _run_unit(runner: _Runner, unit: dict, grow=lambda n: None) -> None:
    """Search (if the unit asks) and measure one configuration's points into `runner`'s stores."""
    base, scan, sz = unit["base"], unit["scan"], unit["size"]
    search = dict(budget=base["budget"], device=base["device"], precision=base["precision"],
                  steps=unit["search_steps"], warmup=base["warmup"], seed=base["seed"],
                  **{k: base[k] for k in OPTIONAL_PARAMS if k in base})
    if "search_dim" in unit:
        b = unit["batch_sizes"][0]
        s = max_model_size(base["model"], base["mom"], dim=scan, batch_size=b, **search,
                           measure_fn=runner.cached_measure(scan), **sz)
        values = auto_points(s)
        grow(len(values))
        for v in values:
            runner.point({**base, "batch_size": b, "size": {**sz, scan: v}}, scan)
        return
    if unit["batch_sizes"] == "auto":
        s = max_batch_size(base["model"], base["mom"], step=unit["batch_step"], **search,
                           measure_fn=runner.cached_measure("batch_size"), **sz)
        batches = auto_points(s)
    else:
        batches = list(unit["batch_sizes"])
    grow(len(batches))
    for b in batches:
        runner.point({**base, "batch_size": b, "size": sz}, scan)


# bf16/fp16 steps on a CPU without AVX-512 BF16 / AMX: about 125x fp32 (/work/shared/ENVIRONMENT.md)
_CPU_HALF_FACTOR = 125
# An "auto" scan's points are unknown until its search ends: count it as batches 1, 2, ... 64 and as many trials
_AUTO_SAMPLES = 2 * (1 + 2 + 4 + 8 + 16 + 32 + 64)


@functools.lru_cache(maxsize=None)
def _parameters(model: str, size_json: str) -> int:
    import torch

    with torch.device("meta"):
        net = catalog.make_model(model, catalog.resolve_size(model, json.loads(size_json)))
    return sum(p.numel() for p in net.parameters())


def expected_cost(unit: dict) -> float:
    """A configuration's expected cost, in no unit: parameters x samples stepped (x 125 for half precision on CPU).

    Only its order matters: it sorts the work largest first, so the longest
    configuration does not start last on an otherwise idle cluster (LPT
    scheduling). It is not a prediction of seconds. Parameters are counted on
    the meta device (nothing allocated); a size search counts the model at
    its other keywords' values and the catalog's default for the searched one.
    """
    base = unit["base"]
    per_step = base["steps"] + base["warmup"]
    if unit["batch_sizes"] == "auto":
        samples = _AUTO_SAMPLES * per_step
    elif "search_dim" in unit:
        samples = unit["batch_sizes"][0] * per_step * 8  # about 8 trials and points per size search
    else:
        samples = sum(unit["batch_sizes"]) * per_step
    half = base["device"].split(":")[0] == "cpu" and base["precision"] != "fp32"
    params = _parameters(base["model"], json.dumps(unit["size"], sort_keys=True))
    return float(params * samples * (_CPU_HALF_FACTOR if half else 1))


def _work(job_index: int, spec: dict) -> dict:
    """One worker of a launch: claim configurations in cost order and run them into this worker's shard."""
    from tqdm.auto import tqdm

    from momlab import launch

    worker = launch.enter_worker(job_index, spec["launch"], spec["device"])
    claims = spec["claims"]
    launch.claim(claims, f"worker-{worker['index']}", worker)  # who is who (pids), for humans and tests
    env = environment(spec["device"])  # after enter_worker: its threads and GPU are what is stamped
    runner = _Runner(spec["store"], env, spec["measure_fn"], spec["fresh_process"], spec["run"],
                     tqdm(disable=True), shard=f"{spec['run_id']}-w{worker['index']}", worker=worker,
                     claims=claims)
    keys = {}
    for i, unit in enumerate(spec["units"]):
        if not launch.claim(claims, f"unit-{i}", worker):
            continue
        first = len(runner.keys)
        _run_unit(runner, unit)
        keys[i] = runner.keys[first:]
        launch.claim(claims, f"done-{i}", worker)
    return {"keys": keys, "measured": runner.measured, "skipped": runner.skipped, "worker": worker}


def _sweep_launched(units: list[dict], store: Path, run: dict, device: str, measure_fn, fresh_process: bool,
                    launch, progress: bool):
    import shutil

    from tqdm.auto import tqdm

    from momlab import launch as launching

    seen, unique = set(), []
    for u in units:  # two scans can name one configuration (a listed value equal to the fixed one)
        ident = json.dumps(u, sort_keys=True)
        if ident not in seen:
            seen.add(ident)
            unique.append(u)
    order = sorted(range(len(unique)), key=lambda i: -expected_cost(unique[i]))  # stable: ties keep plan order
    rid = launching.run_id()
    claims = shards_dir(store) / f"claims-{rid}"
    folder = Path(launch.folder) if launch.folder else shards_dir(store) / f"jobs-{rid}"
    spec = dict(units=[unique[i] for i in order], store=str(store), run=run, device=device, measure_fn=measure_fn,
                fresh_process=fresh_process, launch=launch, claims=str(claims), run_id=rid)
    watch = Store(store)
    before = len(watch.keys())
    bar = tqdm(total=len(unique), disable=not progress, unit="configuration", dynamic_ncols=True,
               desc=f"{launch.workers} {launch.launcher} workers")

    def poll() -> None:
        bar.n = len(launching.claimed(claims, "done-"))
        bar.set_postfix_str(f"{len(watch.keys()) - before} points recorded")
        bar.refresh()

    failures = ["interrupted"]
    try:
        jobs = launching.submit(_work, launch, folder, device, spec)
        failures = launching.wait(jobs, poll)
        outs = launching.results(jobs)
    finally:
        bar.close()
        shutil.rmtree(claims, ignore_errors=True)  # a rerun claims afresh: these name a launch that is over
        if not failures:
            shutil.rmtree(folder, ignore_errors=True)  # logs are kept only where something went wrong
        for path in (store, search_store_path(store)):
            compact(path, prefix=rid)
    if failures:
        raise SweepIncomplete(f"{len(failures)} of {launch.jobs} jobs failed ({'; '.join(failures)}); the points "
                              f"they finished are in {store}: run the same sweep again to measure the rest"
                              f" (submitit logs: {folder})")
    by_unit = {}
    for out in outs:
        for i, keys in out["keys"].items():
            by_unit[order[i]] = keys
    runner = _Runner(store, {}, None, False, run, None)
    runner.keys = [k for i in sorted(by_unit) for k in by_unit[i]]
    runner.measured = sum(o["measured"] for o in outs)
    runner.skipped = sum(o["skipped"] for o in outs)
    return runner


def sweep(models, moms="exact", *, batch_sizes="auto", budget=None, device: str = "cpu", precision="fp32",
          size=None, sizes=None, steps: int = 3, warmup: int = 1, seed: int = 0, batch_step: int = 1,
          search_steps: int = 1, fresh_process: bool = False, store=None, name: str = "sweep",
          params_file=None, progress: bool = True, measure_fn=None, workers: int | None = None,
          launch=None, attention: str | None = None, setup: str = "default"):
    """Measure a grid of configurations into a resumable store; return its records as a DataFrame.

    `models`, `moms`, `precision` and `budget` take one value or a list;
    `batch_sizes` a list or "auto"; `size` fixes size keywords (or "tiny");
    `sizes` scans ``{keyword: [values] | "auto"}``; `setup` and `attention`
    pick the software stack of every point (`momlab.workload.stack`). The store defaults to
    ``results/<name>.jsonl``. The frame has one row per point of this sweep
    (recorded now or before), in plan order, as `momlab.results.load` gives;
    ``df.attrs`` says the store and how many points were measured now or skipped.

    `workers` runs the configurations on that many local workers (one GPU
    each, or a share of the cores); `launch` (a momlab.launch.Launch or a
    mapping of its fields: launcher "slurm", partition, time_min,
    gpus_per_job, threads, ...) says more. Neither given: this process, or
    the launch in the environment variable MOMLAB_SWEEP_LAUNCH (JSON, as
    ``make figures`` sets it). A `measure_fn` must then pickle (a module's
    function, or "module:function").

    >>> df = sweep(["bert-base"], ["exact", "ckpt"], batch_sizes="auto", budget="64MiB",
    ...            size="tiny", name="smoke")  # doctest: +SKIP
    >>> df = sweep(["bert-base", "gpt2"], ["exact", "ckpt"], batch_sizes=[1, 2], size="tiny",
    ...            workers=2)  # doctest: +SKIP
    """
    # a transformers config or a user's module is one model, resolved once (momlab.usermodel)
    models = [m if isinstance(m, str) else _resolve(m)
              for m in (models if isinstance(models, (list, tuple)) else [models])]
    models = _as_list("models", models)
    moms = _as_list("moms", moms)
    precisions = _as_list("precision", precision)
    budgets = [budget] if budget is None or isinstance(budget, (str, int)) else list(budget)
    _check(models, moms, batch_sizes, budgets, device, precisions, size, sizes, steps, warmup, seed, batch_step,
           search_steps, validate_names=measure_fn is None)
    launch = _launch_of(workers, launch)
    store = Path(store) if store is not None else Path("results") / f"{name}.jsonl"
    run = {"name": name, "params_file": None if params_file is None else str(params_file)}
    # a bad setting fails before anything is measured (model names only where momlab measures them)
    check_choice("setup", setup, SETUPS)
    if attention is not None:
        check_choice("attention", attention, ATTENTIONS)
    for model in models if measure_fn is None else ():
        stack(model, setup, attention)
    # the stack settings travel with every point, and are part of its key only when not the default
    stack_kw = stack_settings(attention, setup)
    units = _plan(models, moms, batch_sizes, budgets, device, precisions, size, sizes, steps, warmup, seed,
                  batch_step, search_steps, stack_kw)
    if launch is not None:
        runner = _sweep_launched(units, store, run, device, measure_fn, fresh_process, launch, progress)
    else:
        runner = _sweep_here(units, store, run, device, measure_fn, fresh_process, progress)
    df = runner.frame()
    df.attrs.update(store=str(store), measured=runner.measured, skipped=runner.skipped)
    return df


def _launch_of(workers, launch):
    import os

    from momlab.launch import ENV_VAR, Launch

    if workers is None and launch is None:
        if not os.environ.get(ENV_VAR):
            return None
        try:
            launch = json.loads(os.environ[ENV_VAR])
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR} must be a JSON mapping of launch options, got "
                             f"{os.environ[ENV_VAR]!r}") from exc
    launch = Launch() if launch is None else Launch.of(launch)
    if workers is not None:
        launch = Launch.of({**launch.to_dict(), "workers": workers})
    return launch


def _sweep_here(units: list[dict], store: Path, run: dict, device: str, measure_fn, fresh_process: bool,
                progress: bool) -> _Runner:
    from tqdm.auto import tqdm

    env = environment(device)
    bar = tqdm(total=0, disable=not progress, unit="point", dynamic_ncols=True)
    runner = _Runner(store, env, measure_fn, fresh_process, run, bar)

    def grow(n: int) -> None:
        bar.total += n
        bar.refresh()

    try:
        for done, unit in enumerate(units, start=1):
            bar.set_postfix_str(f"configuration {done}/{len(units)}")
            _run_unit(runner, unit, grow)
    finally:
        bar.close()
    return runner


def read_params(path) -> dict:
    """A sweep parameter file (YAML), validated: unknown keys raise ValueError naming the valid ones.

    A file that is not YAML, or whose top level is not a mapping, raises
    ValueError naming the file and where (one line: the command line prints
    it as its error, not a parser's traceback).
    """
    import yaml

    def where(exc) -> str:  # one line: "line L, column C: problem (context started at line L')", 1-based
        mark = getattr(exc, "problem_mark", None)
        if mark is None:  # a ReaderError (bytes that are not text) has a position, not a mark
            at = f"character {exc.position + 1}: " if getattr(exc, "position", None) is not None else ""
            return at + " ".join(str(exc).split())
        problem = " ".join((getattr(exc, "problem", None) or str(exc)).split())
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context:
            started = f" started at line {context_mark.line + 1}" if context_mark is not None else ""
            problem += f" ({context}{started})"
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"

    try:
        with open(path) as f:
            params = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"params file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"params file {path}: {where(exc)}") from None
    if not isinstance(params, dict):
        kind = "empty" if params is None else f"a {type(params).__name__}"
        raise ValueError(f"params file {path}: line 1, column 1: the top level is {kind}, not a mapping of keys "
                         f"({', '.join(FILE_KEYS)})")
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


# -- scans over rank counts: the data of notebook 07 ---------------------------------------------

def record_key(params: dict, env: dict, ranks: int, parallel: str) -> str:
    """The store key of a distributed point: momlab.results' key of the configuration, plus ranks and parallel."""
    blob = json.dumps([config_key(params, env), ranks, parallel])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def ranks_store_path(store) -> Path:
    """Where `scan_ranks` keeps its records: beside `store`, ``<stem>.ranks.jsonl``, so single-device
    analyses of `store` never mix in multi-rank records."""
    p = Path(store)
    return p.with_name((p.name[:-6] if p.name.endswith(".jsonl") else p.name) + ".ranks.jsonl")


def scan_ranks(model: str, moms=("exact",), *, ranks=(1, 2), parallel=("ddp", "fsdp"), batch_sizes=(2, 4),
               store, size=None, device: str = "cpu", budget=None, precision: str = "fp32", steps: int = 3,
               warmup: int = 1, seed: int = 0, timeout_s: float = distributed.DEFAULT_TIMEOUT_S):
    """Measure moms x parallel x ranks x batch sizes into ``ranks_store_path(store)``; return its frame.

    `size`: size keywords, or "tiny" for the model's tiny preset. Resumable
    like momlab.sweep: a point already recorded (same configuration, ranks,
    parallel and environment) is not measured again. ``ranks=1`` is
    measured as parallel ``none`` (plain training, the 1-GPU point of every
    strategy). Records carry ``ranks`` and ``parallel`` columns. A run whose
    rank failed is recorded with ``fits=False`` and the error.

    >>> df = scan_ranks("bert-base", ["exact", "ckpt"], size="tiny",
    ...                 store="results/smoke.jsonl")  # doctest: +SKIP
    """
    size = catalog.tiny(model) if size == "tiny" else dict(size or {})
    env = environment(device)
    s = Store(ranks_store_path(store))
    keys = []
    plan = [("none" if r == 1 else p, r) for p in ([parallel] if isinstance(parallel, str) else parallel)
            for r in ranks]
    for p, r in dict.fromkeys(plan):
        for mom in ([moms] if isinstance(moms, str) else moms):
            for b in batch_sizes:
                params = dict(model=model, mom=mom, batch_size=b, device=device, precision=precision,
                              size=catalog.resolve_size(model, size), budget=budget, steps=steps, warmup=warmup,
                              seed=seed)
                key = record_key(params, env, r, p)
                keys.append(key)
                if s.get(key) is not None:
                    continue
                try:
                    m = distributed.measure_distributed(model, mom, ranks=r, parallel=p, batch_size=b, device=device,
                                            budget=budget, precision=precision, steps=steps, warmup=warmup,
                                            seed=seed, timeout_s=timeout_s, **size)
                except distributed.RankFailed as exc:
                    m = Measurement(model=model, mom=parse_mom(mom), batch_size=b, device=device,
                                    precision=precision, size=params["size"], fits=False, peak_bytes=0,
                                    params_bytes=0, grads_bytes=0, optimizer_bytes=0, activation_bytes=0,
                                    workspace_bytes=0, host_bytes=0, step_time_s=math.nan, throughput=math.nan,
                                    flops=0, error=str(exc).splitlines()[0], options={"ranks": r, "parallel": p})
                rec = make_record(m, params, env, ranks=r, parallel=p)
                rec["key"] = key
                s.append(rec)
    by_key = {rec.get("key"): rec for rec in s.records()}
    return to_frame([by_key[k] for k in dict.fromkeys(keys) if k in by_key])
