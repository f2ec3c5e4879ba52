"""init_from_env on a CUDA rank (no GPU needed: torch.cuda and the process group are faked):
the rank's GPU is LOCAL_RANK's, set before the group starts and bound to NCCL with device_id."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from temper.distributed import launch


def test_a_cuda_rank_binds_its_own_gpu_to_nccl(monkeypatch):
    calls: list[tuple] = []
    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(("init", kwargs)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    info = launch.init_from_env(device_type="cuda", timeout_s=90)
    gpu = torch.device("cuda", 1)
    assert info.device == gpu and info.local_rank == 1 and info.rank == 3
    timeout = datetime.timedelta(seconds=90)
    assert calls == [
        ("set", gpu),
        ("init", {"backend": "nccl", "device_id": gpu, "timeout": timeout}),
    ]
