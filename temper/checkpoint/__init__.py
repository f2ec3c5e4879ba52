"""Checkpoints: HF safetensors import/export (DCP train state and PEFT adapters come later)."""

from temper.checkpoint.hf import load_pretrained, missing_model_files, save_pretrained

__all__ = ["load_pretrained", "missing_model_files", "save_pretrained"]
