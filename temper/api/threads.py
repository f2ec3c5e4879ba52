"""What a worker thread inherits from the thread that made it: torch's thread count, fixed so
that no other thread can change it later, and the CUDA device.

`torch.set_num_threads` sets the calling thread's OpenMP and MKL counts and also the
process-wide default. Each thread, the first time it asks torch for its count or runs a
parallel op, initializes itself once from that default, overwriting what it set before. So a
thread that sets its count and only later runs its first op takes whatever default holds at
that moment, and other threads change it for a moment (a sampler generating on one thread, an
optimizer step): its count, and the rounding of its results, would depend on timing.

The current CUDA device is per thread too, and a new thread starts on cuda:0. A rank that set
its own GPU (`torch.cuda.set_device(LOCAL_RANK)`) on its main thread would run its workers'
kernels, streams and collectives on GPU 0; so a worker takes its creator's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pin_thread_count(count: int) -> None:
    """The calling thread runs torch ops on `count` threads from now on, whatever the default
    becomes. (Also sets the default, as `torch.set_num_threads` does.)"""
    torch.get_num_threads()  # the one-time initialization from the default, done now
    torch.set_num_threads(count)


@dataclass(frozen=True)
class ThreadSettings:
    """A thread's torch thread count and CUDA device (None: CUDA not started in it)."""

    num_threads: int
    cuda_device: int | None

    @classmethod
    def of_caller(cls) -> ThreadSettings:
        """The calling thread's settings. Reading the CUDA device does not start CUDA: a
        process that has not used it has no device to pass on."""
        started = torch.cuda.is_available() and torch.cuda.is_initialized()
        return cls(
            num_threads=torch.get_num_threads(),
            cuda_device=torch.cuda.current_device() if started else None,
        )

    def apply(self) -> None:
        """Make the calling thread run with these settings (a worker's initializer)."""
        pin_thread_count(self.num_threads)
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
