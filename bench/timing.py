"""Timing shared by the benchmarks: the median of repeated calls after one warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], object], *, repeats: int, device: torch.device | None = None
) -> float:
    device = device or torch.device("cpu")
    fn()  # warm-up: allocator, kernel selection, lazy initialization
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
