"""VllmSteps: the calls of many threads join one vLLM engine's running batch.

vLLM batches continuously: requests added to its engine between two `LLMEngine.step()`s
decode beside the ones in flight, and a request's output is final once it is marked
finished. `LLM.generate` adds one call's requests and steps until all of them finish; here
the calls of every thread share the stepping instead. Between two steps the driving thread
adds the requests of the calls that arrived meanwhile (`LLM.enqueue`, each call with its own
`LoRARequest`s) and runs the tasks queued (adapter loads, weight updates: every other use of
the engine, in submission order), after the `between_steps` hook (an in-flight target's weight
switch, which runs here directly: a task would wait for the thread running it); a call
returns as soon as all of its requests have finished, its outputs in the order of its
prompts, whatever else is still decoding.

No thread of its own, as sampler/decode_loop.py: a caller who finds nobody stepping steps
until its own work is done, then hands the engine to the caller of the oldest unfinished
work (waking that thread only). A caller who starts the engine from idle first waits while
other calls keep arriving within `window_s` of each other (ten windows at most), so calls
that start together prefill together.

A call whose requests vLLM refuses when they are added fails alone (vLLM aborts the ones it
had added); a step that raises fails every call in flight and aborts their requests, and the
engine goes on serving later calls. The same stepping serves vLLM in this process and in its
own engine process (the `LLM` steps its engine-core client the same way).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from temper.sampler.decode_loop import CallerDriven, Work


@dataclass(eq=False)
class _Call(Work):
    prompts: Sequence[Any] = ()
    params: Sequence[Any] = ()
    lora_requests: Sequence[Any] | None = None
    order: list[str] = field(default_factory=list)
    """vLLM's external request ids of the prompts, in order (what its outputs carry)."""
    added: list[str] = field(default_factory=list)
    """vLLM's internal ids of the same requests (what `abort_request` takes)."""
    outputs: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class _Task(Work):
    fn: Callable[[], Any] = lambda: None


class VllmSteps(CallerDriven):
    """Steps one `vllm.LLM` for the calls of every thread (see the module docstring)."""

    def __init__(self, llm: Any, *, window_s: float = 0.0) -> None:
        super().__init__()
        self._llm = llm
        self._window_s = window_s
        self._pending: list[Work] = []  # submitted, not yet added (calls) or run (tasks)
        self._running: list[_Call] = []  # added, some request unfinished
        self._owners: dict[str, _Call] = {}  # external request id -> its call (under _lock)
        self.num_steps = 0
        """Engine steps run so far."""
        self.num_batches = 0
        """Times the engine started stepping from idle (calls joining a running batch do not
        count)."""
        self.num_joined_running = 0
        """Calls added while other calls' requests were decoding."""
        self.between_steps: Callable[[], None] | None = None
        """Run on the stepping thread before each step, ahead of the calls and tasks that
        arrived (generator/vllm.py's weight switch); an error fails the calls in flight and
        those waiting to be added."""

    def generate(
        self, prompts: Sequence[Any], params: Sequence[Any], *, lora_requests: Sequence[Any] | None
    ) -> list[Any]:
        """vLLM's final `RequestOutput` of each prompt, in order, decoded beside whatever
        else is in flight."""
        if not prompts:
            return []
        call = _Call(prompts=prompts, params=params, lora_requests=lora_requests)
        self._wait(call)
        return [call.outputs[request_id] for request_id in call.order]

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """`fn()` between two steps, on the stepping thread; its result, or its error."""
        task = _Task(fn=fn)
        self._wait(task)
        return task.result

    def _drive(self, work: Work) -> None:
        while not work.done:
            if not self._running:
                self._gather_callers()
            self._between_steps()
            if work.done:
                return
            self._step()

    def _gather_callers(self) -> None:
        """From idle: wait while other calls keep arriving, each within the window of the
        last, ten windows at most."""
        deadline = time.monotonic() + 10 * self._window_s
        while self._window_s > 0 and time.monotonic() < deadline:
            count = self.num_pending
            time.sleep(min(self._window_s, max(0.0, deadline - time.monotonic())))
            if self.num_pending == count:
                return

    @property
    def num_pending(self) -> int:
        """Calls and tasks submitted that have not been added or run yet."""
        with self._lock:
            return len(self._pending)

    @property
    def num_running(self) -> int:
        """Calls added whose requests have not all finished."""
        with self._lock:
            return len(self._running)

    def unfinished(self) -> list[int]:
        """Positions in their call of the requests still decoding (a target that runs one
        call at a time: the positions in that call)."""
        with self._lock:
            running = list(self._running)
        return [
            index
            for call in running
            for index, request_id in enumerate(call.order)
            if request_id not in call.outputs
        ]

    def _between_steps(self) -> None:
        if self.between_steps is not None:
            try:
                self.between_steps()
            except BaseException as error:
                self._fail_running(error, waiting=True)
                return
        with self._lock:
            pending, self._pending = self._pending, []
        for work in pending:
            if isinstance(work, _Task):
                try:
                    work.result = work.fn()
                except BaseException as error:
                    work.error = error
                self._settle(work)
            elif isinstance(work, _Call):
                self._add(work)

    def _add(self, call: _Call) -> None:
        """Add a call's requests to vLLM's engine (ids drawn from the `LLM`'s own counter,
        as `LLM.generate` draws them)."""
        first = self._llm.request_counter.counter
        try:
            call.added = self._llm.enqueue(
                list(call.prompts),
                list(call.params),
                lora_request=None if call.lora_requests is None else list(call.lora_requests),
                use_tqdm=False,
            )
        except BaseException as error:  # vLLM aborted what it had added: this call only
            self._settle(call, error=error)
            return
        call.order = [str(first + index) for index in range(len(call.prompts))]
        if self._running:
            self.num_joined_running += 1
        else:
            self.num_batches += 1
        with self._lock:
            self._running.append(call)
            self._owners.update(dict.fromkeys(call.order, call))

    def _step(self) -> None:
        try:
            outputs = self._llm.llm_engine.step()
            self.num_steps += 1
        except BaseException as error:
            self._fail_running(error)
            return
        for output in outputs:
            if not output.finished:
                continue
            with self._lock:
                call = self._owners.pop(output.request_id, None)
            if call is None:
                continue
            call.outputs[output.request_id] = output
            if len(call.outputs) == len(call.order):
                with self._lock:
                    self._running.remove(call)
                self._settle(call)

    def _fail_running(self, error: BaseException, *, waiting: bool = False) -> None:
        """A step raised: every call in flight fails with its error, their requests go;
        `waiting`: the calls not added yet fail too (tasks stay queued)."""
        unadded: list[Work] = []
        with self._lock:
            failed, self._running = self._running, []
            self._owners.clear()
            if waiting:
                unadded = [work for work in self._pending if isinstance(work, _Call)]
                self._pending = [work for work in self._pending if not isinstance(work, _Call)]
        added = [request_id for call in failed for request_id in call.added]
        try:
            self._llm.llm_engine.abort_request(added, internal=True)
        finally:
            for call in [*failed, *unadded]:
                self._settle(call, error=error)

    def _settle(self, work: Work, *, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None:
                work.error = error
            work.done = True
        work.wake.set()
