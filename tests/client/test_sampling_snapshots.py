"""A sampling client is a snapshot of one policy version: it keeps sampling that version after
the trainer moves on (copy-on-write), and nothing is copied when no old client is alive."""

from __future__ import annotations

import gc

import pytest
import torch

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient

ADAM = AdamParams(learning_rate=1e-2)
GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def service(tmp_path):
    return ServiceClient(storage_dir=tmp_path / "storage")


def _make(service, lora):
    if lora:
        return service.create_lora_training_client("tiny", rank=4, seed=1)
    return service.create_training_client("tiny")


def _data(tokenizer):
    data = []
    for index in range(4):
        tokens = [*tokenizer.encode(f"{index}{index}={2 * index}"), tokenizer.eos_token_id]
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    return data


def _step(client, data):
    client.forward_backward(data, "cross_entropy")
    client.optim_step(ADAM).result()


def _probe(sampler, tokens):
    """Greedy tokens and per-token logprobs: what a version answers."""
    prompt = ModelInput.from_ints(tokens[:3])
    sequence = sampler.sample(prompt, 1, GREEDY).result().sequences[0]
    return sequence.tokens, sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_client_taken_before_optim_step_still_samples_its_version(service, lora):
    client = _make(service, lora)
    data = _data(client.get_tokenizer())
    tokens = data[1].model_input.to_ints()
    _step(client, data)
    old = client.save_weights_and_get_sampling_client()
    before = _probe(old, tokens)
    for _ in range(3):
        _step(client, data)
    new = client.save_weights_and_get_sampling_client()
    assert (old.version, new.version) == (1, 4)
    assert _probe(old, tokens) == before  # bitwise: the same weights, kept aside
    assert _probe(new, tokens)[1] != before[1]  # the trainer did move on
    assert old.generator is not new.generator
    assert client.num_sampler_snapshots == 1


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_no_copy_when_the_old_client_is_gone(service, lora):
    client = _make(service, lora)
    data = _data(client.get_tokenizer())
    first = client.save_weights_and_get_sampling_client()
    _probe(first, data[0].model_input.to_ints())
    engine = first.generator
    del first
    gc.collect()
    for _ in range(2):
        _step(client, data)
        _probe(client.save_weights_and_get_sampling_client(), data[0].model_input.to_ints())
    assert client.num_sampler_snapshots == 0
    assert client.save_weights_and_get_sampling_client().generator is engine  # reused in place
    if not lora:
        assert engine.model is client.engine.model


def test_sampling_overlapping_training_sees_one_version(service):
    """Samples submitted just before a training step run on their own worker, concurrently
    with it, and still answer from the version they were asked of."""
    client = _make(service, lora=False)
    data = _data(client.get_tokenizer())
    old = client.save_weights_and_get_sampling_client()
    tokens = data[2].model_input.to_ints()
    reference = _probe(old, tokens)
    prompt = ModelInput.from_ints(tokens[:3])
    samples = [old.sample(prompt, 1, GREEDY) for _ in range(8)]
    logprobs = old.compute_logprobs(ModelInput.from_ints(tokens))
    for _ in range(3):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(ADAM)
    assert client.optim_step(ADAM).result().metrics["policy_version:max"] == 4
    assert all(f.result().sequences[0].tokens == reference[0] for f in samples)
    assert logprobs.result() == reference[1]
    assert _probe(old, tokens) == reference


def test_load_state_keeps_live_clients_on_their_version(service):
    client = _make(service, lora=False)
    data = _data(client.get_tokenizer())
    path = client.save_state("start").result().path
    _step(client, data)
    trained = client.save_weights_and_get_sampling_client()
    tokens = data[0].model_input.to_ints()
    before = _probe(trained, tokens)
    client.load_state(path).result()
    assert _probe(trained, tokens) == before
    restored = client.save_weights_and_get_sampling_client()
    assert restored.version == 0
    torch.testing.assert_close(
        torch.tensor(_probe(restored, tokens)[1][1:]),
        torch.tensor(_probe(service.create_sampling_client(base_model="tiny"), tokens)[1][1:]),
        rtol=0,
        atol=0,
    )
