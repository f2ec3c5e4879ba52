"""Multimodal (conditional-generation) HF checkpoints, read and written for their text model.

transformers 5 saves a conditional-generation model (`Qwen3_5ForConditionalGeneration`) as a
composite config.json (`text_config`, `vision_config`, token ids of the other modalities) and
one set of tensors: the language model's under `model.language_model.` (its `lm_head.weight`
at the top), beside the other parts' (`model.visual.*`, and in released checkpoints
`mtp.*`). A model family reads the text part as it reads its own *ForCausalLM directory,
whose keys are `model.*`: this file renames between the two and keeps the rest.

On load, `read_composite` records the composite config and where every tensor outside the
language model is stored (`HfComposite`, temper/models/common/hf_composite.py); the model
holds none of them. On export, `composite_hf_config` puts the text model's config back into the
composite one (keys the family does not write, such as the multimodal RoPE sections, stay as
they were), and `read_passthrough` reads the other tensors again from their files, a shard at
a time, bitwise as stored. The text model's config decides `tie_word_embeddings` at the top
level, which is the one transformers' conditional-generation models tie by.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from temper.models.common.hf_composite import HfComposite, PassthroughTensor
from temper.models.registry import ModelFamily

TEXT_PREFIX = "model.language_model."
"""Where transformers 5 stores a conditional-generation model's language model."""
_CAUSAL_PREFIX = "model."
"""Where the same tensors sit in the family's *ForCausalLM layout (what its adapter names)."""
_ARCHITECTURE_SUFFIXES = ("ForConditionalGeneration", "ForCausalLM")


def is_composite(hf_config: Mapping[str, Any]) -> bool:
    """Whether a config.json dict describes a multimodal model (it nests a text_config)."""
    return isinstance(hf_config.get("text_config"), Mapping)


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config.json dict of the text model a config.json describes: itself, or a
    composite's text_config with the top level's tie_word_embeddings (the one the
    conditional-generation model ties by) and dtype, and the *ForCausalLM architecture that
    matches the composite's (for finding the family)."""
    if not is_composite(hf_config):
        return dict(hf_config)
    text = dict(hf_config["text_config"])
    architectures = hf_config.get("architectures") or []
    text.setdefault("architectures", [_causal_architecture(name) for name in architectures])
    if "tie_word_embeddings" in hf_config:
        text["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    for key in ("dtype", "torch_dtype"):
        if key in hf_config and key not in text:
            text[key] = hf_config[key]
    return text


def _causal_architecture(name: str) -> str:
    first, suffix = _ARCHITECTURE_SUFFIXES
    return name.removesuffix(first) + suffix if name.endswith(first) else name


def text_key(hf_key: str) -> str:
    """A composite checkpoint's key as the family's *ForCausalLM layout names it."""
    if hf_key.startswith(TEXT_PREFIX):
        return _CAUSAL_PREFIX + hf_key.removeprefix(TEXT_PREFIX)
    return hf_key


def stored_key(composite: HfComposite | None, hf_key: str) -> str:
    """Where a family's HF key (*ForCausalLM layout) is stored: under the composite's text
    prefix, or as it is (no composite, or a top-level key such as lm_head.weight)."""
    if composite is not None and hf_key.startswith(_CAUSAL_PREFIX):
        return composite.text_prefix + hf_key.removeprefix(_CAUSAL_PREFIX)
    return hf_key


def read_composite(
    model_dir: Path, *, hf_config: Mapping[str, Any], family: ModelFamily, files: Iterable[Path]
) -> HfComposite:
    """The composite checkpoint in `model_dir` (config.json `hf_config`, weights in `files`):
    every tensor outside the language model is passthrough. The language model's tensors
    are those under TEXT_PREFIX and the top-level ones the family names (lm_head.weight).
    Reads only the files' headers."""
    passthrough = []
    num_text = 0
    for path in files:
        for hf_key, (dtype, shape, nbytes) in _header(path).items():
            if hf_key.startswith(TEXT_PREFIX) or family.slot_from_hf(hf_key) is not None:
                num_text += hf_key.startswith(TEXT_PREFIX)
                continue
            passthrough.append(
                PassthroughTensor(hf_key=hf_key, path=path, shape=shape, dtype=dtype, nbytes=nbytes)
            )
    if num_text == 0:
        raise ValueError(
            f"{model_dir}: config.json has a text_config (a multimodal checkpoint) but no "
            f"tensor is stored under {TEXT_PREFIX!r}, where transformers 5 stores the language "
            "model of a conditional-generation checkpoint"
        )
    return HfComposite(
        config_json=json.dumps(hf_config),
        text_prefix=TEXT_PREFIX,
        passthrough=tuple(passthrough),
    )


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """A safetensors file's tensors: name -> (dtype, shape, bytes), from its header alone
    (an 8-byte little-endian length, then that much JSON)."""
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__":
            start, stop = entry["data_offsets"]
            tensors[name] = (entry["dtype"], tuple(entry["shape"]), stop - start)
    return tensors


def composite_hf_config(
    composite: HfComposite, *, text_hf_config: Mapping[str, Any]
) -> dict[str, Any]:
    """The composite config.json for a text model whose own config.json dict (the family's
    *ForCausalLM one) is `text_hf_config`: the composite as read, with the text model's
    fields merged into its text_config (the keys the family does not write stay) and the
    top level's dtype and tie_word_embeddings set as the text model's."""
    hf_config = composite.hf_config
    text = {k: v for k, v in text_hf_config.items() if k not in ("architectures", "model_type")}
    hf_config["text_config"] = _merged(hf_config["text_config"], text)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key in text:
            hf_config[key] = text[key]
    return hf_config


def _merged(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `update`'s entries, nested dicts merged key by key."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_passthrough(composite: HfComposite) -> None:
    """That every passthrough tensor is still where it was read, as it was (name, dtype,
    shape): checked before an export writes anything. Reads only the files' headers."""
    by_path: dict[Path, list[PassthroughTensor]] = {}
    for tensor in composite.passthrough:
        by_path.setdefault(tensor.path, []).append(tensor)
    for path, tensors in by_path.items():
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is gone: it holds {len(tensors)} tensors of the multimodal checkpoint "
                f"(e.g. {tensors[0].hf_key!r}) that this model does not hold and its export "
                "copies from there; restore that model directory to export the model"
            )
        header = _header(path)
        for tensor in tensors:
            stored = header.get(tensor.hf_key)
            if stored is None or stored[:2] != (tensor.dtype, tensor.shape):
                raise ValueError(
                    f"{path}: tensor {tensor.hf_key!r} is {stored[:2] if stored else 'absent'}, "
                    f"not the {tensor.dtype} {tensor.shape} read at load; the model directory "
                    "changed since the model was loaded"
                )


def read_passthrough(tensors: Iterable[PassthroughTensor]) -> dict[str, torch.Tensor]:
    """The stored values of `tensors` (CPU, bitwise as stored), each file opened once."""
    by_path: dict[Path, list[PassthroughTensor]] = {}
    for tensor in tensors:
        by_path.setdefault(tensor.path, []).append(tensor)
    values = {}
    for path, wanted in by_path.items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for tensor in wanted:
                values[tensor.hf_key] = handle.get_tensor(tensor.hf_key)
    return values
