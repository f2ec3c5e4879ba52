"""The in-process clients on the vLLM backend: what an `optim_step` changes is what the next
sampling client samples (full and LoRA, tied and untied output layers), and an older client,
which a one-version generator cannot keep, refuses new requests by name. `make test-vllm`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper import AdamParams, ModelInput, SamplingParams, ServiceClient
from temper.checkpoint.hf import save_pretrained
from temper.generator.choice import GeneratorChoice
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import build_builtin_tokenizer
from tests.client.test_sampling_snapshots import _data

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402

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
    service = ServiceClient(storage_dir=tmp_path / "storage", generator=VLLM)
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
