# Shoal: `make demo` runs a local router with replicas; `make test` runs every check CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this kind of machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test lint typecheck contracts unit demo bench clean

$(VENV)/.installed: pyproject.toml
	@echo "installing Shoal into $(VENV) (the first time takes a few minutes: torch, the dev tools)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[dev,replica]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy router autoscaler replica simulations

contracts: install
	$(VENV)/bin/lint-imports

unit: install
	$(VENV)/bin/pytest

test: lint typecheck contracts unit

# A router and two replicas of the demo model on loopback, then a few example requests; Ctrl-C stops all three.
# The demo model ships with the package (replica/demo/weights/, rebuilt by `shoal replica build-demo`).
demo: install
	@echo "starting the router and 2 replicas of the packaged demo model; they load it, then answer the demo requests"
	$(VENV)/bin/shoal up --replicas 2 --demo-requests

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
