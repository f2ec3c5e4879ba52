"""Export a LoRA-adapted model as a plain HF model directory with the adapters merged in.

The merged weights (W + scale * B @ A, summed in fp32) are loaded into a plain model built on
the meta device from `merged_config` (tied embeddings come out untied when the unembedding was
adapted), which the ordinary `save_pretrained` then writes. Only the merged weights are
allocated: the plain model's parameters are the merged tensors themselves, and its unadapted
ones (norms, the embedding) share storage with the source model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from temper.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, save_pretrained
from temper.models.common.decoder import Decoder
from temper.models.lora import merged_config, merged_state_dict
from temper.tokenizer import Tokenizer


def merged_model(model: Decoder) -> Decoder:
    """A plain (adapter-free) model computing what `model` computes (see the module doc)."""
    with torch.device("meta"):
        plain = merged_config(model).build()
    plain.load_state_dict(merged_state_dict(model), assign=True)
    return plain


def save_merged_pretrained(
    model: Decoder,
    out_dir: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `model` with its LoRA adapters merged as a HF model directory; returns its path."""
    return save_pretrained(
        merged_model(model),
        out_dir,
        tokenizer=tokenizer,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
    )
