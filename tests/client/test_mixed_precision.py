"""A 'bf16-mixed' service: the trainer keeps fp32 weights, its generator decodes a bf16 copy
that follows every optimizer step (a cast at each weight sync), an older sampling client keeps
its version, and sampling clients from checkpoints decode in bf16 too."""

from __future__ import annotations

import pytest
import torch

from temper import AdamParams, ModelInput, SamplingParams, ServiceClient
from temper.models import materialize
from tests.client import test_training_client
from tests.client.test_training_client import _data

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _greedy_of(model: torch.nn.Module, prompt: list[int], *, eos: int) -> list[int]:
    """Greedy tokens of `model` by full forwards (the argmax the engine's greedy decode picks),
    up to `GREEDY.max_tokens` or the end-of-sequence token."""
    tokens = list(prompt)
    with torch.no_grad():
        while len(tokens) < len(prompt) + GREEDY.max_tokens and tokens[-1:] != [eos]:
            logits_V = model(torch.tensor([tokens]))[0, -1]
            tokens.append(int(logits_V.argmax()))
    return tokens[len(prompt) :]


def _bf16_copy(client) -> torch.nn.Module:
    """The trainer's current weights cast to bf16, as the generator should hold them."""
    model = client.engine.model
    copy = materialize(model.config, dtype="bfloat16", init="empty")
    copy.load_state_dict(model.state_dict())
    return copy


def _sample(sampler, prompt: list[int]) -> list[int]:
    return sampler.sample(ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0].tokens


def test_the_generator_decodes_a_bf16_copy_that_follows_the_fp32_trainer(tmp_path):
    service = ServiceClient(storage_dir=tmp_path, dtype="bf16-mixed")
    client = service.create_training_client("tiny")
    assert all(p.dtype == torch.float32 for p in client.engine.model.parameters())
    assert client.engine.compute_dtype == torch.bfloat16
    data = _data(client.get_tokenizer())
    prompt = data[0].model_input.to_ints()[:3]
    eos = client.get_tokenizer().eos_token_id

    first = client.save_weights_and_get_sampling_client()
    model = first.generator.model
    assert model is not client.engine.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    before = _sample(first, prompt)
    assert before == _greedy_of(_bf16_copy(client), prompt, eos=eos)

    # Steps the bf16 copy must see: a learning rate that changes the greedy answer.
    for _ in range(5):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(AdamParams(learning_rate=3e-2)).result()
    after = client.save_weights_and_get_sampling_client()
    assert after.version == 5 and after.generator is not first.generator
    assert all(p.dtype == torch.bfloat16 for p in after.generator.model.parameters())
    tokens = _sample(after, prompt)
    assert tokens == _greedy_of(_bf16_copy(client), prompt, eos=eos)
    assert tokens != before
    assert _sample(first, prompt) == before  # the live client kept its version's copy

    # compute_logprobs on the generator's copy: the bf16 policy the samples come from.
    sequence = ModelInput.from_ints(prompt + tokens)
    logprobs = after.compute_logprobs(sequence).result()
    assert logprobs[0] is None and len(logprobs) == len(prompt) + len(tokens)


def test_without_a_live_client_the_bf16_copy_is_refreshed_in_place(tmp_path):
    service = ServiceClient(storage_dir=tmp_path, dtype="bf16-mixed")
    client = service.create_training_client("tiny")
    data = _data(client.get_tokenizer())
    generator = client.save_weights_and_get_sampling_client().generator  # the client is dropped
    client.forward_backward(data, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=3e-2)).result()
    fresh = client.save_weights_and_get_sampling_client()
    assert fresh.generator is generator and client.num_sampler_snapshots == 0
    expected = _bf16_copy(client).state_dict()
    for name, tensor in fresh.generator.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_sampling_clients_of_a_bf16_mixed_service_decode_in_bf16(tmp_path):
    service = ServiceClient(storage_dir=tmp_path, dtype="bf16-mixed")
    client = service.create_training_client("tiny")
    path = client.save_weights_for_sampler("step0").result().path
    for sampler in (
        service.create_sampling_client(model_path=path),
        service.create_sampling_client(base_model="tiny"),
    ):
        assert all(p.dtype == torch.bfloat16 for p in sampler.generator.model.parameters())


def test_auto_is_fp32_on_cpu(tmp_path):
    service = ServiceClient(storage_dir=tmp_path, dtype="auto")
    assert (service.dtype, service.generator_dtype) == ("float32", "float32")
    client = service.create_training_client("tiny")
    sampler = client.save_weights_and_get_sampling_client()
    assert sampler.generator.model is client.engine.model  # one dtype: no copy


def test_a_bf16_mixed_lora_client_trains_fp32_adapters_on_a_bf16_base(tmp_path):
    service = ServiceClient(storage_dir=tmp_path, dtype="bf16-mixed")
    client = service.create_lora_training_client("tiny", rank=4)
    engine = client.engine
    assert {p.dtype for p in engine.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in engine.trainable} == {torch.float32}
    data = _data(client.get_tokenizer())
    prompt = data[0].model_input.to_ints()[:3]
    first = client.save_weights_and_get_sampling_client()
    before = _sample(first, prompt)
    for _ in range(5):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(AdamParams(learning_rate=3e-2)).result()
    after = client.save_weights_and_get_sampling_client()
    # The shared base's multi-LoRA sampler decodes in bf16, the adapters cast to it.
    assert after.generator.sampler is client.adapter_sampler
    assert client.adapter_sampler.engine.model.embed.weight.dtype == torch.bfloat16
    assert _sample(after, prompt) != before
    assert _sample(first, prompt) == before


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_mixed_resume_is_bitwise(tmp_path, lora):
    """The fp32 masters and moments are the state: a resumed bf16-mixed run is bitwise."""
    service = ServiceClient(storage_dir=tmp_path, dtype="bf16-mixed")
    test_training_client.test_save_load_and_continue_is_bitwise_equal_to_uninterrupted(
        service, lora
    )
