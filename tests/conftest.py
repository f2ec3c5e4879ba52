"""Test-wide settings: deterministic CPU torch, GPU tests skipped without a GPU."""

from __future__ import annotations

import os

import pytest

# Spinning OpenMP threads make small ops 30-190x slower on a busy 2-core machine (DESIGN.md 7).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files that take longest (minutes each on the 2-core CI machine), longest first: with
# `-n 2 --dist loadfile` they are handed out first, so no worker ends on one while the other
# idles (longest-first scheduling; it saved about a minute of wall time here).
LONGEST_FILES = (
    "tests/test_docs.py",
    "tests/rl/test_multiturn_job.py",
    "tests/rl/test_job.py",
    "tests/test_bench.py",
    "tests/distributed/test_disaggregated.py",
    "tests/server/test_cookbook.py",
    "tests/distributed/test_sharded_training.py",
    "tests/server/test_replicated.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
