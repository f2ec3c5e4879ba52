"""gsm8k: GRPO with LoRA on grade-school word problems, Qwen3-0.6B loaded from a local directory.

Nothing is downloaded: `model.base_model` is a Qwen3-0.6B directory you provide (HF layout:
config.json, *.safetensors, tokenizer.json), and the problems are a GSM8K-format JSONL file. The
default file is the 50-problem sample shipped in data/ (so the recipe runs from a clean clone);
point `task:math --task.path` at GSM8K's train.jsonl (and `--task.heldout_path` at test.jsonl)
for a real run:

    temper train gsm8k_qwen3_0_6b --model.base_model /models/Qwen3-0.6B \
        task:math --task.path gsm8k/train.jsonl --task.heldout_path gsm8k/test.jsonl

Prompts are plain text ("Question: ...\\nAnswer:"), no chat template. A short supervised warm-up
on the worked solutions teaches the answer format ("... #### 42" then the stop token) before
GRPO. Meant for a GPU; a missing model directory fails before anything trains.
"""

from __future__ import annotations

from pathlib import Path

from temper.config.recipes import recipe
from temper.job import ModelChoice
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.engine import SamplerEngine
from temper.tasks import Math

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
"""The repository's data/ folder (absolute, so a run works from any directory)."""


@recipe("GRPO + LoRA on GSM8K-format JSONL, Qwen3-0.6B from a local directory (GPU)")
def gsm8k_qwen3_0_6b() -> RLJob.Config:
    return RLJob.Config(
        # dtype 'auto' on CUDA: bf16 matmuls, fp32 adapters and AdamW moments, a bf16 base (in
        # pure bf16 the 4e-5 steps would round away on most adapter weights).
        model=ModelChoice.Config(base_model="models/Qwen3-0.6B", lora_rank=32, device="cuda"),
        task=Math.Config(path=str(DATA_DIR / "gsm8k_sample.jsonl")),
        warmup=SFTWarmup.Config(steps=20, batch_size=16, learning_rate=1e-4, warmup_steps=5),
        rl=RLSteps.Config(
            steps=200,
            prompts_per_step=32,
            group_size=8,
            max_tokens=384,
            temperature=1.0,
            learning_rate=4e-5,
            eval_every=25,
        ),
        eval_problems=128,
        sampler=SamplerEngine.Config(max_batch=256, max_seq_len=1024),
    )
