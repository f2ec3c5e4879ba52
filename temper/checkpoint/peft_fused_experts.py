"""Expert adapters in PEFT's format for fused expert parameters (`target_parameters`).

Shapes: E experts, R rank, D model dim, F expert hidden width.

transformers 5 holds a MoE layer's experts as two 3-D parameters, `gate_up_proj` [E, 2F, D]
(gate's rows, then up's) and `down_proj` [E, D, F]. For some model types PEFT (0.21) converts
an adapter written per expert (`mlp.experts.3.gate_proj`, peft.py's default) onto them; for the
others (`FUSED_EXPERT_MODEL_TYPES`) it does not, and an adapter must target the parameters
themselves. PEFT's layout for a parameter [E, O, I]: lora_A [E * R, I] (expert-major), lora_B
[O, R * E] (rank-major: column r * E + e), expert e adding scale * B[:, :, e] @ A[e].

Temper's gate and up adapters of an expert are joined into one of rank 2R on `gate_up_proj`: A
stacked ([A_gate; A_up]) and B block-diagonal, rank and alpha doubled (the scale stays alpha /
R), which is exact. PEFT wraps the experts module once per target parameter, in the order the
config lists them: `gate_up_proj` first (its factors under `experts.base_layer`), then
`down_proj` (under `experts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from temper.models.registry import ModelFamily

FUSED_EXPERT_MODEL_TYPES = frozenset({"qwen3_5_moe_text"})
"""HF model types whose expert adapters PEFT takes only as fused-parameter adapters."""
TARGET_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""PEFT `target_parameters`, in the order that fixes the key names below."""
JOINED_PATTERN = r".*\.gate_up_proj"
"""The rank/alpha pattern of the joined gate and up adapters (rank and alpha doubled)."""
_EXPERTS = ".feed_forward.experts."


@dataclass(frozen=True)
class FusedExpertAdapter:
    """One MoE layer's adapter of one fused expert parameter, in PEFT's layout."""

    module: str
    """Where PEFT keeps its factors: 'model.layers.0.mlp.experts.base_layer' (gate_up_proj)
    or 'model.layers.0.mlp.experts' (down_proj)."""
    lora_A: torch.Tensor
    lora_B: torch.Tensor


def fused_experts(family: ModelFamily) -> bool:
    """Whether `family`'s expert adapters are written as fused-parameter adapters."""
    return family.name in FUSED_EXPERT_MODEL_TYPES


def is_expert_adapter(name: str) -> bool:
    """Whether a `lora_state_dict` key is a routed-expert adapter's factor."""
    return _EXPERTS in name


def fused_expert_adapters(
    family: ModelFamily, tensors: Mapping[str, torch.Tensor]
) -> list[FusedExpertAdapter]:
    """The expert adapters in `tensors` (`lora_state_dict` names; gate, up and down of every
    adapted layer), two per MoE layer, in layer order."""
    prefixes = {name.split(_EXPERTS)[0] for name in tensors if is_expert_adapter(name)}
    adapters = []
    for prefix in sorted(prefixes, key=lambda p: int(p.split(".")[1])):

        def pair(weight: str, prefix: str = prefix) -> tuple[torch.Tensor, torch.Tensor]:
            name = f"{prefix}{_EXPERTS}{weight}_adapter"
            return tensors[f"{name}.lora_A"].detach(), tensors[f"{name}.lora_B"].detach()

        (gate_A_ERD, gate_B_EFR), (up_A_ERD, up_B_EFR) = pair("w_gate"), pair("w_up")
        down_A_ERF, down_B_EDR = pair("w_down")
        hf_key = family.expert_key_to_hf(f"{prefix}{_EXPERTS}w_gate", 0)
        module = hf_key.rsplit(".experts.", 1)[0] + ".experts"
        E, F, R = gate_B_EFR.shape
        joined_B_EXY = gate_B_EFR.new_zeros(E, 2 * F, 2 * R)  # block-diagonal per expert
        joined_B_EXY[:, :F, :R] = gate_B_EFR
        joined_B_EXY[:, F:, R:] = up_B_EFR
        joined_A_ERD = torch.cat((gate_A_ERD, up_A_ERD), dim=1)
        adapters.append(
            FusedExpertAdapter(
                module=f"{module}.base_layer",
                lora_A=joined_A_ERD.reshape(E * 2 * R, -1),
                lora_B=joined_B_EXY.permute(1, 2, 0).reshape(2 * F, 2 * R * E),
            )
        )
        adapters.append(
            FusedExpertAdapter(
                module=module,
                lora_A=down_A_ERF.reshape(E * R, -1),
                lora_B=down_B_EDR.permute(1, 2, 0).reshape(down_B_EDR.shape[1], R * E),
            )
        )
    return adapters


def fused_config_entries(*, rank: int, alpha: float) -> dict:
    """What adapter_config.json adds for fused expert adapters."""
    return {
        "target_parameters": list(TARGET_PARAMETERS),
        "rank_pattern": {JOINED_PATTERN: 2 * rank},
        "alpha_pattern": {JOINED_PATTERN: 2 * alpha},
    }
