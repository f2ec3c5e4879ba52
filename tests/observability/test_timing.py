"""PhaseTimer reports seconds per phase per step; tokens_per_second."""

from __future__ import annotations

import time

import pytest

from temper.observability import PhaseTimer, tokens_per_second


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_accumulate_per_step_and_reset_on_collect() -> None:
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("sample"):
        clock.now += 1.0
    with timer.phase("train"):
        clock.now += 2.0
    with timer.phase("sample"):  # a second sampling round in the same step adds up
        clock.now += 0.5
    clock.now += 0.25  # untimed work still counts toward the total
    assert timer.collect() == {"time/sample": 1.5, "time/train": 2.0, "time/total": 3.75}

    with timer.phase("train"):
        clock.now += 1.0
    assert timer.collect() == {"time/train": 1.0, "time/total": 1.0}


def test_nested_phases_and_errors_still_count() -> None:
    clock = FakeClock()
    timer = PhaseTimer(prefix="t/", clock=clock)
    with pytest.raises(KeyError), timer.phase("step"):
        with timer.phase("decode"):
            clock.now += 1.0
        clock.now += 1.0
        raise KeyError("boom")
    assert timer.collect() == {"t/step": 2.0, "t/decode": 1.0, "t/total": 2.0}


def test_real_clock_phases_sum_within_total() -> None:
    timer = PhaseTimer()
    for _ in range(3):
        with timer.phase("sample"):
            time.sleep(0.002)
        with timer.phase("train"):
            time.sleep(0.001)
    metrics = timer.collect()
    assert metrics["time/sample"] >= 0.006 and metrics["time/train"] >= 0.003
    assert metrics["time/sample"] + metrics["time/train"] <= metrics["time/total"]


def test_bad_phase_use_is_rejected() -> None:
    timer = PhaseTimer()
    with pytest.raises(ValueError, match="'total'"), timer.phase("total"):
        pass
    with pytest.raises(ValueError, match="already running"), timer.phase("train"):  # noqa: SIM117
        with timer.phase("train"):
            pass
    with timer.phase("sample"), pytest.raises(RuntimeError, match="'sample'"):
        timer.collect()


def test_tokens_per_second() -> None:
    assert tokens_per_second(1000, seconds=0.5) == 2000.0
    with pytest.raises(ValueError, match="seconds=0"):
        tokens_per_second(10, seconds=0)
