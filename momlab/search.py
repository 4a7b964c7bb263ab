"""The largest batch, or the largest model, that fits a memory budget.

Method: geometric growth, then bisection, on a grid of multiples of `step`.
Starting from `start`, the value doubles until the first trial that runs out of
memory; the answer then lies between the last value that fitted and that
failure, and bisection closes the gap to one grid step. With the default
start (the first grid value) an answer of `a` grid steps costs at most
``2*ceil(log2(a)) + 2`` trials (``1`` when nothing fits): one more doubling
than a plain binary search would need, in exchange for not knowing an upper
bound. The paper scanned batch sizes linearly in steps of 4 (``a/4 + 1``
trials) or bisected multiples of 4; Lightning's batch-size finder
("binsearch") doubles then bisects too, but starts at 2 and never tries a
value below it. benchmarks/bench_search.py compares the three.

The answer is exact on its grid and every claim is measured: ``.value``
fitted and ``.first_failure`` (``value + step``) ran out of memory, both
among ``.trials``. It assumes memory grows with the searched value (true of
batch and model sizes); a trial that raises anything but an out-of-memory
(which `measure` turns into ``fits=False``) stops the search with that error.

Only whether a step fits matters here, so trials default to ``steps=1``
timed step after ``warmup=1``: the fit is decided by the warm-up (optimizer
state created) and the memory-tracked probe step, which `measure` always
runs; more timed steps would only refine a throughput the search discards.
A sweep re-measures the points it keeps with its own ``steps``.

``fresh_process=True`` runs each trial in a new interpreter (multiprocessing
"spawn"), so that allocator caches and fragmentation left by one trial can
not change whether the next one fits; it costs an interpreter start and the
imports (seconds) per trial.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from momlab import catalog
from momlab.catalog import SIZE_KEYWORDS
from momlab.moms import parse_mom
from momlab.record import Measurement
from momlab.usermodel import resolve
from momlab.workload import stack_settings


@dataclass(frozen=True)
class Grid:
    """The values a search may answer: ``step, 2*step, 3*step, ...`` up to `limit`."""

    step: int = 1
    limit: int | None = None

    def __contains__(self, value) -> bool:
        return (isinstance(value, int) and value >= self.step and value % self.step == 0
                and (self.limit is None or value <= self.limit))

    def next(self, value: int) -> int | None:
        """The grid value after `value` (None past the limit)."""
        nxt = (value // self.step + 1) * self.step
        return None if self.limit is not None and nxt > self.limit else nxt


@dataclass
class Search:
    """Outcome of a search: the largest value of `dim` that fits, and every trial.

    - ``value``: largest grid value that fits; 0 when even the first does not.
    - ``trials``: the Measurements in the order tried; ``tried`` their values.
    - ``first_failure``: the grid value after ``value``, measured not to fit;
      None only when the search stopped at ``grid.limit`` with everything fitting.
    """

    dim: str
    value: int
    trials: list = field(default_factory=list)
    tried: list = field(default_factory=list)
    grid: Grid = Grid()
    first_failure: int | None = None
    config: dict = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.grid.step

    @property
    def capped(self) -> bool:
        """True when every value up to the grid's limit fitted (the answer is a lower bound)."""
        return self.first_failure is None

    @property
    def best(self):
        """The trial at ``value`` (None when nothing fits)."""
        return self._trial_at(self.value)

    @property
    def failure(self):
        """The trial at ``first_failure`` (None when capped)."""
        return self._trial_at(self.first_failure)

    def _trial_at(self, value):
        for v, m in zip(self.tried, self.trials):
            if v == value:
                return m
        return None

    def to_dict(self) -> dict:
        return {"dim": self.dim, "value": self.value, "first_failure": self.first_failure,
                "step": self.grid.step, "limit": self.grid.limit, "tried": list(self.tried),
                "config": {k: (v if k != "model" or isinstance(v, str) else v.name) for k, v in self.config.items()},
                "trials": [m.to_dict() if hasattr(m, "to_dict") else m for m in self.trials]}

    def __repr__(self) -> str:
        return (f"Search(dim={self.dim!r}, value={self.value}, first_failure={self.first_failure}, "
                f"step={self.grid.step}, trials={len(self.trials)})")


