"""Renderers: conversations -> token ids with per-token loss weights, and generation prompts.

Chat formatting lives here, never in the sampler or the trainer. `build_renderer(name,
tokenizer=...)` returns one of RENDERER_NAMES; see `base.py` for the protocol.
`default_renderer(model)` names the one a model (an HF repo id or a family) speaks.
"""

from __future__ import annotations

from typing import Literal, get_args

from temper.tokenizer.renderers.base import (
    ROLES,
    Message,
    Renderer,
    TrainOn,
    WeightedTokens,
    check_messages,
)
from temper.tokenizer.renderers.defaults import default_renderer
from temper.tokenizer.renderers.qwen3 import Qwen3Renderer
from temper.tokenizer.renderers.qwen3_5 import QWEN3_5_NAMES, ParsedReply, Qwen3_5Renderer
from temper.tokenizer.renderers.role_colon import RoleColonRenderer
from temper.tokenizer.tokenizer import Tokenizer

RendererName = Literal[
    "role_colon",
    "qwen3",
    "qwen3_no_think",
    "qwen3_5",
    "qwen3_5_disable_thinking",
    "qwen3_5_preserve_thinking",
]
RENDERER_NAMES: tuple[str, ...] = get_args(RendererName)


def build_renderer(name: RendererName, *, tokenizer: Tokenizer) -> Renderer:
    """The renderer called `name` over `tokenizer`."""
    if name == "role_colon":
        return RoleColonRenderer(tokenizer)
    if name in ("qwen3", "qwen3_no_think"):
        return Qwen3Renderer(tokenizer, thinking=name == "qwen3")
    if name in QWEN3_5_NAMES:
        return Qwen3_5Renderer(tokenizer, name=name)
    raise ValueError(f"unknown renderer {name!r}; valid renderers are {list(RENDERER_NAMES)}")


__all__ = [
    "RENDERER_NAMES",
    "ROLES",
    "Message",
    "ParsedReply",
    "Qwen3Renderer",
    "Qwen3_5Renderer",
    "Renderer",
    "RendererName",
    "RoleColonRenderer",
    "TrainOn",
    "WeightedTokens",
    "build_renderer",
    "check_messages",
    "default_renderer",
]
