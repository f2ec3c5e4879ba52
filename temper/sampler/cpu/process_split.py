"""A sampler whose CPU generate calls split over helper processes (`cpu.processes` > 1).

`SamplerEngine.Config.build` returns a `ProcessSplitSampler` around the engine it builds when
the config asks for more than one process on CPU; callers use it as they would the engine
(generate, sample, score, update_weights, model, version, ...). The engine itself knows
nothing of processes: this wrapper plans the split, gives unseeded requests the seeds an
unsplit call would draw (the engine's entropy, in request order, so results are the same),
decodes the first part on its engine and hands the others to `HelperProcesses`
(helper_processes.py), whose engines are built from the same config with one process.

Calls from several threads: a call that stays in one part (too small to split) joins the
engine's decode loop like any call (sampler/decode_loop.py); calls that split take the helpers
one at a time (their parts do not join other calls' batches), the local part of each joining
the loop.

This module does not import the engine (the engine's config imports it): it names what it
needs of one in `LocalEngine`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from temper.api.types import SampleResponse
from temper.sampler.cpu.helper_processes import EngineConfig, HelperProcesses
from temper.sampler.requests import OnePromptSampling, SampleRequest
from temper.sampler.weight_source import WeightSource, WeightUpdate
from temper.tokenizer import Tokenizer


class LocalEngine(Protocol):
    """What the wrapper uses of the engine it holds (a `SamplerEngine`)."""

    config: EngineConfig
    weights: WeightSource
    tokenizer: Tokenizer | None
    vocab_size: int
    device: torch.device

    @property
    def model(self) -> nn.Module: ...

    @property
    def version(self) -> int: ...

    def describe(self) -> str: ...

    def update_weights(self, source: WeightUpdate, *, version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def seeded(self, requests: Sequence[SampleRequest]) -> list[SampleRequest]: ...

    def generate(
        self, requests: Sequence[SampleRequest], *, num_threads: int | None = None
    ) -> list[SampleResponse]: ...

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


class ProcessSplitSampler(OnePromptSampling):
    """`engine`, with generate calls split over up to `processes` processes (its own and
    helpers started on first use)."""

    holds_one_version = False
    joins_running_batch = True  # calls from several threads share decode steps

    def __init__(self, engine: LocalEngine, *, processes: int) -> None:
        assert processes >= 2 and engine.device.type == "cpu", "nothing to split"
        self.engine = engine
        cpu = engine.config.cpu
        # Every process of a split call, the engine's part included, runs on this many
        # threads, so the parts do not crowd each other's cores.
        threads = (
            cpu.num_threads
            if isinstance(cpu.num_threads, int)
            else max(1, torch.get_num_threads() // processes)
        )
        helper_config = replace(engine.config, cpu=replace(cpu, processes=1, num_threads=threads))
        self.helpers = HelperProcesses(
            max_helpers=processes - 1,
            min_rows=cpu.process_min_rows,
            config=helper_config,
            tokenizer=engine.tokenizer,
            threads=threads,
        )
        weakref.finalize(self, self.helpers.close)
        self._split_lock = threading.Lock()  # one split call on the helpers at a time

    # -- what callers use of an engine ---------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    @property
    def version(self) -> int:
        """Policy version of the weights in use (set by `update_weights`)."""
        return self.engine.version

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def describe(self) -> str:
        return (
            f"{self.engine.describe()}; generate calls split over up to "
            f"{self.helpers.max_helpers + 1} processes"
        )

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """The engine's `update_weights`; the helpers follow on the next split call."""
        self.engine.update_weights(source, version=version)

    def sleep(self) -> None:
        """Stop the helpers (their memory goes with them) and release the engine's KV cache;
        `wake_up` re-allocates it, and helpers start again on the next split call."""
        self.helpers.close()
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """The engine's `score` (one forward per batch, in this process)."""
        return self.engine.score(sequences, temperature=temperature)

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        """The engine's `generate`, its requests split over the processes when the call is
        large enough; the same responses, in request order."""
        parts = self.helpers.plan(requests)
        if len(parts) == 1:
            return self.engine.generate(requests)
        # Seed and validate everything before any part starts (see helper_processes.py).
        requests = self.engine.seeded(requests)
        with self._split_lock:
            return self._run_split(requests, parts)

    def _run_split(self, requests: list[SampleRequest], parts: list[range]) -> list[SampleResponse]:
        return self.helpers.run(
            [requests[part.start : part.stop] for part in parts],
            model=self.engine.model,
            generation=self.engine.weights.generation,
            version=self.engine.version,
            local=lambda part: self.engine.generate(part, num_threads=self.helpers.threads),
        )

    def close(self) -> None:
        """Stop the helper processes and the engine's decode threads (both start again if
        needed)."""
        self.helpers.close()
        self.engine.close()
