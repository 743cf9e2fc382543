# kvfleet developer entry points. `make demo` and `make test` are the two commands in the README.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
export UV_CACHE_DIR ?= $(HOME)/.cache/kvfleet/uv
export UV_LINK_MODE ?= copy
# Every engine, operator and pytest process imports torch: with PYTHONDONTWRITEBYTECODE set (as
# some CI images do) each compiled ~3,000 modules from source again, and a tiny-model
# `kvfleet serve` took 50-60 s to /ready on 2 shared cores, 16 s reading bytecode. So the first
# import of a module writes its bytecode and later ones read it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help venv test test-fast test-integrations lint demo

help:
	@echo "make demo         local cluster with GPU nodes, then an autoscaled InferenceDeployment scaling 1 -> 3 -> 1"
	@echo "make test         lint, type-check and run every CPU test (unit and e2e)"
	@echo "make test-fast    the tests under tests/ in one process, without lint or the cluster"
	@echo "make lint         ruff, mypy and the import contracts"
	@echo "make test-integrations  real Prometheus (and KEDA) in the local cluster (builds them first)"
	@echo "make cluster-bin  build the local control plane's binaries (cached)"
	@echo "make cluster-up   start the local control plane (prints export KUBECONFIG=...)"
	@echo "make cluster-status  whether it runs, and its KUBECONFIG"
	@echo "make cluster-down stop it"

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(PY) -m pip install -q 'uv==0.9.7'
	$(UV) pip install --python $(PY) -q -e '.[engine,operator]' --group dev
	$(PY) -m kvfleet_cli fetch-model smollm2   # the embedded model, cached once (~93 MB)
	@touch $@

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test-fast: venv
	$(PY) -m pytest tests -q

# Two pytest workers: most tests wait on engine processes starting, so two share the CI machine's
# two cores well. Each test module stays whole on one worker (its module-scoped servers start once);
# every e2e test shares the worker that owns the local control plane (tests/conftest.py,
# e2e/conftest.py). One OpenMP thread a process: two workers and the engines they start share two
# cores, and torch's default of one thread per core oversubscribes them (its threads then wait
# on each other: SmolLM2's int4 dequantization took 55 ms a layer with 2 threads, 6 ms with 1).
test: lint cluster-bin
	OMP_NUM_THREADS=1 KVFLEET_REQUIRE_HELM=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=40 --ignore=tests/kernels -m "not gpu and not integration"
	# The kernel tests switch Triton to its interpreter, which is process-wide: kernels imported
	# natively by earlier tests in the same process would not run there, so they get their own.
	$(PY) -m pytest -q --durations=10 tests/kernels

# Real Prometheus (and KEDA) beside the local control plane: their cold builds do not fit in
# `make test`'s time budget, so they run here (README "Integrations").
test-integrations: venv cluster-bin integrations-bin
	$(PY) -m pytest -q -m integration e2e

include e2e/cluster.mk
