"""Two NCCL ranks on two GPUs (needs two GPUs; `make gpu-check` runs it): each rank's worker
thread runs on its own GPU, and a weight bucket broadcast over NCCL arrives exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.spawn import spawn

pytestmark = pytest.mark.gpu


def _rank(rank: int) -> list[int]:
    from temper.api.futures import Worker

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    worker_device = Worker("test-nccl").submit(torch.cuda.current_device).result()
    bucket = torch.arange(1 << 20, dtype=torch.bfloat16, device=device) * (rank == 0)
    group = dist.new_group([0, 1], backend="nccl")
    dist.broadcast(bucket, src=0, group=group)
    expected = torch.arange(1 << 20, dtype=torch.bfloat16, device=device)
    return [worker_device, int(torch.equal(bucket, expected))]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_use_their_own_gpus_and_broadcast_exactly(tmp_path):
    assert spawn(_rank, world_size=2, out_dir=tmp_path) == [[0, 1], [1, 1]]
