# momlab: the dependency graph from parameters to results to figures.
# `make test` and `make figures` set everything up from nothing (a .venv).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PARAMS ?= params/default.yaml
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
export HF_HUB_OFFLINE := 1
export PYTHONHASHSEED := 0

.PHONY: help venv test test-all test-fast figures bench lab test-browser gpu-check clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[notebooks,test]'
	touch $@

venv: $(VENV)/.installed ## create .venv with the pinned dependencies

test: $(VENV)/.installed ## run the test suite (CPU, tiny configs, notebooks with params/smoke.yaml)
	$(PY) -m pytest -q --ignore=tests/browser -m "not exhaustive"

test-all: $(VENV)/.installed ## the test suite with the exhaustive model x MOM matrices (about 25 minutes)
	$(PY) -m pytest -q --ignore=tests/browser

test-fast: $(VENV)/.installed ## the tests not marked slow
	$(PY) -m pytest -q --ignore=tests/browser -m "not slow and not exhaustive"

# SWEEP: launch flags for the notebooks' sweeps, e.g. SWEEP="--workers 4" (README, momlab.launch)
SWEEP ?=
figures: $(VENV)/.installed ## run every notebook with $(PARAMS) (and $(SWEEP) flags): results/ and figures/
	$(PY) -m momlab figures $(SWEEP) $(PARAMS) $(NOTEBOOKS)

bench: $(VENV)/.installed ## benchmarks: ratios measured side by side in one run
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lab: $(VENV)/.installed ## open JupyterLab on the notebooks
	$(VENV)/bin/jupyter lab notebooks/

# Debian's chromium (apt-get, as root) and the `browser` extra (playwright)
$(VENV)/.browser: $(VENV)/.installed
	test -x /usr/bin/chromium || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)
	$(PY) -m pip install -q -e '.[notebooks,test,browser]'
	touch $@

test-browser: $(VENV)/.browser ## the what-if widgets in headless Chromium (installs chromium and playwright)
	$(PY) -m pytest -q tests/browser

# On a GPU machine as it comes: its own python3 (torch, transformers, pandas, pyyaml), no venv, no
# network. Evidence (at most 8 files) goes to $(OUT): the device tool's output folder, else build/gpu-check.
OUT ?= build/gpu-check
gpu-check: ## prove every CUDA path on this machine's GPU in one run (< 8 min); evidence in $(OUT)
	$(PYTHON) -m momlab gpu-check $(OUT)

clean: ## remove build outputs (keeps results/ and figures/)
	rm -rf build .pytest_cache
