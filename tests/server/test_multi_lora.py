"""Eight concurrent LoRA clients of `temper serve`, through the official tinker SDK, train and
sample on one base model and one multi-LoRA sampler (generator/multi_lora.py).

Each client's losses are bitwise those of a twin (same rank and seed) run alone afterwards,
and its seeded samples, drawn in batches mixed with the other clients' rows, are the twin's
tokens with logprobs within fp32 rounding. Beyond `--multi-lora.max-adapters` the oldest
snapshots make room, and with none left a snapshot fails with a message naming the setting.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=1e-2)
CLIENTS = [dict(rank=2 + 2 * (i % 3), seed=i, train_unembed=i % 2 == 0) for i in range(8)]


def _run(service, model_dir, who, config, start=None):
    """Create, train two steps, snapshot and sample; returns (losses, samples)."""
    model = service.create_lora_training_client(str(model_dir), **config).result()
    tokenizer = model.get_tokenizer()
    data = [datum(tokenizer, f"{who}{who + 1}=3"), datum(tokenizer, f"{who % 5 + 4}5=9")]
    if start is not None:
        start.wait()
    losses = []
    for _ in range(2):
        losses.append(model.forward_backward(data, "cross_entropy").result().metrics)
        model.optim_step(ADAM).result()
    sampler = model.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12="))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=who)
    response = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    return losses, [(s.tokens, s.logprobs) for s in response.sequences]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_eight_concurrent_lora_clients_train_and_sample_as_if_alone(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path / "storage", tmp_path / "server.log")
    try:
        sessions = [server.service() for _ in CLIENTS]
        results: list = [None] * len(CLIENTS)
        errors: list = []
        start = threading.Barrier(len(CLIENTS))

        def client(who):
            try:
                results[who] = _run(sessions[who], model_dir, who, CLIENTS[who], start)
            except BaseException as error:  # reported below
                errors.append(error)
                start.abort()

        threads = [threading.Thread(target=client, args=(w,)) for w in range(len(CLIENTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        for service in sessions:
            service.close("success").result()

        for who, config in enumerate(CLIENTS):
            service = server.service()
            losses, samples = _run(service, model_dir, who, config)
            assert losses == results[who][0], f"client {who}"
            for (tokens, logprobs), (their_tokens, their_logprobs) in zip(
                results[who][1], samples, strict=True
            ):
                assert tokens == their_tokens, f"client {who}"
                torch.testing.assert_close(
                    torch.tensor(logprobs), torch.tensor(their_logprobs), atol=1e-5, rtol=1e-5
                )
            service.close("success").result()
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_adapter_capacity_evicts_old_snapshots_then_refuses_clearly(model_dir, tmp_path):
    extra = ("--multi-lora.max-adapters", "2")
    server = start_server(model_dir, tmp_path / "storage", tmp_path / "server.log", *extra)
    try:
        service = server.service()
        first, second, third = (
            service.create_lora_training_client(str(model_dir), rank=2, seed=s).result()
            for s in range(3)
        )
        prompt = types.ModelInput.from_ints(first.get_tokenizer().encode("12="))
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        old = first.save_weights_and_get_sampling_client().result()
        old.sample(prompt, num_samples=1, sampling_params=params).result()
        newer = first.save_weights_and_get_sampling_client().result()  # same weights: same one
        newer.sample(prompt, num_samples=1, sampling_params=params).result()
        second.save_weights_and_get_sampling_client().result()  # two adapters: full
        # The third model's snapshot makes room by evicting the oldest snapshot...
        with pytest.raises(Exception, match="max-adapters 2"):
            # ... but each model keeps its newest adapter version, so nothing frees a slot.
            third.save_weights_and_get_sampling_client().result()
        with pytest.raises(Exception, match="max-adapters"):
            old.sample(prompt, num_samples=1, sampling_params=params).result()
        # The models themselves are untouched: training goes on.
        data = [datum(first.get_tokenizer(), "12=3")]
        first.forward_backward(data, "cross_entropy").result()
        first.optim_step(ADAM).result()
    finally:
        server.stop()
