"""LoRA exports: a PEFT adapter that `peft` loads onto the HF base model, and a merged HF model.

Both are checked by logits: HF transformers (+ peft) must compute what Temper's LoRA model does.
Qwen3-MoE runs with a dense layer (its default here) and without: expert adapters are written
per expert, and dense MLP layers beside experts need `target_parameters` (checkpoint/peft.py).
Qwen3.5 adapts its Gated DeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
out_proj) and its gated attention's (q with its gate half).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import warnings

import pytest
import torch
from safetensors import safe_open

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.merge import save_merged_pretrained
from temper.checkpoint.peft import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, save_peft_adapter
from temper.models import materialize
from temper.models.lora import LoraConfig, apply_lora, lora_modules
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size
from tests.models.hf_reference import save_hf, tiny_hf_llama, tiny_hf_qwen3, tiny_hf_qwen3_moe

pytest.importorskip("transformers")

VOCAB = 97


def _hf_exported(family: str, *, tie: bool, seed: int):
    """The HF model of a random tiny Temper model of `family`, through Temper's export (for
    families whose HF twin tests/models does not build)."""
    from transformers import AutoModelForCausalLM

    size = {"qwen3_5": qwen3_5_size, "qwen3_5_moe": qwen3_5_moe_size}[family]
    config = dataclasses.replace(size("tiny", vocab_size=VOCAB), tie_embeddings=tie)
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(materialize(config, seed=seed), directory)
        return AutoModelForCausalLM.from_pretrained(directory).float().eval()


HF_BUILDERS = {
    "qwen3": lambda **kwargs: tiny_hf_qwen3(attention_bias=True, **kwargs),
    "llama": tiny_hf_llama,
    "qwen3_moe": tiny_hf_qwen3_moe,
    "qwen3_moe_all_sparse": lambda **kwargs: tiny_hf_qwen3_moe(mlp_only_layers=(), **kwargs),
    # 3 Gated DeltaNet layers and a gated full-attention layer: every projection adapted.
    "qwen3_5": lambda **kwargs: _hf_exported("qwen3_5", **kwargs),
    # Routed experts (per expert) and a shared expert (a dense twin, `target_parameters`).
    "qwen3_5_moe": lambda **kwargs: _hf_exported("qwen3_5_moe", **kwargs),
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _randomize_B(model, *, std: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(1)
    for module in lora_modules(model).values():
        module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * std)


def _lora_model(base_dir, config: LoraConfig):
    model = load_pretrained(base_dir, dtype=torch.float32).eval()
    apply_lora(model, config)
    _randomize_B(model)
    return model


@pytest.mark.parametrize("family", HF_BUILDERS)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_peft_loads_the_adapter_with_equal_logits(tmp_path, tie, family):
    peft = pytest.importorskip("peft")
    hf_model = HF_BUILDERS[family](tie=tie, seed=2)
    save_hf(hf_model, tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=4, alpha=8.0))
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-qwen3")

    tokens_BT = _tokens()
    with torch.no_grad():
        base_BTV = hf_model(input_ids=tokens_BT).logits
        expected_BTV = model(tokens_BT)
    with warnings.catch_warnings():
        # PEFT warns that lm_head is tied to the embedding; it adapts lm_head only, as we do.
        warnings.simplefilter("ignore")
        peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        actual_BTV = peft_model(input_ids=tokens_BT).logits
    assert (expected_BTV - base_BTV).abs().max() > 1e-2  # the adapter is far from a no-op
    torch.testing.assert_close(actual_BTV, expected_BTV, rtol=0, atol=1e-5)


def test_adapter_files_use_peft_names(tmp_path):
    save_hf(tiny_hf_qwen3(tie=True, num_layers=1), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=2, alpha=4.0, train_mlp=False))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="org/base")

    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (2, 4.0)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    assert config["base_model_name_or_path"] == "org/base"
    assert (config["lora_dropout"], config["bias"], config["fan_in_fan_out"]) == (
        0.0,
        "none",
        False,
    )
    with safe_open(str(out / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
        keys = set(handle.keys())
        q_A = handle.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert "base_model.model.lm_head.lora_B.weight" in keys
    assert len(keys) == 2 * 5
    assert torch.equal(q_A, model.blocks[0].attention.wq.lora_A)

    with pytest.raises(FileExistsError, match="overwrite"):
        save_peft_adapter(model, out, base_model_name_or_path="org/base")


def test_saving_a_model_without_adapters_raises(tmp_path):
    save_hf(tiny_hf_qwen3(num_layers=1), tmp_path / "base")
    model = load_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="apply_lora"):
        save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="x")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("family", HF_BUILDERS)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_merged_export_loads_in_transformers_with_equal_logits(tmp_path, tie, family):
    from transformers import AutoModelForCausalLM

    save_hf(HF_BUILDERS[family](tie=tie, seed=4), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=4, alpha=8.0))
    save_merged_pretrained(model, tmp_path / "merged")

    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is (
        False
    )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    tokens_BT = _tokens()
    with torch.no_grad():
        expected_BTV = model(tokens_BT)
        actual_BTV = reloaded(input_ids=tokens_BT).logits
        temper_BTV = load_pretrained(tmp_path / "merged")(tokens_BT)
    torch.testing.assert_close(actual_BTV, expected_BTV, rtol=0, atol=1e-5)
    torch.testing.assert_close(temper_BTV, expected_BTV, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dense_layers", [(1,), ()], ids=["dense-layer-1", "all-sparse"])
def test_moe_adapter_is_written_per_expert(tmp_path, dense_layers):
    save_hf(tiny_hf_qwen3_moe(mlp_only_layers=dense_layers), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=2, alpha=4.0, train_unembed=False))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="org/moe")

    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["target_modules"] == [
        *("q_proj", "k_proj", "v_proj", "o_proj"),
        *("gate_proj", "up_proj", "down_proj"),
    ]
    expected_twins = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    assert config.get("target_parameters") == (expected_twins if dense_layers else None)
    adapter = model.blocks[0].feed_forward.experts.w_down_adapter
    with safe_open(str(out / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
        keys = set(handle.keys())
        down_B = handle.get_tensor(
            "base_model.model.model.layers.0.mlp.experts.5.down_proj.lora_B.weight"
        )
    assert torch.equal(down_B, adapter.lora_B[5])  # [D, R]: expert 5's B
    num_sparse = 3 - len(dense_layers)  # 3 layers; 8 experts; (A, B) of every module
    assert len(keys) == 2 * (3 * 4 + num_sparse * 8 * 3 + len(dense_layers) * 3)
    assert not any(".mlp.gate." in key for key in keys)  # the router is not adapted


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_transformers_load_adapter_gives_the_moe_lora_logits(tmp_path, family):
    from transformers import AutoModelForCausalLM

    save_hf(HF_BUILDERS[family](tie=False, seed=6), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=4, alpha=8.0))
    save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-moe")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "base").float().eval()
    with warnings.catch_warnings():
        # PEFT warns that the doubled rank of the fused gate_up_proj matches no module name;
        # it applies to the fused parameter (the logits below say so).
        warnings.simplefilter("ignore")
        hf_model.load_adapter(str(tmp_path / "adapter"))
    tokens_BT = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            hf_model(input_ids=tokens_BT).logits, model(tokens_BT), rtol=0, atol=1e-5
        )


def test_qwen3_5_adapter_targets_the_linear_attention_projections(tmp_path):
    save_hf(_hf_exported("qwen3_5", tie=True, seed=0), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=2, train_mlp=False))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="org/qwen3.5")
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert config["target_modules"] == [
        *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
        *("q_proj", "k_proj", "v_proj", "o_proj", "lm_head"),
    ]
    with safe_open(str(out / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
        qkv_B = handle.get_tensor(
            "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_B.weight"
        )
        keys = set(handle.keys())
    assert torch.equal(qkv_B, model.blocks[0].linear_attention.in_proj_qkv.lora_B)
    # 3 linear-attention layers of 5 projections, 1 attention layer of 4, the unembedding.
    assert len(keys) == 2 * (3 * 5 + 4 + 1)


def test_qwen3_5_moe_expert_adapters_target_the_fused_parameters(tmp_path):
    save_hf(_hf_exported("qwen3_5_moe", tie=False, seed=0), tmp_path / "base")
    model = _lora_model(tmp_path / "base", LoraConfig(rank=2, alpha=4.0, train_attn=False))
    out = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="org/moe")
    config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    # The shared expert's linears are modules; the routed experts' fused parameters.
    assert config["target_modules"] == ["gate_proj", "up_proj", "down_proj", "lm_head"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 4}
    assert config["alpha_pattern"] == {r".*\.gate_up_proj": 8.0}
    experts = model.blocks[0].feed_forward.experts
    E, R = experts.w_down_adapter.lora_A.shape[:2]
    with safe_open(str(out / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
        down_B = handle.get_tensor("base_model.model.model.layers.0.mlp.experts.lora_B.weight")
        gate_up_A = handle.get_tensor(
            "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"
        )
    # down: B [D, R * E], column r * E + e; gate_up: A [E * 2R, D], expert e's gate then up.
    assert torch.equal(down_B[:, 1 * E + 3], experts.w_down_adapter.lora_B[3, :, 1])
    assert torch.equal(gate_up_A[3 * 2 * R + R], experts.w_up_adapter.lora_A[3, 0])
