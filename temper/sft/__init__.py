"""Supervised fine-tuning on a task's problems or on JSONL conversations, via the client API."""

from temper.sft.datasets import ConversationDataset, DataPosition, load_conversations
from temper.sft.job import SFTJob, SFTResult, SFTState

__all__ = [
    "ConversationDataset",
    "DataPosition",
    "SFTJob",
    "SFTResult",
    "SFTState",
    "load_conversations",
]
