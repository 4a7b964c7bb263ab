"""`make gpu-check`: one command that proves (or disproves) every CUDA path on a GPU machine as it comes.

A GPU may be lent for minutes, so the check is one prepared run whose output
settles every question, cheapest phase first, each phase time-boxed, every
result written the moment it exists (a timeout or a kill loses only the
phase in flight). It needs only what such a machine has: torch, transformers,
pandas, pyyaml (no papermill, no jupyter, no network).

Phases (``--dry-run --device cpu`` runs the same phases at tiny sizes, so the
script itself is tested on every `make test`):

1. environment: versions, device, allocator facts (context outside the
   allocator, configuration, the host time to reserve a segment on an
   empty cache and to take one from it), an indexed device accepted by
   the cap; the context of a fresh process that has loaded cuBLAS and
   cuDNN, with kernels loaded lazily (today's default) and eagerly (the
   paper's 2022 stack, before lazy loading: what
   `estimate.PAPER_CONTEXT_BYTES` assumes).
2. tiny: every MOM (and the paper's combinations) on tiny models under a
   1 GiB budget in fp32/fp16/bf16: fits, allocated and reserved peaks at
   most the budget, device memory back to its baseline after each,
   quantization compiled.
3. bert-large fp16 at batch 32 under 16 GiB with every MOM: the breakdown,
   the three peaks, host memory, step time, and what the timed steps asked
   of the driver (``options["cuda_allocator_events"]``: segments reserved
   and released, allocations retried after a cache release, per step).
4. OOM and leaks: a batch that must not fit comes back ``fits=False``; the
   first measurement of phase 3 repeated gives the same memory, to the byte.
5. ckpt-auto at a batch exact cannot fit: it fits, peak within the budget.
6. ddp and fsdp on one rank (nccl on CUDA).
7. estimate against measure for phase 3's configurations: error per field, and
   the replayed caching allocator's reserved peak against the measured one.
8. the paper's vision script's first step: resnet50 fp32 in the paper's
   setup, exact and swap at two batch sizes each, with cuDNN's algorithm
   search off and on (``torch.backends.cudnn.benchmark``; GACT-ICML
   benchmark/vision/train.py turns it on and records memory in its first
   step, where the search allocates workspaces through the caching
   allocator): the first step's peak (CUDA only) and measure's (after a
   warm-up: the chosen algorithms' workspaces) against the predicted one,
   and the per-sample slopes (the paper's ResNet swap rows peak ~3 MB a
   sample over the prediction; docs/LOG.md 2026-12-06 22:57).
9. the paper's stack on this GPU: bert-large, gpt3-small and swin-large in
   the paper's setup (``setup="paper"``: eager attention, torch 1.10's
   softmax keeping its input, BERT's fp32 mask, fairseq's half model, Swin's
   DDP buckets, GACT's quantizer), a few MOMs at two batch sizes each,
   measured against the estimate of the same configuration: peak and
   activation per point, per-sample slopes beside the paper's V100 slopes.
   It separates what momlab's trace of that stack gets wrong on CUDA from
   what the paper's 2022 software did differently (issue 13's misses).
10. the paper's headline S1 sweep (bert-large fp16, 16 GiB, exact, quant4,
   ckpt, ckpt-auto, cheapest first) into a results store notebooks 02 and
   04 read.

Output (at most 8 files in the folder given): ``env.json``,
``invariants.jsonl`` (one line per invariant: phase, name, ok, values),
``measurements.jsonl`` (every Measurement, with its phase), ``estimates.csv``,
``summary.md``, and the sweep's store ``s1.jsonl`` with ``s1.search.jsonl``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20

# the paper's combinations beside the atomic MOMs
COMBINATIONS = ("quant4+ckpt", "quant4+swap", "swap+ckpt", "quant4+ckpt-auto")


def _error_text(exc: BaseException) -> str:
    """An exception as evidence: its type and the first line of its message (at most 200 characters)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


class _Deadline(BaseException):
    """The phase's (or the whole check's) time is up; BaseException so no `except Exception` swallows it."""


