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

With a `Deadline` (deadline.py) the whole transfer must end within it: every broadcast waits
only what is left of it, and a peer that dies or stalls raises a `PeerFailure` that names this
rank, the bucket and the bytes so far ("weight sync of version 3: receiving bucket 5 (40.0 of
120.0 MiB) from trainer rank 1 failed after 10.0 s: ...").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from temper.distributed.deadline import (
    NCCL_GRACE_S,
    Deadline,
    Progress,
    crossing,
    size_text,
    wait_all,
)
from temper.distributed.weight_pieces import (
    Destination,
    WeightPiece,
    WeightRows,
    as_bytes,
    as_rows,
)


@dataclass(frozen=True)
class WeightChannel:
    """One sender's way to its receivers: a gloo group for headers and a data group (the
    device's backend) for the buckets, the sender being rank 0 of both."""

    control: Any
    data: Any
    sender: int = 0
    """The sending rank (global), named in a failure's message."""
    receivers: tuple[int, ...] = ()
    """The receiving ranks (global), named in a failure's message."""

    def sender_name(self) -> str:
        return f"trainer rank {self.sender}"

    def receivers_name(self) -> str:
        ranks = ", ".join(str(rank) for rank in self.receivers) or "?"
        return f"generator rank{'s' if len(self.receivers) > 1 else ''} {ranks}"


@dataclass(frozen=True)
class BucketHeader:
    entries: tuple[tuple[str, int, tuple[int, ...], bool], ...]
    """(name, first row, shape, packed) of each piece: packed ones travel together in one
    buffer, the others each in a broadcast of its own, after it, in order."""
    dtype: torch.dtype
    packed_bytes: int
    """Bytes of the packed buffer (each entry starts at a 16-byte aligned offset)."""


@dataclass(frozen=True)
class TransferStats:
    tensors: int
    """Pieces sent (a tensor split over buckets counts once per bucket)."""
    buckets: int
    bytes: int
    largest_bucket_bytes: int


PACKED_BELOW = 2**20
"""Pieces smaller than this many bytes are packed together (one broadcast for many); larger
ones are broadcast as they are, without a copy on either side when they can be."""


