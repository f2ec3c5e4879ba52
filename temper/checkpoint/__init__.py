"""Checkpoints: HF safetensors import/export and DCP train state (PEFT adapters come later)."""

from temper.checkpoint.dcp import load_train_state, read_train_state_metadata, save_train_state
from temper.checkpoint.hf import load_pretrained, missing_model_files, save_pretrained

__all__ = [
    "load_pretrained",
    "load_train_state",
    "missing_model_files",
    "read_train_state_metadata",
    "save_pretrained",
    "save_train_state",
]
