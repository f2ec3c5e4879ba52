"""The trainer engine: losses on model logprobs, gradient accumulation, AdamW, sharding."""

from temper.models.lora import LoraConfig
from temper.trainer.engine import TrainerEngine

__all__ = ["LoraConfig", "TrainerEngine"]
