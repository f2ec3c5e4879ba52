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
twin), NCCL with device buffers on a GPU; `device` says where buffers live. A second group,
`control`, may carry the headers and acknowledgements in host memory while `group` carries
the tensors' bytes (NCCL for the bytes, gloo for the rest: a host-side acknowledgement is what
a deadline can wait on, and a header is read on the host anyway); the order of operations on
each group is the one above, restricted to that group. A receiver on a GPU finishes its load
on the device before it acknowledges. Deadlines are the caller's: the sender hands each
acknowledgement's work to its `wait` hook.
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
    def __init__(self, group: Any, *, device: torch.device, control: Any = None) -> None:
        """`control`: the group of headers and acknowledgements (host memory); None: `group`."""
        self._group, self._device = group, device
        self._control = _Control(group, device=device, control=control)

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
        _wait_all(self._control.header_works(b""))
        while in_flight:
            self._acknowledge(*in_flight.popleft(), **hooks)

    def _post(self, bucket: Bucket) -> list[Any]:
        header = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in bucket]
        data = [_as_bytes(tensor.detach().to(self._device)) for _, tensor in bucket]
        return self._control.header_works(pickle.dumps(header)) + [
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
        work = self._control.acknowledgement(torch.iinfo(torch.int64).max)
        wait(work)
        _wait_all([*works, work])
        acked(bucket)


def receive(
    group: Any,
    *,
    device: torch.device,
    load: Callable[[Bucket], None],
    before_load: Callable[[int], None] = lambda number: None,
    control: Any = None,
) -> int:
    """Receive and `load` every bucket of one stream (a receiver's side); returns how many.
    Each bucket has a buffer of its own (`load` may keep views of it). `control`: as the
    sender's."""
    headers = _Control(group, device=device, control=control)
    entries = headers.receive_header()
    if entries is None:
        return 0
    tensors, works = _post_data(group, entries, device=device)
    _wait_all(works)
    number = 0
    while entries is not None:
        number += 1
        following = headers.receive_header()
        posted = None if following is None else _post_data(group, following, device=device)
        before_load(number)
        load([(name, tensor) for (name, _, _), tensor in zip(entries, tensors, strict=True)])
        del tensors
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # loaded, before acknowledging
        _wait_all([headers.acknowledgement(number)])
        if posted is not None:
            tensors, works = posted
            _wait_all(works)
        entries = following
    return number


class _Control:
    """Headers and acknowledgements: on `control` in host memory, or on the data group."""

    def __init__(self, group: Any, *, device: torch.device, control: Any) -> None:
        self.group = group if control is None else control
        self.device = device if control is None else torch.device("cpu")

    def header_works(self, header: bytes) -> list[Any]:
        length = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        works = [_broadcast(self.group, length)]
        if header:
            data = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
            works.append(_broadcast(self.group, data))
        return works

    def receive_header(self) -> list[Any] | None:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        _wait_all([_broadcast(self.group, length)])
        size = int(length.item())
        if size == 0:
            return None
        data = torch.empty(size, dtype=torch.uint8, device=self.device)
        _wait_all([_broadcast(self.group, data)])
        return pickle.loads(data.cpu().numpy().tobytes())

    def acknowledgement(self, count: int) -> Any:
        """The all-reduce (min) of buckets loaded: `count` from a receiver, the maximum from
        the sender."""
        return _all_reduce_min(self.group, torch.full((1,), count, device=self.device))


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
