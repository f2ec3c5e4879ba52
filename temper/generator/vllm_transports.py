"""Which path new weights take into vLLM, from where vLLM runs (vllm_transfer.py moves them).

The rule (`choose_transport` with `choice='auto'`):
- vLLM in this process: 'inline', the tensors travel in the request itself.
- vLLM's own processes, every worker on the sender's device (its GPU, or host memory on
  CPU): 'ipc', each bucket in a shared buffer that the workers map without a copy.
- vLLM's own processes, every worker on a GPU other than the sender's (the sender on a GPU):
  'nccl', the buckets streamed device to device over an NCCL group (control over gloo).
- anything else (a sender on CPU and workers on GPUs; tensor-parallel workers of which one
  shares the sender's GPU, where NCCL cannot pair two ranks and CUDA IPC reaches only that
  one): 'gloo', the buckets streamed over a gloo group, staged in host memory.
A forced choice (`VllmGenerator.Config.transport`) that cannot work on the placement is
refused, saying why and which would.

vLLM's worker of tensor-parallel rank i runs on the i-th visible GPU of the process that
starts the engine (`worker_devices`), and on CPU every worker is in host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Transport = Literal["inline", "gloo", "ipc", "nccl"]
TransportChoice = Literal["auto", "inline", "gloo", "ipc", "nccl"]
TRANSPORT_CHOICES: tuple[TransportChoice, ...] = ("auto", "inline", "gloo", "ipc", "nccl")
_FIELD = "VllmGenerator.Config.transport"


def worker_devices(*, sender: torch.device, tensor_parallel_size: int) -> list[torch.device]:
    """The devices of vLLM's workers when this process starts the engine."""
    if sender.type == "cpu":
        return [torch.device("cpu")] * tensor_parallel_size
    return [torch.device(sender.type, index) for index in range(tensor_parallel_size)]


def check_process_boundary(choice: TransportChoice, *, in_process: bool) -> None:
    """What the config alone can refuse (before any engine starts): a transport across a
    process boundary for vLLM in this process, or 'inline' for vLLM in its own processes.
    Whether the devices fit is checked when the engine is built (`choose_transport`)."""
    if choice == "auto":
        return
    if in_process and choice != "inline":
        raise ValueError(
            f"{_FIELD}={choice!r} needs vLLM in its own processes, and it runs in this one "
            "(engine_process='inline', tensor_parallel_size 1): use 'inline' or 'auto', or "
            "set VllmGenerator.Config.engine_process='separate'"
        )
    if not in_process and choice == "inline":
        raise ValueError(
            f"{_FIELD}='inline' needs vLLM in this process (engine_process='inline' and "
            "tensor_parallel_size 1); it runs in its own processes: use 'auto' (ipc, nccl or "
            "gloo, by where vLLM's workers run)"
        )


def choose_transport(
    choice: TransportChoice,
    *,
    in_process: bool,
    sender: torch.device,
    workers: Sequence[torch.device],
) -> Transport:
    """The transport for this placement (`choice='auto'`), or `choice` if it can work there;
    a ValueError naming the field, the placement and what would work otherwise."""
    sender = _indexed(sender)
    workers = [_indexed(device) for device in workers]
    automatic = _automatic(in_process=in_process, sender=sender, workers=workers)
    if choice == "auto" or choice == automatic:
        return automatic
    where = f"vLLM's workers on {_names(workers)}, the sender on {sender}"
    if in_process:
        raise ValueError(
            f"{_FIELD}={choice!r} needs vLLM in its own processes, and it runs in this one "
            "(engine_process='inline', tensor_parallel_size 1): use 'inline' or 'auto', or "
            "set VllmGenerator.Config.engine_process='separate'"
        )
    if choice == "inline":
        raise ValueError(
            f"{_FIELD}='inline' needs vLLM in this process (engine_process='inline' and "
            f"tensor_parallel_size 1); it runs in its own processes: use {automatic!r} or 'auto'"
        )
    if choice == "ipc" and any(device != sender for device in workers):
        raise ValueError(
            f"{_FIELD}='ipc' shares memory on one device, and {where}: use {automatic!r} or 'auto'"
        )
    if choice == "nccl" and (
        sender.type != "cuda" or any(d.type != "cuda" or d == sender for d in workers)
    ):
        raise ValueError(
            f"{_FIELD}='nccl' needs the sender and every vLLM worker on distinct GPUs (NCCL "
            f"runs on CUDA devices and cannot pair two ranks on one GPU), and {where}: use "
            f"{automatic!r} or 'auto'"
        )
    return choice


def _automatic(
    *, in_process: bool, sender: torch.device, workers: Sequence[torch.device]
) -> Transport:
    if in_process:
        return "inline"
    if all(device == sender for device in workers):
        return "ipc"
    if sender.type == "cuda" and all(d.type == "cuda" and d != sender for d in workers):
        return "nccl"
    return "gloo"


def _indexed(device: torch.device) -> torch.device:
    """cuda means the current GPU: give it its index, so equal devices compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _names(devices: Sequence[torch.device]) -> str:
    return ", ".join(str(device) for device in devices)