@dataclass
class Plan:
    """The sizes of each phase: the GPU's, or tiny ones for `--dry-run`."""

    device: str
    tiny_models: tuple
    precisions: tuple
    tiny_budget: int
    big: dict  # model, size, precision, batch, budget of phases 3-5 and 8
    oom_batch: int
    auto_batch: int
    s1_moms: tuple
    s1_step: int
    s1_steps: int
    phase_s: dict = field(default_factory=dict)  # seconds each phase may take
    # phase 8: model, size, precision, and per MOM the two batch sizes of its first steps (every MOM its own
    # sizes: cuDNN searches a convolution's algorithms once per shape and process)
    vision: dict = field(default_factory=dict)
    # phase 9: per model (its precision, size, and per MOM the two batch sizes measured and estimated)
    paper: dict = field(default_factory=dict)


def plan(device: str, dry_run: bool) -> Plan:
    if dry_run:
        from momlab import catalog

        size = catalog.tiny("bert-base")
        return Plan(device, ("bert-base",), ("fp32",), GiB,
                    {"model": "bert-base", "size": size, "precision": "fp32", "batch_size": 4,
                     "budget": 48 * MiB}, oom_batch=4096, auto_batch=64,
                    s1_moms=("exact", "quant4", "ckpt", "ckpt-auto"), s1_step=16, s1_steps=1,
                    # the S1 sweep takes ~100 s of a quiet 2-core machine: room for a loaded one
                    phase_s={**dict.fromkeys(range(1, 10), 120.0), 10: 300.0},
                    vision={"model": "resnet50", "size": catalog.tiny("resnet50"), "precision": "fp32",
                            "batches": {"exact": (2, 4), "swap": (3, 5)}},
                    paper={"bert-large": ("fp16", catalog.tiny("bert-large"), {"exact": (2, 4), "quant4": (2, 4)}),
                           "gpt3-small": ("fp16", catalog.tiny("gpt3-small"), {"exact": (2, 4)}),
                           "swin-large": ("fp16", catalog.tiny("swin-large"), {"exact": (2, 4), "ckpt": (2, 4)})})
    return Plan(device, ("bert-base", "gpt2", "resnet50"), ("fp32", "fp16", "bf16"), GiB,
                {"model": "bert-large", "size": {"seq_len": 128}, "precision": "fp16", "batch_size": 32,
                 "budget": 16 * GiB}, oom_batch=4096, auto_batch=256,
                s1_moms=("exact", "quant4", "ckpt", "ckpt-auto"), s1_step=4, s1_steps=3,
                # seconds per phase; the S1 sweep gets what is left (its store resumes on a rerun)
                phase_s={1: 20 + 2 * CONTEXT_PROBE_S, 2: 100, 3: 70, 4: 30, 5: 45, 6: 40, 7: 45, 8: 60, 9: 60},
                vision={"model": "resnet50", "size": {}, "precision": "fp32",
                        "batches": {"exact": (16, 32), "swap": (24, 40)}},
                # the paper's sizes (catalog defaults); small batches: the slope needs two points, not a full card
                paper={"bert-large": ("fp16", {}, {"exact": (4, 8), "ckpt": (8, 16), "quant4": (4, 8)}),
                       "gpt3-small": ("fp16", {}, {"exact": (1, 2)}),
                       "swin-large": ("fp16", {}, {"exact": (2, 4), "ckpt": (4, 8)})})


def all_moms() -> list[str]:
    import momlab

    return list(momlab.moms()) + list(COMBINATIONS)


