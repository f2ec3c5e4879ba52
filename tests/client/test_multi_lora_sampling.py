"""LoRA clients of one ServiceClient sample through one multi-LoRA sampler on their shared
base (generator/multi_lora.py): a snapshot is a copy of the client's adapters, not a merged
model; samples from concurrent clients decode in mixed batches and equal each client alone.
"""

from __future__ import annotations

import torch

from temper import AdamParams, ModelInput, SamplingParams, ServiceClient
from temper.generator.multi_lora import AdapterView, MultiLoraSampler
from tests.client.test_shared_base import _data, _step, _weights, interleaved

ADAM = AdamParams(learning_rate=1e-2)
EIGHT = [dict(rank=2 + 2 * (i % 3), seed=i, train_unembed=i % 2 == 0) for i in range(8)]
VERBS = ["forward_backward", "optim_step", "sample"] * 2 + ["forward_backward", "sample"]


def _train(client, who, steps=1):
    for _ in range(steps):
        client.forward_backward(_data(client.get_tokenizer(), who), "cross_entropy").result()
        client.optim_step(ADAM).result()


def _prompt(client):
    return ModelInput.from_ints(client.get_tokenizer().encode("12="))


def _params(who):
    return SamplingParams(max_tokens=6, temperature=1.0, seed=who)


def test_eight_clients_interleaved_are_bitwise_each_alone(tmp_path):
    shared = ServiceClient(storage_dir=tmp_path / "shared")
    clients = [shared.create_lora_training_client("tiny", **kw) for kw in EIGHT]
    logs = interleaved(clients, VERBS, seed=1)
    # One sampler served every client's snapshots.
    samplers = {id(c.save_weights_and_get_sampling_client().generator.sampler) for c in clients}
    assert len(samplers) == 1
    for who, kw in enumerate(EIGHT):
        alone = ServiceClient(storage_dir=tmp_path / f"alone{who}")
        client = alone.create_lora_training_client("tiny", **kw)
        log = []
        for verb in VERBS:
            _step(client, who, verb, log)
        assert log == logs[who], f"client {who}"
        ours, theirs = _weights(clients[who]), _weights(client)
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), who


def test_concurrent_samples_mix_in_batches_and_equal_each_alone(tmp_path):
    shared = ServiceClient(storage_dir=tmp_path / "shared")
    clients = [shared.create_lora_training_client("tiny", **kw) for kw in EIGHT]
    for who, client in enumerate(clients):
        _train(client, who)
    samplers = [client.save_weights_and_get_sampling_client() for client in clients]
    engine = samplers[0].generator
    assert isinstance(engine, AdapterView)
    batches_before = engine.sampler.num_batches
    futures = [  # every client's request in flight at once
        sampler.sample(_prompt(c), num_samples=3, sampling_params=_params(who))
        for who, (c, sampler) in enumerate(zip(clients, samplers, strict=True))
    ]
    together = [future.result() for future in futures]
    assert engine.sampler.num_batches - batches_before < len(clients)
    for who, kw in enumerate(EIGHT):
        alone = ServiceClient(storage_dir=tmp_path / f"alone{who}")
        client = alone.create_lora_training_client("tiny", **kw)
        _train(client, who)
        sampler = client.save_weights_and_get_sampling_client()
        expected = sampler.sample(_prompt(client), num_samples=3, sampling_params=_params(who))
        expected = expected.result()
        for ours, theirs in zip(together[who].sequences, expected.sequences, strict=True):
            assert ours.tokens == theirs.tokens, who
            torch.testing.assert_close(
                torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=1e-5
            )


def test_a_snapshot_keeps_its_version_while_the_client_trains_on(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "storage")
    client = service.create_lora_training_client("tiny", rank=4, seed=3)
    _train(client, 0)
    old = client.save_weights_and_get_sampling_client()
    before = old.sample(_prompt(client), num_samples=4, sampling_params=_params(0)).result()
    _train(client, 0, steps=3)
    after = old.sample(_prompt(client), num_samples=4, sampling_params=_params(0)).result()
    assert after == before and old.version == 1
    new = client.save_weights_and_get_sampling_client()
    assert new.version == 4 and new.generator.adapter is not old.generator.adapter
    logprobs = new.compute_logprobs(_prompt(client)).result()
    assert logprobs != old.compute_logprobs(_prompt(client)).result()


def test_merged_sampling_stays_available(tmp_path):
    merged = ServiceClient(
        storage_dir=tmp_path / "merged", multi_lora=MultiLoraSampler.Config(enabled=False)
    )
    shared = ServiceClient(storage_dir=tmp_path / "shared")
    results = []
    for service in (merged, shared):
        client = service.create_lora_training_client("tiny", rank=4, seed=2)
        _train(client, 0)
        sampler = client.save_weights_and_get_sampling_client()
        response = sampler.sample(_prompt(client), num_samples=4, sampling_params=_params(5))
        results.append((sampler.generator, response.result()))
    (merged_engine, merged_response), (view, shared_response) = results
    assert not isinstance(merged_engine, AdapterView) and isinstance(view, AdapterView)
    for ours, theirs in zip(shared_response.sequences, merged_response.sequences, strict=True):
        assert ours.tokens == theirs.tokens
        torch.testing.assert_close(
            torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=1e-5
        )
