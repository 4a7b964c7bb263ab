"""Derive momlab/reference/paper_v100.csv from the paper's raw measurements.

Run by hand (the raw files live outside the project, in ../shared/paper/data):

    .venv/bin/python scripts/derive_reference.py [--data DIR] [--out CSV]

One output row per run: a configuration the paper's benchmark code executed
once, with its throughput or its out-of-memory. The raw files are JSON lines
(comment lines start with ``/`` or ``#``) written by four benchmark scripts
whose field names differ, plus two tab-separated Alpa/Megatron logs. What this
script decides, and why:

Units. Throughput ``ips`` is samples per second summed over all GPUs; a
negative ``ips`` marks an out-of-memory (``fits`` False, throughput NaN).
Memory fields come in two units, sometimes within one record: MiB as floats
(torch's ``memory_allocated() / 2**20``; BERT-L's ``model_size`` of 5093 MiB is
its 333.6 M parameters x 16 bytes of fp32 weights, gradients and two AdamW
moments) and bytes as integers. A value >= 1e6 is bytes (no GPU here holds
1e6 MiB), a smaller one MiB (no raw value lies between 17,000 and 1e6, so
the rule is unambiguous); stored as int bytes. Values are kept as measured,
including the negative ``activation_mem`` of GPT swap / cpu-off runs (memory
at the end of forward minus before it, which offloading drives below zero).
ResNet records have no model-related field; ``model_bytes`` is their
``total - activation`` (weights, gradients, momentum, input batch).
Every row is one V100 16 GB per GPU (the loader adds ``gpu``). DTR
(``ckpt-dtr``) runs carry their memory budget (7 to 15 GB, ``budget``) and
record no OOM: their largest batch, 200, is the largest tried.

Batch size is per GPU. The GPT data-parallel files (2/4/8 V100) are the
exception in the raw data: their successful runs (key ``alg``) record the
global batch and the peak memory summed over GPUs, while their out-of-memory
markers (key ``algorithm``) record the per-GPU batch; both are turned into per
GPU here (the global batch is divisible by the GPU count in every such
record, which is asserted). Megatron/Alpa runs are model parallel with one data
parallel replica, so their batch is the global one.

Names. ``network`` maps to momlab catalog names (bert-large-cased ->
bert-large, transformer_lm_gpt3_small -> gpt3-small, swin_large -> swin-large,
wide_resnet50_2 -> wide-resnet50-2, ...); networks momlab lacks keep their raw
name (roberta-base, transformer_lm_gpt3_large, resnet101, the Megatron
``gpt``). ``scaled_resnet_N`` is ResNet-152's block layout stretched to N
layers and ``scaled_wide_resnet_W`` ResNet-152 with ``width_per_group`` W
(scaled_wide_resnet_64 runs like resnet152: max batch 76 vs 72, 156 vs 154
img/s), so both become ``resnet152`` with ``size.num_layers`` /
``size.width_per_group``. ``algorithm`` (or ``alg``) maps to momlab MOM names:
None/exact/L0 exact, ckpt, L1 quant4, swap, L4bit-swap quant4+swap, L1_ckpt
quant4+ckpt, swap_ckpt and ckpt_swap swap+ckpt (the fp16 BERT file writes the
out-of-memory markers of its swap_ckpt sweep as ckpt_swap: its swap_ckpt runs
stop at 520, its ckpt_swap OOMs are 528 and 536), dtr ckpt-dtr; Swin records
carry ``ckpt: true`` beside the algorithm (exact + ckpt flag = ckpt) and encode
precision and MOM in one string on their OOM markers (``fp16O1-ckpt``).
Unmapped algorithms keep their raw name (cpu-off, swap-lz4, L1-part,
chen_ckpt).

Precision. GPT and ``text_classification_fp16_*`` BERT: fp16 (AMP, fp32 master
weights). ``text_classification_results_*`` (no fp16 tag) BERT: fp32, inferred:
its throughput is a third of the fp16 files' and its activations per sample
larger. ``text_classification_fp16_v100_results_mem_results_fp32.json``: the
suffix is unexplained; its exact and ckpt activations equal the fp16 file's
(1348.72 and 52.54 MiB at batch 4), so it is not fp32 training and stays fp16; its experiment is ``mem_fp32`` so
that it does not mix with the fp16 memory sweep it partly repeats. Swin: apex
``O0`` fp32, ``O1`` fp16 (autocast-like), ``O2`` fp16-O2 (fp16 model, fp32
master weights). ResNet: fp32. Megatron/Alpa: fp16, inferred from throughput
up to 45 TFLOP/s, above a V100's fp32 peak.

Sizes. ``layer_num``/``hidden_size`` become ``size.num_layers`` /
``size.hidden_size``. OOM markers often omit them; where every other record of
the file shares one value it is filled in, otherwise it stays empty (the BERT
width file's OOM markers lose their hidden size).

Deduplication. Many files are copies or subsets of others (GPT mem == speed
results; the Swin ``*_speed_results.json`` at v100/2v100/4v100/8v100 are one
file four times; ``..._4v100_results_speed_results_old.json`` is the first 155
records of the single-V100 depth study; the 8v100 BERT max-batch file is the
v100 one). A record identical to one already taken from another file is the
same run copied and is dropped. Records with a timestamp are the same run when
network, algorithm, batch and timestamp agree (a copy may rename a field:
GPT's utilization file writes ``peak_mem`` where the speed file has ``peak``, and adds the GPU's
utilization, which the kept row takes over);
records without one (OOM markers, Megatron rows) when all fields agree and
they come from files of the same benchmark and GPU count. Files are read
single-GPU first and speed sweeps before the memory and utilization files
that repeat some of their runs, so a copy keeps its single-GPU, speed-sweep
label. Repeats inside one file are separate runs and are kept.

Files left out (FILES below, ``include`` False): every ``*_archive_N`` file
(results files supersede them; the GPT 2v100 archives are byte copies of the
4v100 ones, with a different batch convention); superseded reruns (``_old``,
``_raw``); the Swin smoke test at batch 8 (precision not recorded, copied
under four GPU counts); a one-line Swin 4v100 mem file; empty files; and
``text_classification_results_tensor_size`` (tensor sizes, not runs). The
reason of each is printed.

Experiments (column ``experiment``): speed (batch sweeps, the S1 data), mem
(memory sweeps), background (breakdown at fixed batch, Figure 1),
mem_fp32 (see Precision), utilization, depth / width (S2': a batch search per
model size), max_depth / max_width (S2: model size at batch 24), max_batch (binary-search result per
depth; ``ips`` -1 there means "not timed", and a batch of 0 that no batch
fits), mem_limit (runs under an unrecorded memory cap), quantize_all,
megatron.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "paper" / "data"
DEFAULT_OUT = REPO / "momlab" / "reference" / "paper_v100.csv"

MIB = 2**20
GIB = 2**30

NETWORKS = {
    "bert-large-cased": "bert-large",
    "bert-base-cased": "bert-base",
    "transformer_lm_gpt3_small": "gpt3-small",
    "transformer_lm_gpt3_medium": "gpt3-medium",
    "swin_large": "swin-large",
    "resnet50": "resnet50",
    "wide_resnet50_2": "wide-resnet50-2",
    "resnet152": "resnet152",
}

ALGORITHMS = {
    None: "exact", "None": "exact", "exact": "exact", "L0": "exact",
    "ckpt": "ckpt",
    "L1": "quant4",
    "swap": "swap",
    "L4bit-swap": "quant4+swap",
    "L1_ckpt": "quant4+ckpt",
    "swap_ckpt": "swap+ckpt",
    "ckpt_swap": "swap+ckpt",
    "dtr": "ckpt-dtr",
}
# Swin's ckpt flag composed with its algorithm
WITH_CKPT = {"exact": "ckpt", "quant4": "quant4+ckpt", "swap": "swap+ckpt"}
SWIN_PRECISION = {"O0": "fp32", "O1": "fp16", "O2": "fp16-O2"}
SWIN_OOM = re.compile(r"^(fp32|fp16O1|fp16O2)(?:-(.+))?$")

# file -> (include, experiment or reason left out)
FILES: dict[str, tuple[bool, str]] = {
    # GPT (fp16)
    "GPT_v100_results_speed_results.json": (True, "speed"),
    "GPT_v100_results_mem_results.json":
        (False, "byte copy of GPT_v100_results_speed_results.json"),
    "GPT_v100_results_utilization.json": (True, "utilization"),
    "GPT_2v100_results_speed_results.json": (True, "speed"),
    "GPT_2v100_results_mem_results.json":
        (False, "byte copy of GPT_2v100_results_speed_results.json"),
    "GPT_4v100_results_speed_results.json": (True, "speed"),
    "GPT_4v100_results_mem_results.json":
        (False, "byte copy of GPT_4v100_results_speed_results.json"),
    "GPT_8v100_results_speed_results.json": (True, "speed"),
    "GPT_8v100_results_mem_results.json": (True, "mem"),
    # Swin-L
    "Swin-Transformer_v100_results_speed_results.json": (True, "speed"),
    "Swin-Transformer_v100_results_mem_results.json": (True, "mem"),
    "Swin-Transformer_v100_results_mem_results_background.json": (True, "background"),
    "Swin-Transformer_v100_results_utilization.json": (True, "utilization"),
    "Swin-Transformer_2v100_results_speed_results.json": (True, "speed"),
    "Swin-Transformer_4v100_results_speed_results.json": (True, "speed"),
    "Swin-Transformer_8v100_results_speed_results.json": (True, "speed"),
    "Swin-Transformer_2v100_results_old_speed_results.json":
        (False, "superseded by Swin-Transformer_2v100_results_speed_results.json"),
    "Swin-Transformer_4v100_results_speed_results_raw.json":
        (False, "superseded quant4 rerun; throughput of one GPU, not four"),
    "Swin-Transformer_4v100_results_mem_results.json": (False, "a single OOM line"),
    "Swin-Transformer_v100_speed_results.json":
        (False, "smoke test at batch 8, precision not recorded"),
    "Swin-Transformer_2v100_speed_results.json":
        (False, "byte copy of Swin-Transformer_v100_speed_results.json"),
    "Swin-Transformer_4v100_speed_results.json":
        (False, "byte copy of Swin-Transformer_v100_speed_results.json"),
    "Swin-Transformer_8v100_speed_results.json":
        (False, "byte copy of Swin-Transformer_v100_speed_results.json"),
    # ResNet (fp32)
    "resnet_v100_results_speed_results.json": (True, "speed"),
    "resnet_v100_results_mem_results.json": (True, "mem"),
    "resnet_v100_results_mem_results_background.json": (True, "background"),
    "resnet_v100_results_utilization.json": (True, "utilization"),
    "resnet_v100_speed_results.json": (True, "depth/width"),  # per network
    "resnet_v100_speed_results_depth.json": (True, "depth"),
    "resnet_v100_speed_results_width.json": (True, "width"),
    "resnet_2v100_speed_results.json": (True, "speed"),
    "resnet_4v100_speed_results.json": (True, "speed"),
    "resnet_8v100_speed_results.json": (True, "speed"),
    # BERT, fp16
    "text_classification_fp16_v100_results_speed_results.json": (True, "speed"),
    "text_classification_fp16_v100_results_speed_results_36.json": (True, "speed"),
    "text_classification_fp16_v100_results_speed_results_48.json": (True, "speed"),
    "text_classification_fp16_v100_results_mem_results.json": (True, "mem"),
    "text_classification_fp16_v100_results_mem_results_36.json": (True, "mem"),
    "text_classification_fp16_v100_results_mem_results_48.json": (True, "mem"),
    "text_classification_fp16_v100_results_mem_results_fp32.json": (True, "mem_fp32"),
    "text_classification_fp16_v100_results_mem_results_category.json": (True, "background"),
    "text_classification_fp16_v100_results_speed_results_depth.json": (True, "depth"),
    "text_classification_fp16_v100_results_speed_results_hidden_size.json": (True, "width"),
    "text_classification_fp16_v100_results_speed_results_model_size_depth.json":
        (True, "max_depth"),
    "text_classification_fp16_v100_results_speed_results_model_size_width.json":
        (True, "max_width"),
    "text_classification_fp16_v100_results_utilization.json": (True, "utilization"),
    "text_classification_fp16_v100_util_results_speed_results.json": (True, "utilization"),
    "text_classification_fp16_v100_util_results_mem_results.json": (True, "utilization"),
    "text_classification_fp16_v100_max_batch_results.json": (True, "max_batch"),
    "text_classification_fp16_8v100_max_batch_results.json":
        (False, "byte copy of text_classification_fp16_v100_max_batch_results.json"),
    "text_classification_fp16_2v100_results_speed_results.json": (True, "speed"),
    "text_classification_fp16_4v100_results_speed_results.json": (True, "speed"),
    "text_classification_fp16_4v100_results_mem_results.json": (True, "mem"),
    "text_classification_fp16_8v100_results_speed_results.json": (True, "speed"),
    "text_classification_fp16_4v100_results_speed_results_old.json":
        (False, "its records are the first 155 of the single-V100 depth study "
                "(text_classification_fp16_v100_results_speed_results_depth.json)"),
    # BERT, fp32 (older runs)
    "text_classification_results_speed_results_no_limit.json": (True, "speed"),
    "text_classification_results_speed_results.json": (True, "width"),
    "text_classification_results_mem_results.json": (True, "mem"),
    "text_classification_results_speed_results_mem_limit.json": (True, "mem_limit"),
    "text_classification_results_speed_results_quantize_all.json": (True, "quantize_all"),
    "text_classification_results_tensor_size": (False, "tensor sizes of one forward, not runs"),
    # Megatron / Alpa (tab-separated)
    "megatron_model_depth_data": (True, "megatron"),
    "megatron_model_parallel_all_data": (True, "megatron"),
}

COLUMNS = [
    "model", "mom", "batch_size", "gpus", "precision",
    "size.num_layers", "size.hidden_size", "size.width_per_group",
    "size.seq_len", "size.num_heads",
    "fits", "throughput", "step_time_s",
    "peak_bytes", "activation_bytes", "workspace_bytes", "model_bytes",
    "params_bytes", "total_bytes", "budget", "gpu_utilization",
    "experiment", "algorithm", "source",
]
INT_COLUMNS = [
    "batch_size", "gpus", "size.num_layers", "size.hidden_size",
    "size.width_per_group", "size.seq_len", "size.num_heads",
    "peak_bytes", "activation_bytes", "workspace_bytes", "model_bytes",
    "params_bytes", "total_bytes", "budget",
]
SIZE_FIELDS = {"layer_num": "size.num_layers", "hidden_size": "size.hidden_size"}
MEMORY_FIELDS = {  # raw key -> column; first present wins
    "peak_bytes": ("peak", "peak_mem"),
    "total_bytes": ("total", "total_mem"),
    "activation_bytes": ("activation", "activation_mem"),
    "workspace_bytes": ("workspace", "workspace_size"),
    "model_bytes": ("model_size",),
    "params_bytes": ("model_only", "pure_model_size"),
}


def benchmark_of(name: str) -> str:
    for prefix in ("GPT", "Swin-Transformer", "resnet", "text_classification", "megatron"):
        if name.startswith(prefix):
            return prefix
    raise ValueError(f"unknown benchmark for file {name!r}")


def gpus_of(name: str) -> int:
    m = re.search(r"_(\d*)v100_", name)
    return int(m.group(1) or 1) if m else 1


def read_json_lines(path: Path):
    """Yield (line, record); skip comments, split records glued on one line
    (the second of them is line "N#2")."""
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        s = line.strip()
        if not s or s[0] in "/#":
            continue
        for i, part in enumerate(re.split(r"(?<=\})\s*(?=\{)", s)):
            try:
                yield (f"{lineno}#{i + 1}" if i else str(lineno)), json.loads(part)
            except json.JSONDecodeError as e:
                print(f"  skip unparsable {path.name}:{lineno}: {e}", file=sys.stderr)


def to_bytes(value) -> float:
    if value is None:
        return math.nan
    v = float(value)
    return v if abs(v) >= 1e6 else v * MIB


def mom_of(record: dict, benchmark: str) -> tuple[str, str, str | None]:
    """(mom, raw algorithm label, precision from the record or None)."""
    alg = record["algorithm"] if "algorithm" in record else record.get("alg")
    precision = None
    raw = "None" if alg is None else str(alg)
    if benchmark == "Swin-Transformer":
        if "fp16" in record:
            precision = SWIN_PRECISION[record["fp16"]]
        m = SWIN_OOM.match(raw)
        if m:  # OOM marker: precision and MOM in one string
            precision = {"fp32": "fp32", "fp16O1": "fp16", "fp16O2": "fp16-O2"}[m.group(1)]
            alg = m.group(2)
            if alg == "ckpt":
                alg, ckpt = None, True
            else:
                ckpt = False
        else:
            ckpt = bool(record.get("ckpt"))
        mom = ALGORITHMS.get(alg, str(alg))
        if ckpt:
            mom = WITH_CKPT[mom]
            if not m:
                raw += "|ckpt"
        return mom, raw, precision
    return ALGORITHMS.get(alg, str(alg)), raw, precision


def default_precision(benchmark: str, name: str) -> str:
    if benchmark == "GPT":
        return "fp16"
    if benchmark == "resnet":
        return "fp32"
    if benchmark == "text_classification":
        return "fp16" if name.startswith("text_classification_fp16") else "fp32"
    if benchmark == "megatron":
        return "fp16"
    raise ValueError(f"{name}: Swin records must carry their precision")


def model_of(network: str) -> tuple[str, dict]:
    m = re.fullmatch(r"scaled_resnet_(\d+)", network)
    if m:
        return "resnet152", {"size.num_layers": int(m.group(1))}
    m = re.fullmatch(r"scaled_wide_resnet_(\d+)", network)
    if m:
        return "resnet152", {"size.width_per_group": int(m.group(1))}
    return NETWORKS.get(network, network), {}


def rows_from_json(path: Path, experiment: str) -> list[tuple[dict, dict]]:
    name = path.name
    benchmark = benchmark_of(name)
    gpus = gpus_of(name)
    out = []
    for lineno, rec in read_json_lines(path):
        if "network" not in rec:
            raise ValueError(f"{name}:{lineno}: record without network: {rec}")
        mom, raw_alg, precision = mom_of(rec, benchmark)
        model, size = model_of(rec["network"])
        exp = experiment
        if experiment == "depth/width":
            exp = "width" if "size.width_per_group" in size else "depth"
        ips = rec.get("ips")
        if exp == "max_batch":
            # a binary search's answer (0: no batch fits); ips -1 means not timed
            batch = rec["max_batch_size"]
            fits = batch > 0
        else:
            batch = rec["batch_size"]
            fits = not (ips is not None and ips < 0)
        throughput = float(ips) if fits and ips is not None and ips > 0 else math.nan
        mem = {col: math.nan for col in MEMORY_FIELDS}
        for col, keys in MEMORY_FIELDS.items():
            for k in keys:
                if rec.get(k) is not None:
                    mem[col] = to_bytes(rec[k])
                    break
        if benchmark == "GPT" and gpus > 1 and "alg" in rec:
            # successful GPT data-parallel runs: global batch, peak summed over GPUs
            if batch % gpus:
                raise ValueError(f"{name}:{lineno}: global batch {batch} not divisible by {gpus}")
            batch //= gpus
            mem["peak_bytes"] /= gpus
        if benchmark == "resnet" and math.isnan(mem["model_bytes"]):
            # ResNet records give total and activation; model-related is the rest
            mem["model_bytes"] = mem["total_bytes"] - mem["activation_bytes"]
        step = rec.get("batch_time", rec.get("bacth_time"))
        # the DTR records write the peak into batch_time
        step_time = float(step) if step is not None and 0 < step < 1e3 else math.nan
        row = {
            "model": model, "mom": mom, "batch_size": batch, "gpus": gpus,
            "precision": precision or default_precision(benchmark, name),
            **size,
            "fits": fits, "throughput": throughput, "step_time_s": step_time,
            **mem,
            "budget": rec.get("mem_budget", math.nan),
            # nvidia-smi's share of time a kernel ran, sampled over the run (percent in the raw records)
            "gpu_utilization": rec["utilization"] / 100 if fits and rec.get("utilization") else math.nan,
            "experiment": exp, "algorithm": raw_alg,
            "source": f"{name}:{lineno}",
        }
        for raw_key, col in SIZE_FIELDS.items():
            if rec.get(raw_key) is not None:
                row[col] = rec[raw_key]
        out.append((row, rec))
    # fill size fields that OOM markers omit when the file holds one value
    for col in SIZE_FIELDS.values():
        values = {r[col] for r, _ in out if r.get(col) is not None}
        if len(values) == 1:
            (v,) = values
            for r, _ in out:
                r.setdefault(col, v)
    return out


MEGATRON_FIELDS = 13


def rows_from_megatron(path: Path, experiment: str) -> list[tuple[dict, dict]]:
    """Alpa's Megatron benchmark TSV: Type, Model Config, Parallel Config,
    P-mesh shape, #Microbatch, Force DP, Remat, Mean Time (s), Std Time,
    #Params (1e9), TFLOPs, TFLOPs (ckpt), Peak Mem (GiB, Alpa's GB = 2**30)."""
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        # one line in the depth file lacks its newline: two rows glued together
        for i, part in enumerate(re.split(r"(?<=\d)(?=gpt\t)", line)):
            f = part.split("\t")
            if len(f) != MEGATRON_FIELDS:
                raise ValueError(f"{path.name}:{lineno}: {len(f)} fields, "
                                 f"expected {MEGATRON_FIELDS}")
            case = ast.literal_eval(f[1])
            batch, (seq_len, hidden, layers, heads, _vocab) = case[0], case[1]
            dp, mp, pp = ast.literal_eval(f[2])
            remat = f[6] == "True"
            mean_time = float(f[7].rstrip("s"))
            out.append(({
                "model": f[0], "mom": "ckpt" if remat else "exact",
                "batch_size": batch, "gpus": dp * mp * pp,
                "precision": "fp16",
                "size.num_layers": layers, "size.hidden_size": hidden,
                "size.seq_len": seq_len, "size.num_heads": heads,
                "fits": True, "throughput": batch / mean_time, "step_time_s": mean_time,
                "peak_bytes": float(f[12].rstrip("G")) * GIB,
                "experiment": experiment,
                "algorithm": f"remat={remat} dp{dp}mp{mp}pp{pp}",
                "source": f"{path.name}:{lineno}" + (f"#{i + 1}" if i else ""),
            }, {"line": part}))
    return out


