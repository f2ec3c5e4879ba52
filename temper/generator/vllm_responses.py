"""A vLLM `RequestOutput` as Temper's `SampleResponse`: sampled tokens and logprobs, top-k
and prompt logprobs, routes and target logprobs (vllm_fields.py), prompt cache hits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from temper.api.types import SampledSequence, SampleResponse, TopkLogprobs
from temper.generator import vllm_fields
from temper.sampler.requests import SampleRequest


def response_of(
    request: SampleRequest, output: Any, *, num_experts: int | None, record_routes: bool
) -> SampleResponse:
    """The `SampleResponse` of one vLLM `RequestOutput` for `request`."""
    prompt_logprobs = topk_prompt = None
    if request.prompt_logprobs:
        prompt_logprobs = actual_logprobs(output.prompt_logprobs, request.prompt)
    if request.topk_prompt_logprobs:
        topk_prompt = [
            None if entry is None else _topk(entry, request.topk_prompt_logprobs)
            for entry in output.prompt_logprobs
        ]
    k = request.topk_sample_logprobs
    sequences = []
    # vLLM returns a request's samples in completion order; their index is their order.
    for completion in sorted(output.outputs, key=lambda completion: completion.index):
        tokens = list(completion.token_ids)
        sequences.append(
            SampledSequence(
                tokens=tokens,
                logprobs=[
                    entry[token].logprob
                    for entry, token in zip(completion.logprobs, tokens, strict=True)
                ],
                stop_reason="stop" if completion.finish_reason == "stop" else "length",
                topk_logprobs=[_topk(e, k) for e in completion.logprobs] if k else None,
                **vllm_fields.sequence_fields(
                    completion,
                    request=request,
                    num_experts=num_experts,
                    record_routes=record_routes,
                ),
            )
        )
    if len(sequences) < request.num_samples:  # greedy: one sample, see the docstring
        sequences = sequences * request.num_samples
    targets = request.target_prompt_logprobs
    return SampleResponse(
        sequences=sequences,
        prompt_logprobs=prompt_logprobs,
        topk_prompt_logprobs=topk_prompt,
        target_prompt_logprobs=None
        if targets is None
        else vllm_fields.target_logprobs(output, targets),
        prompt_cache_hit_tokens=output.num_cached_tokens or 0,
    )


def actual_logprobs(entries: Sequence[Any], tokens: Sequence[int]) -> list[float | None]:
    """Each position's logprob of the token actually there (None at position 0)."""
    pairs = zip(entries[1:], tokens[1:], strict=True)
    return [None, *(entry[token].logprob for entry, token in pairs)]


def _topk(entry: Mapping[int, Any], k: int) -> TopkLogprobs:
    """The k most likely tokens of one position, most likely first (vLLM's dict also holds
    the sampled token, which may rank lower)."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank)
    return [(token, logprob.logprob) for token, logprob in ranked if logprob.rank <= k][:k]
