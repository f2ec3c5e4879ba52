"""RSS, its peak, and the peak of a block, read from /proc for this process."""

from __future__ import annotations

import os

import torch

from temper.observability.process_memory import (
    PeakRss,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
)


def test_a_block_that_touches_64_mib_peaks_at_least_that_much_beyond_before() -> None:
    with PeakRss() as peak:
        block = torch.ones(16 * 2**20)  # 64 MiB, every page written
        del block
    assert 60 <= peak.extra_mib < 200
    assert peak.peak_mib >= peak.before_mib + 60


def test_reset_brings_the_peak_back_to_the_current_rss() -> None:
    block = torch.ones(16 * 2**20)
    del block
    reset_peak_rss()
    assert abs(peak_rss_mib() - rss_mib()) < 16
    assert rss_mib(os.getpid()) > 0