EXPERIMENT_ORDER = ["speed", "max_depth", "max_width", "depth", "width", "depth/width",
                    "max_batch", "mem", "background", "utilization"]


def file_order(name: str, experiment: str):
    # single GPU first, so that a copy keeps its single-GPU name; speed
    # sweeps before the files that repeat some of their runs (mem, utilization)
    rank = EXPERIMENT_ORDER.index(experiment) if experiment in EXPERIMENT_ORDER \
        else len(EXPERIMENT_ORDER)
    return (gpus_of(name), rank, name)


def derive(data: Path) -> pd.DataFrame:
    names = sorted(p.name for p in data.iterdir() if p.is_file())
    catalogue = dict(FILES)
    for n in names:
        if re.search(r"_archive_\d+\.json$", n):
            catalogue.setdefault(n, (False, "archive, superseded by the results file"))
        elif (data / n).stat().st_size == 0:
            catalogue.setdefault(n, (False, "empty"))
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise ValueError(f"files not catalogued in FILES: {unknown}")
    seen: dict[tuple, tuple[str, int]] = {}  # a run -> the file it was first read from, its row
    rows = []
    for name in sorted(names, key=lambda n: file_order(n, catalogue[n][1])):
        include, what = catalogue[name]
        path = data / name
        if not include:
            print(f"  left out  {name}: {what}")
            continue
        reader = rows_from_megatron if benchmark_of(name) == "megatron" else rows_from_json
        kept = dropped = 0
        for row, raw in reader(path, what):
            if "tstamp" in raw:  # a run's identity, whatever its fields are named
                key = (raw["network"], row["algorithm"], raw.get("batch_size"), raw["tstamp"])
            else:
                key = (json.dumps(raw, sort_keys=True), benchmark_of(name), row["gpus"])
            first, at = seen.setdefault(key, (name, len(rows)))
            if first != name:
                dropped += 1
                # a copy may add a field: the utilization files repeat speed runs with the GPU's utilization
                util = row.get("gpu_utilization", math.nan)
                if not math.isnan(util) and math.isnan(rows[at].get("gpu_utilization", math.nan)):
                    rows[at]["gpu_utilization"] = util
                continue
            rows.append(row)
            kept += 1
        note = f"  ({dropped} copies of earlier files dropped)" if dropped else ""
        print(f"  {kept:5d} rows {name}{note}")
    df = pd.DataFrame(rows, columns=COLUMNS)
    for col in INT_COLUMNS:
        df[col] = pd.to_numeric(df[col]).round().astype("Int64")
    df["fits"] = df["fits"].astype(bool)
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    df = derive(args.data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False, float_format="%.6g")
    print(f"wrote {len(df)} rows to {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
