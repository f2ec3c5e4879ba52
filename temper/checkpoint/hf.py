"""Hugging Face model directories: config.json + safetensors (single file or sharded).

`load_pretrained` builds the model on the meta device and copies each tensor from the
safetensors files straight into its final storage (one tensor in flight at a time), after
checking every name and shape against the files' headers (`locate_weights`, which the sharded
loader in sharded_load.py shares). `save_pretrained` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads; it is written under a temporary name
and renamed, so a crash never leaves a half-written model directory behind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from temper.checkpoint.atomic import check_free, staged_directory
from temper.checkpoint.composite import (
    check_passthrough,
    composite_hf_config,
    is_composite,
    read_composite,
    read_passthrough,
    stored_key,
    text_config,
    text_key,
)
from temper.models.build import dtype_name, materialize, parse_dtype
from temper.models.common.hf_composite import HfComposite, PassthroughTensor
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
        return ["the directory itself (no such directory)"]
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
    text = text_config(hf_config)
    family = family_for_hf_config(text)
    try:
        config = family.config_from_hf(text)
    except ValueError as error:  # name the file: "config.json: ..." -> "DIR/config.json: ..."
        config_path = str(Path(model_dir) / "config.json")
        raise ValueError(str(error).replace("config.json", config_path, 1)) from None
    if is_composite(hf_config):
        files = _weight_files(Path(model_dir))
        composite = read_composite(Path(model_dir), hf_config=hf_config, family=family, files=files)
        config = dataclasses.replace(config, hf_composite=composite)
    dtype = _default_dtype(text) if dtype is None else parse_dtype(dtype)
    return materialize(config, device=device, dtype=dtype, init="empty")


def locate_weights(
    model_dir: Path, *, model: nn.Module, shapes: Mapping[str, tuple[int, ...]]
) -> dict[Path, dict[str, WeightSlot]]:
    """Where each of `shapes` (our state-dict key -> whole shape) is stored: safetensors file
    -> {HF key: where it goes}, in the files' order. A stacked expert tensor is stored as one
    HF tensor per expert. Reads only the files' headers.

    Raises ValueError naming the tensor when a shape differs from the one `model` (built from
    config.json) expects, a stored tensor is not used by the model, or one is missing. A
    multimodal checkpoint's text tensors are found under their prefix, and the tensors of its
    other parts (`model.config.hf_composite`) are left out (composite.py).
    """
    family = family_of_model(model)
    composite: HfComposite | None = getattr(model.config, "hf_composite", None)
    passthrough = set() if composite is None else {t.hf_key for t in composite.passthrough}
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
                if hf_key in passthrough:
                    continue
                slot = family.slot_from_hf(hf_key if composite is None else text_key(hf_key))
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
        missing = sorted(stored_key(composite, names[slot]) for slot in remaining)
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


def _shards(sizes: Mapping[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """The tensors (name -> bytes) of each shard, in order, each shard at most
    `max_shard_bytes` unless one tensor alone is larger."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _write_weights(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    *,
    passthrough: tuple[PassthroughTensor, ...] = (),
    max_shard_bytes: int,
) -> None:
    """`tensors` and the `passthrough` ones (read from their files a shard at a time) as
    one safetensors file or shards and their index."""
    sizes = {key: tensor.numel() * tensor.element_size() for key, tensor in tensors.items()}
    sizes.update({tensor.hf_key: tensor.nbytes for tensor in passthrough})
    stored = {tensor.hf_key: tensor for tensor in passthrough}
    shards = _shards(sizes, max_shard_bytes=max_shard_bytes)
    metadata = {"format": "pt"}
    weight_map = {}
    for index, keys in enumerate(shards, start=1):
        shard = {key: tensors[key] for key in keys if key in tensors}
        shard.update(read_passthrough(stored[key] for key in keys if key in stored))
        name = SINGLE_WEIGHTS
        if len(shards) > 1:
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata=metadata)
        weight_map.update(dict.fromkeys(keys, name))
        del shard
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
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
    layout: Literal["as_loaded", "text"] = "as_loaded",
) -> Path:
    """Write `model` (and optionally its tokenizer) as a HF model directory; returns its path.

    layout 'as_loaded': a model read from a multimodal checkpoint (`config.hf_composite`) is
    written as that architecture again: the composite config.json, its text weights under
    their prefix, and the other parts' tensors copied from the files they were read from
    (composite.py). 'text': the text model alone, as the family's *ForCausalLM (e.g. for a
    text-only generator)."""
    if layout not in ("as_loaded", "text"):
        raise ValueError(f"save_pretrained: layout must be 'as_loaded' or 'text', got {layout!r}")
    out_dir = check_free(out_dir, overwrite=overwrite)
    family = family_of_model(model)
    composite = getattr(model.config, "hf_composite", None) if layout == "as_loaded" else None
    if composite is not None:
        check_passthrough(composite)  # before anything is written
    state_dict = model.state_dict()
    dtype = next(iter(state_dict.values())).dtype
    tensors = {
        stored_key(composite, hf_key): tensor.detach().to("cpu").contiguous()
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
    if composite is not None:
        hf_config = composite_hf_config(composite, text_hf_config=hf_config)

    with staged_directory(out_dir) as staging:
        passthrough = () if composite is None else composite.passthrough
        _write_weights(staging, tensors, passthrough=passthrough, max_shard_bytes=max_shard_bytes)
        (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        if generation_config:
            text = json.dumps(generation_config, indent=2) + "\n"
            (staging / "generation_config.json").write_text(text)
        if tokenizer is not None:
            tokenizer.save(staging)
    return out_dir
