"""`SamplingClient.batch()`: samples sent in the block decode as one batch whatever the timing,
so their tokens and logprobs are those of one engine call with all of them."""

from __future__ import annotations

import time

import pytest

from temper import ModelInput, SamplingParams, ServiceClient
from temper.sampler.requests import SampleRequest


@pytest.fixture
def sampler(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    return service.create_training_client("tiny").save_weights_and_get_sampling_client()


def _requests(tokenizer) -> list[SampleRequest]:
    return [
        SampleRequest(
            prompt=tokenizer.encode(f"{index * 7}+{index}="),
            params=SamplingParams(max_tokens=6, temperature=1.0, seed=100 + index),
            num_samples=3,
        )
        for index in range(5)
    ]


def _answers(responses):
    return [[(s.tokens, s.logprobs) for s in r.sequences] for r in responses]


def test_samples_sent_slowly_in_a_block_equal_one_engine_batch(sampler):
    requests = _requests(sampler.get_tokenizer())
    one_batch = _answers(sampler.generator.generate(requests))
    calls = []
    generate = sampler.generator.generate
    sampler.generator.generate = lambda batch, **kw: (
        calls.append(len(batch)) or generate(batch, **kw)
    )
    with sampler.batch():
        futures = []
        for request in requests:
            prompt = ModelInput.from_ints(list(request.prompt))
            futures.append(sampler.sample(prompt, request.num_samples, request.params))
            time.sleep(0.05)  # the worker is free: without the block, each would run alone
    assert calls == [] or calls == [len(requests)]
    assert _answers([future.result() for future in futures]) == one_batch
    assert calls == [len(requests)]
