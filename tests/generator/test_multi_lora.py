"""MultiLoraSampler (generator/multi_lora.py): many adapters on one engine, rows mixed.

A mixed batch (rows of different adapters, continuous batching, one KV-cache pool) gives each
adapter's samples as that adapter alone on the same sampler (seeded tokens equal, logprobs
within fp32 rounding) and as its merged weights in a plain engine; adapters beyond the
resident slots run in rounds; capacity errors name the setting; concurrent calls batch.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import threading

import pytest
import torch

from temper.api import SamplingParams
from temper.generator.multi_lora import AdapterCapacityError, MultiLoraSampler
from temper.models.lora import LoraConfig
from temper.sampler.engine import SamplerEngine, SampleRequest
from tests.models.test_multi_lora import trained_adapters
from tests.sampler.test_decode_loop import JoinAtStep

CONFIGS = [
    LoraConfig(rank=2, seed=1),
    LoraConfig(rank=4, seed=2, train_unembed=False),
    LoraConfig(rank=8, seed=3, train_mlp=False, alpha=8.0),
    LoraConfig(rank=4, seed=4, train_attn=False),
]
ENGINE = SamplerEngine.Config(max_batch=8, max_seq_len=64)
PROMPTS = [[3, 4, 5], [7], [1, 2, 3, 4], [9, 9, 2, 5, 1], [2, 2]]


@pytest.fixture(scope="module")
def base_and_adapters():
    """(the frozen base, [(config, adapter tensors)], [each adapter's merged plain model])."""
    return trained_adapters(CONFIGS)


def _sampler(base, **config):
    return MultiLoraSampler.Config(**config).build(
        model=copy.deepcopy(base), tokenizer=None, engine=ENGINE
    )


def _requests(who, *, num_samples=2):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=100 + who)
    return [
        SampleRequest(prompt=prompt, params=params, num_samples=num_samples, prompt_logprobs=True)
        for prompt in PROMPTS[who % len(PROMPTS) :][:2]
    ]


def _tokens_and_logprobs(responses):
    tokens = [[s.tokens for s in r.sequences] for r in responses]
    logprobs = [torch.tensor([lp for s in r.sequences for lp in s.logprobs]) for r in responses]
    return tokens, logprobs


def _concurrently(sampler, calls):
    """Each (requests, adapter) call from its own thread, released together."""
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(index, requests, adapter):
        barrier.wait()
        results[index] = sampler.generate(requests, adapter=adapter)

    threads = [
        threading.Thread(target=run, args=(i, requests, adapter))
        for i, (requests, adapter) in enumerate(calls)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_mixed_calls_equal_each_adapter_alone_and_its_merged_weights(base_and_adapters):
    base, adapters, merged = base_and_adapters
    mixed = _sampler(base)
    registered = [
        mixed.register(config=c, tensors=t, version=i) for i, (c, t) in enumerate(adapters)
    ]
    together = _concurrently(mixed, [(_requests(i), a) for i, a in enumerate(registered)])
    assert mixed.num_loads == len(adapters)  # each loaded once, none evicted
    assert mixed.num_batches < len(adapters)  # calls that met in the queue shared a batch
    for who, (config, tensors) in enumerate(adapters):
        alone = _sampler(base)
        adapter = alone.register(config=config, tensors=tensors, version=0)
        expected = alone.generate(_requests(who), adapter=adapter)
        tokens, logprobs = _tokens_and_logprobs(together[who])
        expected_tokens, expected_logprobs = _tokens_and_logprobs(expected)
        assert tokens == expected_tokens, who
        for ours, theirs in zip(logprobs, expected_logprobs, strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        for ours, theirs in zip(together[who], expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(ours.prompt_logprobs[1:]),
                torch.tensor(theirs.prompt_logprobs[1:]),
                atol=1e-5,
                rtol=1e-5,
            )
        # ... and the merged model's plain engine draws the same tokens.
        plain = ENGINE.build(model=merged[who])
        assert _tokens_and_logprobs(plain.generate(_requests(who)))[0] == tokens, who


def test_one_adapter_alone_is_bitwise_whatever_else_is_loaded(base_and_adapters):
    base, adapters, _ = base_and_adapters
    crowded = _sampler(base)
    held = [crowded.register(config=c, tensors=t, version=0) for c, t in adapters]
    crowded.generate(_requests(0), adapter=held[2])  # rank 8 loaded: the slots grow
    ours = crowded.generate(_requests(1), adapter=held[1])
    alone = _sampler(base)
    theirs = alone.generate(
        _requests(1),
        adapter=alone.register(config=adapters[1][0], tensors=adapters[1][1], version=0),
    )
    assert ours == theirs


def test_more_adapters_than_slots_run_in_rounds(base_and_adapters):
    base, adapters, _ = base_and_adapters
    small = _sampler(base, max_resident_adapters=2)
    registered = [small.register(config=c, tensors=t, version=0) for c, t in adapters]
    results = _concurrently(small, [(_requests(i), a) for i, a in enumerate(registered)])
    roomy = _sampler(base)
    for who, (config, tensors) in enumerate(adapters):
        adapter = roomy.register(config=config, tensors=tensors, version=0)
        expected = roomy.generate(_requests(who), adapter=adapter)
        assert _tokens_and_logprobs(results[who])[0] == _tokens_and_logprobs(expected)[0]
    assert small.num_loads >= len(adapters)  # slots were reused
    # An adapter used again after being evicted is loaded again from its host copy.
    again = small.generate(_requests(0), adapter=registered[0])
    assert _tokens_and_logprobs(again)[0] == _tokens_and_logprobs(results[0])[0]


def test_capacity_is_a_clear_error_and_dropped_adapters_free_it(base_and_adapters):
    base, adapters, _ = base_and_adapters
    sampler = _sampler(base, max_adapters=2)
    config, tensors = adapters[0]
    held = [sampler.register(config=config, tensors=tensors, version=v) for v in range(2)]
    with pytest.raises(AdapterCapacityError, match="max_adapters = 2"):
        sampler.register(config=config, tensors=tensors, version=2)
    del held[0]
    gc.collect()
    sampler.register(config=config, tensors=tensors, version=3)  # room again


def test_an_adapter_is_a_copy_unchanged_by_later_writes(base_and_adapters):
    base, adapters, _ = base_and_adapters
    sampler = _sampler(base)
    config, tensors = adapters[0]
    live = {k: v.clone() for k, v in tensors.items()}
    adapter = sampler.register(config=config, tensors=live, version=0)
    before = sampler.generate(_requests(0), adapter=adapter)
    for tensor in live.values():
        tensor.add_(1.0)  # the trainer steps on
    assert sampler.generate(_requests(0), adapter=adapter) == before


def test_a_bad_request_fails_its_own_call_only(base_and_adapters):
    base, adapters, _ = base_and_adapters
    sampler = _sampler(base)
    good, other = (sampler.register(config=c, tensors=t, version=0) for c, t in adapters[:2])
    bad = [SampleRequest(prompt=[1, 99], params=SamplingParams(max_tokens=3))]
    errors = []

    def run_bad():
        try:
            sampler.generate(bad, adapter=other)
        except ValueError as error:
            errors.append(str(error))

    thread = threading.Thread(target=run_bad)
    thread.start()
    responses = sampler.generate(_requests(0), adapter=good)
    thread.join()
    assert len(responses) == 2 and errors and "outside the vocabulary" in errors[0]


def test_scoring_uses_the_adapter(base_and_adapters):
    base, adapters, merged = base_and_adapters
    sampler = _sampler(base)
    sequences = [[1, 2, 3, 4, 5], [7, 8, 9]]
    for who, (config, tensors) in enumerate(adapters):
        adapter = sampler.register(config=config, tensors=tensors, version=0)
        ours = sampler.score(sequences, adapter=adapter)
        theirs = ENGINE.build(model=merged[who]).score(sequences)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_slot_given_another_adapter_forgets_its_cached_prefixes(base_and_adapters):
    base, adapters, _ = base_and_adapters
    one_slot = _sampler(base, max_resident_adapters=1)
    first, second = (one_slot.register(config=c, tensors=t, version=0) for c, t in adapters[:2])
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    (turn,) = one_slot.generate([SampleRequest(prompt=[3, 4, 5], params=params)], adapter=first)
    follow_up = SampleRequest(prompt=[3, 4, 5, *turn.sequences[0].tokens, 1], params=params)
    ours = one_slot.generate([follow_up], adapter=second)  # loaded into the first's slot
    assert one_slot.engine.prefix_cache.num_hits == 0
    fresh = _sampler(base)
    again = fresh.register(config=adapters[1][0], tensors=adapters[1][1], version=0)
    theirs = fresh.generate([follow_up], adapter=again)
    assert _tokens_and_logprobs(ours)[0] == _tokens_and_logprobs(theirs)[0]
    # The first adapter's own next turn, loaded back, starts from scratch too; its turn
    # after that reuses what it just computed.
    (again,) = one_slot.generate([follow_up], adapter=first)
    assert one_slot.engine.prefix_cache.num_hits == 0
    next_turn = [*follow_up.prompt, *again.sequences[0].tokens, 2]
    one_slot.generate([SampleRequest(prompt=next_turn, params=params)], adapter=first)
    assert one_slot.engine.prefix_cache.num_hits == 1


def test_a_call_of_another_adapter_joins_the_running_batch(base_and_adapters):
    """Submitted while adapter 0's call decodes, adapter 1's call loads its adapter between
    steps and decodes in the same steps (one batch from idle); each equals its adapter alone."""
    base, adapters, _ = base_and_adapters
    sampler = _sampler(base)
    first, second = (sampler.register(config=c, tensors=t, version=0) for c, t in adapters[:2])
    long_first = [dataclasses.replace(r, num_samples=1) for r in _requests(0)]
    joining = JoinAtStep(sampler.engine)
    ours = joining.run(
        lambda: sampler.generate(long_first, adapter=first),
        lambda: sampler.generate(_requests(1), adapter=second),
    )
    assert sampler.num_batches == 1 and sampler.engine.loop.num_joined_running == 1
    assert max(joining.rows_per_step) == 2 + 4  # both adapters' rows in one step
    for requests, (config, tensors), response in zip(
        (long_first, _requests(1)), adapters[:2], ours, strict=True
    ):
        alone = _sampler(base)
        adapter = alone.register(config=config, tensors=tensors, version=0)
        expected = alone.generate(requests, adapter=adapter)
        assert _tokens_and_logprobs(response)[0] == _tokens_and_logprobs(expected)[0]
        for a, b in zip(*(_tokens_and_logprobs(r)[1] for r in (response, expected)), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
