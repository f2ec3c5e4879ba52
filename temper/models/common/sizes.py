"""What the families' named sizes share: the `tiny` test shape and the lookup of a size by name.

`tiny` is the shape tests and the demo use in every dense family (a family adds its own
vocabulary and anything else it needs); the published shapes are each family's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from temper.models.common.decoder import DecoderConfig

Config = TypeVar("Config", bound=DecoderConfig)

TINY_SHAPE: Mapping[str, Any] = {
    "dim": 128,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "ffn_dim": 384,
    "tie_embeddings": True,
    "rope_theta": 10_000.0,
    "max_seq_len": 2048,
}
"""The `tiny` size's shape: 4 layers, 128 wide, 4 query and 2 key/value heads of 32."""


def named_size(
    sizes: Mapping[str, Config], name: str, *, family: str, vocab_size: int | None
) -> Config:
    """A fresh copy of `sizes[name]`, optionally with another vocabulary size."""
    if name not in sizes:
        raise ValueError(f"unknown {family} size {name!r}; valid sizes: {', '.join(sizes)}")
    config = dataclasses.replace(sizes[name])
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    return config
