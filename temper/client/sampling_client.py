"""SamplingClient: `sample` and `compute_logprobs` on one policy version.

A sampling client made by a training client may read the trainer's own weights; it holds the
trainer's weight lock while it decodes, and the training client detaches it onto a private
copy just before those weights change (copy-on-write, see training_client.py). A client made
from a checkpoint or a base model owns its engine outright.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from temper.api.futures import APIFuture, Worker
from temper.api.types import ModelInput, SampleResponse, SamplingParams
from temper.sampler.engine import SamplerEngine
from temper.sampler.requests import SampleRequest

if TYPE_CHECKING:
    from temper.client.training_client import TrainingClient


class SamplingClient:
    def __init__(
        self,
        *,
        engine: SamplerEngine,
        worker: Worker,
        tokenizer: Any,
        owner: tuple[TrainingClient, int] | None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._worker = worker
        self._owner = owner
        # True while `engine` is the training client's own sampler (maybe on its tensors).
        self._shared = owner is not None

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> APIFuture[SampleResponse]:
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt must be a ModelInput, got {type(prompt).__name__}")
        counts = {
            "num_samples": num_samples,
            "topk_prompt_logprobs": topk_prompt_logprobs,
            "topk_sample_logprobs": topk_sample_logprobs,
        }
        for name, value in counts.items():  # the engine checks their ranges
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        request = SampleRequest(
            prompt=prompt.to_ints(),
            params=sampling_params or SamplingParams(),
            num_samples=num_samples,
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
        )
        # Concurrent samples (e.g. one per prompt of an RL batch) decode together.
        return self._worker.submit_batched(self, request, self._generate)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """Logprob of each prompt token given the ones before it (None for the first)."""
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt must be a ModelInput, got {type(prompt).__name__}")
        tokens = prompt.to_ints()
        if not tokens:
            raise ValueError("compute_logprobs: prompt is empty; it needs at least one token")
        # One token needs no forward pass, so the engine never sees it: check it here.
        if len(tokens) == 1:
            vocab_size = self.engine.vocab_size
            if not 0 <= tokens[0] < vocab_size:
                raise ValueError(
                    f"compute_logprobs: prompt token {tokens[0]} at position 0 is outside the "
                    f"vocabulary; valid ids are 0..{vocab_size - 1}"
                )
            return self._worker.submit(lambda: [None])
        return self._worker.submit(self._compute_logprobs, tokens)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version if self._owner is None else self._owner[1]

    async def sample_async(self, *args: Any, **kwargs: Any) -> APIFuture[SampleResponse]:
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.compute_logprobs(*args, **kwargs)

    def _generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        with self._reading() as engine:
            return engine.generate(requests)

    def _compute_logprobs(self, tokens: list[int]) -> list[float | None]:
        with self._reading() as engine:
            return [None, *engine.score([tokens])[0].tolist()]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[SamplerEngine]:
        """The engine to use; weights shared with a trainer are held against changes."""
        if not self._shared:  # a detached client never shares again
            yield self.engine
            return
        with self._owner[0]._weights_lock:
            yield self.engine

    def _detach(self, engine: SamplerEngine) -> None:
        """Serve the same version from `engine` from now on (under the owner's lock)."""
        self.engine, self._shared = engine, False
