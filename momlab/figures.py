"""`make figures`: run every scenario notebook with papermill under one parameter file.

A parameter file (params/*.yaml) has a `common` section given to every notebook
and a `notebooks` section with each notebook's own values, keyed by the
notebook's name without extension:

    common: {device: cpu, precision: fp32, store: results/cpu-default.jsonl, figures_dir: figures}
    notebooks:
      01_memory_breakdown: {models: [bert-base], batch_size: 8}

Executed copies go to build/notebooks/ (build output, never committed); the
notebooks write results into the store and figures into `figures_dir`. A
notebook the file does not mention is skipped, with a line saying so.

    python -m momlab figures params/default.yaml notebooks/01_memory_breakdown.ipynb ...
    python -m momlab figures --workers 4 params/h200.yaml notebooks/*.ipynb

The launch flags (--workers, --launcher slurm, ...: momlab.launch) reach every
`momlab.sweep` the notebooks call, through the environment variable
MOMLAB_SWEEP_LAUNCH, so the notebooks stay free of cluster details.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("common", "notebooks", "description")


def read(path) -> dict:
    """Load and validate a figures parameter file."""
    with open(path) as f:
        params = yaml.safe_load(f) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{path}: expected a mapping with sections {', '.join(SECTIONS)}")
    bad = [k for k in params if k not in SECTIONS]
    if bad:
        raise ValueError(f"{path}: unknown section(s) {', '.join(map(str, bad))}; valid: {', '.join(SECTIONS)}")
    return params


def parameters_for(params: dict, notebook: str, overrides: dict | None = None) -> dict | None:
    """The values papermill injects into `notebook` (None: not in this file)."""
    own = (params.get("notebooks") or {}).get(notebook)
    if own is None:
        return None
    return {**(params.get("common") or {}), **own, **(overrides or {})}


def run(params_path, notebooks, out_dir=ROOT / "build" / "notebooks", overrides: dict | None = None,
        launch=None) -> list[Path]:
    """Execute `notebooks` with the values of `params_path` (and `overrides`, e.g. another figures_dir).

    `launch` (a momlab.launch.Launch, a mapping of its fields, or a number of
    local workers) runs the notebooks' sweeps on workers, as `sweep(launch=...)`.
    """
    if launch is not None:
        from momlab.launch import ENV_VAR, Launch

        previous = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = json.dumps(Launch.of(launch).to_dict())
        try:
            return run(params_path, notebooks, out_dir, overrides)
        finally:
            if previous is None:
                os.environ.pop(ENV_VAR)
            else:
                os.environ[ENV_VAR] = previous
    import papermill

    params = read(params_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for nb in map(Path, notebooks):
        values = parameters_for(params, nb.stem, overrides)
        if values is None:
            print(f"skip {nb.name}: not in {params_path}")
            continue
        t0 = time.perf_counter()
        out = out_dir / nb.name
        print(f"run  {nb.name} -> {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}", flush=True)
        papermill.execute_notebook(str(nb), str(out), parameters=values, cwd=str(ROOT), kernel_name="python3",
                                   progress_bar=False)
        print(f"done {nb.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        done.append(out)
    return done
