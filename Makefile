# Shoal: `make demo` runs a local router with replicas; `make test` runs every check CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this kind of machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test lint typecheck contracts unit demo bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[dev,replica]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy router autoscaler/policy

contracts: install
	$(VENV)/bin/lint-imports

unit: install
	$(VENV)/bin/pytest

test: lint typecheck contracts unit

# Until the bundled replica lands, two stand-in replicas (tests/fakes/fake_replica.py, OpenAI-compatible, with
# vLLM metric names) serve behind the router. Ctrl-C stops all three.
demo: install
	@echo "Router on http://127.0.0.1:8000 with two stand-in replicas (the bundled engine arrives with the replica)."
	@echo "Try: curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"shoal-demo\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'"
	@$(PY) -m tests.fakes.fake_replica --port 8101 --name a --per-token-delay-s 0.02 & a=$$!; \
	$(PY) -m tests.fakes.fake_replica --port 8102 --name b --per-token-delay-s 0.02 & b=$$!; \
	trap 'kill $$a $$b 2>/dev/null' EXIT INT TERM; \
	$(VENV)/bin/shoal router --port 8000 --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
