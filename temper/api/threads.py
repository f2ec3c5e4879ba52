"""A thread's torch thread count, fixed so that no other thread can change it later.

`torch.set_num_threads` sets the calling thread's OpenMP and MKL counts and also the
process-wide default. Each thread, the first time it asks torch for its count or runs a
parallel op, initializes itself once from that default, overwriting what it set before. So a
thread that sets its count and only later runs its first op takes whatever default holds at
that moment, and other threads change it for a moment (a sampler generating on one thread, an
optimizer step): its count, and the rounding of its results, would depend on timing.
"""

from __future__ import annotations

import torch


def pin_thread_count(count: int) -> None:
    """The calling thread runs torch ops on `count` threads from now on, whatever the default
    becomes. (Also sets the default, as `torch.set_num_threads` does.)"""
    torch.get_num_threads()  # the one-time initialization from the default, done now
    torch.set_num_threads(count)
