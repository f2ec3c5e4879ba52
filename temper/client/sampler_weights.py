"""Model sources for the clients: base models by name, and weights for samplers.

Sampler checkpoints (`save_weights_for_sampler`) hold either a full HF model directory, or,
for LoRA, only the adapter tensors plus the base model's name; either way a `sampler.json`
says which, and the tokenizer files come along so the directory is self-describing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from temper.checkpoint.atomic import staged_directory
from temper.checkpoint.gather import full_state_dict, is_sharded, sampler_stream
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.checkpoint.model_source import ModelSource
from temper.checkpoint.storage import CheckpointStorage
from temper.client.named_models import named_model
from temper.distributed.ranks import Ranks
from temper.models.build import materialize
from temper.models.lora import (
    LORA_SUFFIXES,
    LoraConfig,
    apply_lora,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.sampler.weight_source import WeightUpdate
from temper.tokenizer import Tokenizer, load_tokenizer

SAMPLER_FILE = "sampler.json"
GATHER_BUCKET_BYTES = 256 * 2**20
"""A sharded trainer's weights reach each rank's sampler gathered this many bytes at a time
(the default of a placement's `bucket_mb`)."""
LORA_FILE = "lora.safetensors"


def resolve_base_model(name: str, *, device: str, dtype: str) -> ModelSource.Config:
    """A model directory, or a named size for a random model ("8B", "Qwen/Qwen3-8B",
    "llama/tiny:letters": named_models.py)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"base_model must be a non-empty string, got {name!r}")
    path = Path(name).expanduser()
    if path.is_dir():
        return ModelSource.Config(path=str(path), dtype=dtype, device=device)
    return named_model(name, what="base_model").source(device=device, dtype=dtype)


def recorded_base_model(name: str) -> str:
    """`name` as run.json and sampler weights record it: a model directory by its absolute path
    (they are read from other working directories: `temper sample`, another process), a named
    size as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


@dataclass(frozen=True)
class SamplerWeights:
    model: nn.Module
    tokenizer: Tokenizer
    name: str


def sampler_model(
    model: nn.Module, *, lora: LoraConfig | None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The module a trainer's sampler is built on: the trainer's own (full fine-tuning in
    `dtype`) or an empty plain model shaped like the merged one, in `dtype` (LoRA, a sharded
    trainer: each rank's sampler holds whole weights; or another dtype: a bf16 copy of a
    mixed-precision trainer's fp32 weights, filled by a cast at each sync). `dtype` None: the
    trainer's parameters' dtype."""
    parameter = next(model.parameters())
    dtype = dtype or parameter.dtype
    if lora is None and not is_sharded(model) and dtype == parameter.dtype:
        return model
    return materialize(merged_config(model), device=parameter.device, dtype=dtype, init="empty")


def sampler_update(model: nn.Module, *, lora: LoraConfig | None) -> WeightUpdate:
    """What the sampler loads for the current weights: the module itself, or a stream of
    merged tensors, one at a time (gathered whole from a sharded trainer: collective, every
    rank consumes it)."""
    if lora is None and not is_sharded(model):
        return model
    return sampler_stream(model, bucket_bytes=GATHER_BUCKET_BYTES)


def save_sampler_weights(
    directory: Path,
    *,
    model: nn.Module,
    tokenizer: Tokenizer,
    base_model: str,
    lora: LoraConfig | None,
) -> None:
    """Write `model`'s sampler weights to `directory` (which must not exist).

    A sharded model (collective: every rank calls this) is gathered whole on every rank and
    written by rank 0 alone; every rank returns once the directory is in place, or raises
    rank 0's error (an existing directory, a full disk)."""
    info = {"base_model": base_model, "lora": None if lora is None else dataclasses.asdict(lora)}
    if not is_sharded(model):
        _write_sampler_weights(
            directory,
            model=model if lora is None else None,
            adapters=None if lora is None else lora_state_dict(model),
            tokenizer=tokenizer,
            info=info,
        )
        return
    ranks = Ranks.of_trainer()
    ranks.on_writer(lambda: _check_absent(directory))  # before gathering anything
    if lora is None:
        full, adapters = full_state_dict(model), None
    else:
        full, adapters = None, full_state_dict(model, keep=lambda key: key.endswith(LORA_SUFFIXES))

    def write() -> None:
        plain = None
        if full is not None:
            plain = sampler_model(model, lora=None)  # an empty plain model of the same shape
            plain.load_state_dict(full)
        _write_sampler_weights(
            directory, model=plain, adapters=adapters, tokenizer=tokenizer, info=info
        )

    ranks.on_writer(write)


def _check_absent(directory: Path) -> None:
    if directory.exists():
        raise FileExistsError(f"sampler weights {directory} already exist; choose another name")


def _write_sampler_weights(
    directory: Path,
    *,
    model: nn.Module | None,
    adapters: dict[str, torch.Tensor] | None,
    tokenizer: Tokenizer,
    info: dict[str, Any],
) -> None:
    """A full HF model directory (`model`), or LoRA `adapters` plus the tokenizer."""
    _check_absent(directory)
    with staged_directory(directory) as staging:
        if model is not None:
            save_pretrained(model, staging, tokenizer=tokenizer, overwrite=True)
        else:
            assert adapters is not None
            tensors = {k: v.detach().cpu().contiguous() for k, v in adapters.items()}
            save_file(tensors, str(staging / LORA_FILE), metadata={"format": "pt"})
            tokenizer.save(staging)
        (staging / SAMPLER_FILE).write_text(json.dumps(info, indent=2) + "\n")


def load_sampler_weights(
    storage: CheckpointStorage, path: str, *, device: str, dtype: str
) -> SamplerWeights:
    parsed, directory = storage.existing(path)
    if parsed.kind != "sampler_weights":
        raise ValueError(
            f"{path} is a training-state checkpoint; sampling clients load "
            f"tinker://{parsed.run_id}/sampler_weights/<name> (from save_weights_for_sampler)"
        )
    return load_sampler_directory(directory, name=str(parsed), device=device, dtype=dtype)


def sampler_vocab_size(directory: Path) -> int:
    """Vocabulary size of the model a sampler checkpoint directory holds, read without its
    weights (a LoRA checkpoint has no config.json: its base model's)."""
    info = json.loads((directory / SAMPLER_FILE).read_text())
    if info["lora"] is None:
        source = ModelSource.Config(path=str(directory))
    else:
        source = resolve_base_model(info["base_model"], device="cpu", dtype="float32")
    return dataclasses.replace(source, weights="deferred").build().model.config.vocab_size


def load_sampler_directory(
    directory: Path, *, name: str, device: str, dtype: str
) -> SamplerWeights:
    """The model a sampler checkpoint directory holds (a HF model, or LoRA adapters merged
    into their base model) with its tokenizer; `name` names it in errors."""
    info = json.loads((directory / SAMPLER_FILE).read_text())
    tokenizer = load_tokenizer(directory)
    if info["lora"] is None:
        return SamplerWeights(
            model=load_pretrained(directory, dtype=dtype, device=device),
            tokenizer=tokenizer,
            name=name,
        )
    base = resolve_base_model(info["base_model"], device=device, dtype=dtype).build()
    apply_lora(base.model, LoraConfig(**info["lora"]))
    adapters = load_file(str(directory / LORA_FILE), device=device)
    _load_adapters(base.model, adapters, where=name)
    plain = sampler_model(base.model, lora=LoraConfig(**info["lora"]))
    plain.load_state_dict(merged_state_dict(base.model))
    return SamplerWeights(model=plain, tokenizer=tokenizer, name=name)


@torch.no_grad()
def _load_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], *, where: str) -> None:
    expected = lora_state_dict(model)
    if expected.keys() != adapters.keys():
        raise ValueError(
            f"{where}: adapter tensors {sorted(adapters)} do not match the model's "
            f"{sorted(expected)}"
        )
    for name, tensor in adapters.items():
        expected[name].copy_(tensor)
