"""The command line: python -m momlab measure|search|sweep|estimate ...

Bad input is a one-line error on stderr and exit code 2; --json prints the
same dictionary the Python API's `Measurement.to_dict()` gives.

MODEL is a catalog name, a transformers ``config.json`` (a path ending in
.json), or ``module:attribute`` naming a config, a `momlab.UserModel` or a
function returning one (`momlab.usermodel.from_text`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

SIZE_FLAGS = ("num_layers", "hidden_size", "num_heads", "seq_len", "image_size", "width_per_group", "vocab_size")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_size_flags(p: argparse.ArgumentParser) -> None:
    for name in SIZE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="use the model's tiny preset (tests, smoke runs)")


def model_from(args):
    """The MODEL argument as a model (parsed once; see the module docstring)."""
    from momlab.usermodel import from_text

    args.model = from_text(args.model) if isinstance(args.model, str) else args.model
    return args.model


def size_from(args, model: str) -> dict:
    from momlab import catalog

    size = catalog.tiny(model) if args.tiny else {}
    size.update({k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None})
    return size


def _table(d: dict) -> str:
    from momlab.units import format_bytes

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


def cmd_measure(args) -> int:
    from momlab.measure import measure

    m = measure(model_from(args), args.mom, batch_size=args.batch_size, device=args.device, budget=args.budget,
                precision=args.precision, steps=args.steps, warmup=args.warmup, seed=args.seed,
                **size_from(args, args.model))
    print(json.dumps(m.to_dict(), allow_nan=True) if args.json else _table(m.to_dict()))
    return 0


def cmd_gpu_check(args) -> int:
    from momlab.gpucheck import main

    return main(args)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m momlab", description="momlab: evaluate memory optimization methods")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("measure", help="measure one configuration")
    m.add_argument("model")
    m.add_argument("--mom", default="exact")
    m.add_argument("--batch-size", type=int, required=True)
    m.add_argument("--device", default="cpu")
    m.add_argument("--budget", default=None, help="e.g. 2GiB, 512MiB, 16GB or bytes")
    m.add_argument("--precision", default="fp32")
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--json", action="store_true")
    add_size_flags(m)
    m.set_defaults(func=cmd_measure)

    g = sub.add_parser("gpu-check", help="prove every CUDA path on this GPU in one run (evidence into OUT)")
    g.add_argument("out", help="folder for the evidence (at most 8 files)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dry-run", action="store_true", help="the same phases at tiny sizes (CPU tests)")
    g.add_argument("--time-limit", type=float, default=450.0,
                   help="seconds for all phases (default 450: with start-up, within 8 minutes)")
    g.add_argument("--phases", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="comma-separated phase numbers to run (default: all)")
    g.set_defaults(func=cmd_gpu_check)

    for extend in _extensions():
        extend(sub)
    return p


def _extensions():
    """Subcommands contributed by later modules of the chain (search, sweep, estimate)."""
    import importlib
    import importlib.util

    out = []
    for mod in ("momlab.sweep", "momlab.estimate", "momlab.distributed"):
        if importlib.util.find_spec(mod) is None:
            continue
        fn = getattr(importlib.import_module(mod), "add_subparsers", None)
        if fn is not None:
            out.append(fn)
    return out


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
