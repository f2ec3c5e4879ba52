"""The KV-cache engine on a Qwen3-MoE model against full-forward references: seeded sampling,
sampled logprobs, samples of one prompt sharing its prefill, the prefix cache across calls,
and `score()` (what `compute_logprobs` runs). Greedy decoding equal to a full forward is in
tests/models/qwen3_moe/test_hf_parity.py.

A MoE layer computes each expert's rows in one matmul, so a token's result depends on how
many other tokens its experts serve in the same forward (the kernel's blocking by row count,
as in any linear layer) and not otherwise: across batch compositions tokens are equal and
logprobs agree to float rounding, as on the dense models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size
from temper.models.common.logprobs import forward_logprobs
from temper.sampler.admission import Admission
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

VOCAB = 31
PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], [2, 2, 2, 2, 2]]


@pytest.fixture(scope="module")
def model():
    # Logits of order 2 (init_std 0.1): distributions far from uniform; layer 1 is dense.
    config = dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=VOCAB), init_std=0.1, mlp_only_layers=(1,)
    )
    return materialize(config, seed=5, dtype="float32").eval()


def _engine(model, **config):
    fields = {"max_batch": 8, "max_seq_len": 64, "cpu": CpuDecoding.Config(processes=1)}
    return SamplerEngine.Config(**{**fields, **config}).build(model=model)


def _assert_same_sample(a, b):
    """The same tokens; logprobs equal to float rounding (another batch composition)."""
    assert a.tokens == b.tokens
    torch.testing.assert_close(
        torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5
    )


def test_seeded_samples_do_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = _engine(model, max_batch=2).sample(PROMPTS[3], params, num_samples=3)
    crowd = [
        SampleRequest(prompt=PROMPTS[0], params=SamplingParams(max_tokens=7, temperature=0.5)),
        SampleRequest(prompt=PROMPTS[3], params=params, num_samples=3),
        SampleRequest(prompt=PROMPTS[2], params=SamplingParams(max_tokens=3, top_k=4, seed=9)),
    ]
    in_crowd = _engine(model).generate(crowd)[1]
    for a, b in zip(alone.sequences, in_crowd.sequences, strict=True):
        _assert_same_sample(a, b)
    assert len({tuple(s.tokens) for s in alone.sequences}) == 3  # samples differ from each other
    again = _engine(model, max_batch=2).sample(PROMPTS[3], params, num_samples=3)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in alone.sequences]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=0.7, seed=11),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=3),
    ],
    ids=["temperature", "top-k"],
)
def test_sampled_logprobs_equal_full_forward_logprobs(model, params):
    engine = _engine(model)
    prompt = PROMPTS[2]
    response = engine.sample(prompt, params, num_samples=4)
    for sequence in response.sequences:
        tokens_T = torch.tensor(prompt + sequence.tokens)
        with torch.no_grad():
            logits_TV = model(tokens_T[None, :-1])[0, len(prompt) - 1 :].float()
        logits_TV = logits_TV / params.temperature
        if params.top_k > 0:
            kth_T1 = logits_TV.topk(params.top_k, dim=-1).values[:, -1:]
            logits_TV = logits_TV.masked_fill(logits_TV < kth_T1, float("-inf"))
        expected_T = logits_TV.log_softmax(-1).gather(-1, tokens_T[len(prompt) :, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), expected_T, rtol=0, atol=1e-5)


def test_samples_and_requests_of_one_prompt_share_its_prefill(model, monkeypatch):
    rows = []
    prefill = Admission._prefill
    monkeypatch.setattr(
        Admission, "_prefill", lambda self, r: (rows.append(len(r)), prefill(self, r))
    )
    # More samples than slots: the waiting ones keep a copy of the prompt's cache.
    engine = _engine(model, max_batch=2)
    greedy = engine.sample(PROMPTS[2], SamplingParams(max_tokens=5, temperature=0), num_samples=5)
    assert rows == [1]
    assert len({tuple(s.tokens) for s in greedy.sequences}) == 1
    rows.clear()
    requests = [
        SampleRequest(prompt=prompt, params=SamplingParams(max_tokens=5, seed=seed))
        for seed, prompt in enumerate([[3, 4, 5], [3, 4, 5], [7, 1], [3, 4, 5]])
    ]
    shared = _engine(model).generate(requests)
    assert rows == [2]  # two distinct prompts
    for request, response in zip(requests, shared, strict=True):
        (alone,) = _engine(model).generate([request])
        _assert_same_sample(response.sequences[0], alone.sequences[0])


def test_later_turns_hit_the_prefix_cache_and_sample_what_a_cold_engine_does(model):
    """Three conversations, each turn's prompt the last prompt, its completion and two
    'observation' tokens: from turn 2 on each prompt's start is in the prefix cache."""

    def conversations(engine):
        prompts, transcript = [[3, 4, 5], [7, 1], [2, 2, 2, 9]], []
        for turn in range(3):
            requests = [
                SampleRequest(prompt=p, params=SamplingParams(max_tokens=4, seed=10 * turn + i))
                for i, p in enumerate(prompts)
            ]
            sequences = [response.sequences[0] for response in engine.generate(requests)]
            transcript += sequences
            prompts = [
                p + s.tokens + [turn + 1, 30 - turn]
                for p, s in zip(prompts, sequences, strict=True)
            ]
        return transcript

    warm = _engine(model)
    cached = conversations(warm)
    assert warm.prefix_cache.num_hits == 6  # every prompt of turns 2 and 3
    cold = conversations(_engine(model, prefix_cache_mib=0))
    for a, b in zip(cached, cold, strict=True):
        _assert_same_sample(a, b)


def test_score_is_bitwise_the_trainer_logprob_function(model):
    """`score()` (`compute_logprobs`) runs the trainer's full forward on the same batch."""
    engine = _engine(model)
    sequences = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    scored = engine.score(sequences)
    tokens_BT = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]])
    with torch.no_grad():
        expected_BT = forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:])
    assert torch.equal(scored[0], expected_BT[0])
    assert torch.equal(scored[1], expected_BT[1, :2])


def test_prompt_logprobs_equal_the_full_forward(model):
    prompt = PROMPTS[2] + PROMPTS[4]
    request = SampleRequest(
        prompt=prompt, params=SamplingParams(max_tokens=2, seed=0), prompt_logprobs=True
    )
    (response,) = _engine(model).generate([request])
    (scored,) = _engine(model).score([prompt])
    assert response.prompt_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(response.prompt_logprobs[1:]), scored, rtol=0, atol=1e-5
    )
