"""Test-wide settings: the suite runs on CPU even where a GPU exists (only `-m gpu` runs see
it), GPU tests skipped without a GPU, and the longest test files first."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

# Spinning OpenMP threads make small ops 30-190x slower on a busy 2-core machine (DESIGN.md 7).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


RUN_FIRST = (
    "tests/test_docs.py",  # ~170 s: README and docs blocks, many of them CLI runs
    "tests/test_bench.py",  # ~145 s: every bench script runs once
    "tests/generator/test_vllm_transfer.py",  # ~125 s: vLLM's own processes, stalls
    "tests/rl/test_multiturn_job.py",  # ~90 s: two multi-turn recipes that must learn
    "tests/distributed/test_sync_deadline_vllm.py",  # ~110 s: a vLLM rank stalled or killed
    "tests/test_gpu_check.py",  # ~95 s, one test: every GPU check's dry run
    "tests/distributed/test_disaggregated_vllm.py",  # ~70 s: vLLM on its own rank
    "tests/rl/test_vllm_job.py",  # ~60 s, one test: RL on vLLM learns like RL on Temper
    "tests/recipes/test_sum_digits_inflight.py",  # ~65 s: in-flight async GRPO must learn
    "tests/rl/test_job.py",  # ~50 s: the default recipe must learn
    "tests/distributed/test_train_nproc.py",  # ~50 s: torchrun runs
    "tests/recipes/test_sum_digits_moe.py",  # ~45 s: a tiny MoE must learn
    "tests/recipes/test_sum_digits_hybrid.py",  # ~40 s: a tiny hybrid must learn with RL
)
"""Test files that take over 40 s (on the 2-core CI machine), longest first (the vLLM fault
files apart, so that they less often share the two cores with each other). `make test`
runs files whole on two workers (`--dist loadfile`), each worker taking the next file in
collection order (`--no-loadscope-reorder`), so these start first: a long file that starts
last keeps one worker busy while the other idles (xdist's own reordering, by number of
tests, put the one-test vLLM RL file last)."""


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the gpu-marked tests (`-m gpu`, `-m "gpu or vllm"`)."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(
        word == "gpu" and (index == 0 or words[index - 1] != "not")
        for index, word in enumerate(words)
    )


def pytest_configure(config: pytest.Config) -> None:
    # The suite is tuned for CPU (thresholds, bitwise checks, gloo ranks); jobs default to CUDA
    # where one is visible, so the GPU is hidden from this process and every process it
    # starts, unless the run selects the gpu tests (make gpu-check). Set before torch first
    # asks the driver for devices, which reads the variable once.
    if not selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    # Off while test modules are imported: they and what they import (torch, transformers,
    # vLLM: over 700,000 objects) make no cyclic garbage worth a pass, and each full collection
    # walks them all (a third of the collection's CPU time, measured: 10.3 s -> 6.8 s).
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {path: rank for rank, path in enumerate(RUN_FIRST)}
    # Stable: the other files keep their order, and every file its tests' order.
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(RUN_FIRST)))
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA device, and the suite hides GPUs unless run with -m gpu "
        "(make gpu-check)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
