"""`temper plan`: the planned GPU memory of an RL job per rank, computed without running it.

Its flags are the fields of `PlanSettings` (temper/job/memory_plan.py), where what is counted
and what is assumed is written down.
"""

from __future__ import annotations

from typing import Annotated

import tyro

from temper.job.memory_plan import PlanSettings, plan_memory
from temper.job.memory_report import plan_text


def plan(
    settings: Annotated[PlanSettings, tyro.conf.arg(name=""), tyro.conf.OmitArgPrefixes],
) -> int:
    """Print the memory each rank would hold (trainer shard, generator weights, KV cache,
    weight-sync buffers, activations) for a model, placement and world size, and whether it
    fits the GPU.

    Nothing is allocated: shapes come from the model's config. Example:
    `temper plan --model 8B --nnodes 2 --nproc-per-node 8 --lora-rank 32 --batch 256
    --max-seq-len 1024`.
    """
    memory_plan = plan_memory(settings)
    print(plan_text(memory_plan))
    return 0
