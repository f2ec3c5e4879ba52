"""How many processes a split generate call should use: as many as the cores its processes
could have had in the previous split-sized call, measured (Linux).

Helper processes (helper_processes.py) pay off only with cores to run on: each pays every
op's fixed cost for its own part, so a split call costs more CPU in all than one process
(about 1.3x on the tiny models at batch 64) and wins only by getting more of it. Linux
shares the CPU fairly between sessions (autogroup scheduling), not between processes: when
work in other sessions keeps the cores busy, an engine's helpers share its session's share,
and the split call is slower than one process (hybrid_decode.py on 2 cores with two busy
loops in other sessions: 5,471 tokens/s split, 7,483 in one process; with the loops in the
engine's own session, splitting still won). The machine's load average cannot tell those
cases apart, and it counts the engine's own processes; what the engine can see is what its
call got.

So `CoreShare` measures each call it is asked to: the CPU time the engine's processes used
(its own and its helpers') plus the time the machine's cores stood idle, over the call's wall
time. That is the number of cores the call could have had; the next call splits into no more
processes than that, rounded (and at least one). An idle 2-core machine reads about 2 from a
one-process call (one core used, one idle), so the next call splits; a machine busy with other
sessions reads about 1 or less, so the calls stay in one process until cores free up again.
Where /proc is not readable nothing is measured and calls split as configured.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    """A moment's counters: wall clock, the machine's idle core-seconds, the CPU seconds of
    this process and of each helper (by pid)."""

    wall_s: float
    idle_s: float
    own_s: float
    helpers_s: dict[int, float]


def read_cpu_times(pids: Sequence[int]) -> CpuTimes | None:
    """The counters now (Linux /proc); None where they cannot be read."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        helpers_s = {pid: _process_cpu_s(pid) for pid in pids}
    except (OSError, ValueError, IndexError):
        return None
    idle_ticks = int(fields[4]) + int(fields[5])  # idle and iowait, summed over the cores
    return CpuTimes(
        wall_s=time.monotonic(),
        idle_s=idle_ticks / _TICKS_PER_S,
        own_s=time.process_time(),
        helpers_s=helpers_s,
    )


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        # Fields after the command name (which may hold spaces): utime and stime are the
        # 12th and 13th.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def cores_had(start: CpuTimes, end: CpuTimes) -> float | None:
    """Cores the engine's processes could have had between two readings: their CPU time
    plus the machine's idle time, per second of wall time. A helper that started in between
    counts from zero."""
    wall_s = end.wall_s - start.wall_s
    if wall_s <= 0:
        return None
    used_s = end.own_s - start.own_s
    used_s += sum(cpu_s - start.helpers_s.get(pid, 0.0) for pid, cpu_s in end.helpers_s.items())
    return (used_s + end.idle_s - start.idle_s) / wall_s


class CoreShare:
    """The cores the last measured call could have had, and the process count that follows."""

    def __init__(self) -> None:
        self.cores: float | None = None
        """Cores the last measured call could have had; None before the first one."""

    def processes(self, *, at_most: int) -> int:
        """Processes for the next call: the measured cores rounded, 1..at_most (at_most
        before anything was measured)."""
        if self.cores is None:
            return at_most
        return max(1, min(at_most, round(self.cores)))

    @contextlib.contextmanager
    def measure(self, pids: Callable[[], Sequence[int]]) -> Iterator[None]:
        """Measure the block; `pids()` gives the helpers' process ids at each end."""
        start = read_cpu_times(pids())
        yield
        end = read_cpu_times(pids()) if start is not None else None
        if start is not None and end is not None:
            cores = cores_had(start, end)
            if cores is not None:
                self.cores = cores