def find_max(trial: Callable[[int], Any], *, step: int = 1, start: int | None = None, limit: int | None = None,
             dim: str = "value") -> Search:
    """Largest multiple of `step` for which ``trial(value).fits`` is true.

    `trial` is any function of the value returning an object with ``.fits``
    (a Measurement, normally). Values tried: `start` (default `step`), doubling
    until a failure (or halving until a fit, when `start` fails), then
    bisection. `limit` caps the values tried.

    >>> from types import SimpleNamespace
    >>> s = find_max(lambda b: SimpleNamespace(fits=b <= 5))
    >>> s.value, s.tried, s.first_failure
    (5, [1, 2, 4, 8, 6, 5], 6)
    """
    for name, v in (("step", step), ("start", start), ("limit", limit)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    start = step if start is None else start
    if start % step:
        raise ValueError(f"start {start} is not on the grid (a multiple of step {step})")
    top = None if limit is None else limit // step  # in grid units
    if top is not None and top < 1:
        raise ValueError(f"limit {limit} is below the first grid value {step}")

    trials, tried = [], []

    def fits(k: int) -> bool:
        value = k * step
        try:
            m = trial(value)
        except Exception as exc:
            exc.add_note(f"momlab search: stopped while trying {dim}={value} (tried before: {tried})")
            raise
        trials.append(m)
        tried.append(value)
        return bool(m.fits)

    # Work in grid units k (value = k*step); lo fitted (0: nothing yet), hi failed (None: nothing yet).
    lo, hi = 0, None
    k = start // step if top is None else min(start // step, top)
    if fits(k):
        lo = k
        while hi is None and (top is None or lo < top):
            k = 2 * lo if top is None else min(2 * lo, top)
            if fits(k):
                lo = k
            else:
                hi = k
    else:
        hi = k
        while lo == 0 and hi > 1:
            k = hi // 2
            if fits(k):
                lo = k
            else:
                hi = k
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return Search(dim=dim, value=lo * step, trials=trials, tried=tried, grid=Grid(step, limit),
                  first_failure=None if hi is None else hi * step)


def trial_bound(answer: int, step: int = 1) -> int:
    """Most trials a search from the first grid value makes for `answer`: 2*ceil(log2(answer/step)) + 2."""
    k = answer // step
    return 1 if k == 0 else 2 * math.ceil(math.log2(k)) + 2


def size_step(model: str, dim: str, **size) -> int:
    """Natural grid step of a size keyword: the catalog's, adjusted to an explicit head count.

    hidden_size must stay a multiple of the head count, so when `num_heads`
    is given the step is that count.
    """
    if dim not in SIZE_KEYWORDS:
        raise ValueError(f"unknown size keyword {dim!r}; valid: {', '.join(SIZE_KEYWORDS)}")
    if dim == "hidden_size" and size.get("num_heads"):
        return int(size["num_heads"])
    return catalog.size_step(resolve(model), dim)


# -- running trials -------------------------------------------------------------

def resolve_measure(measure_fn=None) -> Callable[..., Measurement]:
    """The measure function: momlab.measure.measure by default, a callable, or "module:function"."""
    if measure_fn is None:
        return importlib.import_module("momlab.measure").measure
    if isinstance(measure_fn, str):
        mod, _, name = measure_fn.partition(":")
        if not name:
            raise ValueError(f"measure_fn string must be 'module:function', got {measure_fn!r}")
        return getattr(importlib.import_module(mod), name)
    if not callable(measure_fn):
        raise ValueError(f"measure_fn must be callable or 'module:function', got {measure_fn!r}")
    return measure_fn


def _child(conn, fn, kwargs) -> None:
    try:
        result = ("ok", fn(**kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", exc)
    try:
        conn.send(result)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
        exc = result[1]
        text = "".join(traceback.format_exception(exc)) if isinstance(exc, BaseException) else repr(exc)
        conn.send(("error", RuntimeError(f"fresh-process trial failed:\n{text}")))
    finally:
        conn.close()


def measure_in_fresh_process(fn: Callable[..., Measurement], /, **kwargs) -> Measurement:
    """Call ``fn(**kwargs)`` in a new interpreter (spawn) and return its result or raise its error.

    `fn` must be importable by name (a module-level function), as spawn pickles it by reference.
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    # not daemonic: a daemonic process may not start children, and a trial on several ranks starts them;
    # the finally clause stops it instead if this process is interrupted
    proc = ctx.Process(target=_child, args=(send, fn, kwargs), daemon=False)
    proc.start()
    send.close()
    try:
        status, payload = receive.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"fresh-process trial died without an answer (exit code {proc.exitcode}); "
                           f"arguments: {kwargs}") from None
    finally:
        receive.close()
        if proc.is_alive() and proc.exitcode is None:
            proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    proc.join()
    if status == "error":
        raise payload
    return payload


def _trial_function(measure_fn, fresh_process: bool, fixed: dict, dim: str) -> Callable[[int], Measurement]:
    fn = resolve_measure(measure_fn)

    def trial(value: int) -> Measurement:
        kwargs = {**fixed, dim: value}
        return measure_in_fresh_process(fn, **kwargs) if fresh_process else fn(**kwargs)

    return trial


def _resolve(model, measure_fn):
    """A transformers config or a user's module, resolved once for every trial (catalog names stay names;
    with a `measure_fn` of its own, names are that function's business)."""
    if isinstance(model, str) and measure_fn is not None:
        return model
    return resolve(model)


def _ranks(ranks: int, parallel: str) -> dict:
    """The rank settings a trial passes on: none for plain training (so any `measure_fn` takes them)."""
    return {} if ranks == 1 and parallel == "none" else dict(ranks=ranks, parallel=parallel)


def _check_budget(budget, device) -> None:
    if budget is None and str(device).split(":")[0] == "cpu":
        raise ValueError("a search on cpu needs a budget (the emulated device has no capacity of its own), "
                         "e.g. budget='2GiB'")


def max_batch_size(model: str, mom: str = "exact", *, budget, device: str = "cpu", precision: str = "fp32",
                   step: int = 1, start: int | None = None, limit: int | None = None, steps: int = 1,
                   warmup: int = 1, seed: int = 0, fresh_process: bool = False, measure_fn=None,
                   ranks: int = 1, parallel: str = "none", attention: str | None = None, setup: str = "default",
                   **size) -> Search:
    """Largest batch size (a multiple of `step`) whose training step fits `budget` on `device`.

    `model`: a catalog name, a transformers config or a `momlab.UserModel`
    (with `fresh_process`, it must pickle: a module defined in a notebook does not).

    `budget` is passed to every trial's `measure` (bytes or "2GiB"; on cuda
    None means the whole device). `size` keywords fix the model size.
    `measure_fn` replaces `momlab.measure.measure` (tests, caching).
    `ranks` and `parallel` run every trial on that many ranks (`measure`'s);
    the batch is then per rank and `budget` per rank. `attention` and `setup`
    pick the software stack of every trial (`momlab.workload.stack`).

    >>> s = max_batch_size("bert-base", "ckpt", budget="64MiB", **tiny("bert-base"))  # doctest: +SKIP
    >>> s.best.fits, s.failure.fits, s.first_failure == s.value + 1  # doctest: +SKIP
    (True, False, True)
    """
    _check_budget(budget, device)
    model, mom = _resolve(model, measure_fn), parse_mom(mom)  # parsed once: every trial takes them as they are
    if "batch_size" in size:
        raise ValueError("max_batch_size searches batch_size; do not pass it")
    fixed = dict(model=model, mom=mom, device=device, budget=budget, precision=precision, steps=steps,
                 warmup=warmup, seed=seed, **_ranks(ranks, parallel), **stack_settings(attention, setup), **size)
    s = find_max(_trial_function(measure_fn, fresh_process, fixed, "batch_size"), step=step, start=start,
                 limit=limit, dim="batch_size")
    s.config = fixed
    return s


def max_model_size(model: str, mom: str = "exact", *, dim: str, batch_size: int, budget, device: str = "cpu",
                   precision: str = "fp32", step: int | None = None, start: int | None = None,
                   limit: int | None = None, steps: int = 1, warmup: int = 1, seed: int = 0,
                   fresh_process: bool = False, measure_fn=None, ranks: int = 1, parallel: str = "none",
                   attention: str | None = None, setup: str = "default", **size) -> Search:
    """Largest value of size keyword `dim` (on its natural grid) that fits at `batch_size`.

    The grid step defaults to `size_step(model, dim, **size)` (e.g. the head
    count for hidden_size); other size keywords stay as given or default.
    `ranks`, `parallel`, `attention` and `setup` as in `max_batch_size`.

    >>> s = max_model_size("bert-base", dim="num_layers", batch_size=24, budget="16GiB")  # doctest: +SKIP
    """
    if dim not in SIZE_KEYWORDS:
        raise ValueError(f"unknown size keyword dim={dim!r}; valid: {', '.join(SIZE_KEYWORDS)}")
    if dim in size:
        raise ValueError(f"max_model_size searches {dim}; do not also pass {dim}={size[dim]!r}")
    _check_budget(budget, device)
    model, mom = _resolve(model, measure_fn), parse_mom(mom)  # parsed once: every trial takes them as they are
    step = size_step(model, dim, **size) if step is None else step
    fixed = dict(model=model, mom=mom, batch_size=batch_size, device=device, budget=budget, precision=precision,
                 steps=steps, warmup=warmup, seed=seed, **_ranks(ranks, parallel), **stack_settings(attention, setup),
                 **size)
    s = find_max(_trial_function(measure_fn, fresh_process, fixed, dim), step=step, start=start, limit=limit,
                 dim=dim)
    s.config = fixed
    return s
