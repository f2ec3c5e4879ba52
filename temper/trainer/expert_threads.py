"""Which threads a trainer's MoE experts run on (TrainerEngine.Config.expert_threads).

On CPU, the experts of one forward or backward can run whole experts per thread, each thread
with one intra-op thread (temper/models/common/sliced_experts.py): small expert matmuls keep
two cores busier that way than with torch's intra-op threads inside each of them. Only where
nothing else splits the work: one process, no thread shards of the batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from temper.distributed.thread_shards import ThreadShards
from temper.models.common.moe import use_expert_threads


def expert_threads_for(
    model: nn.Module,
    *,
    mode: Literal["auto", "off"],
    moe: bool,
    one_cpu_process: bool,
    shard_threads: bool,
) -> ThreadShards | None:
    """Threads for `model`'s experts, set on it (None: none apply, nothing is set)."""
    num_threads = torch.get_num_threads()
    if mode == "off" or not moe or not one_cpu_process or shard_threads or num_threads < 2:
        return None
    threads = ThreadShards(num_threads)
    use_expert_threads(model, threads)
    return threads
