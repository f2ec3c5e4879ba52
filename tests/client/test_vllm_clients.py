"""The in-process clients on the vLLM backend: what an `optim_step` changes is what the next
sampling client samples (full and LoRA, tied and untied output layers), and an older client,
which a one-version generator cannot keep, refuses new requests by name. LoRA clients on the
multi-LoRA vLLM engine (generator/vllm_lora.py) sync their adapters only, and older clients
keep their versions. `make test-vllm`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper import AdamParams, ModelInput, SamplingParams, ServiceClient
from temper.checkpoint.hf import save_pretrained
from temper.generator.choice import GeneratorChoice
from temper.generator.multi_lora import AdapterView, MultiLoraSampler
from temper.models import materialize, qwen3_size
from temper.models.lora import lora_state_dict
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import build_builtin_tokenizer
from tests.client.test_sampling_snapshots import _data

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402
from temper.generator.vllm_lora import VllmMultiLora  # noqa: E402

ADAM = AdamParams(learning_rate=1e-2)
VLLM = GeneratorChoice.Config(
    backend="vllm", vllm=VllmGenerator.Config(kv_cache_mib=32, max_model_len=64)
)


def _untied_model_dir(path):
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=tokenizer.vocab_size), tie_embeddings=False
    )
    return str(save_pretrained(materialize(config, seed=3), path, tokenizer=tokenizer))


def _trainer_scores(client, tokens) -> torch.Tensor:
    """The trainer's current weights, scored by Temper's engine on a plain (merged) copy."""
    engine = client.engine
    state = engine.model.state_dict()
    if engine.lora is not None:
        from temper.models.lora import merged_config, merged_state_dict

        plain = materialize(merged_config(engine.model), init="empty")
        plain.load_state_dict(merged_state_dict(engine.model))
    else:
        plain = materialize(engine.model.config, init="empty")
        plain.load_state_dict(state)
    return SamplerEngine.Config(max_batch=4, max_seq_len=64).build(model=plain).score([tokens])[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_vllm_samples_what_optim_step_made(tmp_path, tied, lora):
    # LoRA here: merged weights in an engine of the client's own (multi-LoRA off).
    service = ServiceClient(
        storage_dir=tmp_path / "storage",
        generator=VLLM,
        multi_lora=MultiLoraSampler.Config(enabled=False),
    )
    base = "tiny" if tied else _untied_model_dir(tmp_path / "untied")
    if lora:
        client = service.create_lora_training_client(base, rank=4, seed=1)
    else:
        client = service.create_training_client(base)
    data = _data(client.get_tokenizer())
    tokens = data[2].model_input.to_ints()
    first = client.save_weights_and_get_sampling_client()
    assert isinstance(first.generator, VllmGenerator)
    before = first.compute_logprobs(ModelInput.from_ints(tokens)).result()
    pending = first.sample(ModelInput.from_ints(tokens[:3]), 2, SamplingParams(max_tokens=3))
    for _ in range(2):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(ADAM).result()
        sampler = client.save_weights_and_get_sampling_client()
        scores = sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:]
        reference = _trainer_scores(client, tokens)
        assert sampler.version == client.engine.policy_version
        assert (torch.tensor(scores) - reference).abs().max() < 1e-5
    assert scores != before[1:]  # the weights did move
    # A request submitted before the update ran on the old weights; the old client is retired.
    assert len(pending.result().sequences) == 2
    with pytest.raises(ValueError, match="no longer holds"):
        first.sample(ModelInput.from_ints(tokens[:3]), 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="take a new sampling client"):
        first.compute_logprobs(ModelInput.from_ints(tokens))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_vllm_lora_clients_sync_only_adapters_and_keep_old_versions(tmp_path, tied, monkeypatch):
    service = ServiceClient(storage_dir=tmp_path / "storage", generator=VLLM)
    base = "tiny" if tied else _untied_model_dir(tmp_path / "untied")
    client = service.create_lora_training_client(base, rank=4, seed=1)
    sampler = client.adapter_sampler
    assert isinstance(sampler, VllmMultiLora)
    synced = []
    register = sampler.register

    def counting_register(**kwargs):
        synced.append(sum(t.numel() * t.element_size() for t in kwargs["tensors"].values()))
        return register(**kwargs)

    monkeypatch.setattr(sampler, "register", counting_register)

    def no_whole_weights(*args, **kwargs):
        raise AssertionError("a LoRA sync reloaded the base weights")

    monkeypatch.setattr(VllmGenerator, "update_weights", no_whole_weights)
    data = _data(client.get_tokenizer())
    tokens = data[2].model_input.to_ints()
    first = client.save_weights_and_get_sampling_client()
    assert isinstance(first.generator, AdapterView)
    before = first.compute_logprobs(ModelInput.from_ints(tokens)).result()
    for _ in range(2):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(ADAM).result()
        sampler_client = client.save_weights_and_get_sampling_client()
        scores = sampler_client.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:]
        assert sampler_client.version == client.engine.policy_version
        assert (torch.tensor(scores) - _trainer_scores(client, tokens)).abs().max() < 1e-5
    assert scores != before[1:]  # the weights did move
    adapter_bytes = sum(
        t.numel() * t.element_size() for t in lora_state_dict(client.engine.model).values()
    )
    assert synced == [adapter_bytes] * 3
    model_bytes = sum(t.numel() * t.element_size() for t in client.engine.model.parameters())
    assert adapter_bytes < 0.2 * model_bytes
    # The first client keeps its version on the shared engine (no retirement).
    assert first.compute_logprobs(ModelInput.from_ints(tokens)).result() == before
