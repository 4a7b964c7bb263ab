"""Notebook 06 in a real browser: JupyterLab, headless Chromium, run all cells, move sliders.

What a user does: open the notebook, run it, drag a slider, and see the
figure and the verdict change without rerunning the model. The notebook is
parameterized for bert-base's tiny preset (as params/smoke.yaml does), so a
size change traces in seconds (its three MOMs at 19 layers: about half a
minute on two busy cores). Screenshots go to build/browser/: after the
notebook ran, after the batch slider moved, after the depth slider moved.

Needs Debian's chromium and the playwright package (the `browser` extra),
both installed by `make test-browser`; playwright's own browser download is
never used: Chromium is launched from /usr/bin/chromium.

    make test-browser      # installs them, then pytest -q tests/browser
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_what_if.ipynb"
SHOTS = ROOT / "build" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SMOKE = {"model": "bert-base", "size": "tiny", "gpu": "A100-40", "moms": ["exact", "ckpt", "quant4"],
         "batch_size": 8, "smoke": True}


def _check_tools():
    missing = [what for what, ok in (("Debian's chromium", os.path.exists(CHROMIUM)),
                                     ("playwright (the browser extra)", importlib.util.find_spec("playwright")))
               if not ok]
    if missing:
        pytest.fail(f"missing {' and '.join(missing)}: run `make test-browser`, which installs them")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 (random port, random token) serving a parameterized copy of notebook 06."""
    _check_tools()
    from papermill.iorw import load_notebook_node, write_ipynb
    from papermill.parameterize import parameterize_notebook  # papermill's injection, without executing

    root = tmp_path_factory.mktemp("lab")
    params = {**SMOKE, "figure": str(root / "06_what_if")}

    nb = parameterize_notebook(load_notebook_node(str(NOTEBOOK)), params)
    write_ipynb(nb, str(root / NOTEBOOK.name))
    port, token = _free_port(), secrets.token_hex(16)
    log = open(root / "jupyter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {(root / 'jupyter.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield {"url": f"http://127.0.0.1:{port}/lab/tree/{NOTEBOOK.name}?token={token}", "root": root}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _slider_readout(page, name: str):
    slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text=name))
    return slider.locator(".widget-readout").first


def _move_slider(page, name: str, fraction: float) -> None:
    """Click the slider's track at `fraction` of its length, as a user would."""
    slider = page.locator(".widget-slider", has=page.locator(".widget-label", has_text=name)).first
    box = slider.locator(".noUi-target").first.bounding_box()
    page.mouse.click(box["x"] + fraction * box["width"], box["y"] + box["height"] / 2)


def _state(page) -> tuple[bytes, str]:
    """The figure as displayed (its pixels: the image's URL changes at every update, drawn anew or not)
    and the verdict's text."""
    img = page.locator("img.widget-image").first.screenshot()
    verdict = page.locator(".widget-html-content", has_text="S1 on").first.inner_text()
    return img, verdict


def _wait_change(page, before: tuple[bytes, str], timeout_s: float = 120) -> tuple[bytes, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _state(page)
        if now[0] != before[0]:
            return now
        time.sleep(0.25)
    raise AssertionError("the figure did not change")


def test_sliders_redraw_figure_and_verdict(lab):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.goto(lab["url"])
        page.wait_for_selector(".jp-NotebookPanel", timeout=120_000)
        try:  # a fresh JupyterLab asks which kernel to start: the notebook's own
            page.get_by_role("button", name="Select", exact=True).click(timeout=20_000)
        except Exception:  # noqa: BLE001 - no dialog: the kernel started by itself
            pass
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        try:
            page.wait_for_selector("img.widget-image", timeout=150_000)
        except Exception:
            page.screenshot(path=str(SHOTS / "06_what_if_failed.png"), full_page=True)
            raise
        page.wait_for_selector(".widget-html-content:has-text('S1 on')", timeout=300_000)
        page.locator("img.widget-image").first.scroll_into_view_if_needed()
        first = _state(page)
        assert first[0].startswith(b"\x89PNG") and "S1 on A100-40" in first[1]
        page.screenshot(path=str(SHOTS / "06_what_if.png"), full_page=True)

        # the batch slider: read off the cached traces, the figure changes, the S1 verdict does not
        _move_slider(page, "batch", 0.6)
        after_batch = _wait_change(page, first, timeout_s=30)
        assert after_batch[1] == first[1]
        page.screenshot(path=str(SHOTS / "06_what_if_batch.png"), full_page=True)

        # a deeper model: traced once (or read from build/cache), the figure and the verdict change
        _move_slider(page, "num_layers", 0.8)
        after_size = _wait_change(page, after_batch)
        deadline = time.monotonic() + 60
        while after_size[1] == first[1] and time.monotonic() < deadline:
            time.sleep(0.25)
            after_size = _state(page)
        assert after_size[1] != first[1] and "S1 on A100-40" in after_size[1]
        page.locator("img.widget-image").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "06_what_if_after.png"), full_page=True)
        browser.close()
    # the notebook wrote its figure to the path it was given
    assert (lab["root"] / "06_what_if.png").stat().st_size > 10_000
    print(f"browser test: {time.monotonic() - t0:.0f} s after JupyterLab started")
    shutil.copy(lab["root"] / "06_what_if.png", SHOTS / "06_what_if_notebook_figure.png")
