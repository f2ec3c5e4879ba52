"""`temper serve --generator.backend vllm`: LoRA clients of one base sample their adapters on
one vLLM engine (generator/vllm_lora.py), through the official tinker SDK, with the capacity
rules of Temper's engine (tests/server/test_multi_lora.py).

Four concurrent clients train and sample greedily; each one's losses are bitwise, and its
tokens equal (logprobs within fp32 rounding), those of a twin (same rank and seed) run alone
afterwards. Beyond `--multi-lora.max-adapters` the oldest snapshots are evicted (sampling on
one fails naming the setting) and with none left a snapshot fails naming it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_sdk import datum

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

ADAM = types.AdamParams(learning_rate=1e-2)
CLIENTS = [dict(rank=2 + 2 * (i % 3), seed=i, train_unembed=i % 2 == 0) for i in range(4)]
VLLM = ("--generator.backend", "vllm", "--generator.vllm.kv_cache_mib", "64")
VLLM += ("--generator.vllm.max_lora_rank", "8")


def _run(service, model_dir, who, config, start=None):
    """Create, train two steps, snapshot and sample greedily; returns (losses, samples)."""
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
    prompt = types.ModelInput.from_ints(tokenizer.encode(f"{who}2="))
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    response = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    return losses, [(s.tokens, s.logprobs) for s in response.sequences]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_concurrent_lora_clients_on_one_vllm_engine_sample_as_if_alone(model_dir, tmp_path):
    server = start_server(model_dir, tmp_path / "storage", tmp_path / "server.log", *VLLM)
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
            ((tokens, logprobs),) = results[who][1]
            ((their_tokens, their_logprobs),) = samples
            assert tokens == their_tokens, f"client {who}"
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(their_logprobs), atol=1e-5, rtol=0
            )
            service.close("success").result()
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vllm_adapter_capacity_evicts_old_snapshots_then_refuses_clearly(model_dir, tmp_path):
    extra = (*VLLM, "--multi-lora.max-adapters", "2")
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
        data = [datum(first.get_tokenizer(), "12=3")]
        first.forward_backward(data, "cross_entropy").result()
        first.optim_step(ADAM).result()
        newer = first.save_weights_and_get_sampling_client().result()  # a second version
        newer.sample(prompt, num_samples=1, sampling_params=params).result()
        # Two adapter versions held: the second model's snapshot evicts the oldest ...
        second.save_weights_and_get_sampling_client().result()
        with pytest.raises(Exception, match="max-adapters"):
            old.sample(prompt, num_samples=1, sampling_params=params).result()
        # ... and each model keeps its newest version, so the third finds nothing to evict.
        with pytest.raises(Exception, match="max-adapters 2"):
            third.save_weights_and_get_sampling_client().result()
        # The models themselves are untouched: training goes on.
        second.forward_backward(data, "cross_entropy").result()
        second.optim_step(ADAM).result()
    finally:
        server.stop()
