"""Weights streamed from one rank to others in buckets of bounded size.

The sender packs (name, tensor) pairs, as they come, into one flat buffer of `bucket_bytes`
(cast to the transfer dtype); when the next tensor does not fit, it broadcasts a header (the
names and shapes, over a gloo group) and then the buffer (over the data group: gloo on CPU,
NCCL on GPU). A tensor larger than a bucket travels alone. The receivers yield each tensor as
a view of their own buffer, valid until they draw the next: a generator copies it into its
model and the buffer is reused. So neither side ever holds more than a bucket (or the largest
tensor) of weights beyond its model, whatever the model's size.

Both sides must run a transfer to its end; a header of None ends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BucketHeader:
    entries: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype
    size: int
    """Bytes of the bucket (each entry starts at a 16-byte aligned offset)."""


@dataclass(frozen=True)
class TransferStats:
    tensors: int
    buckets: int
    bytes: int
    largest_bucket_bytes: int


class BucketSender:
    """Packs and broadcasts weights from this rank (rank 0 of both groups)."""

    def __init__(
        self,
        *,
        control_group: Any,
        data_group: Any,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        """`dtype`: the transfer dtype (None: each tensor's own; a bucket holds one dtype)."""
        self._control, self._data = control_group, data_group
        self._bucket_bytes, self._dtype, self._device = bucket_bytes, dtype, device
        self._buffer: torch.Tensor | None = None  # uint8, grown up to `bucket_bytes`, reused

    def send(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        entries: list[tuple[str, tuple[int, ...]]] = []
        used = 0  # bytes of the buffer filled
        bucket_dtype: torch.dtype | None = None
        tensors = buckets = total = largest = 0

        def flush() -> None:
            nonlocal entries, used, buckets, total, largest
            if entries:
                assert bucket_dtype is not None
                self._broadcast(entries, self._bytes(used), bucket_dtype)
                buckets, total, largest = buckets + 1, total + used, max(largest, used)
            entries, used = [], 0

        for name, tensor in pairs:
            dtype = self._dtype or tensor.dtype
            size = tensor.numel() * dtype.itemsize
            if entries and (used + _aligned(size) > self._bucket_bytes or dtype != bucket_dtype):
                flush()
            bucket_dtype = dtype
            tensors += 1
            if size > self._bucket_bytes:  # alone, in a buffer of its own
                alone = tensor.detach().to(device=self._device, dtype=dtype).reshape(-1)
                self._broadcast([(name, tuple(tensor.shape))], alone.view(torch.uint8), dtype)
                buckets, total, largest = buckets + 1, total + size, max(largest, size)
                del tensor, alone  # not held while the next one is gathered
                continue
            start = used
            self._bytes(start + size, start=start).view(dtype).copy_(tensor.detach().reshape(-1))
            entries.append((name, tuple(tensor.shape)))
            used = start + _aligned(size)
            del tensor  # a gathered whole tensor: gone before the next is gathered
        flush()
        dist.broadcast_object_list([None], group=self._control, group_src=0)
        return TransferStats(
            tensors=tensors, buckets=buckets, bytes=total, largest_bucket_bytes=largest
        )

    def _bytes(self, end: int, *, start: int = 0) -> torch.Tensor:
        """Bytes [start, end) of the buffer, which doubles (keeping what it holds) up to
        `bucket_bytes` as buckets need: a small model never allocates a whole bucket."""
        held = 0 if self._buffer is None else self._buffer.numel()
        if held < end:
            size = min(self._bucket_bytes, max(end, 2 * held, 2**20))
            grown = torch.empty(size, dtype=torch.uint8, device=self._device)
            if held and start:
                grown[:start].copy_(self._buffer[:start])
            self._buffer = grown
        assert self._buffer is not None
        return self._buffer[start:end]

    def _broadcast(
        self, entries: list[tuple[str, tuple[int, ...]]], data: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """The header, then the bucket's bytes (uint8: any backend sends any dtype so)."""
        header = BucketHeader(entries=tuple(entries), dtype=dtype, size=data.numel())
        dist.broadcast_object_list([header], group=self._control, group_src=0)
        dist.broadcast(data, group=self._data, group_src=0)


class BucketReceiver:
    """Receives the buckets a `BucketSender` broadcasts (group rank 0 sends)."""

    def __init__(self, *, control_group: Any, data_group: Any, device: torch.device) -> None:
        self._control, self._data, self._device = control_group, data_group, device
        self._buffer: torch.Tensor | None = None  # uint8, grown to the largest bucket

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor of the transfer, a view valid until the next is drawn. Draw them all
        (`drain` the rest after an error), or the sender waits."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, group=self._control, group_src=0)
            header: BucketHeader | None = message[0]
            if header is None:
                return
            data = self._bytes(header.size)
            dist.broadcast(data, group=self._data, group_src=0)
            offset = 0
            for name, shape in header.entries:
                size = _numel(shape) * header.dtype.itemsize
                yield name, data[offset : offset + size].view(header.dtype).view(shape)
                offset += _aligned(size)
            del data  # a larger next bucket does not sit beside this one

    def _bytes(self, size: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # the old one goes before the larger one comes
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        return self._buffer[:size]


def drain(stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Receive the rest of a transfer without using it (the sender finishes its broadcasts)."""
    for _ in stream:
        pass


_ALIGNMENT = 16  # bytes: every tensor of a bucket starts aligned for any dtype's view


def _aligned(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
