"""Timing shared by the benchmarks: medians of repeated calls after one warm-up."""

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


def interleaved_median_seconds(
    fns: dict[str, Callable[[], object]], *, repeats: int, device: torch.device | None = None
) -> dict[str, float]:
    """Median seconds of each function, timed in `repeats` rounds that call each once, in
    an order that alternates between rounds, so a shared machine's drift hits all alike."""
    device = device or torch.device("cpu")
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(repeats):
        names = list(fns) if round_index % 2 == 0 else list(reversed(fns))
        for name in names:
            synchronize(device)
            start = time.perf_counter()
            fns[name]()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def require_baseline(module: str, *, extra: str = "bench") -> None:
    """Exit with an install hint (not a traceback) when a baseline's package is missing."""
    import importlib.util
    import sys

    if importlib.util.find_spec(module) is None:
        sys.exit(
            f"{sys.argv[0]}: its baseline needs `{module}`; install the `{extra}` extra from the "
            f"repository's directory: {sys.executable} -m pip install -e '.[{extra}]'"
        )