class BucketSender:
    """Broadcasts weights from this rank (rank 0 of its channel's groups), a bucket at a time."""

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
        self._buffer: torch.Tensor | None = None  # uint8, the packed pieces; grown, reused

    def send(
        self,
        pieces: Iterable[WeightPiece],
        *,
        what: str = "weight transfer",
        deadline: Deadline | None = None,
    ) -> TransferStats:
        """Send every piece (whole tensors and row ranges), then the end of the transfer.

        A bucket holds up to `bucket_bytes` of pieces: the small ones copied into the packed
        buffer, the large ones as they are (the sender keeps them until the bucket goes, so a
        piece must not change before `send` returns: a model's tensors, or new ones).
        `what` names the transfer in a failure's message ('weight sync of version 3');
        `deadline` bounds the whole transfer."""
        watch = _Watch(Progress(what), who=self._channel.sender_name(), deadline=deadline)
        to = self._channel.receivers_name()
        entries: list[tuple[str, int, tuple[int, ...], bool]] = []
        direct: list[torch.Tensor] = []  # the unpacked pieces of the bucket, in order
        used = size_so_far = 0  # bytes of the packed buffer filled; of the whole bucket
        bucket_dtype: torch.dtype | None = None
        tensors = buckets = total = largest = 0

        def flush() -> None:
            nonlocal entries, direct, used, size_so_far, buckets, total, largest
            if entries:
                assert bucket_dtype is not None
                watch.progress.step = (
                    f"sending bucket {buckets + 1} ({size_text(total)} sent before it) to {to}"
                )
                self._broadcast(entries, self._bytes(used), direct, bucket_dtype, watch=watch)
                buckets, total = buckets + 1, total + size_so_far
                largest = max(largest, size_so_far)
            entries, direct, used, size_so_far = [], [], 0, 0

        for piece in pieces:
            whole = as_rows(piece)
            dtype = self._dtype or whole.value.dtype
            for rows in self._fitting(whole, dtype.itemsize):
                size = rows.value.numel() * dtype.itemsize
                packed = size < PACKED_BELOW
                full = size_so_far + size > self._bucket_bytes or (
                    packed and used > 0 and used + size > self._held()
                )
                if entries and (full or dtype != bucket_dtype):
                    flush()  # (the packed buffer grows only while empty: never two at once)
                bucket_dtype = dtype
                tensors, size_so_far = tensors + 1, size_so_far + size
                entries.append((rows.name, rows.start, tuple(rows.value.shape), packed))
                value = rows.value.detach()
                if not packed:  # as it is, if it is already what goes on the wire
                    direct.append(value.to(device=self._device, dtype=dtype).contiguous())
                    continue
                start = used
                self._bytes(start + size, start=start).view(dtype).copy_(value.reshape(-1))
                used = start + _aligned(size)
            del piece, whole  # a gathered whole tensor goes with its bucket
        flush()
        watch.progress.step = f"ending the transfer ({size_text(total)} sent) to {to}"
        with watch.on(self._channel.control):
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
        """Bytes [start, end) of the packed buffer. An empty buffer too small for `end` is
        replaced by one twice as large (from 1 MiB, up to `bucket_bytes`, or `end` for a
        single row larger than a bucket): a small model never allocates a whole bucket, and
        growing never holds two buffers."""
        if end == 0:
            return torch.empty(0, dtype=torch.uint8, device=self._device)
        held = self._held()
        if held < end:
            assert start == 0, "the buffer grows only while empty"
            self._buffer = None  # the old one goes before the larger one comes
            size = max(end, min(self._bucket_bytes, max(2 * held, 2**20)))
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self._device)
        assert self._buffer is not None
        return self._buffer[start:end]

    def _broadcast(
        self,
        entries: list[tuple[str, int, tuple[int, ...], bool]],
        packed: torch.Tensor,
        direct: list[torch.Tensor],
        dtype: torch.dtype,
        *,
        watch: _Watch,
    ) -> None:
        """The header, the packed buffer, then each direct piece (as bytes: any backend sends
        any dtype so), all queued at once: per-broadcast latency overlaps the transfers."""
        header = BucketHeader(entries=tuple(entries), dtype=dtype, packed_bytes=packed.numel())
        with watch.on(self._channel.control):
            dist.broadcast_object_list([header], group=self._channel.control, group_src=0)
        data = ([packed] if packed.numel() else []) + [as_bytes(value) for value in direct]
        _all(
            data,
            group=self._channel.data,
            watch=watch,
            on_cuda=torch.device(self._device).type == "cuda",
        )


