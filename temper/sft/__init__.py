"""Supervised fine-tuning."""

from temper.sft.loop import SFTJob, SFTResult

__all__ = ["SFTJob", "SFTResult"]