class Evidence:
    """The output folder: every line appended and flushed at once, the summary rewritten per phase."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.counts = {"pass": 0, "fail": 0}
        self.failures: list[str] = []
        self.phases: list[tuple[str, str, float]] = []
        for name in ("invariants.jsonl", "measurements.jsonl"):
            (self.out / name).write_text("")

    def _append(self, name: str, obj: dict) -> None:
        with open(self.out / name, "a") as f:
            f.write(json.dumps(obj, allow_nan=True, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def check(self, phase: str, name: str, ok: bool, **values) -> bool:
        ok = bool(ok)
        self.counts["pass" if ok else "fail"] += 1
        if not ok:
            self.failures.append(f"{phase}: {name} {values}")
        self._append("invariants.jsonl", {"phase": phase, "name": name, "ok": ok, "values": values})
        return ok

    def measurement(self, phase: str, m) -> None:
        self._append("measurements.jsonl", {"phase": phase, **m.to_dict()})

    def write(self, name: str, obj) -> None:
        (self.out / name).write_text(json.dumps(obj, indent=2, allow_nan=True, default=str) + "\n")

    def summary(self, header: dict, tables: list[str]) -> None:
        lines = [f"# gpu-check on {header.get('device_name')} ({header.get('date')})", "",
                 f"torch {header.get('torch')}, transformers {header.get('transformers')}, "
                 f"commit {header.get('commit')}; mode: {header.get('mode')}", "",
                 f"invariants: {self.counts['pass']} passed, {self.counts['fail']} failed", "",
                 "| phase | status | seconds |", "|---|---|---|"]
        lines += [f"| {p} | {s} | {t:.1f} |" for p, s, t in self.phases]
        if self.failures:
            lines += ["", "## Failed invariants", ""] + [f"- {f}" for f in self.failures[:60]]
        lines += ["", *tables]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")


@dataclass
class Check:
    """State shared by the phases."""

    plan: Plan
    ev: Evidence
    deadline: float
    header: dict = field(default_factory=dict)
    tables: list = field(default_factory=list)
    big: dict = field(default_factory=dict)  # phase 3's measurements by MOM

    # -- device helpers (the check itself reads the allocator to judge measure) --
    @property
    def cuda(self) -> bool:
        return self.plan.device.startswith("cuda")

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated() if self.cuda else 0

    @property
    def gpu(self) -> str:
        """The catalog name estimates target for this device (`cpu` on a dry run)."""
        import torch

        from momlab import gpus

        return gpus.for_device_name(torch.cuda.get_device_name()) if self.cuda else "cpu"

    def table(self, head: str, lines) -> None:
        """Put (or replace) the summary table that starts with `head`: a phase rewrites its table as rows come."""
        self.tables[:] = [t for t in self.tables if not t.startswith(head)] + ["\n".join([head, *lines])]

    def estimate(self, phase: str, label: str, model: str, mom: str, **kw):
        """momlab's estimate for this device, or None where it cannot be made (then a failed invariant saying why:
        a row of evidence, not the end of the phase)."""
        from momlab.estimate import estimate

        try:
            return estimate(model, mom, gpu=self.gpu, **kw)
        except Exception as exc:  # noqa: BLE001
            self.ev.check(phase, f"{label} estimated", False, error=_error_text(exc))
            return None

    def measure(self, phase: str, model: str, mom: str, tags: dict | None = None, **kw):
        """momlab.measure on the check's device, recorded with `tags` added to its options."""
        import momlab

        m = momlab.measure(model, mom, device=self.plan.device, **kw)
        m.options.update(tags or {})
        self.ev.measurement(phase, m)
        return m


def _phase_env(c: Check) -> None:
    import torch

    from momlab import device as dev
    from momlab.provenance import environment

    env = environment(c.plan.device)
    env["mode"] = c.header.get("mode")
    facts = {"allocator_conf": dev.allocator_conf(), "host_limit_bytes": dev.host_limit()}
    if c.cuda:
        d = dev.check_device(c.plan.device)
        c.ev.check("env", "device normalized with an index", d.index is not None, device=str(d))
        free, total = torch.cuda.mem_get_info(d)
        facts.update(total_memory=dev.total_memory(d), mem_get_info_free=free, mem_get_info_total=total,
                     outside_allocator=dev.outside_allocator(d), capability=list(torch.cuda.get_device_capability(d)),
                     host_memory_stats_available=bool(dev.host_memory_stats()))
        try:  # the first defect a budgeted CUDA run hit: the cap took no index-less device
            torch.cuda.set_per_process_memory_fraction(1.0, d)
            ok, err = True, None
        except Exception as e:  # noqa: BLE001
            ok, err = False, repr(e)
        c.ev.check("env", "set_per_process_memory_fraction accepts the device", ok, error=err)
        try:  # a fact, not an invariant: its failure must not cost env.json
            facts["segment_reserve_s"] = _segment_reserve_s(d)
        except Exception as e:  # noqa: BLE001
            facts["segment_reserve_s"] = {"error": repr(e)}
        facts["context_by_module_loading"] = ctx = _contexts(d)
        c.table("## Phase 1: the CUDA context of a fresh process (cuBLAS and cuDNN loaded)",
                ["| CUDA_MODULE_LOADING | context MiB | seconds to load | note |", "|---|---|---|---|"]
                + [f"| {mode} | {r['context_bytes'] / MiB:.0f} | {r['load_s']:.1f} | |" if "error" not in r
                   else f"| {mode} | | | {r['error']} |" for mode, r in ctx.items()])
    env["facts"] = facts
    c.header.update(env)
    c.ev.write("env.json", env)


