"""Tool execution, isolated from the job: a timeout per call, and errors become results.

An environment that offers a tool calls `ToolRunner.call(argument)` from its `step`; the
runner runs the tool on its own threads and waits at most `timeout_s`. A tool that raises or
runs over time gives a failed `ToolResult` (the env turns it into an observation or ends the
episode); nothing a tool does raises into the episode runner or the RL loop.

Threads cannot be killed: a call that runs over time is abandoned, not stopped, and keeps its
thread until it returns. A tool that may run away (untrusted code, a subprocess) should bound
its own work too, e.g. `subprocess.run(..., timeout=...)`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str
    """The tool's answer, or what went wrong ("timeout after 1.0 s", "ValueError: ...")."""
    seconds: float
    timed_out: bool = False


class ToolRunner:
    """Runs one tool function with a timeout per call."""

    def __init__(
        self, tool: Callable[[str], str], *, name: str, timeout_s: float, max_workers: int = 4
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"tool {name!r}: timeout_s must be > 0, got {timeout_s}")
        self.tool, self.name, self.timeout_s = tool, name, timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix=f"tool-{name}"
        )

    def call(self, argument: str) -> ToolResult:
        start = time.perf_counter()
        future = self._executor.submit(self.tool, argument)
        try:
            text = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            seconds = time.perf_counter() - start
            return ToolResult(
                ok=False, text=f"timeout after {self.timeout_s} s", seconds=seconds, timed_out=True
            )
        except Exception as error:  # the tool's own failure, reported to the policy
            return ToolResult(
                ok=False,
                text=f"{type(error).__name__}: {error}",
                seconds=time.perf_counter() - start,
            )
        return ToolResult(ok=True, text=str(text), seconds=time.perf_counter() - start)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
