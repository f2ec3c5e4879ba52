"""The bucket stream (distributed/bucket_stream.py) between one sender and two receivers, as
one group and split as the nccl transport splits it (bytes on one group, headers and
acknowledgements on a gloo group beside it; here both gloo, the CPU twin): every receiver
loads every bucket bitwise, in order, and the sender sees each acknowledged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from temper.distributed import bucket_stream
from tests.distributed.spawn import spawn


def _buckets() -> list[list[tuple[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(3)
    return [
        [(f"w{index}.{part}", torch.randn(5, index + 1, generator=generator)) for part in "ab"]
        + [(f"b{index}", torch.arange(index + 2).to(torch.bfloat16))]
        for index in range(5)
    ]


def _stream_main(rank: int, split: bool):
    data = dist.new_group(backend="gloo")
    control = dist.new_group(backend="gloo") if split else None
    device = torch.device("cpu")
    if rank == 0:
        acked = []
        sender = bucket_stream.StreamSender(data, device=device, control=control)
        sender.send(
            iter(_buckets()),
            wait=lambda work: work.wait(),
            acked=lambda bucket: acked.append([name for name, _ in bucket]),
        )
        return acked
    loaded: list[tuple[str, torch.Tensor]] = []
    count = bucket_stream.receive(
        data,
        device=device,
        load=lambda bucket: loaded.extend((name, t.clone()) for name, t in bucket),
        control=control,
    )
    return count, loaded


@pytest.mark.parametrize("split", [False, True], ids=["one_group", "data_and_control"])
def test_every_receiver_loads_every_bucket_bitwise_and_each_is_acknowledged(tmp_path, split):
    sender, *receivers = spawn(_stream_main, world_size=3, out_dir=tmp_path, args=(split,))
    buckets = _buckets()
    assert sender == [[name for name, _ in bucket] for bucket in buckets]
    expected = [pair for bucket in buckets for pair in bucket]
    for count, loaded in receivers:
        assert count == len(buckets)
        assert [name for name, _ in loaded] == [name for name, _ in expected]
        assert all(
            got.dtype == sent.dtype and torch.equal(got, sent)
            for (_, got), (_, sent) in zip(loaded, expected, strict=True)
        )