def _segment_reserve_s(d, n: int = 16) -> dict:
    """Host seconds to reserve one caching-allocator segment on an empty cache (a ``cudaMalloc``) and to take the
    same block from the cache, per size: what a training loop that empties the cache every step (the paper's
    Swin main.py, docs/LOG.md 2026-12-06 23:00) pays for each segment it reserves again."""
    import torch

    from momlab.device import empty_cache

    out = {}
    for mib in (20, 200):
        times = {}
        for fresh in (True, False):
            blocks = []
            if fresh:
                empty_cache(d)
            torch.cuda.synchronize(d)
            t0 = time.perf_counter()
            for _ in range(n):
                blocks.append(torch.empty(mib * MiB, dtype=torch.uint8, device=d))
            torch.cuda.synchronize(d)
            times["reserve" if fresh else "cached"] = (time.perf_counter() - t0) / n
            del blocks
        out[f"{mib}MiB"] = times
    empty_cache(d)
    return out


# module loading modes of CUDA (``CUDA_MODULE_LOADING``): LAZY loads a kernel when first launched (the
# default from CUDA 11.7 and PyTorch 1.13), EAGER every kernel image of a library when it loads (the paper's stack)
MODULE_LOADING = ("LAZY", "EAGER")
CONTEXT_PROBE_S = 40.0  # the longest a context probe's process may take (it imports torch and loads two libraries)


def _contexts(d) -> dict:
    """The device bytes a fresh process holds outside its caching allocator once it has run a cuBLAS matmul and a
    cuDNN convolution, per `MODULE_LOADING` mode, each in a process of its own (the mode is read when CUDA starts).
    `estimate.CudaOverheads` takes the paper's context from a maintainer's ">1000MB" for eager loading: this
    measures eager against lazy on the machine at hand (another GPU and CUDA than the paper's V100 with CUDA
    11.x, so an order of size and a ratio, not the V100's figure). A probe that fails gives its error."""
    import torch

    from momlab.device import empty_cache

    empty_cache(d)
    free, total = torch.cuda.mem_get_info(d)
    return {mode: _context_probe(d.index, mode, total - free) for mode in MODULE_LOADING}


def _context_probe(index: int, mode: str, used_before: int) -> dict:
    """One probe process (`_context_child`) with ``CUDA_MODULE_LOADING=mode``: its JSON line, or an error."""
    env = {**os.environ, "CUDA_MODULE_LOADING": mode}
    cmd = [sys.executable, "-c", "from momlab.gpucheck import _context_child; _context_child()", str(index),
           str(used_before)]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CONTEXT_PROBE_S,
                           cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer in {CONTEXT_PROBE_S:.0f} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


def _context_child() -> None:
    """A context probe's process: argv ``index used_before`` (the device bytes in use before it started, by
    the check's own process). Prints one JSON line: the mode it ran under, the seconds from importing torch to
    the two libraries loaded, and ``context_bytes`` = the device's used bytes less `used_before` less this
    process's reserved bytes (the check's process waits meanwhile, so its use stays as it was)."""
    t0 = time.perf_counter()
    import torch

    out = {"module_loading": os.environ.get("CUDA_MODULE_LOADING")}
    if not torch.cuda.is_available():
        print(json.dumps({**out, "error": "no CUDA device"}))
        return
    index, used_before = int(sys.argv[1]), int(sys.argv[2])
    d = torch.device("cuda", index)
    x = torch.ones(64, 64, device=d)
    y = (x @ x).sum() + torch.nn.functional.conv2d(torch.ones(1, 3, 16, 16, device=d),
                                                   torch.ones(4, 3, 3, 3, device=d)).sum()
    y.item()
    torch.cuda.synchronize(d)
    free, total = torch.cuda.mem_get_info(d)
    reserved = torch.cuda.memory_reserved(d)
    print(json.dumps({**out, "load_s": time.perf_counter() - t0, "context_bytes": total - free - used_before - reserved,
                      "reserved_bytes": reserved, "cudnn": torch.backends.cudnn.version()}))


def _judge_fit(c: Check, phase: str, label: str, m, budget: int, baseline: int) -> None:
    c.ev.check(phase, f"{label} fits", m.fits, error=m.error)
    if not m.fits:
        return
    c.ev.check(phase, f"{label} allocated peak <= budget", m.peak_bytes <= budget, peak=m.peak_bytes, budget=budget)
    if m.reserved_peak_bytes is not None:
        c.ev.check(phase, f"{label} reserved peak <= budget", m.reserved_peak_bytes <= budget,
                   reserved=m.reserved_peak_bytes, budget=budget)
    after = c.allocated()
    c.ev.check(phase, f"{label} memory back to baseline", after <= baseline, before=baseline, after=after)
    if "quant" in m.mom and c.cuda:
        state = (m.options.get("quant_compile") or {}).get("cuda", {})
        c.ev.check(phase, f"{label} quantization compiled",
                   state.get("encode") == "compiled" and state.get("decode") == "compiled", state=state)


