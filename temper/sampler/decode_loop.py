"""DecodeLoop: one engine's decode loop, shared by the calls of every thread.

Calls are submitted from any thread and join the batch in flight at the next decode step
(continuous batching across calls): between two steps the loop admits the calls that arrived
meanwhile, then the next step decodes their rows beside the running ones, and a call returns
as soon as all of its sequences are done, whatever else is still decoding.

No thread of its own: the loop runs on the threads of its callers. A caller who finds nobody
driving the loop drives it (steps until its own work is done), then hands it to the caller of
the oldest unfinished work (waking that one thread only), who goes on with the rows in flight.
A single caller thus runs its call on its own thread, as a plain loop would.

`between_steps` is the one place where pending work enters the batch, in submission order:
- a call joins when its `gate` (if any) lets it (a multi-LoRA sampler's gate puts the call's
  adapter into a slot no running row uses; a call it holds back waits, later calls pass it);
- a task runs there (an adapter load for scoring, say);
- a barrier task (a weight update, sleep) first lets every call submitted before it finish,
  admits nothing after it until it has run, then runs with no row in flight.

What a step does is the runner's (`BatchRunner`: the engine): admission, chunked prefill,
one decode step. If a step raises, every call in flight fails with that error and the runner
drops their rows, so the loop keeps serving.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from temper.api.types import SampleResponse
from temper.sampler.requests import RequestState

Gate = Callable[[], bool]
"""Called between steps, on the driving thread, for a call about to join: True when it may
join now (it may rewrite its states, e.g. their adapter slot), False to wait for the next
step."""


class BatchRunner(Protocol):
    """What the loop drives (the engine)."""

    def session(self, *, num_threads: int | None, rows: int) -> contextlib.AbstractContextManager:
        """Around the steps one thread drives (threads, inference mode)."""
        ...

    def join(self, states: Sequence[RequestState]) -> None:
        """A call's requests wait for slots from now on."""
        ...

    def step(self) -> None:
        """Admit, prefill and decode once."""
        ...

    @property
    def busy(self) -> bool:
        """Rows in flight or requests waiting for slots."""
        ...

    def abort(self) -> None:
        """Drop every row and waiting request (after a step raised)."""
        ...

    def refresh(self) -> None:
        """After a task ran between steps (it may have changed the weights)."""
        ...


@dataclass(eq=False)
class Work:
    """What a caller waits for: a call's responses, or a task's result. Its caller sleeps
    on `wake` until the work is done or the loop is handed to it (`drives`)."""

    done: bool = False
    error: BaseException | None = None
    result: Any = None
    drives: bool = False
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Call(Work):
    states: list[RequestState] = field(default_factory=list)
    gate: Gate | None = None
    on_done: Callable[[], None] | None = None
    num_samples: int = 0
    joined: bool = False

    def finished(self) -> bool:
        return all(None not in state.sequences for state in self.states)


@dataclass(eq=False)
class _Task(Work):
    fn: Callable[[], Any] = lambda: None
    barrier: bool = False


