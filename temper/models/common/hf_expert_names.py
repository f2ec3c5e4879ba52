"""MoE <-> Hugging Face names: the router, and stacked experts stored one tensor per expert.

Our sparse block holds `feed_forward.router.weight` [E, D] and three stacked expert tensors
(`feed_forward.experts.w_gate` [E, F, D], `w_up` [E, F, D], `w_down` [E, D, F]); released
checkpoints (and what transformers writes) name the router `mlp.gate.weight` and each expert's
projections `mlp.experts.{e}.gate_proj.weight` and so on, each of them one row of ours.
Dense blocks keep the dense decoder's names (hf_names.py).
"""

from __future__ import annotations

import re

from temper.models.common import hf_names

_ROUTER = ("feed_forward.router.weight", "mlp.gate.weight")
_EXPERTS = {
    "feed_forward.experts.w_gate": "gate_proj",
    "feed_forward.experts.w_up": "up_proj",
    "feed_forward.experts.w_down": "down_proj",
}
_HF_EXPERTS = {hf: ours for ours, hf in _EXPERTS.items()}
_OUR_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def key_to_hf(key: str) -> str:
    """Our state-dict key -> the HF key (a stacked expert key has one per expert:
    `expert_key_to_hf`)."""
    match = _OUR_BLOCK.fullmatch(key)
    if match is not None and match.group(2) == _ROUTER[0]:
        return f"model.layers.{match.group(1)}.{_ROUTER[1]}"
    return hf_names.key_to_hf(key)


def key_from_hf(hf_key: str) -> str | None:
    """HF key -> our key, or None for a tensor the MoE decoder does not use."""
    suffix = f".{_ROUTER[1]}"
    if hf_key.startswith("model.layers.") and hf_key.endswith(suffix):
        layer = hf_key.removeprefix("model.layers.").removesuffix(suffix)
        if layer.isdigit():
            return f"blocks.{layer}.{_ROUTER[0]}"
    return hf_names.key_from_hf(hf_key)


def expert_key_to_hf(key: str, expert: int) -> str | None:
    """(our stacked expert key, expert index) -> that expert's HF key; None for other keys."""
    match = _OUR_BLOCK.fullmatch(key)
    if match is None or match.group(2) not in _EXPERTS:
        return None
    return f"model.layers.{match.group(1)}.mlp.experts.{expert}.{_EXPERTS[match.group(2)]}.weight"


def expert_key_from_hf(hf_key: str) -> tuple[str, int] | None:
    """HF per-expert key -> (our stacked key, expert index); None for other keys."""
    match = _HF_EXPERT.fullmatch(hf_key)
    if match is None or match.group(3) not in _HF_EXPERTS:
        return None
    return f"blocks.{match.group(1)}.{_HF_EXPERTS[match.group(3)]}", int(match.group(2))