def _phase_tiny(c: Check) -> None:
    from momlab import catalog

    for precision in c.plan.precisions:  # fp32 first: if time runs out, the plainest cases are done
        for model in c.plan.tiny_models:
            for mom in all_moms():
                baseline = c.allocated()
                m = c.measure("tiny", model, mom, batch_size=4, budget=c.plan.tiny_budget, precision=precision,
                              steps=2, **catalog.tiny(model))
                _judge_fit(c, "tiny", f"{model} {precision} {mom}", m, c.plan.tiny_budget, baseline)


def _big_kw(c: Check, **over) -> dict:
    b = {**c.plan.big, **over}
    return dict(batch_size=b["batch_size"], budget=b["budget"], precision=b["precision"], steps=3, **b["size"])


def _phase_big(c: Check) -> None:
    b = c.plan.big
    rows = ["## Phase 3: " + f"{b['model']} {b['precision']} batch {b['batch_size']}, budget {b['budget'] / GiB:.2f} GiB",
            "", "| MOM | fits | peak MiB | reserved MiB | params | grads | optim | activ | workspace | host MiB | "
            "step s | samples/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mom in ("exact", "ckpt", "ckpt-selective", "ckpt-auto", "swap", "quant8", "quant4", "quant2",
                *COMBINATIONS):
        baseline = c.allocated()
        m = c.measure("big", b["model"], mom, **_big_kw(c))
        c.big[mom] = m
        _judge_fit(c, "big", f"{b['model']} {mom}", m, b["budget"], baseline)
        mib = [x / MiB if isinstance(x, int) else math.nan for x in
               (m.peak_bytes, m.reserved_peak_bytes, m.params_bytes, m.grads_bytes, m.optimizer_bytes,
                m.activation_bytes, m.workspace_bytes, m.host_bytes)]
        rows.append(f"| {mom} | {m.fits} | " + " | ".join(f"{v:.0f}" for v in mib)
                    + f" | {m.step_time_s:.4f} | {m.throughput:.1f} |")
        c.table(rows[0], rows[1:])
    if "swap" in c.big and c.big["swap"].fits:
        c.ev.check("big", "swap keeps its activations on the host", c.big["swap"].host_bytes > 0,
                   host=c.big["swap"].host_bytes)


def _phase_oom(c: Check) -> None:
    b = c.plan.big
    baseline = c.allocated()
    m = c.measure("oom", b["model"], "exact", **_big_kw(c, batch_size=c.plan.oom_batch))
    c.ev.check("oom", "a batch that cannot fit is fits=False, not a crash", not m.fits, error=m.error,
               where=m.options.get("oom"))
    after = c.allocated()
    c.ev.check("oom", "memory back to baseline after the OOM", after <= baseline, before=baseline, after=after)
    first = c.big.get("exact")
    if first is None or not first.fits:
        c.ev.check("oom", "phase 3's exact measurement exists to repeat", False)
        return
    again = c.measure("oom", b["model"], "exact", **_big_kw(c))
    fields = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "workspace_bytes")
    diff = {f: (getattr(first, f), getattr(again, f)) for f in fields if getattr(first, f) != getattr(again, f)}
    c.ev.check("oom", "the measurement after an OOM repeats the one before, to the byte", not diff, differences=diff)


def _phase_auto(c: Check) -> None:
    b = c.plan.big
    exact = c.measure("ckpt-auto", b["model"], "exact", **_big_kw(c, batch_size=c.plan.auto_batch))
    c.ev.check("ckpt-auto", f"exact does not fit at batch {c.plan.auto_batch}", not exact.fits,
               peak=exact.peak_bytes)
    baseline = c.allocated()
    m = c.measure("ckpt-auto", b["model"], "ckpt-auto", **_big_kw(c, batch_size=c.plan.auto_batch))
    _judge_fit(c, "ckpt-auto", f"ckpt-auto batch {c.plan.auto_batch}", m, b["budget"], baseline)
    plan = m.options.get("ckpt_plan", {})
    c.ev.check("ckpt-auto", "the plan checkpoints some blocks, not necessarily all",
               bool(plan.get("checkpointed")), checkpointed=plan.get("checkpointed"), blocks=plan.get("blocks"),
               trials=plan.get("trials"))


