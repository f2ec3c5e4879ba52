"""Qwen3.5-MoE <-> Hugging Face (the text-only Qwen3_5MoeForCausalLM layout): config.json
fields and state-dict key names.

The Gated DeltaNet's names are in hf_hybrid_names.py; the router and the routed experts, one
tensor per expert as the released checkpoints and transformers' own `save_pretrained` store
them, in hf_expert_names.py; the shared expert and its gate are `mlp.shared_expert.*` and
`mlp.shared_expert_gate.weight`; the rest are the dense decoder's names (hf_names.py).

transformers keeps the experts fused in memory (`mlp.experts.gate_up_proj`) but converts them
to the per-expert layout on save, which is the one read and written here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from temper.models.common import hf_expert_names
from temper.models.common.hf_expert_names import expert_key_from_hf, expert_key_to_hf
from temper.models.common.hf_hybrid_names import (
    check_hybrid_fields,
    hybrid_config_to_hf,
    hybrid_fields_from_hf,
    with_linear_attention,
)
from temper.models.common.hf_names import decoder_config_to_hf, decoder_fields_from_hf
from temper.models.qwen3_5_moe.model import Qwen3_5Moe

HF_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_5_moe_text"

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "expert_key_from_hf",
    "expert_key_to_hf",
    "key_from_hf",
    "key_to_hf",
]

_SHARED_KEYS = {
    "feed_forward.shared_expert.w_gate.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w_up.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.w_down.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
_HF_SHARED_KEYS = {hf: ours for ours, hf in _SHARED_KEYS.items()}
_OUR_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _moe_key_to_hf(key: str) -> str:
    match = _OUR_BLOCK.fullmatch(key)
    if match is not None and match.group(2) in _SHARED_KEYS:
        return f"model.layers.{match.group(1)}.{_SHARED_KEYS[match.group(2)]}"
    return hf_expert_names.key_to_hf(key)


def _moe_key_from_hf(hf_key: str) -> str | None:
    match = _HF_BLOCK.fullmatch(hf_key)
    if match is not None and match.group(2) in _HF_SHARED_KEYS:
        return f"blocks.{match.group(1)}.{_HF_SHARED_KEYS[match.group(2)]}"
    return hf_expert_names.key_from_hf(hf_key)


key_to_hf, key_from_hf = with_linear_attention(_moe_key_to_hf, _moe_key_from_hf)

_MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3_5Moe.Config:
    """Build our config from a HF Qwen3.5-MoE text config.json dict. The router always
    renormalizes its top-k weights (as transformers' does, whatever norm_topk_prob says)."""
    check_hybrid_fields(hf_config, family="Qwen3.5-MoE")
    missing = [name for name in _MOE_FIELDS if name not in hf_config]
    if missing:
        raise ValueError(f"config.json: missing required Qwen3.5-MoE fields {missing}")
    num_experts, top_k = hf_config["num_experts"], hf_config["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={top_k} is not valid for num_experts="
            f"{num_experts}; valid: 1..{num_experts}"
        )
    shared = {**hf_config, "intermediate_size": hf_config["shared_expert_intermediate_size"]}
    fields = decoder_fields_from_hf(shared, norm_eps=1e-6, max_seq_len=32_768)
    fields["head_dim"] = hf_config.get("head_dim") or 256
    return Qwen3_5Moe.Config(
        **fields,
        **hybrid_fields_from_hf(hf_config),
        num_experts=num_experts,
        top_k=top_k,
        moe_ffn_dim=hf_config["moe_intermediate_size"],
        norm_topk_prob=True,
        router_aux_loss_coef=hf_config.get("router_aux_loss_coef", 0.001),
    )


def config_to_hf(config: Qwen3_5Moe.Config, *, dtype_name: str) -> dict[str, Any]:
    """A config.json dict that transformers (5.x) loads as Qwen3_5MoeForCausalLM."""
    hf_config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_config_to_hf(config, dtype_name=dtype_name),
        **hybrid_config_to_hf(config),
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "moe_intermediate_size": config.moe_ffn_dim,
        "shared_expert_intermediate_size": config.ffn_dim,
        "norm_topk_prob": True,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
    del hf_config["intermediate_size"]  # no dense feed-forward
    return hf_config
