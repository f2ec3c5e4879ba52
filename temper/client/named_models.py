"""Named base models: what a base model name means when it is not a model directory.

A named base model is a family's named size (temper/models/*/sizes.py) with random weights,
written `NAME[:TOKENIZER]`, where NAME is one of

- the HF repo id of a published checkpoint the size has the shapes of: `Qwen/Qwen3-8B`,
  `meta-llama/Llama-3.1-8B`, `Qwen/Qwen3-30B-A3B` (`HF_REPO_IDS`; nothing is downloaded, the
  name only picks the shapes);
- a family (its HF model_type) and a size: `qwen3/8B`, `llama/8B`, `qwen3_moe/tiny`;
- a Qwen3 size alone: `8B`, `tiny`. Sizes of other families need their family: Llama 3's 8B
  and Qwen3's 8B are different models.

TOKENIZER is a built-in vocabulary (digits, letters, words, bytes): a random model built of the
name takes its vocabulary size from it (the clients pair a name without one with `digits`),
and `temper plan` plans the published vocabulary unless one is given.

A name that is also a directory is that directory: the callers look for one first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from temper.checkpoint.model_source import ModelSource
from temper.models.common.decoder import DecoderConfig
from temper.models.registry import MODEL_FAMILIES
from temper.tokenizer import build_builtin_tokenizer, builtin_names

BARE_SIZES_FAMILY = "qwen3"
"""The family whose sizes may be named alone ('8B', 'tiny')."""

HF_REPO_IDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        **{
            f"Qwen/Qwen3-{size}": ("qwen3", size)
            for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
        },
        "Qwen/Qwen3-30B-A3B": ("qwen3_moe", "30B-A3B"),
        "Qwen/Qwen3-235B-A22B": ("qwen3_moe", "235B-A22B"),
        **{f"Qwen/Qwen3.5-{size}": ("qwen3_5", size) for size in ("4B", "9B", "27B")},
        "Qwen/Qwen3.5-35B-A3B": ("qwen3_5_moe", "35B-A3B"),
        "Qwen/Qwen3.5-397B-A17B": ("qwen3_5_moe", "397B-A17B"),
        # Base checkpoints have their instruct models' shapes; Qwen3.6 is Qwen3.5's
        # architecture at the same sizes (tinker-cookbook's model table gives both the same
        # width), so its names pick the Qwen3.5 size of that name.
        "Qwen/Qwen3.5-9B-Base": ("qwen3_5", "9B"),
        "Qwen/Qwen3.5-35B-A3B-Base": ("qwen3_5_moe", "35B-A3B"),
        "Qwen/Qwen3.6-27B": ("qwen3_5", "27B"),
        "Qwen/Qwen3.6-35B-A3B": ("qwen3_5_moe", "35B-A3B"),
        "meta-llama/Llama-3.2-1B": ("llama", "1B"),
        "meta-llama/Llama-3.2-3B": ("llama", "3B"),
        "meta-llama/Llama-3.1-8B": ("llama", "8B"),
        "meta-llama/Llama-3.1-70B": ("llama", "70B"),
    }
)
"""HF repo id -> (family, size) of each published size (every size but `tiny`), and of the
published checkpoints that share a size's shapes."""


@dataclass(frozen=True, kw_only=True)
class NamedModel:
    """A named size of a family, and the built-in tokenizer the name paired it with."""

    family: str
    """HF model_type of the family (a key of MODEL_FAMILIES)."""
    size: str
    """One of the family's named sizes."""
    tokenizer: str | None
    """Built-in vocabulary given with the name; None when the name gave none."""

    def config(self) -> DecoderConfig:
        """The size's shapes: its published vocabulary, or the tokenizer's when the name
        gives one (what a random model of the name has)."""
        config = MODEL_FAMILIES[self.family].sizes[self.size]
        if self.tokenizer is None:
            return dataclasses.replace(config)
        vocab_size = build_builtin_tokenizer(self.tokenizer).vocab_size
        return dataclasses.replace(config, vocab_size=vocab_size)

    def source(self, *, device: str, dtype: str) -> ModelSource.Config:
        """A random model of this size (seed 0), its tokenizer `digits` unless named."""
        return ModelSource.Config(
            family=self.family,
            size=self.size,
            tokenizer=self.tokenizer or "digits",
            dtype=dtype,
            device=device,
        )


def named_model(name: str, *, what: str) -> NamedModel:
    """The named model `name` stands for; a ValueError naming `what` (the field) and listing
    the valid names otherwise."""
    model, _, tokenizer = name.partition(":")
    found = _lookup(model)
    if found is None:
        raise ValueError(
            f"{what} {name!r} is neither a model directory nor a named size; {valid_names()}"
        )
    if tokenizer and tokenizer not in builtin_names():
        raise ValueError(
            f"{what} {name!r}: unknown built-in tokenizer {tokenizer!r} after ':'; valid: "
            f"{', '.join(builtin_names())}"
        )
    family, size = found
    return NamedModel(family=family, size=size, tokenizer=tokenizer or None)


def _lookup(model: str) -> tuple[str, str] | None:
    """(family, size) of a name without its tokenizer, or None."""
    if model in HF_REPO_IDS:
        return HF_REPO_IDS[model]
    family, slash, size = model.rpartition("/")
    if not slash:
        family = BARE_SIZES_FAMILY
    if family in MODEL_FAMILIES and size in MODEL_FAMILIES[family].sizes:
        return family, size
    return None


def valid_names() -> str:
    """The named models, for error messages."""
    sizes = "; ".join(f"{name}: {', '.join(f.sizes)}" for name, f in MODEL_FAMILIES.items())
    bare = ", ".join(MODEL_FAMILIES[BARE_SIZES_FAMILY].sizes)
    return (
        f"named sizes are a HF repo id ({', '.join(HF_REPO_IDS)}), FAMILY/SIZE such as "
        f"'llama/8B' ({sizes}) or a Qwen3 size alone ({bare}), each optionally with a "
        "built-in tokenizer ('tiny:letters')"
    )
