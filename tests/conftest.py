"""Test-wide settings: deterministic CPU torch, GPU tests skipped without a GPU."""

from __future__ import annotations

import os

import pytest

# Spinning OpenMP threads make small ops 30-190x slower on a busy 2-core machine (DESIGN.md 7).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
