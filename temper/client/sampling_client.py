"""SamplingClient: `sample` and `compute_logprobs` on one policy version.

A sampling client reads through a `Snapshot` (weight_sync.py). One made by a training client
may read the trainer's own weights: the snapshot holds them against changes while it decodes,
and gets a private copy just before they change (copy-on-write). A client made from a
checkpoint or a base model owns its generator outright.

Concurrent `sample` calls decode together: the requests that arrive while the worker decodes
form its next batch (temper/api/futures.py). Since a generator's results depend on the batch at
rounding level, a caller that must reproduce them sends its requests inside `batch()`, which
makes them one batch whatever the timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from temper.api.futures import APIFuture, Worker
from temper.api.prompt_targets import PromptTargets
from temper.api.types import ModelInput, SampleResponse, SamplingParams, TensorData
from temper.client.inflight import InflightSnapshot
from temper.client.weight_sync import Snapshot
from temper.generator.seam import Generator, score_each_alone
from temper.sampler.requests import SampleRequest
from temper.tokenizer import Tokenizer


class SamplingClient:
    def __init__(
        self, *, snapshot: Snapshot | InflightSnapshot, worker: Worker, tokenizer: Tokenizer
    ) -> None:
        self.tokenizer = tokenizer
        self._snapshot = snapshot
        self._worker = worker

    @property
    def generator(self) -> Generator:
        """The generator that serves this client's version now (copy-on-write may replace
        it)."""
        return self._snapshot.generator

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: PromptTargets | TensorData | torch.Tensor | None = None,
    ) -> APIFuture[SampleResponse]:
        """Completions of `prompt` (Tinker's `sample`). `target_prompt_logprobs`: token ids
        to score at prompt positions, a [len(prompt) - 1, K] int table whose row i scores
        position i + 1, -1 where nothing is asked (`PromptTargets`, or anything
        `PromptTargets.from_ids` takes); the response's `target_prompt_logprobs` answers it."""
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt must be a ModelInput, got {type(prompt).__name__}")
        counts = {
            "num_samples": num_samples,
            "topk_prompt_logprobs": topk_prompt_logprobs,
            "topk_sample_logprobs": topk_sample_logprobs,
        }
        for name, value in counts.items():  # the generator checks their ranges
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        targets = target_prompt_logprobs
        if targets is not None and not isinstance(targets, PromptTargets):
            targets = PromptTargets.from_ids(targets)
        request = SampleRequest(
            prompt=prompt.to_ints(where="sample: prompt"),
            params=sampling_params or SamplingParams(),
            num_samples=num_samples,
            prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=targets,
        )
        self._snapshot.submitted(request)
        # Concurrent samples (e.g. one per prompt of an RL batch) decode together.
        return self._worker.submit_batched(self, request, self._generate)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """`sample` calls inside the block decode as one batch, sent when the block ends
        (without it, the first may start alone while the rest are still being sent, and its
        logprobs then round differently); `compute_logprobs` calls likewise go as one.
        Read no result inside the block."""
        with self._worker.batch():
            yield

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """Logprob of each prompt token given the ones before it (None for the first)."""
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt must be a ModelInput, got {type(prompt).__name__}")
        tokens = prompt.to_ints(where="compute_logprobs: prompt")
        self._snapshot.check_usable()
        if not tokens:
            raise ValueError("compute_logprobs: prompt is empty; it needs at least one token")
        # One token needs no forward pass, so the generator never sees it: check it here.
        if len(tokens) == 1:
            vocab_size = self.generator.vocab_size
            if not 0 <= tokens[0] < vocab_size:
                raise ValueError(
                    f"compute_logprobs: prompt token {tokens[0]} at position 0 is outside the "
                    f"vocabulary; valid ids are 0..{vocab_size - 1}"
                )
            return self._worker.submit(lambda: [None])
        # Concurrent calls go in one batch, each sequence still scored alone (the same
        # numbers whatever the timing); a generator on other ranks answers them in one trip.
        return self._worker.submit_batched((self, "logprobs"), tokens, self._compute_logprobs)

    def compute_logprobs_batch(
        self, prompts: Sequence[ModelInput]
    ) -> APIFuture[list[list[float | None]]]:
        """`compute_logprobs` of several sequences, scored together [Temper's choice]: one
        forward per batch of up to Temper's engine's `max_score_tokens` padded tokens instead of
        one per sequence (512 short RL sequences on the tiny model: 0.11-0.15 s, against 4 s). The
        same list gives the same numbers every time, but a sequence's logprobs may differ in
        the last bits from `compute_logprobs` of it alone (a batch rounds differently)."""
        sequences = []
        for index, prompt in enumerate(prompts):
            if not isinstance(prompt, ModelInput):
                raise TypeError(
                    f"prompts[{index}] must be a ModelInput, got {type(prompt).__name__}"
                )
            tokens = prompt.to_ints(where=f"compute_logprobs_batch: prompts[{index}]")
            if not tokens:
                raise ValueError(f"compute_logprobs_batch: prompts[{index}] is empty")
            sequences.append(tokens)
        self._snapshot.check_usable()
        _check_vocabulary(sequences, vocab_size=self.generator.vocab_size)
        return self._worker.submit(self._compute_logprobs_together, sequences)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    @property
    def version(self) -> int:
        return self._snapshot.version

    async def sample_async(self, *args: Any, **kwargs: Any) -> APIFuture[SampleResponse]:
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.compute_logprobs(*args, **kwargs)

    def _generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        with self._snapshot.reading(requests=requests) as generator:
            return generator.generate(requests)

    def _compute_logprobs_together(
        self, sequences: Sequence[list[int]]
    ) -> list[list[float | None]]:
        scored = [sequence for sequence in sequences if len(sequence) > 1]  # one token: no forward
        with self._snapshot.reading() as generator:
            scores = iter(generator.score(scored) if scored else [])
        return [[None, *next(scores).tolist()] if len(s) > 1 else [None] for s in sequences]

    def _compute_logprobs(self, sequences: Sequence[list[int]]) -> list[list[float | None]]:
        with self._snapshot.reading() as generator:
            scores = score_each_alone(generator, sequences)
        return [[None, *score.tolist()] for score in scores]


def _check_vocabulary(sequences: Sequence[list[int]], *, vocab_size: int) -> None:
    """Every token id in [0, vocab_size), else a ValueError naming the first one outside."""
    flat = [token for sequence in sequences for token in sequence]
    if not flat or (min(flat) >= 0 and max(flat) < vocab_size):
        return
    for index, sequence in enumerate(sequences):
        for position, token in enumerate(sequence):
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"compute_logprobs_batch: prompts[{index}] token {token} at position "
                    f"{position} is outside the vocabulary; valid ids are 0..{vocab_size - 1}"
                )
