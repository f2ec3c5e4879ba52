"""Qwen3-MoE against transformers: logits with and without renormalized top-k weights and with
dense layers (mlp_only_layers, decoder_sparse_step), per-expert export that transformers
reloads, init-model, greedy KV-cache sampling, a full fine-tuning step, a LoRA training step
(adapters on attention, the dense layer and every expert), and HF configs Temper refuses."""

from __future__ import annotations

import json

import pytest
import torch

from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.model_source import ModelSource, init_model_dir
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.logprobs import forward_logprobs
from temper.models.common.moe import MoE
from temper.models.lora import LoraConfig, apply_lora, lora_state_dict
from temper.models.qwen3_moe import Qwen3Moe
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode
from tests.models.hf_reference import assert_export_reloads_exactly, save_hf, tiny_hf_qwen3_moe

pytest.importorskip("transformers")


def _tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("norm_topk_prob", "mlp_only_layers", "sparse_step", "tie"),
    [(True, (1,), 1, False), (False, (), 1, True), (True, (), 2, False)],
    ids=["renormalized-dense-layer-1", "softmax-share-tied", "every-second-layer"],
)
def test_loaded_hf_checkpoint_matches_hf_logits(
    tmp_path, norm_topk_prob, mlp_only_layers, sparse_step, tie
):
    hf_model = tiny_hf_qwen3_moe(
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=mlp_only_layers,
        decoder_sparse_step=sparse_step,
        tie=tie,
    )
    model = load_pretrained(save_hf(hf_model, tmp_path), dtype=torch.float32).eval()
    assert isinstance(model, Qwen3Moe)
    kinds = [type(block.feed_forward) for block in model.blocks]
    expected_kinds = [
        MoE if i not in mlp_only_layers and (i + 1) % sparse_step == 0 else SwiGLU for i in range(3)
    ]
    assert kinds == expected_kinds
    tokens_BT = _tokens(3, 40)
    with torch.no_grad():
        expected_BTV = hf_model(input_ids=tokens_BT).logits
        actual_BTV = model(tokens_BT)
    torch.testing.assert_close(actual_BTV, expected_BTV, rtol=0, atol=1e-5)


def test_renormalizing_the_top_k_changes_the_logits(tmp_path):
    renormalized = load_pretrained(save_hf(tiny_hf_qwen3_moe(), tmp_path / "a")).eval()
    plain = tiny_hf_qwen3_moe(norm_topk_prob=False)
    plain = load_pretrained(save_hf(plain, tmp_path / "b")).eval()
    tokens_BT = _tokens(1, 30)
    with torch.no_grad():
        assert not torch.allclose(renormalized(tokens_BT), plain(tokens_BT), atol=1e-3)


def test_export_writes_one_tensor_per_expert_and_transformers_reloads_it_exactly(tmp_path):
    from safetensors import safe_open
    from transformers import Qwen3MoeForCausalLM

    source = tiny_hf_qwen3_moe(seed=3)
    model = load_pretrained(save_hf(source, tmp_path / "hf"))
    save_pretrained(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"]) == (8, 2)
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.0.mlp.gate.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # the dense layer

    assert_export_reloads_exactly(
        source,
        model,
        tmp_path / "export",
        tokens_BT=_tokens(2, 50, seed=1),
        hf_class=Qwen3MoeForCausalLM,
    )


def test_init_model_writes_a_qwen3_moe_directory_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    init_model_dir(tmp_path / "m", family="qwen3_moe", size="tiny", tokenizer="digits")
    model = ModelSource.Config(path=str(tmp_path / "m")).build().model.eval()
    assert isinstance(model, Qwen3Moe)
    assert all(isinstance(block.feed_forward, MoE) for block in model.blocks)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").float().eval()
    tokens_BT = torch.randint(0, model.config.vocab_size, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5)


def test_greedy_kv_cache_sampling_equals_full_forward_argmax(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_qwen3_moe(seed=2), tmp_path)).eval()
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


def test_full_fine_tuning_step_updates_experts_and_router(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_qwen3_moe(), tmp_path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens_BT = _tokens(2, 24, seed=5)
    losses = []
    for _ in range(3):
        loss = -forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    moe = model.blocks[0].feed_forward
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.w_down.grad.abs().sum() > 0
    assert losses[-1] < losses[0]


def test_lora_training_step_lowers_the_loss(tmp_path):
    model = load_pretrained(save_hf(tiny_hf_qwen3_moe(), tmp_path))
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(lora_state_dict(model))
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    tokens_BT = _tokens(2, 24, seed=5)
    losses = []
    for _ in range(3):
        loss = -forward_logprobs(model, tokens_BT[:, :-1], tokens_BT[:, 1:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    experts = model.blocks[0].feed_forward.experts
    assert experts.w_down_adapter.lora_B.grad.abs().sum() > 0
    assert experts.w_gate_adapter.lora_A.grad.abs().sum() > 0
    assert model.blocks[1].feed_forward.w_up.lora_B.grad.abs().sum() > 0  # the dense layer
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # router included
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 is not valid.*valid: 1\.\.8"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"RoPE type 'yarn' is not supported",
        ),
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported for Qwen3-MoE"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_only_layers": [7]}, r"mlp_only_layers \[7\] are not layers; valid: 0\.\.2"),
    ],
    ids=["top-k", "rope-type", "sliding-window", "activation", "mlp-only-layer"],
)
def test_unsupported_hf_config_fails_before_loading_naming_the_field(tmp_path, change, message):
    save_hf(tiny_hf_qwen3_moe(), tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path)