class CallerDriven:
    """Work submitted from any thread and driven by the threads of its callers: the first
    caller who finds nobody driving drives (`_drive`, the subclass's) until its own work is
    done, then hands over to the caller of the oldest unfinished work, waking that thread
    only. `_pending` holds work not yet taken in, `_running` calls taken in and not done;
    both are the subclass's to move, under `_lock`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        self._running: list[Any] = []
        self._driving = False

    def _drive(self, work: Work, **options: Any) -> None:
        raise NotImplementedError

    def _wait(self, work: Work, **options: Any) -> None:
        """Submit `work` and return once it is done (driving meanwhile if handed the
        loop); raises its error. `options` go to `_drive`."""
        with self._lock:
            self._pending.append(work)
            if not self._driving:
                self._driving = work.drives = True
        if not work.drives:
            work.wake.wait()  # done, or handed the loop
        if not work.done:
            try:
                self._drive(work, **options)
            finally:
                self._hand_over()
        if work.error is not None:
            raise work.error

    def _hand_over(self) -> None:
        """Wake the caller of the oldest unfinished work to drive on (only that one), or
        leave the loop idle."""
        with self._lock:
            successor = next((w for w in (*self._running, *self._pending) if not w.done), None)
            self._driving = successor is not None
            if successor is not None:
                successor.drives = True
                successor.wake.set()


class DecodeLoop(CallerDriven):
    def __init__(self, runner: BatchRunner, *, max_rows: int) -> None:
        super().__init__()
        self._runner = runner
        self._max_rows = max_rows
        self._pending: list[Work] = []  # submitted, not yet joined (calls) or run (tasks)
        self._running: list[_Call] = []  # joined, some sequence still decoding
        self.num_batches = 0
        """Times the loop started decoding from idle (calls joining a running batch do not
        count)."""
        self.num_steps = 0
        """Steps run so far."""
        self.num_joined_running = 0
        """Calls that joined while other calls' rows were decoding."""

    @property
    def num_pending(self) -> int:
        """Calls and tasks submitted that have not joined or run yet."""
        with self._lock:
            return len(self._pending)

    def generate(
        self,
        states: list[RequestState],
        *,
        gate: Gate | None = None,
        on_done: Callable[[], None] | None = None,
        num_threads: int | None = None,
    ) -> list[SampleResponse]:
        """Run a call's validated requests with whatever else is in flight; its responses
        in order. `on_done`: called on the driving thread once the call has finished or
        failed (after it joined)."""
        samples = sum(state.request.num_samples for state in states)
        call = _Call(states=states, gate=gate, on_done=on_done, num_samples=samples)
        self._wait(call, num_threads=num_threads)
        return [state.response() for state in states]

    def between_steps(self, fn: Callable[[], Any], *, barrier: bool = False) -> Any:
        """`fn()` on the driving thread between two steps (see the module docstring);
        its result, or its error."""
        task = _Task(fn=fn, barrier=barrier)
        self._wait(task, num_threads=None)
        return task.result

    def _drive(self, work: Work, *, num_threads: int | None) -> None:
        """Steps on this thread until `work` is done. The session (the CPU threads a step
        runs on, chosen by the rows in flight) is entered again when the rows more than
        double: calls that joined a small call's batch then decode on the threads their
        rows call for."""
        while not work.done:
            rows = self._rows_in_flight()
            with self._runner.session(num_threads=num_threads, rows=rows):
                self._steps(work, until_rows=2 * rows)

    def _steps(self, work: Work, *, until_rows: int) -> None:
        while not work.done:
            self._between_steps()
            if work.done or self._rows_in_flight() > until_rows:
                return
            if not self._runner.busy:  # only calls a gate holds back (slots pinned
                time.sleep(0.005)  # by scores on other threads): try again shortly
                continue
            try:
                self._runner.step()
                self.num_steps += 1
            except BaseException as error:
                self._runner.abort()
                self._complete(self._running, error=error)
                continue
            self._complete([call for call in self._running if call.finished()])

    def _rows_in_flight(self) -> int:
        """Sequences of the running and waiting calls, at most a batch (at least 1)."""
        with self._lock:
            calls = [*self._running, *self._pending]
        samples = sum(getattr(call, "num_samples", 0) for call in calls)
        return max(1, min(self._max_rows, samples))

    def _between_steps(self) -> None:
        """Pending work in submission order: calls join, tasks run (see the module
        docstring)."""
        with self._lock:
            pending = list(self._pending)
        ran_task = False
        for work in pending:
            if isinstance(work, _Task):
                if work.barrier and (self._running or self._runner.busy):
                    break  # later work waits for the barrier
                self._run_task(work)
                ran_task = True
            elif isinstance(work, _Call) and (work.gate is None or self._gate(work)):
                self._join(work)
        if ran_task:
            self._runner.refresh()

    def _gate(self, call: _Call) -> bool:
        try:
            return call.gate()
        except BaseException as error:  # it fails this call only
            self._settle(call, error=error)
            return False

    def _join(self, call: _Call) -> None:
        if self._running:
            self.num_joined_running += 1
        elif not self._runner.busy:
            self.num_batches += 1
        self._runner.join(call.states)
        call.joined = True
        with self._lock:
            self._pending.remove(call)
            self._running.append(call)

    def _run_task(self, task: _Task) -> None:
        try:
            task.result = task.fn()
        except BaseException as error:
            task.error = error
        self._settle(task)

    def _complete(self, calls: list[_Call], *, error: BaseException | None = None) -> None:
        for call in list(calls):
            with self._lock:
                self._running.remove(call)
            if call.on_done is not None:
                call.on_done()
            self._settle(call, error=error)

    def _settle(self, work: Work, *, error: BaseException | None = None) -> None:
        with self._lock:
            if work in self._pending:
                self._pending.remove(work)
            if error is not None:
                work.error = error
            work.done = True
        work.wake.set()