def _phase_ranks(c: Check) -> None:
    from momlab import catalog
    from momlab.distributed import measure_distributed

    for parallel in ("ddp", "fsdp"):
        m = measure_distributed("bert-base", "exact", ranks=1, parallel=parallel, batch_size=4,
                                device=c.plan.device, steps=2, **catalog.tiny("bert-base"))
        c.ev.measurement("ranks", m)
        c.ev.check("ranks", f"{parallel} on one rank fits", m.fits, error=m.error, backend=m.options.get("backend"))
        if c.cuda:
            c.ev.check("ranks", f"{parallel} ran on nccl", m.options.get("backend") == "nccl",
                       backend=m.options.get("backend"))


def _phase_estimate(c: Check) -> None:
    from momlab.estimate import estimate

    gpu = c.gpu
    fields = ("peak_bytes", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
              "workspace_bytes", "step_time_s")
    path = c.ev.out / "estimates.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "mom", "batch_size", "precision", "gpu", "field", "measured", "estimated",
                    "error_rel", "note"])
        for mom, m in c.big.items():
            if not m.fits:
                continue
            try:
                e = estimate(m.model, mom, batch_size=m.batch_size, gpu=gpu, precision=m.precision,
                             budget=m.budget, **m.size)
            except Exception as exc:  # noqa: BLE001 - an estimate that cannot be made is a row, not a stop
                w.writerow([m.model, mom, m.batch_size, m.precision, gpu, "", "", "", "",
                            f"error: {_error_text(exc)}"])
                continue
            pairs = [(name, getattr(m, name), getattr(e, name), "") for name in fields]
            if c.cuda and m.reserved_peak_bytes:
                # the caching allocator replayed on a traced fresh process (momlab.allocator) vs what it reserved
                try:
                    ec = estimate(m.model, mom, batch_size=m.batch_size, gpu=gpu, precision=m.precision,
                                  budget=m.budget, allocator="caching", **m.size)
                    pairs.append(("reserved_peak_bytes", m.reserved_peak_bytes, ec.reserved_bytes,
                                  f"replay fits={ec.fits}"))
                except Exception as exc:  # noqa: BLE001
                    pairs.append(("reserved_peak_bytes", m.reserved_peak_bytes, math.nan,
                                  f"error: {_error_text(exc)}"))
            for name, want, got, note in pairs:
                err = (got - want) / want if want else math.nan
                w.writerow([m.model, mom, m.batch_size, m.precision, gpu, name, want, got, f"{err:.4f}", note])
            f.flush()
    c.ev.check("estimate", "estimates written", path.stat().st_size > 0, gpu=gpu)


def _first_step_peak(v: dict, mom: str, batch: int) -> int:
    """The first step's peak allocated bytes on CUDA, the model's and its batch's included (a fresh workload:
    cuDNN's search, when on, runs in it; what measure's probe step, after its warm-up, never sees)."""
    import torch

    from momlab.device import empty_cache
    from momlab.workload import build

    cuda = torch.device("cuda")
    empty_cache(cuda)
    baseline = torch.cuda.memory_allocated()
    w = build(v["model"], batch_size=batch, mom=mom, device="cuda", precision=v["precision"], setup="paper",
              **v["size"])
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        w.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline
    finally:
        del w
        empty_cache(cuda)


