"""Buckets through shared memory (distributed/shared_buckets.py), on CPU (the twin of CUDA
IPC): another process maps the sender's two slots and reads bitwise every tensor of every
bucket (mixed dtypes, an empty tensor, a bucket that grows its slot) from descriptors that
are plain data; a loader that keeps a view of a slot past its return is caught."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from temper.distributed import shared_buckets
from temper.distributed.shared_buckets import MappedSlots, SharedSlots

SLOT_BYTES = 4096


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype)

    return [
        [("a", rand(3, 5)), ("b", rand(7, dtype=torch.bfloat16)), ("c", torch.arange(5))],
        [("d", rand(0, 4)), ("e", rand(2, 3, 4, dtype=torch.float16))],
        [("f", rand(40, 40))],  # 6400 bytes: grows slot 0
        [("g", rand(9)), ("h", torch.tensor([True, False]))],
        [("i", rand(64, 30))],  # 7680 bytes: grows slot 0 again
    ]


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    return isinstance(value, str | int | float | bool | bytes)


def _receiver(descriptors, results) -> None:
    mapped = MappedSlots()
    loaded: list[tuple[str, torch.Tensor]] = []
    while (descriptor := descriptors.get()) is not None:
        loaded.clear()
        mapped.load(
            descriptor,
            device=torch.device("cpu"),
            load=lambda bucket: loaded.extend((name, t.clone()) for name, t in bucket),
        )
        results.put(list(loaded))  # the acknowledgement: the sender may refill that slot
    mapped.close()


def test_another_process_reads_every_bucket_bitwise_from_two_rotating_slots():
    context = mp.get_context("spawn")
    descriptors, results = context.Queue(), context.Queue()
    receiver = context.Process(target=_receiver, args=(descriptors, results))
    receiver.start()
    slots = SharedSlots(device=torch.device("cpu"), min_bytes=SLOT_BYTES)
    handles = []
    try:
        for bucket in _buckets():
            descriptor = slots.fill(bucket)
            assert _plain(descriptor)  # travels in a msgpack request without pickling
            handles.append((descriptor["slot"], descriptor["handle"]["name"]))
            descriptors.put(descriptor)
            loaded = results.get(timeout=60)
            assert [name for name, _ in loaded] == [name for name, _ in bucket]
            for (_, got), (_, sent) in zip(loaded, bucket, strict=True):
                assert got.dtype == sent.dtype and torch.equal(got, sent)
    finally:
        descriptors.put(None)
        receiver.join(timeout=60)
    assert [slot for slot, _ in handles] == [0, 1, 0, 1, 0]
    slot0 = [name for slot, name in handles if slot == 0]
    assert len(set(slot0)) == 3  # grown twice, each time a new buffer and handle
    assert handles[1][1] == handles[3][1]  # slot 1 reused as it is


def test_a_loader_that_keeps_a_view_past_its_return_is_caught_unless_released():
    slots, mapped = SharedSlots(device=torch.device("cpu"), min_bytes=SLOT_BYTES), MappedSlots()
    kept: list[torch.Tensor] = []
    keep_one = lambda bucket: kept.append(bucket[0][1])  # noqa: E731
    with pytest.raises(RuntimeError, match=r"kept views of shared slot 0 past its return"):
        mapped.load(slots.fill(_buckets()[0]), device=torch.device("cpu"), load=keep_one)
    kept.clear()

    def copy_kept(buffer: torch.Tensor) -> None:
        kept[:] = [tensor.clone() for tensor in kept]

    mapped.load(
        slots.fill(_buckets()[0]), device=torch.device("cpu"), load=keep_one, release=copy_kept
    )
    assert torch.equal(kept[0], _buckets()[0][0][1])


def test_a_cuda_handle_names_every_plain_parameter_of_torchs_rebuild():
    parameters = tuple(inspect.signature(rebuild_cuda_tensor).parameters)
    assert parameters == shared_buckets._CUDA_PARAMETERS
