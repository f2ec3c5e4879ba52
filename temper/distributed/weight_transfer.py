"""Weights streamed from one rank to others in buckets of bounded size.

A sender packs pieces of weights (whole tensors, or row ranges: weight_pieces.py), as they
come, into one flat buffer of `bucket_bytes` (cast to the transfer dtype); when the next
piece does not fit, it broadcasts a header (names, first rows and shapes, over a gloo group)
and then the buffer (over the data group: gloo on CPU, NCCL on GPU), both on its
`WeightChannel`. A tensor larger than a bucket is split by rows over several buckets. The
receivers yield each piece as a view of their own buffer, valid until they draw the next: a
generator copies it into its model and the buffer is reused. So neither side holds more than
a bucket of weights beyond its model, whatever the model's size.

Several senders (each trainer rank, with its own shard) each run one transfer on their own
channel; a receiver takes the channels one after another. Both sides must run a transfer to
its end; a header of None ends it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from temper.distributed.weight_pieces import WeightPiece, WeightRows, as_rows


@dataclass(frozen=True)
class WeightChannel:
    """One sender's way to its receivers: a gloo group for headers and a data group (the
    device's backend) for the buckets, the sender being rank 0 of both."""

    control: Any
    data: Any


@dataclass(frozen=True)
class BucketHeader:
    entries: tuple[tuple[str, int, tuple[int, ...]], ...]
    """(name, first row, shape) of each piece."""
    dtype: torch.dtype
    size: int
    """Bytes of the bucket (each entry starts at a 16-byte aligned offset)."""


@dataclass(frozen=True)
class TransferStats:
    tensors: int
    """Pieces sent (a tensor split over buckets counts once per bucket)."""
    buckets: int
    bytes: int
    largest_bucket_bytes: int


class BucketSender:
    """Packs and broadcasts weights from this rank (rank 0 of its channel's groups)."""

    def __init__(
        self,
        *,
        channel: WeightChannel,
        bucket_bytes: int,
        dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        """`dtype`: the transfer dtype (None: each tensor's own; a bucket holds one dtype)."""
        self._channel = channel
        self._bucket_bytes, self._dtype, self._device = bucket_bytes, dtype, device
        self._buffer: torch.Tensor | None = None  # uint8, grown up to `bucket_bytes`, reused

    def send(self, pieces: Iterable[WeightPiece]) -> TransferStats:
        """Send every piece (whole tensors and row ranges), then the end of the transfer."""
        entries: list[tuple[str, int, tuple[int, ...]]] = []
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

        for piece in pieces:
            whole = as_rows(piece)
            dtype = self._dtype or whole.value.dtype
            for rows in self._fitting(whole, dtype.itemsize):
                size = rows.value.numel() * dtype.itemsize
                if entries and (used + _aligned(size) > self._held() or dtype != bucket_dtype):
                    flush()  # (the buffer grows only while empty: never two at once)
                bucket_dtype = dtype
                tensors += 1
                entry = (rows.name, rows.start, tuple(rows.value.shape))
                if size > self._bucket_bytes:  # one row over a bucket: alone, in its own buffer
                    alone = rows.value.detach().to(device=self._device, dtype=dtype).reshape(-1)
                    self._broadcast([entry], alone.view(torch.uint8), dtype)
                    buckets, total, largest = buckets + 1, total + size, max(largest, size)
                    del alone
                    continue
                start = used
                target = self._bytes(start + size, start=start).view(dtype)
                target.copy_(rows.value.detach().reshape(-1))
                entries.append(entry)
                used = start + _aligned(size)
            del piece, whole  # a gathered whole tensor: gone before the next is gathered
        flush()
        dist.broadcast_object_list([None], group=self._channel.control, group_src=0)
        return TransferStats(
            tensors=tensors, buckets=buckets, bytes=total, largest_bucket_bytes=largest
        )

    def _fitting(self, rows: WeightRows, itemsize: int) -> Iterator[WeightRows]:
        """`rows` in ranges of at most a bucket each (a single row may still be larger)."""
        value = rows.value
        if value.dim() == 0 or value.numel() * itemsize <= self._bucket_bytes:
            yield rows
            return
        per_bucket = max(1, self._bucket_bytes // (value[0].numel() * itemsize))
        for first in range(0, value.shape[0], per_bucket):
            part = value[first : first + per_bucket]
            yield WeightRows(name=rows.name, start=rows.start + first, value=part)

    def _held(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _bytes(self, end: int, *, start: int = 0) -> torch.Tensor:
        """Bytes [start, end) of the buffer. An empty buffer too small for `end` is replaced
        by one twice as large (from 1 MiB, up to `bucket_bytes`): a small model never
        allocates a whole bucket, and growing never holds two buffers."""
        held = self._held()
        if held < end:
            assert start == 0, "the buffer grows only while empty"
            self._buffer = None  # the old one goes before the larger one comes
            size = min(self._bucket_bytes, max(end, 2 * held, 2**20))
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        assert self._buffer is not None
        return self._buffer[start:end]

    def _broadcast(
        self,
        entries: list[tuple[str, int, tuple[int, ...]]],
        data: torch.Tensor,
        dtype: torch.dtype,
    ) -> None:
        """The header, then the bucket's bytes (uint8: any backend sends any dtype so)."""
        header = BucketHeader(entries=tuple(entries), dtype=dtype, size=data.numel())
        dist.broadcast_object_list([header], group=self._channel.control, group_src=0)
        dist.broadcast(data, group=self._channel.data, group_src=0)


class BucketReceiver:
    """Receives what the `BucketSender`s of some channels send, one channel after another,
    into one buffer."""

    def __init__(self, *, channels: Sequence[WeightChannel], device: torch.device) -> None:
        self._channels, self._device = tuple(channels), device
        self._buffer: torch.Tensor | None = None  # uint8, grown to the largest bucket

    def receive(self) -> Iterator[WeightRows]:
        """Each piece of a transfer from every channel, in channel order: a view valid until
        the next is drawn. Draw them all (`drain` the rest after an error), or the senders
        wait."""
        for channel in self._channels:
            yield from self._receive(channel)

    def _receive(self, channel: WeightChannel) -> Iterator[WeightRows]:
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, group=channel.control, group_src=0)
            header: BucketHeader | None = message[0]
            if header is None:
                return
            data = self._bytes(header.size)
            dist.broadcast(data, group=channel.data, group_src=0)
            offset = 0
            for name, start, shape in header.entries:
                size = _numel(shape) * header.dtype.itemsize
                value = data[offset : offset + size].view(header.dtype).view(shape)
                yield WeightRows(name=name, start=start, value=value)
                offset += _aligned(size)
            del data  # a larger next bucket does not sit beside this one

    def _bytes(self, size: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None  # the old one goes before the larger one comes
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        return self._buffer[:size]


def drain(stream: Iterator[object]) -> None:
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
