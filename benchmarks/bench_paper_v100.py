"""Benchmark: predicted MOM/Exact maximum-throughput ratios on one V100 against the paper's, with the error.

Every prediction is made here, from traces (build/cache/traces when they are
there) and the time model calibrated on the paper's *Exact* runs only
(momlab.timemodel); the MOM rows and the depth study are what it is checked
against. Prints the calibration (its parameters and per-model residuals), the
S1 ratio table with the error per row (rows whose paper MOM is another
system marked), the sets of MOMs that beat Exact, each also at the batch
sizes the paper ran that fit (the paper's memory, momlab's speed: the time
model's error apart from the predicted maximum batch's), and the depth at
which Checkpoint overtakes Exact for BERT, the paper's and predicted: over the
batch sizes the paper ran at each depth (what it measured: its depth study
stepped coarsely) and over every batch; and the GPU utilization the paper
sampled against the predicted share of each step the GPU runs kernels
(`validation.utilization_table`): where a step's time goes, host or GPU; and
the same crossing along the width (`validation.width_curves`, out of sample:
no run of the paper's width study is in the calibration), with the error of
the predicted throughput at the paper's batches per width.

Targets (issue 14): |ratio error| <= 0.15 on every comparable row; the same
set of MOMs beating Exact per model; the crossing within 4 layers.

Usage: python benchmarks/bench_paper_v100.py [--models resnet50 bert-large ...] [--no-depth] [--no-width]
A cold cache traces every configuration (minutes on a laptop); later runs read the traces.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from momlab import validation


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None, help=f"default: {' '.join(validation.MODELS)}")
    ap.add_argument("--no-depth", action="store_true", help="skip the S2' depth check")
    ap.add_argument("--no-width", action="store_true", help="skip the S2' width check (a trace per width)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = validation.summary(args.models, results=[], depth=not args.no_depth, width=not args.no_width)
    cal = out["calibration"]
    print(f"calibration of {validation.GPU}: {cal.describe()}")
    by_model = collections.defaultdict(list)
    for curve, r in zip(cal.curves, cal.residuals):  # the curves the fit weighed alike
        by_model[curve].append(r)
    for model, rs in by_model.items():
        print(f"  {model:33s} {len(rs):3d} Exact runs, residual median {np.median(rs):+.3f} "
              f"(range {min(rs):+.3f} .. {max(rs):+.3f})")
    print()
    print(validation.ratio_text(out["table"]))
    print()
    for r in out["verdicts"].itertuples(index=False):
        print(f"  {r.model:16s} beat Exact: paper {r.paper_beat or '-'}, predicted {r.pred_beat or '-'}"
              f"{'' if r.same else '   <- differs'}; at the paper's batches {r.pred_beat_paper_batches or '-'}"
              f"{'' if r.same_paper_batches else '   <- differs'}")
    if len(out["other"]):
        print("\nThe paper's sweeps at another precision than the model's headline one (its earlier runs; their "
              "Exact curves are in the calibration, their MOM rows are not):")
        print(validation.ratio_text(out["other"]))
        for r in out["other_verdicts"].itertuples(index=False):
            print(f"  {r.model:16s} beat Exact: paper {r.paper_beat or '-'}, predicted {r.pred_beat or '-'}"
                  f"{'' if r.same else '   <- differs'}")
    util = validation.utilization_summary(validation.utilization_table(args.models, results=[]))
    print("\nGPU utilization (nvidia-smi's share of the loop a kernel runs), the paper's runs against the "
          "prediction\n(medians over each sweep; nothing fitted to it):")
    print(util.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    if "depth" in out:
        print(f"\nBERT-large depth where Checkpoint overtakes Exact: paper {out['paper_crossing']:.1f} layers; "
              f"predicted over the batches the paper ran at each depth {out['pred_crossing_paper_batches']:.1f}, "
              f"over every batch {out['pred_crossing']:.1f}")
        _curves(out["depth"], "num_layers", "layers")
    if "width" in out:
        print(f"\nBERT-large width where Checkpoint overtakes Exact (out of sample: no run of the width study is in "
              f"the calibration): paper {out['paper_width_crossing']:.0f}; predicted over the batches the paper ran "
              f"at each width {out['pred_width_crossing_paper_batches']:.0f}, over every batch "
              f"{out['pred_width_crossing']:.0f}")
        w = out["width"]
        _curves(w, "hidden_size", "hidden")
        w = w[w["paper_throughput"].notna() & (w["pred_throughput_paper_batches"] > 0)]
        err = (w["pred_throughput_paper_batches"] / w["paper_throughput"] - 1).abs()
        for mom, e in err.groupby(w["mom"], sort=False):
            print(f"  {mom}: predicted throughput at the paper's batches, {len(e)} widths: median |error| "
                  f"{e.median():.1%}, max {e.max():.1%}, within 10%: {(e <= 0.10).sum()} of {len(e)}")
    print(f"\n({time.perf_counter() - t0:.0f} s; predicted numbers are predictions, the paper's are measured)")
    return 0


def _curves(d, dim: str, label: str) -> None:
    """The S2' curves where the paper has a point: its best batch and throughput, and the two predictions."""
    print(f"  {'MOM':6s} {label:>6s}  {'paper: batch, tp':>17s}  {'pred (paper batches)':>20s}  "
          f"{'pred (every batch)':>18s}")
    for r in d[d["paper_throughput"].notna()].itertuples(index=False):
        print(f"  {r.mom:6s} {getattr(r, dim):6d}  {r.paper_best_batch:6d} {r.paper_throughput:10.1f}  "
              f"{r.pred_best_paper_batch:6d} {r.pred_throughput_paper_batches:13.1f}  "
              f"{r.pred_best_batch:6d} {r.pred_throughput:11.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
