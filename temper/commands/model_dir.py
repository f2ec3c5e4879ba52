"""`temper init-model`: write a randomly initialized model directory for offline work."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import tyro

from temper.checkpoint.model_source import init_model_dir


def init_model(
    out_dir: Annotated[Path, tyro.conf.Positional],
    /,
    *,
    size: str = "tiny",
    tokenizer: Literal["digits", "letters", "words", "bytes"] = "digits",
    family: Literal["qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe"] = "qwen3",
    dtype: Literal["float32", "bfloat16"] = "float32",
    seed: int = 0,
    overwrite: bool = False,
) -> int:
    """Write a randomly initialized model directory (config.json, safetensors, tokenizer).

    Args:
        out_dir: Directory to create; it must not exist or be empty unless --overwrite.
        size: Named model size (qwen3: tiny, 0.6B, 1.7B, 4B, 8B, 14B, 32B; llama: tiny,
            1B, 3B, 8B, 70B; qwen3_moe: tiny, 30B-A3B, 235B-A22B; qwen3_5: tiny, 4B, 9B,
            27B; qwen3_5_moe: tiny, 35B-A3B, 397B-A17B).
        tokenizer: Built-in vocabulary; the model's vocab_size is taken from it.
        family: Model family (qwen3, llama, qwen3_moe, qwen3_5 or qwen3_5_moe).
        dtype: Parameter dtype written to disk.
        seed: Seed of the random initialization.
        overwrite: Replace an existing non-empty directory.
    """
    tokenizer_obj = init_model_dir(
        out_dir,
        size=size,
        tokenizer=tokenizer,
        family=family,
        dtype=dtype,
        seed=seed,
        overwrite=overwrite,
    )
    print(
        f"wrote {size} {family} model with the {tokenizer!r} vocabulary "
        f"({tokenizer_obj.vocab_size} tokens) to {out_dir}"
    )
    return 0
