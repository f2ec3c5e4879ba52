"""The trainer engine: losses on model logprobs, gradient accumulation, AdamW, LoRA."""

from temper.trainer.engine import TrainerEngine
from temper.trainer.lora import LoraConfig

__all__ = ["LoraConfig", "TrainerEngine"]
