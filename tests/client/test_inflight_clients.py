"""In-flight sampling clients (client/inflight.py): one mutable target per training client that
every in-flight save moves on, for clients made before and after it; a save never waits for a
sample in progress, which goes on with the newer weights; each client its own prefix-cache
namespace; every sequence says which versions it was decoded with."""

from __future__ import annotations

import threading

import pytest

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

ADAM = AdamParams(learning_rate=1e-2)
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return ServiceClient(storage_dir=tmp_path_factory.mktemp("storage"))


def _make(service, lora):
    if lora:
        return service.create_lora_training_client("tiny", rank=4, seed=1)
    return service.create_training_client("tiny")


def _step(client):
    tokenizer = client.get_tokenizer()
    tokens = [*tokenizer.encode("12=3"), tokenizer.eos_token_id]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    client.forward_backward([datum], "cross_entropy")
    client.optim_step(ADAM).result()


def _probe(sampler):
    sequence = sampler.sample(ModelInput.from_ints([5, 6, 7]), 1, GREEDY).result().sequences[0]
    return sequence.tokens, sequence.logprobs, sequence.weight_versions


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_inflight_client_samples_the_newest_save(service, lora):
    client = _make(service, lora)
    first = client.save_weights_and_get_sampling_client(kind="inflight")
    tokens0, logprobs0, versions0 = _probe(first)
    assert versions0 == (0,) and first.version == 0
    _step(client)
    _step(client)
    # Not saved yet: the target stays where the last save put it.
    assert _probe(first)[:2] == (tokens0, logprobs0)
    second = client.save_weights_and_get_sampling_client(kind="inflight")
    snapshot = client.save_weights_and_get_sampling_client()  # the same weights, fixed
    expected_tokens, expected_logprobs, _ = _probe(snapshot)
    assert logprobs0 != expected_logprobs
    for sampler in (first, second):
        tokens, logprobs, versions = _probe(sampler)
        assert versions == (2,)
        assert tokens == expected_tokens
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)
    assert (first.version, second.version) == (0, 2)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_save_does_not_wait_for_a_sample_that_then_spans_both_versions(service, lora):
    client = _make(service, lora=lora)
    sampler = client.save_weights_and_get_sampling_client(kind="inflight")
    target = client._inflight.target
    # Full fine-tuning: the target's own engine; LoRA: the multi-LoRA sampler's shared one.
    engine = target.generator.sampler.engine if lora else target.generator
    # Hold the sample in its decode loop (third turn) until the next save has returned.
    reached, saved = threading.Event(), threading.Event()
    calls = [0]
    switch_steps = engine.between_steps

    def hook(engine_):
        calls[0] += 1
        if calls[0] == 3:
            reached.set()
            assert saved.wait(timeout=120), "the save waited for the sample"
        return switch_steps(engine_)

    engine.between_steps = hook
    try:
        params = SamplingParams(max_tokens=12, temperature=0, stop=[])
        future = sampler.sample(ModelInput.from_ints([5, 6, 7]), 2, params)
        assert reached.wait(timeout=120)
        _step(client)
        newer = client.save_weights_and_get_sampling_client(kind="inflight")
        saved.set()
        response = future.result()
    finally:
        engine.between_steps = switch_steps
    assert [s.weight_versions for s in response.sequences] == [(0, 1), (0, 1)]
    assert target.switch.num_switches == 1 and target.generator.version == 1
    assert _probe(newer)[2] == (1,)


def test_each_inflight_client_is_its_own_prefix_cache_namespace(service):
    client = _make(service, lora=False)
    one = client.save_weights_and_get_sampling_client(kind="inflight")
    two = client.save_weights_and_get_sampling_client(kind="inflight")  # no step between
    cache = client._inflight.target.generator.prefix_cache
    params = SamplingParams(max_tokens=6, temperature=0, stop=[])
    prompt = [5, 6, 7, 8]
    tokens = one.sample(ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens
    turn = ModelInput.from_ints([*prompt, *tokens, 9])
    hits = cache.num_hits
    # Another namespace: no hit on one's entries.
    tokens2 = two.sample(turn, 1, params).result().sequences[0].tokens
    assert cache.num_hits == hits
    two.sample(ModelInput.from_ints([*turn.to_ints(), *tokens2, 3]), 1, params).result()
    assert cache.num_hits == hits + 1  # its own entries
