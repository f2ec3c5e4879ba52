"""Bucketed weight transfer (distributed/weight_transfer.py) on gloo ranks.

- What arrives is what was sent: names and rows in order, the dtype, a tensor larger than a
  bucket split by rows, buckets never over their size.
- Streamed sync of an FSDP-sharded model much larger than the bucket (2 trainer ranks + 1
  generator rank, the channels of a disaggregated placement, each trainer rank sending its
  share): the generator holds bitwise the trainer's gathered weights, and the peak memory each
  rank adds (RSS high-water mark) stays within a few buckets, where a whole-dict gather adds
  the model's size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from temper.checkpoint.gather import sampler_share, sampler_state_dict
from temper.distributed.parallel_dims import MeshDegrees
from temper.distributed.placement import Placement
from temper.distributed.weight_pieces import WeightRows, rows_of
from temper.distributed.weight_transfer import BucketReceiver, BucketSender, WeightChannel
from temper.distributed.world import using_trainer_world
from temper.models.build import materialize
from temper.models.qwen3.sizes import qwen3_size
from temper.observability.process_memory import PeakRss
from temper.sampler.weight_source import WeightSource
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

MiB = 2**20
BUCKET = 2 * MiB
# About 32 MiB of fp32 weights in 16 blocks; the largest tensors (embedding, unembedding)
# are 1 MiB.
MODEL = dataclasses.replace(
    qwen3_size("tiny"), vocab_size=1024, dim=256, num_layers=16, ffn_dim=512, tie_embeddings=False
)


def _peak_extra(run) -> int:
    """Bytes the RSS of this process rose to above what it held before `run`."""
    with PeakRss() as peak:
        run()
    return int(peak.extra_mib * MiB)


def _pairs_main(rank: int) -> dict:
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    channel = WeightChannel(control=groups[0], data=groups[1])
    large = torch.randn(300, generator=torch.Generator().manual_seed(0))
    pieces = [
        ("small", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("ints", torch.arange(5, dtype=torch.int64)),
        ("large", large),
        WeightRows(name="rows", start=7, value=torch.full((2, 3), 0.5)),
        ("after", torch.full((4,), 0.1)),
    ]
    if rank == 0:
        sender = BucketSender(channel=channel, bucket_bytes=512, dtype=None, device="cpu")
        return {"stats": sender.send(iter(pieces))}
    receiver = BucketReceiver(channels=[channel], device="cpu")
    received = [(rows.name, rows.start, rows.value.clone()) for rows in receiver.receive()]
    return {"received": received, "large": large}


def test_what_arrives_is_what_was_sent_in_buckets_no_larger_than_asked(tmp_path):
    sent, received = spawn(_pairs_main, world_size=2, out_dir=tmp_path)
    pieces = received["received"]
    # The large tensor (1200 bytes) is split by rows into buckets of at most 512 bytes.
    assert [(name, start) for name, start, _ in pieces] == [
        ("small", 0),
        ("ints", 0),
        ("large", 0),
        ("large", 128),
        ("large", 256),
        ("rows", 7),
        ("after", 0),
    ]
    values = {(name, start): value for name, start, value in pieces}
    assert torch.equal(values["small", 0], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert values["ints", 0].dtype == torch.int64
    assert torch.equal(values["ints", 0], torch.arange(5))
    joined = torch.cat([values["large", 0], values["large", 128], values["large", 256]])
    assert torch.equal(joined, received["large"])
    assert torch.equal(values["rows", 7], torch.full((2, 3), 0.5))
    assert torch.equal(values["after", 0], torch.full((4,), 0.1))
    stats = sent["stats"]
    # [small] [ints] [large 0:128] [large 128:256] [large 256:300, rows, after]
    assert (stats.tensors, stats.buckets) == (7, 5)
    assert stats.largest_bucket_bytes <= 512


def _direct_main(rank: int) -> dict:
    """Pieces of 1 MiB or more travel as they are; a receiver puts them where `into` says."""
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]
    channel = WeightChannel(control=groups[0], data=groups[1])
    generator = torch.Generator().manual_seed(1)
    pieces = {
        "a": torch.randn(512, 1024, generator=generator),  # 2 MiB
        "norm": torch.randn(64, generator=generator),  # packed
        "b": torch.randn(768, 1024, generator=generator),  # 3 MiB: a bucket of its own
        "c": torch.randn(1024, 384, generator=generator).t(),  # not contiguous
    }
    if rank == 0:
        sender = BucketSender(channel=channel, bucket_bytes=4 * MiB, dtype=None, device="cpu")
        return {"stats": sender.send(iter(pieces.items())), "sent": pieces}
    model = {"a": torch.zeros(512, 1024), "b": torch.zeros(1024, 1024)}  # b: rows 0:768
    receiver = BucketReceiver(channels=[channel], device="cpu")
    received = {}
    for rows in receiver.receive(into=rows_of(model)):
        in_place = rows.name in model and rows.value.data_ptr() == model[rows.name].data_ptr()
        received[rows.name] = (rows.value.clone(), in_place)
    return {"received": received, "model": model}


def test_large_pieces_travel_as_they_are_and_land_in_place(tmp_path):
    sent, received = spawn(_direct_main, world_size=2, out_dir=tmp_path)
    pieces, model = received["received"], received["model"]
    for name, value in sent["sent"].items():
        assert torch.equal(pieces[name][0], value), name
    assert pieces["a"][1] and pieces["b"][1]  # received straight into the model's rows
    assert not pieces["norm"][1] and not pieces["c"][1]  # no such tensor there: the buffer
    assert torch.equal(model["a"], sent["sent"]["a"])
    assert torch.equal(model["b"][:768], sent["sent"]["b"]) and not model["b"][768:].any()
    stats = sent["stats"]
    # [a, norm] [b] [c]: a bucket holds at most 4 MiB
    assert (stats.tensors, stats.buckets) == (4, 3)


def _sync_main(rank: int) -> dict:
    torch.manual_seed(0)
    placement = Placement(
        Placement.Config(mode="disaggregated", generator_ranks=1, bucket_mb=BUCKET / MiB),
        world_size=3,
    )
    roles = placement.split(
        trainer_mesh=MeshDegrees(dp_replicate=1, dp_shard=2, tp=1), device_type="cpu"
    )
    if roles.is_generator:
        model = materialize(MODEL, init="random", seed=2)  # resident, other values
        source = WeightSource(model)
        receiver = BucketReceiver(channels=roles.weight_channels, device="cpu")
        into = rows_of(model.state_dict())
        peak = _peak_extra(lambda: source.update(receiver.receive(into=into), version=1))
        # The trainer's whole weights, for the check (after the measurement).
        expected = [None]
        dist.broadcast_object_list(expected, group=roles.sync_control, group_src=0)
        same = all(torch.equal(v, expected[0][k]) for k, v in source.model.state_dict().items())
        return {"peak": peak, "same": same and expected[0].keys() == model.state_dict().keys()}
    trainer = materialize(MODEL, init="random", seed=1)
    with using_trainer_world(roles.trainer_world):
        Sharding(Sharding.Config(), model=trainer)
        sender = BucketSender(
            channel=roles.weight_channels[rank],
            bucket_bytes=placement.config.bucket_bytes,
            dtype=None,
            device=torch.device("cpu"),
        )
        share = lambda: sender.send(sampler_share(trainer, lead=rank == 0))  # noqa: E731
        peak = _peak_extra(share)
        whole = _peak_extra(lambda: sampler_state_dict(trainer))
        expected = sampler_state_dict(trainer)
    if rank == 0:
        dist.broadcast_object_list([expected], group=roles.sync_control, group_src=0)
    model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    return {"peak": peak, "whole": whole, "model_bytes": model_bytes}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    return spawn(_sync_main, world_size=3, out_dir=tmp_path_factory.mktemp("sync"))


def test_the_generator_receives_the_trainers_gathered_weights_bitwise(synced):
    assert synced[2]["same"]


def test_peak_extra_memory_stays_within_a_few_buckets_not_the_model_size(synced):
    model_bytes = synced[0]["model_bytes"]
    assert model_bytes > 14 * BUCKET  # the model is much larger than a bucket
    for rank, result in enumerate(synced):
        # Each trainer rank sends its own rows (nothing gathered) through its bucket; the
        # generator receives into its bucket and copies into the model. Measured (MiB):
        # 2.9-3.0 per trainer rank, 3.6 on the generator, once 6.04 there in a full CI run
        # (RSS also counts what the allocator and gloo's threads touch under load); a
        # whole-dict gather adds 39-52, the model itself is over 14 buckets.
        assert result["peak"] < 4 * BUCKET, (rank, result["peak"] / MiB)
    for rank in (0, 1):  # the check has teeth: a whole-dict gather adds the model's size
        assert synced[rank]["whole"] > 0.8 * model_bytes, (rank, synced[rank]["whole"] / MiB)
