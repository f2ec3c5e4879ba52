"""Named Llama 3 sizes: `tiny` for tests and the demo, and the published 3.1/3.2 shapes.

The published shapes are those of meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B and -3.1-70B
(vocab 128256, 8 KV heads, rope_theta 5e5, llama3 RoPE scaling from 8192 positions, 131072
positions). `tiny` scales RoPE from 256 positions and allows 2048, so the scaling is exercised;
it takes its vocabulary from the tokenizer it is paired with.
"""

from __future__ import annotations

from types import MappingProxyType

from temper.models.common.rope import Llama3RopeScaling
from temper.models.common.sizes import TINY_SHAPE, named_size
from temper.models.llama.model import Llama

LLAMA3_VOCAB_SIZE = 128_256


def _published(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    ffn_dim: int,
    tie: bool,
    factor: float,
) -> Llama.Config:
    return Llama.Config(
        vocab_size=LLAMA3_VOCAB_SIZE,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        tie_embeddings=tie,
        rope_scaling=Llama3RopeScaling(
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )


LLAMA_SIZES = MappingProxyType(
    {
        "tiny": Llama.Config(
            vocab_size=LLAMA3_VOCAB_SIZE,
            **TINY_SHAPE,
            rope_scaling=Llama3RopeScaling(
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
        ),
        "1B": _published(
            dim=2048, num_layers=16, num_heads=32, head_dim=64, ffn_dim=8192, tie=True, factor=32
        ),
        "3B": _published(
            dim=3072, num_layers=28, num_heads=24, head_dim=128, ffn_dim=8192, tie=True, factor=32
        ),
        "8B": _published(
            dim=4096, num_layers=32, num_heads=32, head_dim=128, ffn_dim=14336, tie=False, factor=8
        ),
        "70B": _published(
            dim=8192, num_layers=80, num_heads=64, head_dim=128, ffn_dim=28672, tie=False, factor=8
        ),
    }
)


def llama_size(name: str, *, vocab_size: int | None = None) -> Llama.Config:
    """A fresh config for a named size, optionally with another vocabulary size."""
    return named_size(LLAMA_SIZES, name, family="Llama", vocab_size=vocab_size)
