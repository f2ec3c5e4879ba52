"""generator/vllm_fields.py on fake vLLM outputs (no vLLM needed): the GPU-path answers
(`prompt_token_id_logprobs`, `sampling_mask`, `routed_experts`) become Temper's types, and
what the CPU build cannot give is refused by name."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from temper.api import SamplingParams
from temper.api.prompt_targets import PromptTargets
from temper.generator import vllm_fields
from temper.sampler.requests import SampleRequest


def _logprob(value):
    return SimpleNamespace(logprob=value, rank=1)


def test_native_prompt_token_id_logprobs_become_the_targets_answer():
    targets = PromptTargets.from_ids([[2, 3], [4, -1], [-1, -1], [0, 1]])
    table_RK = np.array([[-1.0, -2.0], [-3.0, -np.inf], [-np.inf, -np.inf], [-4.0, -5.0]])
    output = SimpleNamespace(prompt_token_id_logprobs=table_RK)
    answer = vllm_fields.target_logprobs(output, targets)
    assert answer.to_torch().tolist() == [[-1.0, -2.0], [-3.0, 0.0], [0.0, 0.0], [-4.0, -5.0]]
    assert (answer.crow_indices, answer.col_indices) == (targets.crow_indices, targets.col_indices)
    # The full-vocabulary fallback (vLLM's V1 runner) answers the same cells the same way.
    vocab = {token: _logprob(-float(token)) for token in range(6)}
    fallback = SimpleNamespace(prompt_token_id_logprobs=None, prompt_logprobs=[None] + [vocab] * 4)
    assert vllm_fields.target_logprobs(fallback, targets).to_torch().tolist() == [
        [-2.0, -3.0],
        [-4.0, 0.0],
        [0.0, 0.0],
        [-0.0, -1.0],
    ]


def test_sampling_mask_or_finite_processed_logprobs_give_the_support():
    masked = SimpleNamespace(sampling_mask=SimpleNamespace(token_ids=[[5, 1, 3], [2]]))
    assert vllm_fields.support(masked) == [[1, 3, 5], [2]]
    entries = [
        {4: _logprob(-0.1), 7: _logprob(-2.5), 1: _logprob(-float("inf"))},
        {2: _logprob(0.0), 3: _logprob(-float("inf"))},
    ]
    from_logprobs = SimpleNamespace(sampling_mask=None, logprobs=entries)
    assert vllm_fields.support(from_logprobs) == [[4, 7], [2]]


def test_routed_experts_cover_the_datum_positions():
    prompt, tokens = [1, 2, 3], [4, 5]
    experts_TLE = np.arange(6 * 2 * 3).reshape(6, 2, 3) % 9  # vLLM may hold one extra row
    completion = SimpleNamespace(routed_experts=experts_TLE, token_ids=tokens)
    request = SampleRequest(prompt=prompt)
    fields = vllm_fields.sequence_fields(
        completion, request=request, num_experts=9, record_routes=True
    )
    routes = fields["routed_experts"]
    assert routes.shape == (4, 2, 3) and routes.dtype == "uint8"
    assert torch.equal(routes.to_torch(), torch.from_numpy(experts_TLE[:4]).long())
    short = SimpleNamespace(routed_experts=experts_TLE[:3], token_ids=tokens)
    with pytest.raises(ValueError, match=r"expected \[>= 4 tokens"):
        vllm_fields.sequence_fields(short, request=request, num_experts=9, record_routes=True)


def test_request_fields_per_runner():
    targets = PromptTargets.from_ids([[2], [3]])
    params = SamplingParams(top_k=5, top_p=0.9, return_support=True)
    request = SampleRequest(prompt=[1, 2, 3], params=params, target_prompt_logprobs=targets)
    v1 = vllm_fields.request_fields(request, v2=False)
    assert v1 == {"logprobs": 5, "prompt_logprobs": -1}
    v2 = vllm_fields.request_fields(dataclasses.replace(request, topk_sample_logprobs=8), v2=True)
    assert v2["logprobs"] == 8 and v2["prompt_logprob_token_ids"].tolist() == [[2], [3]]
    assert vllm_fields.request_fields(SampleRequest(prompt=[1]), v2=True) == {}


def test_what_the_cpu_build_cannot_give_is_refused_with_the_reason():
    no_top_k = SampleRequest(prompt=[1], params=SamplingParams(top_p=0.9, return_support=True))
    with pytest.raises(
        ValueError, match="request 0: return_support on the vllm backend needs top_k"
    ):
        vllm_fields.check_request(no_top_k, where="request 0")
    with pytest.raises(ValueError, match="needs a MoE model"):
        vllm_fields.check_routes(num_experts=0, v2=True)
    with pytest.raises(ValueError, match="Model Runner V2 only, which needs Triton"):
        vllm_fields.check_routes(num_experts=8, v2=False)
    vllm_fields.check_routes(num_experts=8, v2=True)
