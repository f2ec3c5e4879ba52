"""Hugging Face model directories: config.json + safetensors (single file or sharded).

`load_pretrained` builds the model on the meta device and copies each tensor from the
safetensors files straight into its final storage (one tensor in flight at a time), after
checking every name and shape against the files' headers (`locate_weights`, which the sharded
loader in sharded_load.py shares). `save_pretrained` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads; it is written under a temporary name
and renamed, so a crash never leaves a half-written model directory behind.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from temper.checkpoint.atomic import check_free, staged_directory
from temper.models.build import dtype_name, materialize, parse_dtype
from temper.models.registry import WeightSlot, family_for_hf_config, family_of_model
from temper.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Buffers some exporters write that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def missing_model_files(model_dir: Path) -> list[str]:
    """Names of the files a loadable model directory lacks (empty when complete)."""
    if not model_dir.is_dir():
        return [f"{model_dir} (the directory itself)"]
    missing = [] if (model_dir / CONFIG_FILE).is_file() else [CONFIG_FILE]
    index_path = model_dir / WEIGHTS_INDEX
    if index_path.is_file():
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        missing += [shard for shard in shards if not (model_dir / shard).is_file()]
    elif not (model_dir / SINGLE_WEIGHTS).is_file():
        missing.append(f"{SINGLE_WEIGHTS} (or {WEIGHTS_INDEX} with its shards)")
    return missing


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    model_dir = Path(model_dir)
    missing = missing_model_files(model_dir)
    if missing:
        raise FileNotFoundError(f"model directory {model_dir} is missing: {', '.join(missing)}")
    return json.loads((model_dir / CONFIG_FILE).read_text())


def _weight_files(model_dir: Path) -> list[Path]:
    index_path = model_dir / WEIGHTS_INDEX
    if index_path.is_file():
        shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    return [model_dir / SINGLE_WEIGHTS]


def _default_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return parse_dtype(name, field="config.json dtype")


def load_pretrained(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Load a HF model directory into the matching Temper model (e.g. `Qwen3`).

    dtype defaults to the one recorded in config.json (float32 when absent).
    """
    model = empty_pretrained(model_dir, dtype=dtype, device=device)
    _copy_weights(model, model_dir=Path(model_dir), device=torch.device(device))
    return model


def empty_pretrained(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """The model a HF model directory describes, with uninitialized storage on `device`
    (none on 'meta'); dtype as in `load_pretrained`."""
    hf_config = read_hf_config(model_dir)
    config = family_for_hf_config(hf_config).config_from_hf(hf_config)
    dtype = _default_dtype(hf_config) if dtype is None else parse_dtype(dtype)
    return materialize(config, device=device, dtype=dtype, init="empty")


def locate_weights(
    model_dir: Path, *, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]
) -> dict[Path, dict[str, WeightSlot]]:
    """Where each of `shapes` (our state-dict key -> whole shape) is stored: safetensors file
    -> {HF key: where it goes}, in the files' order. A stacked expert tensor is stored as one
    HF tensor per expert. Reads only the files' headers.

    Raises ValueError naming the tensor when a shape differs from the one `model` (built from
    config.json) expects, a stored tensor is not used by the model, or one is missing.
    """
    family = family_of_model(model)
    tied = getattr(model, "output", "absent") is None
    remaining: dict[WeightSlot, tuple[int, ...]] = {}
    names: dict[WeightSlot, str] = {}
    for key, shape in shapes.items():
        slots = family.hf_slots(key, tuple(shape))
        names.update(slots)
        remaining.update(
            {slot: tuple(shape if slot.expert is None else shape[1:]) for slot in slots}
        )
    located: dict[Path, dict[str, WeightSlot]] = {}
    unexpected = []
    for path in _weight_files(model_dir):
        located[path] = {}
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for hf_key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                slot = family.slot_from_hf(hf_key)
                if slot == WeightSlot("output.weight") and tied:
                    continue  # some exporters store the tied unembedding; the embedding is it
                if slot is None or slot not in remaining:
                    if not hf_key.endswith(_IGNORED_SUFFIXES):
                        unexpected.append(hf_key)
                    continue
                shape = tuple(handle.get_slice(hf_key).get_shape())
                expected = remaining.pop(slot)
                if shape != expected:
                    raise ValueError(
                        f"checkpoint tensor {hf_key!r} has shape {shape} but the model built "
                        f"from config.json expects {expected} for {slot.key!r}"
                    )
                located[path][hf_key] = slot
    if unexpected:
        raise ValueError(
            f"{model_dir}: tensors not used by {family.hf_architecture}: {sorted(unexpected)}"
        )
    if remaining:
        missing = sorted(names[slot] for slot in remaining)
        raise ValueError(f"{model_dir}: checkpoint lacks tensors {missing}")
    return located


@torch.no_grad()
def _copy_weights(model: nn.Module, *, model_dir: Path, device: torch.device) -> None:
    targets = model.state_dict()
    shapes = {key: tuple(value.shape) for key, value in targets.items()}
    safetensors_device = "cpu" if device.type == "meta" else str(device)
    for path, slots in locate_weights(model_dir, model=model, shapes=shapes).items():
        with safe_open(str(path), framework="pt", device=safetensors_device) as handle:
            for hf_key, slot in slots.items():
                target = targets[slot.key]
                if slot.expert is not None:
                    target = target[slot.expert]
                target.copy_(handle.get_tensor(hf_key))


def _shards(
    tensors: dict[str, torch.Tensor], *, max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _write_weights(
    directory: Path, tensors: dict[str, torch.Tensor], *, max_shard_bytes: int
) -> None:
    shards = _shards(tensors, max_shard_bytes=max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_WEIGHTS), metadata=metadata)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def _special_token_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def save_pretrained(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `model` (and optionally its tokenizer) as a HF model directory; returns its path."""
    out_dir = check_free(out_dir, overwrite=overwrite)
    family = family_of_model(model)
    state_dict = model.state_dict()
    dtype = next(iter(state_dict.values())).dtype
    tensors = {
        hf_key: tensor.detach().to("cpu").contiguous()
        for key, value in state_dict.items()
        for hf_key, tensor in family.tensors_to_hf(key, value)
    }
    hf_config = family.config_to_hf(model.config, dtype_name=dtype_name(dtype))
    generation_config: dict[str, Any] = {}
    if tokenizer is not None:
        hf_config.update(_special_token_ids(tokenizer))
        generation_config = {
            k: v for k, v in _special_token_ids(tokenizer).items() if v is not None
        }

    with staged_directory(out_dir) as staging:
        _write_weights(staging, tensors, max_shard_bytes=max_shard_bytes)
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        if generation_config:
            text = json.dumps(generation_config, indent=2) + "\n"
            (staging / "generation_config.json").write_text(text)
        if tokenizer is not None:
            tokenizer.save(staging)
    return out_dir
