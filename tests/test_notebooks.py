"""Every scenario notebook runs under papermill with params/smoke.yaml and draws its figures."""

import json
from pathlib import Path

import pytest

from momlab import figures

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
SMOKE = ROOT / "params" / "smoke.yaml"

# the figures each notebook must write (PNG and PDF), as listed in figures/README.md
FIGURES = {
    "01_memory_breakdown": ["01_memory_breakdown"],
    "02_batch_scenario": ["02_batch_scenario"],
    "03_model_scenario": ["03_largest_model", "03_size_curves"],
    "04_paper_data": ["04_paper_batch_curves", "04_paper_depth_curves", "04_paper_gpu_count"],
    "05_lossy_moms": ["05_gradient_error", "05_loss_curves"],
    "06_what_if": ["06_what_if"],
    "07_gpu_count": ["07_gpu_count", "07_rank_memory"],
    "08_your_model": ["08_your_model", "08_what_if_llm"],
}


def test_every_notebook_is_known_and_in_the_smoke_params():
    assert [nb.stem for nb in NOTEBOOKS] == sorted(FIGURES)
    params = figures.read(SMOKE)
    assert sorted(params["notebooks"]) == sorted(FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_clean_and_parameterized(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and not c.get("execution_count") for c in code), "strip outputs"
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    assert nb["cells"][0]["cell_type"] == "markdown"


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_smoke_params_and_writes_its_figures(path, tmp_path):
    out = figures.run(SMOKE, [path], out_dir=tmp_path / "nb",
                      overrides={"figures_dir": str(tmp_path / "fig"), "store": str(tmp_path / "smoke.jsonl")})
    assert len(out) == 1 and out[0].exists()
    for name in FIGURES[path.stem]:
        png, pdf = tmp_path / "fig" / f"{name}.png", tmp_path / "fig" / f"{name}.pdf"
        assert png.exists() and _is_png(png) and png.stat().st_size > 10_000, name
        assert pdf.exists() and pdf.read_bytes()[:5] == b"%PDF-", name
