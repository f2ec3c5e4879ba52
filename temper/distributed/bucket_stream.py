"""Buckets of named tensors streamed over one process group, two in flight, each acknowledged
once every receiver has loaded it.

One sender (group rank 0), any number of receivers. Per bucket, broadcast from rank 0 and
queued at once: the length of its header, the header (names, dtypes, shapes), then each
tensor's bytes. Then, once each receiver has loaded the bucket, an all-reduce (min) of the
number of buckets loaded: the acknowledgement. A receiver receives bucket k+1 (on the
group's own threads, or the device's communication stream) while it loads bucket k, and the
sender sends bucket k+1 before it waits for bucket k's acknowledgement: transfer and load
overlap, one request carries the whole stream, and at most two buckets are held on either
side. A header of length 0 ends the stream. The order of operations is the same on every
rank: H1 D1 H2 D2 A1 H3 D3 A2 ... HN DN A(N-1) END AN.

The same code runs on whatever backend the group has: gloo with host buffers on CPU (the CPU
twin), NCCL with device buffers on a GPU; `device` says where buffers live. Deadlines are the
caller's: the sender hands each acknowledgement's work to its `wait` hook.
"""

from __future__ import annotations

import pickle
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

Bucket = list[tuple[str, torch.Tensor]]
_ALIGNMENT = 16  # bytes: each tensor of a bucket starts aligned for any dtype's view


class PeerError(RuntimeError):
    """A collective of the stream failed (a peer gone, or the group's own timeout)."""


class StreamSender:
    def __init__(self, group: Any, *, device: torch.device) -> None:
        self._group, self._device = group, device

    def send(
        self,
        buckets: Iterable[Bucket],
        *,
        wait: Callable[[Any], None],
        acked: Callable[[Bucket], None],
    ) -> None:
        """Stream every bucket. `wait(work)` returns once an acknowledgement's work is done
        (or raises: the caller's deadline); `acked(bucket)` follows each acknowledgement. If
        drawing a bucket fails, the stream is ended (what was sent is still acknowledged) and
        the error raised: the receivers are not left waiting."""
        in_flight: deque[tuple[Bucket, list[Any]]] = deque()
        source = iter(buckets)
        while True:
            try:
                bucket = next(source)
            except StopIteration:
                break
            except BaseException:
                self._end(in_flight, wait=wait, acked=acked)
                raise
            in_flight.append((bucket, self._post(bucket)))
            if len(in_flight) == 2:
                self._acknowledge(*in_flight.popleft(), wait=wait, acked=acked)
        self._end(in_flight, wait=wait, acked=acked)

    def _end(self, in_flight: deque, **hooks: Any) -> None:
        """The end of the stream, then the acknowledgements of the buckets still in flight."""
        _wait_all(_header_works(self._group, b"", device=self._device))
        while in_flight:
            self._acknowledge(*in_flight.popleft(), **hooks)

    def _post(self, bucket: Bucket) -> list[Any]:
        header = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]
        data = [_as_bytes(tensor.detach().to(self._device)) for _, tensor in bucket]
        return _header_works(self._group, pickle.dumps(header), device=self._device) + [
            _broadcast(self._group, value) for value in data if value.numel()
        ]

    def _acknowledge(
        self,
        bucket: Bucket,
        works: list[Any],
        *,
        wait: Callable[[Any], None],
        acked: Callable[[Bucket], None],
    ) -> None:
        count = torch.full((1,), torch.iinfo(torch.int64).max, device=self._device)
        work = _all_reduce_min(self._group, count)
        wait(work)
        _wait_all([*works, work])
        acked(bucket)


def receive(
    group: Any,
    *,
    device: torch.device,
    load: Callable[[Bucket], None],
    before_load: Callable[[int], None] = lambda number: None,
) -> int:
    """Receive and `load` every bucket of one stream (a receiver's side); returns how many.
    Each bucket has a buffer of its own (`load` may keep views of it)."""
    entries = _receive_header(group, device=device)
    if entries is None:
        return 0
    tensors, works = _post_data(group, entries, device=device)
    _wait_all(works)
    number = 0
    while entries is not None:
        number += 1
        following = _receive_header(group, device=device)
        posted = None if following is None else _post_data(group, following, device=device)
        before_load(number)
        load([(name, tensor) for (name, _, _), tensor in zip(entries, tensors, strict=True)])
        del tensors
        _wait_all([_all_reduce_min(group, torch.full((1,), number, device=device))])
        if posted is not None:
            tensors, works = posted
            _wait_all(works)
        entries = following
    return number


def _header_works(group: Any, header: bytes, *, device: torch.device) -> list[Any]:
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    works = [_broadcast(group, length)]
    if header:
        data = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        works.append(_broadcast(group, data))
    return works


def _receive_header(group: Any, *, device: torch.device) -> list[Any] | None:
    length = torch.zeros(1, dtype=torch.int64, device=device)
    _wait_all([_broadcast(group, length)])
    size = int(length.item())
    if size == 0:
        return None
    data = torch.empty(size, dtype=torch.uint8, device=device)
    _wait_all([_broadcast(group, data)])
    return pickle.loads(data.cpu().numpy().tobytes())


def _post_data(
    group: Any, entries: list[Any], *, device: torch.device
) -> tuple[list[torch.Tensor], list[Any]]:
    dtypes = [getattr(torch, dtype) for _, dtype, _ in entries]
    sizes = [
        _numel(shape) * dtype.itemsize for (_, _, shape), dtype in zip(entries, dtypes, strict=True)
    ]
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // _ALIGNMENT) * _ALIGNMENT
    buffer = torch.empty(end, dtype=torch.uint8, device=device)
    views = [buffer[start : start + size] for start, size in zip(starts, sizes, strict=True)]
    works = [_broadcast(group, view) for view in views if view.numel()]
    tensors = [
        view.view(dtype).view(shape)
        for view, dtype, (_, _, shape) in zip(views, dtypes, entries, strict=True)
    ]
    return tensors, works


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        return group.broadcast([tensor], options)
    except RuntimeError as error:
        raise PeerError(str(error)) from error


def _all_reduce_min(group: Any, tensor: torch.Tensor) -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    try:
        return group.allreduce([tensor], options)
    except RuntimeError as error:
        raise PeerError(str(error)) from error


def _wait_all(works: list[Any]) -> None:
    try:
        for work in works:
            work.wait()
    except RuntimeError as error:
        raise PeerError(str(error)) from error


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel
