"""sft_conversations: a random tiny Qwen3 learns short chats from a JSONL file.

The data is data/conversations_sample.jsonl (made by data/make_conversations_sample.py): a few
hundred templated conversations over the built-in "words" vocabulary, in the plain role_colon
format. Held-out loss falls from about ln(vocab size) = 6.6 to about 0.5 in 300 steps (about 70 s
of CPU time on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

from temper.config.recipes import recipe
from temper.job import ModelChoice
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.sft import ConversationDataset, SFTJob

SAMPLE_DATASET = Path(__file__).resolve().parents[1] / "data" / "conversations_sample.jsonl"


@recipe("SFT a random tiny Qwen3 on sample JSONL conversations (role_colon, ~1.5 min on CPU)")
def sft_conversations() -> SFTJob.Config:
    return SFTJob.Config(
        model=ModelChoice.Config(base_model="tiny:words"),
        source="conversations",
        conversations=ConversationDataset.Config(
            path=str(SAMPLE_DATASET), renderer="role_colon", heldout_fraction=0.1
        ),
        steps=300,
        batch_size=32,
        learning_rate=2e-3,
        warmup_steps=20,
        eval_every=50,
        max_new_tokens=20,
        sampler=SamplerEngine.Config(
            max_batch=64, max_seq_len=128, cpu=CpuDecoding.Config(num_threads=1)
        ),
        export="none",
    )
