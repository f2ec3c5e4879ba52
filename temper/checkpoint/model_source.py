"""Where a job's model comes from: a HF model directory, or a named size with random weights.

Random models pair a named size with a built-in tokenizer vocabulary (the model's vocabulary
size is taken from the tokenizer), so toy tasks, tests and the demo run with nothing
downloaded. `init_model_dir` writes such a model as a regular model directory.

With `weights="deferred"` the model is built on the meta device (no storage) and
`deferred_weights` fills it later, after it is sharded: each rank then reads or draws only its
own shards (sharded_load.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from temper.checkpoint.hf import empty_pretrained, load_pretrained, save_pretrained
from temper.checkpoint.sharded_load import DeferredWeights
from temper.config.checks import check_choice
from temper.config.configurable import Configurable
from temper.config.local_paths import LOCAL_PATH
from temper.models.build import materialize
from temper.models.registry import family
from temper.tokenizer import Tokenizer, build_builtin_tokenizer, load_tokenizer

DType = Literal["float32", "bfloat16"]


class ModelSource(Configurable):
    """A loaded model and its tokenizer."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        path: str | None = field(default=None, metadata=LOCAL_PATH)
        """HF model directory to load; unset: a random model of `size` with `tokenizer`."""
        family: str = "qwen3"
        """Model family of a random model (qwen3, llama, qwen3_moe, qwen3_5, qwen3_5_moe)."""
        size: str = "tiny"
        """Named size of a random model (qwen3: tiny, 0.6B, 1.7B, 4B, 8B, 14B, 32B; llama: tiny,
        1B, 3B, 8B, 70B; qwen3_moe: tiny, 30B-A3B, 235B-A22B; qwen3_5: tiny, 4B, 9B, 27B;
        qwen3_5_moe: tiny, 35B-A3B, 397B-A17B)."""
        tokenizer: str = "digits"
        """Built-in vocabulary of a random model (digits, letters, words, bytes)."""
        seed: int = 0
        """Seed of a random model's initialization."""
        dtype: DType = "float32"
        """Parameter dtype."""
        device: str = "cpu"
        """Device to hold the model on, e.g. 'cpu' or 'cuda'."""
        weights: Literal["loaded", "deferred"] = "loaded"
        """'loaded': the model holds its weights. 'deferred': the model is on the meta device
        and `deferred_weights` fills it on `device` once it is sharded (sharded loading)."""

        def __post_init__(self) -> None:
            check_choice(
                self.weights, field="ModelSource.Config.weights", choices=("loaded", "deferred")
            )

    def __init__(self, config: Config) -> None:
        self.config = config
        deferred = config.weights == "deferred"
        device = "meta" if deferred else config.device
        self.deferred_weights = (
            DeferredWeights(
                device=torch.device(config.device),
                model_dir=None if config.path is None else Path(config.path),
                seed=config.seed,
            )
            if deferred
            else None
        )
        if config.path is not None:
            build = empty_pretrained if deferred else load_pretrained
            self.model = build(config.path, dtype=config.dtype, device=device)
            self.tokenizer = load_tokenizer(config.path)
            if self.tokenizer.vocab_size > self.model.config.vocab_size:
                raise ValueError(
                    f"{config.path}: tokenizer has {self.tokenizer.vocab_size} tokens but the "
                    f"model's vocab_size is {self.model.config.vocab_size}"
                )
        else:
            self.tokenizer = build_builtin_tokenizer(config.tokenizer)
            sizes = family(config.family).sizes
            if config.size not in sizes:
                raise ValueError(
                    f"ModelSource.Config.size: unknown {config.family} size {config.size!r}; "
                    f"valid sizes: {', '.join(sizes)}"
                )
            model_config = dataclasses.replace(
                sizes[config.size], vocab_size=self.tokenizer.vocab_size
            )
            self.model = materialize(
                model_config,
                device=device,
                dtype=config.dtype,
                init="empty" if deferred else "random",
                seed=config.seed,
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def init_model_dir(
    out_dir: str | Path,
    *,
    size: str = "tiny",
    tokenizer: str = "digits",
    family: str = "qwen3",
    dtype: DType = "float32",
    seed: int = 0,
    overwrite: bool = False,
) -> Tokenizer:
    """Write a randomly initialized model directory that `load_pretrained` and HF load."""
    loaded = ModelSource.Config(
        family=family, size=size, tokenizer=tokenizer, dtype=dtype, seed=seed
    ).build()
    save_pretrained(loaded.model, out_dir, tokenizer=loaded.tokenizer, overwrite=overwrite)
    return loaded.tokenizer
