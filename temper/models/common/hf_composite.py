"""The multimodal Hugging Face checkpoint a text model was read from.

Released conditional-generation checkpoints (`Qwen3_5ForConditionalGeneration`) hold a
composite config.json (`text_config`, `vision_config`, ...) and, beside the language model's
weights, the tensors of parts Temper does not compute: the vision tower, multi-token-prediction
heads. A model read from such a directory carries an `HfComposite` in its config
(`DecoderConfig.hf_composite`), so that every model built from that config (merged LoRA
exports, sampler copies) exports the same architecture again. The other parts' tensors
("passthrough tensors") are never held by the model: only where they are stored, read again
when a directory is written (temper/checkpoint/composite.py does the reading and writing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class PassthroughTensor:
    """One stored tensor of a part the model does not compute, and where it is stored."""

    hf_key: str
    """Its name in the checkpoint, e.g. 'model.visual.blocks.0.attn.qkv.weight'."""
    path: Path
    """The safetensors file it is read from at export."""
    shape: tuple[int, ...]
    dtype: str
    """safetensors' name of its dtype ('F32', 'BF16', ...)."""
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class HfComposite:
    """A composite checkpoint's config and other parts, as read (see the module doc)."""

    config_json: str
    """The composite config.json as read (JSON text, so the record stays immutable)."""
    text_prefix: str
    """Where the language model's weights sit, e.g. 'model.language_model.'."""
    passthrough: tuple[PassthroughTensor, ...]
    """Every stored tensor outside the language model, in the files' order."""

    @property
    def hf_config(self) -> dict[str, Any]:
        """A fresh copy of the composite config.json dict."""
        return json.loads(self.config_json)

    @property
    def passthrough_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.passthrough)