def _phase_vision(c: Check) -> None:
    import torch

    v = c.plan.vision
    head = (f"## Phase 8: {v['model']} {v['precision']}, the paper's setup, cuDNN's algorithm search off and on: "
            "the first step's peak (CUDA only) and the measured one after a warm-up, against the prediction")
    rows = ["", "| MOM | batch | cudnn.benchmark | first step MiB | peak MiB | reserved MiB | predicted MiB | error |",
            "|---|---|---|---|---|---|---|---|"]
    points: dict = {}

    before = torch.backends.cudnn.benchmark
    try:
        for search in (False, True):  # off first: with it on, cuDNN keeps what it found for each shape
            torch.backends.cudnn.benchmark = search
            for mom, batches in v["batches"].items():
                for b in batches:
                    # a fresh workload's first step has the search (each MOM its own sizes: once a shape)
                    first = _first_step_peak(v, mom, b) if c.cuda else None
                    m = c.measure("vision", v["model"], mom, {"cudnn_benchmark": search}, batch_size=b,
                                  precision=v["precision"], setup="paper", steps=1, **v["size"])
                    if not c.ev.check("vision", f"{mom} batch {b} cudnn.benchmark={search} fits", m.fits,
                                      error=m.error, first_step_peak=first):
                        continue
                    e = c.estimate("vision", f"{mom} batch {b}", v["model"], mom, batch_size=b,
                                   precision=v["precision"], setup="paper", **v["size"])
                    pred = math.nan if e is None else e.peak_bytes
                    points[(mom, search, b)] = (first, m.peak_bytes, pred)
                    rows.append(f"| {mom} | {b} | {search} | {first / MiB if first else math.nan:.0f} | "
                                f"{m.peak_bytes / MiB:.0f} | {(m.reserved_peak_bytes or 0) / MiB:.0f} | "
                                f"{pred / MiB:.0f} | {pred / m.peak_bytes - 1:+.3f} |")
                    c.table(head, rows)
    finally:
        torch.backends.cudnn.benchmark = before
    slopes = ["", "| MOM | cudnn.benchmark | first step MiB a sample | measured MiB a sample | "
              "predicted MiB a sample |", "|---|---|---|---|---|"]
    for mom, (lo, hi) in v["batches"].items():
        for search in (False, True):
            if (mom, search, lo) in points and (mom, search, hi) in points:
                d = (hi - lo) * MiB
                (f0, m0, p0), (f1, m1, p1) = points[(mom, search, lo)], points[(mom, search, hi)]
                first = (f1 - f0) / d if f0 is not None and f1 is not None else math.nan
                slopes.append(f"| {mom} | {search} | {first:.2f} | {(m1 - m0) / d:.2f} | {(p1 - p0) / d:.2f} |")
    c.table(head, rows + slopes)
    c.ev.check("vision", "cudnn.benchmark as it was before the phase", torch.backends.cudnn.benchmark == before)


def _phase_paper(c: Check) -> None:
    """The paper's stack measured on this device against its trace: what momlab's emulation of the 2022 software
    keeps on real kernels, point by point and per sample, beside the paper's own V100 slopes."""
    from momlab import reference

    head = ("## Phase 9: the paper's stack (setup=\"paper\") measured on this device against its estimate, "
            "and the per-sample slopes beside the paper's V100 ones")
    rows = ["", "| model | MOM | batch | peak MiB | predicted | error | activation MiB | predicted | error |",
            "|---|---|---|---|---|---|---|---|---|"]
    slopes = ["", "| model | MOM | measured MiB a sample | predicted | the paper's (V100) |", "|---|---|---|---|---|"]

    def err(pred, got):
        return pred / got - 1 if got else math.nan

    for model, (precision, size, moms) in c.plan.paper.items():
        try:  # the paper's memory sweep of this model, where it ran one (MiB a sample of its peak)
            paper = reference.paper_memory_per_sample(model).set_index("mom")["bytes_per_sample"] / MiB
        except ValueError:
            paper = {}
        for mom, batches in moms.items():
            points = {}
            for b in batches:
                m = c.measure("paper", model, mom, batch_size=b, precision=precision, setup="paper", steps=1, **size)
                if not c.ev.check("paper", f"{model} {mom} batch {b} fits", m.fits, error=m.error):
                    continue
                e = c.estimate("paper", f"{model} {mom} batch {b}", model, mom, batch_size=b, precision=precision,
                               setup="paper", **size)
                pred = (math.nan, math.nan) if e is None else (e.peak_bytes, e.activation_bytes)
                got = (m.peak_bytes, m.activation_bytes)
                points[b] = (got, pred)
                if not c.cuda:  # a CPU step is what its trace is, to the byte; on a GPU the table is the evidence
                    c.ev.check("paper", f"{model} {mom} batch {b}: the trace is the measurement", got == pred,
                               measured=got, estimated=pred)
                rows.append(f"| {model} | {mom} | {b} | {got[0] / MiB:.0f} | {pred[0] / MiB:.0f} | "
                            f"{err(pred[0], got[0]):+.3f} | {got[1] / MiB:.0f} | {pred[1] / MiB:.0f} | "
                            f"{err(pred[1], got[1]):+.3f} |")
                c.table(head, rows + slopes)
            if len(points) == 2:
                (lo, (g0, p0)), (hi, (g1, p1)) = sorted(points.items())
                d = hi - lo
                v100 = paper.get(mom, math.nan) if not size else math.nan  # the paper ran its own sizes only
                slopes.append(f"| {model} | {mom} | {(g1[0] - g0[0]) / d / MiB:.2f} | "
                              f"{(p1[0] - p0[0]) / d / MiB:.2f} | {v100:.2f} |")
                c.table(head, rows + slopes)


