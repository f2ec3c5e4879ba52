"""`SamplingParams.return_support` on Temper's engine: the kept set of every drawn token
equals what Temper's sampling transform keeps on a full forward's logits, and costs nothing
to a request that does not ask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.support import support_of_logits

VOCAB = 31
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2]]


@pytest.fixture(scope="module")
def model():
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32").eval()


def _full_forward_logits(model, prompt, tokens):
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1 :].float()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1, stop=[]),
        SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=2, stop=[]),
        SamplingParams(max_tokens=8, temperature=1.3, top_k=8, top_p=0.8, seed=3, stop=[]),
        SamplingParams(max_tokens=8, temperature=1.0, seed=4, stop=[]),
    ],
    ids=["top_p", "top_k", "top_k_top_p", "untruncated"],
)
def test_support_is_the_kept_set_of_temper_sampling_transform(model, params):
    engine = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(model=model)
    params = dataclasses.replace(params, return_support=True)
    requests = [SampleRequest(prompt=p, params=params, num_samples=3) for p in PROMPTS]
    for prompt, response in zip(PROMPTS, engine.generate(requests), strict=True):
        for sequence in response.sequences:
            logits_TV = _full_forward_logits(model, prompt, sequence.tokens)
            assert sequence.support == support_of_logits(logits_TV, params)
            assert all(t in s for t, s in zip(sequence.tokens, sequence.support, strict=True))
    if params.top_k < 0 and params.top_p == 1:
        assert all(len(s) == VOCAB for s in sequence.support)
    else:  # truncation keeps fewer than the vocabulary somewhere
        assert min(len(s) for s in sequence.support) < VOCAB


def test_support_only_when_asked_and_not_for_greedy(model):
    engine = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(model=model)
    plain = SamplingParams(max_tokens=4, top_p=0.9, seed=1)
    asked = dataclasses.replace(plain, return_support=True)
    mixed = engine.generate(
        [
            SampleRequest(prompt=PROMPTS[0], params=plain),
            SampleRequest(prompt=PROMPTS[0], params=asked),
        ]
    )
    assert mixed[0].sequences[0].support is None
    assert len(mixed[1].sequences[0].support) == len(mixed[1].sequences[0].tokens)
    # The same seed draws the same tokens whether the support is returned or not.
    assert mixed[0].sequences[0].tokens == mixed[1].sequences[0].tokens
    greedy = SamplingParams(max_tokens=4, temperature=0, return_support=True)
    with pytest.raises(ValueError, match="return_support needs a temperature > 0"):
        engine.generate([SampleRequest(prompt=PROMPTS[0], params=greedy)])
    with pytest.raises(TypeError, match="return_support must be a bool"):
        SamplingParams(return_support="yes")
