"""Named Qwen3.5 sizes: `tiny` for tests and the demo, and the published dense checkpoints.

The published shapes are the text towers of Qwen/Qwen3.5-4B, -9B and -27B (vocab 248320,
attention heads of 256 with a quarter rotated, rope_theta 1e7, 262144 positions, every fourth
layer full attention, Gated DeltaNet with 16 key heads of 128 and value heads of 128). The
values were read from copies of the released config.json files (the hub itself was not
reachable from here); 4B ties its embeddings, 9B and 27B do not.

`tiny` is the dense families' tiny shape (4 layers: 3 linear + 1 full attention) with small
Gated DeltaNet heads; it takes its vocabulary from the tokenizer it is paired with.
"""

from __future__ import annotations

from types import MappingProxyType

from temper.models.common.sizes import TINY_SHAPE, named_size
from temper.models.qwen3_5.model import Qwen3_5

QWEN3_5_VOCAB_SIZE = 248_320
TINY_LINEAR_SHAPE = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "partial_rotary_factor": 0.25,
}
"""The tiny size's Gated DeltaNet: 2 key heads and 4 value heads of 32."""
PUBLISHED_SHAPE = {
    "vocab_size": QWEN3_5_VOCAB_SIZE,
    "head_dim": 256,
    "rope_theta": 10_000_000.0,
    "max_seq_len": 262_144,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
"""What every published Qwen3.5 size shares (dense and MoE)."""


def _published(
    *,
    dim: int,
    num_layers: int,
    num_heads: int,
    ffn_dim: int,
    linear_value_heads: int,
    tie: bool,
) -> Qwen3_5.Config:
    return Qwen3_5.Config(
        **PUBLISHED_SHAPE,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=4,
        ffn_dim=ffn_dim,
        tie_embeddings=tie,
        linear_num_value_heads=linear_value_heads,
    )


QWEN3_5_SIZES = MappingProxyType(
    {
        "tiny": Qwen3_5.Config(vocab_size=QWEN3_5_VOCAB_SIZE, **TINY_SHAPE, **TINY_LINEAR_SHAPE),
        "4B": _published(
            dim=2560, num_layers=32, num_heads=16, ffn_dim=9216, linear_value_heads=32, tie=True
        ),
        "9B": _published(
            dim=4096, num_layers=32, num_heads=16, ffn_dim=12288, linear_value_heads=32, tie=False
        ),
        "27B": _published(
            dim=5120, num_layers=64, num_heads=24, ffn_dim=17408, linear_value_heads=48, tie=False
        ),
    }
)


def qwen3_5_size(name: str, *, vocab_size: int | None = None) -> Qwen3_5.Config:
    """A fresh config for a named size, optionally with another vocabulary size."""
    return named_size(QWEN3_5_SIZES, name, family="Qwen3.5", vocab_size=vocab_size)