def _phase_s1(c: Check) -> None:
    from momlab.sweep import sweep

    b = c.plan.big
    store = c.ev.out / "s1.jsonl"
    try:
        df = sweep([b["model"]], list(c.plan.s1_moms), batch_sizes="auto", budget=b["budget"],
                   device=c.plan.device, precision=b["precision"], size={b["model"]: dict(b["size"])},
                   steps=c.plan.s1_steps, batch_step=c.plan.s1_step, store=str(store), progress=False)
    finally:
        for lock in c.ev.out.glob("*.lock"):  # only needed while writing; the folder keeps at most 8 files
            lock.unlink()
    c.ev.check("s1", "the S1 sweep recorded points", len(df) > 0, points=len(df), store=str(store))
    if len(df):
        c.tables.append("## Phase 10: S1 sweep\n\n" + _s1_text(df))


def _s1_text(df) -> str:
    fit = df[df["fits"]] if "fits" in df else df
    rows = ["| MOM | max batch measured | max throughput | at batch |", "|---|---|---|---|"]
    for mom, g in fit.groupby("mom"):
        best = g.loc[g["throughput"].idxmax()]
        rows.append(f"| {mom} | {int(g['batch_size'].max())} | {best['throughput']:.1f} | {int(best['batch_size'])} |")
    return "\n".join(rows)


PHASES = (("1 environment", _phase_env), ("2 tiny models, every MOM", _phase_tiny),
          ("3 real size, every MOM", _phase_big), ("4 OOM and leaks", _phase_oom),
          ("5 ckpt-auto beyond exact", _phase_auto), ("6 ddp/fsdp on one rank", _phase_ranks),
          ("7 estimate vs measure", _phase_estimate), ("8 the paper's vision first step", _phase_vision),
          ("9 the paper's stack, trace vs device", _phase_paper), ("10 S1 sweep", _phase_s1))


def _alarm(signum, frame):
    raise _Deadline(f"signal {signum}")


def run(out, *, device: str = "cuda", dry_run: bool = False, time_limit_s: float = 450.0,
        phases: list[int] | None = None) -> dict:
    """Run the check into the folder `out`; returns the counts. See the module docstring."""
    start = time.monotonic()
    p = plan(device, dry_run)
    c = Check(p, Evidence(Path(out)), start + time_limit_s,
              header={"mode": ("dry-run" if dry_run else "full") + f" on {device}"})
    previous = {s: signal.signal(s, _alarm) for s in (signal.SIGTERM, signal.SIGALRM)}
    try:
        for i, (name, fn) in enumerate(PHASES, start=1):
            if phases is not None and i not in phases:
                continue
            left = c.deadline - time.monotonic()
            if left < 5:
                c.ev.phases.append((name, "skipped: out of time", 0.0))
                continue
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, max(1.0, min(p.phase_s.get(i, left), left)))
            try:
                fn(c)
                status = "done"
            except _Deadline:
                status = "stopped at its time limit"
            except Exception as exc:  # noqa: BLE001 - a broken phase is evidence; the next phase still runs
                status = f"error: {_error_text(exc)}"
                c.ev.check(name, "phase ran without an exception", False,
                           traceback="".join(traceback.format_exception(exc))[-3000:])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            c.ev.phases.append((name, status, time.monotonic() - t0))
            c.ev.summary(c.header, c.tables)
    except _Deadline:  # SIGTERM between phases
        c.ev.phases.append(("(terminated)", "stopped by a signal", 0.0))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        c.ev.summary(c.header, c.tables)
    return dict(c.ev.counts, seconds=time.monotonic() - start, out=str(c.ev.out))


def main(args) -> int:
    result = run(args.out, device=args.device, dry_run=args.dry_run, time_limit_s=args.time_limit,
                 phases=args.phases)
    print(f"gpu-check: {result['pass']} invariants passed, {result['fail']} failed in {result['seconds']:.0f} s; "
          f"evidence in {result['out']} (summary.md)")
    return 0 if result["fail"] == 0 else 1

