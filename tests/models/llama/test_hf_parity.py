"""Llama 3 against transformers: logits with llama3 RoPE scaling (tied and untied), export that
transformers reloads, greedy KV-cache sampling, a LoRA step, and HF configs Temper refuses."""

from __future__ import annotations

import json

import pytest
import torch

from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.model_source import ModelSource, init_model_dir
from temper.models.common.logprobs import forward_logprobs
from temper.models.llama import Llama
from temper.models.lora import LoraConfig, apply_lora
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode
from tests.models.hf_reference import (
    LLAMA3_ROPE,
    assert_export_reloads_exactly,
    save_hf,
    tiny_hf_llama,
)

pytest.importorskip("transformers")


def _tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("tie", "rope_scaling"),
    [(True, LLAMA3_ROPE), (False, LLAMA3_ROPE), (False, None)],
    ids=["tied-llama3-rope", "untied-llama3-rope", "untied-plain-rope"],
)
def test_loaded_hf_checkpoint_matches_hf_logits(tmp_path, tie, rope_scaling):
    hf_model = tiny_hf_llama(tie=tie, rope_scaling=rope_scaling)
    save_hf(hf_model, tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(model, Llama)
    assert (model.config.rope_scaling is None) == (rope_scaling is None)
    assert model.output is None if tie else model.output is not None
    # 160 positions: past original_max_position_embeddings (64), where the scaling matters.
    tokens_BT = _tokens(2, 160)
    with torch.no_grad():
        expected_BTV = hf_model(input_ids=tokens_BT).logits
        actual_BTV = model(tokens_BT)
    torch.testing.assert_close(actual_BTV, expected_BTV, rtol=0, atol=1e-5)


def test_llama3_scaling_changes_the_logits(tmp_path):
    scaled = load_pretrained(save_hf(tiny_hf_llama(), tmp_path / "a")).eval()
    plain = load_pretrained(save_hf(tiny_hf_llama(rope_scaling=None), tmp_path / "b")).eval()
    tokens_BT = _tokens(1, 100)
    with torch.no_grad():
        assert not torch.allclose(scaled(tokens_BT), plain(tokens_BT), atol=1e-3)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_exactly(tmp_path, tie):
    from transformers import LlamaForCausalLM

    source = tiny_hf_llama(tie=tie, seed=3)
    save_hf(source, tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    save_pretrained(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"]["rope_type"] == "llama3"

    assert_export_reloads_exactly(
        source,
        model,
        tmp_path / "export",
        tokens_BT=_tokens(3, 120, seed=1),
        hf_class=LlamaForCausalLM,
    )


def test_init_model_writes_a_llama_directory_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    init_model_dir(tmp_path / "m", family="llama", size="tiny", tokenizer="digits")
    model = ModelSource.Config(path=str(tmp_path / "m")).build().model.eval()
    assert isinstance(model, Llama) and model.config.rope_scaling is not None
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    tokens_BT = torch.randint(0, model.config.vocab_size, (2, 300))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5)


def test_greedy_kv_cache_sampling_equals_full_forward_argmax(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_llama(tie=False, seed=2), tmp_path)).eval()
    engine = SamplerEngine.Config(
        max_batch=3, max_seq_len=160, cpu=CpuDecoding.Config(processes=1)
    ).build(model=model)
    prompts = [[3, 4, 5], list(range(1, 80)), [9, 9], [50] * 70]
    requests = [
        SampleRequest(prompt=p, params=SamplingParams(max_tokens=12, temperature=0))
        for p in prompts
    ]
    for prompt, response in zip(prompts, engine.generate(requests), strict=True):
        expected = greedy_decode(model, [prompt], max_new_tokens=12)[0]
        assert response.sequences[0].tokens == expected


def test_lora_training_step_lowers_the_loss(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_llama(tie=True), tmp_path))
    apply_lora(model, LoraConfig(rank=4, train_unembed=True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    tokens_BT = _tokens(2, 24, seed=5)
    losses = []
    for _ in range(3):
        logprobs_BT = forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:])
        loss = -logprobs_BT.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in trainable)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"rope_parameters.rope_type 'yarn' is not supported.*\['default', 'llama3'\]",
        ),
        (
            {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 1e4, "beta_fast": 32}},
            r"rope_parameters fields \['beta_fast'\] are not supported.*valid fields",
        ),
        (
            {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic"}},
            r"rope_scaling.rope_type 'dynamic' is not supported",
        ),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
    ids=["rope-type", "rope-field", "legacy-rope-type", "mlp-bias", "activation"],
)
def test_unsupported_hf_config_fails_before_loading_naming_the_field(tmp_path, change, message):
    save_hf(tiny_hf_llama(), tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path)
