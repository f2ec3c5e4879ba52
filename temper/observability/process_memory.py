"""A process's resident memory from /proc (Linux): now, its peak, and the peak of one block.

`VmRSS` is what a process holds now, `VmHWM` the most it has held; writing "5" to
/proc/self/clear_refs sets the peak back to the current RSS, so the peak of a block of code
is measurable without sampling. Memory freed by the C allocator may stay mapped in the
process (glibc keeps freed heap chunks for reuse), which would hide part of a block's
allocations behind an RSS that already counts them: `PeakRss` first returns it to the
system (`malloc_trim`). CPU memory only: a GPU's is torch.cuda's to report.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

MIB = 2**20


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of process `pid` now, MiB."""
    return _status_kib(pid, "VmRSS") / 1024


def peak_rss_mib(pid: int | str = "self") -> float:
    """The most resident memory process `pid` has held (since start or `reset_peak_rss`), MiB."""
    return _status_kib(pid, "VmHWM") / 1024


def reset_peak_rss() -> None:
    """Set this process's peak (VmHWM) back to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def release_freed_memory() -> None:
    """Give memory the C allocator keeps after frees back to the system (glibc)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """The most memory a block of code held beyond what the process held before it
    (`with PeakRss() as peak: work()`, then `peak.extra_mib`)."""

    def __init__(self) -> None:
        self.before_mib = 0.0
        self.peak_mib = 0.0

    def __enter__(self) -> PeakRss:
        release_freed_memory()
        reset_peak_rss()
        self.before_mib = rss_mib()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.peak_mib = peak_rss_mib()

    @property
    def extra_mib(self) -> float:
        return self.peak_mib - self.before_mib


def _status_kib(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field} (a kernel thread, or not Linux)")


def device_memory_bytes(device: str) -> int:
    """The device's total memory: the GPU's for a CUDA device, else the machine's RAM."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
