"""Buckets of named tensors handed to another process on the same device through shared
memory: the sender copies a bucket into one of two shared buffers (slots), the receiver maps
that buffer without a copy and loads views of it.

Everything that crosses the process boundary is plain data (str, int, bytes, lists and
dicts of them), so it travels inside any request (msgpack, JSON) without pickling:
- a slot's handle: on a GPU, the CUDA IPC handle of a device buffer (the fields of
  `torch.multiprocessing.reductions.reduce_tensor`'s answer that are not Python types);
  on CPU, the name of a shared-memory file (torch's `file_system` sharing: the buffer's
  `_share_filename_cpu_`), the CPU twin of the same protocol;
- a bucket's descriptor: its slot's handle and each tensor's name, dtype, shape and offset.

Two slots rotate: the sender fills one while the receiver loads the other, and fills a slot
again only once the receiver has acknowledged the bucket in it (the caller's protocol: here
the request that carried the descriptor returns). A slot grows, with a new handle, when a
bucket is larger than it. Each handle is exported once and mapped once (torch's reference
counts pair one export with one mapping); the receiver keeps its mappings until the handle of
a slot changes or `close`.

A receiver's loader must not keep views of the buffer past its return (the slot is refilled):
`MappedSlots.load` checks that after its `release` hook, which copies what a loader keeps on
purpose, and raises otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import (
    rebuild_cuda_tensor,
    rebuild_storage_filename,
    reduce_tensor,
)

Bucket = list[tuple[str, torch.Tensor]]
NUM_SLOTS = 2
_ALIGNMENT = 16  # bytes: each tensor of a bucket starts aligned for any dtype's view


class SharedSlots:
    """The sender's side: two shared buffers on `device`, filled in turn."""

    def __init__(self, *, device: torch.device, min_bytes: int) -> None:
        self._device, self._min_bytes = device, min_bytes
        self._buffers: list[torch.Tensor | None] = [None] * NUM_SLOTS
        self._handles: list[dict[str, Any] | None] = [None] * NUM_SLOTS
        self._next = 0

    def fill(self, bucket: Bucket) -> dict[str, Any]:
        """Copy `bucket` into the next slot; its descriptor (plain data) once the bytes are
        there. The caller fills a slot again only after the receiver acknowledged it."""
        slot, self._next = self._next, (self._next + 1) % NUM_SLOTS
        offsets, end = _layout([tensor.nbytes for _, tensor in bucket])
        buffer = self._buffer(slot, end)
        for (_, tensor), offset in zip(bucket, offsets, strict=True):
            if tensor.numel():
                view = buffer[offset : offset + tensor.nbytes]
                view.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()  # visible to the receiver
        return {
            "slot": slot,
            "handle": self._handles[slot],
            "names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "offsets": offsets,
        }

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, self._min_bytes)
            buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
            self._buffers[slot], self._handles[slot] = buffer, _export(buffer)
        return buffer


class MappedSlots:
    """The receiver's side: the sender's slots mapped into this process, by handle."""

    def __init__(self) -> None:
        self._mapped: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}

    def load(
        self,
        descriptor: dict[str, Any],
        *,
        device: torch.device,
        load: Callable[[Bucket], None],
        release: Callable[[torch.Tensor], None] = lambda buffer: None,
    ) -> None:
        """`load` the bucket `descriptor` names, as views of the mapped slot (no copy), then
        `release(buffer)`: make whatever the loader kept independent of the buffer."""
        buffer = self._buffer(descriptor["slot"], descriptor["handle"], device=device)
        storage = buffer.untyped_storage()
        held = torch._C._storage_Use_Count(storage._cdata)
        views = [
            buffer[offset : offset + _nbytes(shape, dtype_name)]
            .view(getattr(torch, dtype_name))
            .view(shape)
            for shape, dtype_name, offset in zip(
                descriptor["shapes"], descriptor["dtype_names"], descriptor["offsets"], strict=True
            )
        ]
        load(list(zip(descriptor["names"], views, strict=True)))
        del views
        release(buffer)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # read before the acknowledgement
        if torch._C._storage_Use_Count(storage._cdata) > held:
            raise RuntimeError(
                f"the loader kept views of shared slot {descriptor['slot']} past its return; "
                "the sender refills that slot, so they would change under it"
            )

    def _buffer(self, slot: int, handle: dict[str, Any], *, device: torch.device) -> torch.Tensor:
        mapped = self._mapped.get(slot)
        if mapped is None or mapped[0] != handle:
            self._mapped.pop(slot, None)  # drop the old mapping first (its reference count)
            self._mapped[slot] = (handle, _import(handle, device=device))
        return self._mapped[slot][1]

    def close(self) -> None:
        self._mapped.clear()


# The parameters of torch's `rebuild_cuda_tensor` that are plain data (the others are Python
# types, the dtype and the device, which the receiver knows: a uint8 buffer on its own GPU).
_CUDA_PLAIN = (
    "tensor_offset",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
_CUDA_PARAMETERS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    *_CUDA_PLAIN[:1],
    "storage_cls",
    "dtype",
    "storage_device",
    *_CUDA_PLAIN[1:4],
    "requires_grad",
    *_CUDA_PLAIN[4:],
)


def _export(buffer: torch.Tensor) -> dict[str, Any]:
    """A shared buffer's handle, as plain data."""
    if buffer.device.type == "cuda":
        _, args = reduce_tensor(buffer)
        exported = dict(zip(_CUDA_PARAMETERS, args, strict=True))
        return {
            "kind": "cuda",
            "gpu_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "numel": buffer.numel(),
            **{name: exported[name] for name in _CUDA_PLAIN},
        }
    assert buffer.device.type == "cpu", buffer.device
    storage = buffer.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()
    storage._shared_incref()  # held for the receiver's one mapping (torch's file_system rule)
    return {"kind": "cpu", "manager": manager, "name": name, "size": size}


def _import(handle: dict[str, Any], *, device: torch.device) -> torch.Tensor:
    """Map a slot's buffer into this process (a uint8 tensor over the sender's bytes)."""
    if handle["kind"] == "cuda":
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        if uuid != handle["gpu_uuid"]:
            raise ValueError(
                f"a shared bucket lives on GPU {handle['gpu_uuid']}, this worker runs on "
                f"{device} ({uuid}): CUDA IPC needs the sender's GPU (the nccl transport "
                "goes across GPUs)"
            )
        return rebuild_cuda_tensor(
            tensor_cls=torch.Tensor,
            tensor_size=(handle["numel"],),
            tensor_stride=(1,),
            storage_cls=torch.UntypedStorage,
            dtype=torch.uint8,
            storage_device=torch.cuda.current_device() if device.index is None else device.index,
            requires_grad=False,
            **{name: handle[name] for name in _CUDA_PLAIN},
        )
    storage = rebuild_storage_filename(
        torch.UntypedStorage, handle["manager"], handle["name"], handle["size"]
    )
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGNMENT) * _ALIGNMENT
    return offsets, end


def _nbytes(shape: list[int], dtype_name: str) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * getattr(torch, dtype_name).itemsize
