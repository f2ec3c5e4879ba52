"""Named Qwen3 sizes: `tiny` for tests and the demo, and the published dense checkpoints.

The published shapes are those of the Qwen3 dense releases (vocab 151936, head_dim 128,
rope_theta 1e6, 40960 positions); `tiny` takes its vocabulary from the tokenizer it is paired
with, since toy tasks use small built-in vocabularies.
"""

from __future__ import annotations

from types import MappingProxyType

from temper.models.common.sizes import TINY_SHAPE, named_size
from temper.models.qwen3.model import Qwen3

QWEN3_VOCAB_SIZE = 151_936


def _published(
    *, dim: int, num_layers: int, num_heads: int, ffn_dim: int, tie: bool
) -> Qwen3.Config:
    return Qwen3.Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        dim=dim,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn_dim,
        tie_embeddings=tie,
    )


QWEN3_SIZES = MappingProxyType(
    {
        "tiny": Qwen3.Config(vocab_size=QWEN3_VOCAB_SIZE, **TINY_SHAPE),
        "0.6B": _published(dim=1024, num_layers=28, num_heads=16, ffn_dim=3072, tie=True),
        "1.7B": _published(dim=2048, num_layers=28, num_heads=16, ffn_dim=6144, tie=True),
        "4B": _published(dim=2560, num_layers=36, num_heads=32, ffn_dim=9728, tie=True),
        "8B": _published(dim=4096, num_layers=36, num_heads=32, ffn_dim=12288, tie=False),
        "14B": _published(dim=5120, num_layers=40, num_heads=40, ffn_dim=17408, tie=False),
        "32B": _published(dim=5120, num_layers=64, num_heads=64, ffn_dim=25600, tie=False),
    }
)


def qwen3_size(name: str, *, vocab_size: int | None = None) -> Qwen3.Config:
    """A fresh config for a named size, optionally with another vocabulary size."""
    return named_size(QWEN3_SIZES, name, family="Qwen3", vocab_size=vocab_size)