class BucketReceiver:
    """Receives what the `BucketSender`s of some channels send, one channel after another,
    into one buffer (or straight where `receive`'s destination says)."""

    def __init__(self, *, channels: Sequence[WeightChannel], device: torch.device) -> None:
        self._channels, self._device = tuple(channels), device
        self._buffer: torch.Tensor | None = None  # uint8, grown to the largest need

    def receive(
        self,
        *,
        into: Destination | None = None,
        who: str = "the receiver",
        what: str = "weight transfer",
        deadline: Deadline | None = None,
        total_elements: int | None = None,
    ) -> Iterator[WeightRows]:
        """Each piece of a transfer from every channel, in channel order: a view valid until
        the next is drawn. A large piece for which `into` gives a tensor is received straight
        into it (and that tensor is what comes out). Draw them all (`drain` the rest after an
        error), or the senders wait.

        A failure's message names this rank (`who`: 'generator rank 2'), the transfer
        (`what`), the bucket and the bytes received of the whole (`total_elements` of the
        transfer's dtype); `deadline` bounds the whole transfer."""
        watch = _Watch(Progress(what), who=who, deadline=deadline)
        count = _Count(total_elements=total_elements)
        for channel in self._channels:
            yield from self._receive(channel, into, watch=watch, count=count)

    def _receive(
        self, channel: WeightChannel, into: Destination | None, *, watch: _Watch, count: _Count
    ) -> Iterator[WeightRows]:
        while True:
            message: list[Any] = [None]
            watch.progress.step = count.step(channel, bucket=count.buckets + 1)
            with watch.on(channel.control):
                dist.broadcast_object_list(message, group=channel.control, group_src=0)
            header: BucketHeader | None = message[0]
            if header is None:
                return
            count.bucket(header)
            watch.progress.step = count.step(channel, bucket=count.buckets)
            # Where each piece lands: the packed ones at the start of the buffer, each other
            # one where `into` says or after them; all received before any is drawn.
            dtype, entries = header.dtype, header.entries
            targets = [
                None if packed or into is None else into(name, start, shape, dtype)
                for name, start, shape, packed in entries
            ]
            packed_end = _aligned(header.packed_bytes)
            spilled = sum(
                _aligned(math.prod(shape) * dtype.itemsize)
                for (_, _, shape, packed), target in zip(entries, targets, strict=True)
                if not packed and target is None
            )
            data = self._bytes(packed_end + spilled)
            offsets = {True: 0, False: packed_end}  # next free byte: packed, unpacked pieces
            views: list[torch.Tensor] = []
            received = [data[: header.packed_bytes]] if header.packed_bytes else []
            for (_, _, shape, packed), target in zip(entries, targets, strict=True):
                if target is None:
                    size = math.prod(shape) * dtype.itemsize
                    start = offsets[packed]
                    target = data[start : start + size].view(dtype).view(shape)
                    offsets[packed] = start + _aligned(size)
                views.append(target)
                if not packed:
                    received.append(as_bytes(target))
            _all(
                received,
                group=channel.data,
                watch=watch,
                on_cuda=torch.device(self._device).type == "cuda",
            )
            count.received(header)
            for (name, start, _, _), value in zip(entries, views, strict=True):
                yield WeightRows(name=name, start=start, value=value)
            del data, views, received, targets  # the buffer is free again

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


def _all(tensors: list[torch.Tensor], *, group: Any, watch: _Watch, on_cuda: bool) -> None:
    """Broadcast each tensor from group rank 0, in order, all queued before any is waited on."""
    if not tensors:
        return
    with watch.on(group, on_cuda=on_cuda):
        works = [
            dist.broadcast(tensor, group=group, group_src=0, async_op=True) for tensor in tensors
        ]
        wait_all(works, deadline=watch.deadline, on_cuda=on_cuda)


@dataclass
class _Watch:
    """A transfer's progress and deadline, and who runs it: each group operation runs
    `on` it, under what is left of the deadline, and fails with a message saying where."""

    progress: Progress
    who: str
    deadline: Deadline | None

    def on(self, group: Any, *, on_cuda: bool = False) -> Any:
        if self.deadline is not None:
            with crossing(self.progress, who=self.who, deadline=self.deadline):
                self.deadline.bound(group, grace_s=NCCL_GRACE_S if on_cuda else 0.0)
        return crossing(self.progress, who=self.who, deadline=self.deadline)


@dataclass
class _Count:
    """A receiver's buckets and bytes so far, over every channel of one transfer."""

    total_elements: int | None
    buckets: int = 0
    bytes: int = 0
    total_bytes: int | None = None

    def bucket(self, header: BucketHeader) -> None:
        self.buckets += 1
        if self.total_elements is not None:
            self.total_bytes = self.total_elements * header.dtype.itemsize

    def received(self, header: BucketHeader) -> None:
        self.bytes += sum(
            math.prod(shape) * header.dtype.itemsize for _, _, shape, _ in header.entries
        )

    def step(self, channel: WeightChannel, *, bucket: int) -> str:
        whole = "" if self.total_bytes is None else f" of {size_text(self.total_bytes)}"
        return (
            f"receiving bucket {bucket} ({size_text(self.bytes)}{whole} received) "
            f"from {channel.sender_name()}"
        )


def _aligned(size: int) -> int:
    return -(-size // _ALIGNMENT) * _ALIGNMENT
