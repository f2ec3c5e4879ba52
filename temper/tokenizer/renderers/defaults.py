"""Which chat format a model speaks: the renderer to use when none is named.

Chat models of a family speak its format; base models (`...-Base`) and anything unknown get
`role_colon`, the plain-text format any tokenizer encodes. The choices agree with
tinker-cookbook's `model_info` for the names both know.
"""

from __future__ import annotations

from types import MappingProxyType

FAMILY_RENDERERS = MappingProxyType(
    {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5"}
)
"""HF model_type of a chat model -> its renderer."""

_QWEN_PREFIXES = (("Qwen3.5-", "qwen3_5"), ("Qwen3.6-", "qwen3_5"), ("Qwen3-", "qwen3"))


def default_renderer(model: str) -> str:
    """The renderer for `model`: an HF repo id (`Qwen/Qwen3.5-4B`, `Qwen/Qwen3.6-35B-A3B`,
    `Qwen/Qwen3-8B`) or a family's HF model_type (`qwen3_5`, `qwen3_5_moe`, `qwen3`)."""
    if model in FAMILY_RENDERERS:
        return FAMILY_RENDERERS[model]
    organization, _, name = model.rpartition("/")
    if organization != "Qwen" or name.endswith("-Base"):
        return "role_colon"
    # Qwen3's VL and 2507 instruct models write no think blocks: a format of their own.
    if "-VL-" in name or name.endswith("-2507"):
        return "role_colon"
    return next(
        (renderer for prefix, renderer in _QWEN_PREFIXES if name.startswith(prefix)), "role_colon"
    )
