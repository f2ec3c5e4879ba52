"""Sample requests: validation up front, and the per-request state the engine fills in.

A request is validated whole before the engine does any work, so a bad request raises a
ValueError naming the request and the parameter and leaves the engine as it was.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from temper.api.prompt_targets import PromptTargetLogprobs, PromptTargets
from temper.api.types import SampledSequence, SampleResponse, SamplingParams, TopkLogprobs
from temper.sampler.context_limits import prompt_too_long
from temper.sampler.kv_cache import SlotPrefix

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio); spreads sample indices


@dataclass(frozen=True, kw_only=True)
class SampleRequest:
    prompt: Sequence[int]
    """Prompt token ids."""
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    """Independent completions of the prompt (its prefill is shared)."""
    prompt_logprobs: bool = False
    """Also return the logprob of every prompt token (None at position 0)."""
    topk_prompt_logprobs: int = 0
    """Also return the k most likely tokens at each prompt position."""
    topk_sample_logprobs: int = 0
    """Also return the k most likely tokens at each generated position."""
    target_prompt_logprobs: PromptTargets | None = None
    """Also return the logprobs of these token ids at these prompt positions."""
    adapter: int = 0
    """The adapter slot this request samples with, on an engine whose model has multi-LoRA
    slots (models/multi_lora.py; the multi-LoRA sampler sets it); ignored elsewhere."""


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of one sample: a function of the request seed and the sample's index only."""
    mixed = (request_seed + (sample_index + 1) * _SEED_MIX) % 2**64
    return mixed - 2**64 if mixed >= 2**63 else mixed  # as a signed int64


class OnePromptSampling:
    """`sample(prompt, ...)`: one prompt's completions through the host's `generate` (the
    engine, and the process-split wrapper around it)."""

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        raise NotImplementedError

    def sample(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: PromptTargets | None = None,
    ) -> SampleResponse:
        """Completions of one prompt (see `generate` for many requests at once)."""
        request = SampleRequest(
            prompt=prompt,
            params=params or SamplingParams(),
            num_samples=num_samples,
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_logprobs,
        )
        return self.generate([request])[0]


class RequestState:
    """One request in flight: its prompt, its samples' seeds and limits, and its results."""

    def __init__(
        self,
        request: SampleRequest,
        *,
        index: int,
        vocab_size: int,
        max_seq_len: int,
        eos_token_id: int | None,
        entropy: random.Random,
    ) -> None:
        self.request = request
        self.index = index
        self.params = request.params
        validate(request, index=index, vocab_size=vocab_size, max_seq_len=max_seq_len)
        self.prompt = [int(token) for token in request.prompt]
        room = max_seq_len - len(self.prompt)
        self.max_new_tokens = min(self.params.max_tokens or room, room)
        stop_ids = set(self.params.stop_token_ids)
        if self.params.stops_at_eos and eos_token_id is not None:
            stop_ids.add(eos_token_id)
        self.stop_token_ids = sorted(stop_ids)
        base_seed = self.params.seed if self.params.seed is not None else entropy.getrandbits(63)
        self.seeds = [sample_seed(base_seed, i) for i in range(request.num_samples)]
        self.num_admitted = 0
        self.prefix: SlotPrefix | None = None
        """Cached prompt keys/values (and recurrent states), kept while samples still wait
        for a slot."""
        self.prompt_routes: torch.Tensor | None = None
        """The prompt's recorded routes [P, L, K] (an engine that records routes)."""
        self.first_logits_V: torch.Tensor | None = None
        self.prompt_logprobs: list[float | None] | None = None
        self.topk_prompt_logprobs: list[TopkLogprobs | None] | None = None
        self.target_prompt_logprobs: PromptTargetLogprobs | None = None
        self.prompt_cache_hit_tokens = 0
        """Prompt tokens served from the prefix cache or a twin's prefill (admission.py)."""
        self.sequences: list[SampledSequence | None] = [None] * request.num_samples

    @property
    def prefilled(self) -> bool:
        return self.first_logits_V is not None

    @property
    def num_waiting(self) -> int:
        return self.request.num_samples - self.num_admitted

    def response(self) -> SampleResponse:
        assert all(sequence is not None for sequence in self.sequences)
        return SampleResponse(
            sequences=list(self.sequences),
            prompt_logprobs=self.prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_cache_hit_tokens=self.prompt_cache_hit_tokens,
        )


def validate(request: SampleRequest, *, index: int, vocab_size: int, max_seq_len: int) -> None:
    """A ValueError naming request `index` and the parameter if it cannot run."""
    where = f"request {index}"
    if not isinstance(request.params, SamplingParams):
        raise TypeError(f"{where}: params must be SamplingParams, got {type(request.params)}")
    if len(request.prompt) == 0:
        raise ValueError(f"{where}: prompt is empty; it needs at least one token")
    for position, token in enumerate(request.prompt):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(
                f"{where}: prompt token {token!r} at position {position} is outside the "
                f"vocabulary; valid ids are 0..{vocab_size - 1}"
            )
    if len(request.prompt) >= max_seq_len:
        raise ValueError(
            prompt_too_long(
                f"{where}: prompt",
                num_tokens=len(request.prompt),
                context=max_seq_len,
                holder="the sampler (max_seq_len)",
            )
        )
    if request.num_samples < 1:
        raise ValueError(f"{where}: num_samples must be >= 1, got {request.num_samples}")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        value = getattr(request, name)
        if not 0 <= value <= vocab_size:
            raise ValueError(f"{where}: {name} must be in 0..{vocab_size}, got {value}")
    targets = request.target_prompt_logprobs
    if targets is not None:
        if not isinstance(targets, PromptTargets):
            raise TypeError(
                f"{where}: target_prompt_logprobs must be PromptTargets, got {type(targets)}"
            )
        try:
            targets.check(prompt_length=len(request.prompt), vocab_size=vocab_size)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    if request.params.return_support and request.params.temperature == 0:
        raise ValueError(
            f"{where}: return_support needs a temperature > 0 (a greedy token is drawn from "
            "no truncated distribution); use temperature > 0 with top_k=1 for the argmax"
        )
    for token in request.params.stop_token_ids:
        if token >= vocab_size:
            raise ValueError(
                f"{where}: stop token id {token} is outside the vocabulary (0..{vocab_size - 1})"
            )
