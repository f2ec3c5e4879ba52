"""Whole tensors out of row ranges on several channels (distributed/whole_tensors.py), what a
vLLM generator rank loads from FSDP trainer ranks without a second copy of the model.

- In one process: every tensor comes out once, whole and bitwise, in the model's order as its
  rows complete; a piece from a reused buffer is copied, one received through `into` is not;
  missing or repeated rows fail.
- 2 FSDP trainer ranks + 1 generator rank on gloo, the channels of a disaggregated
  placement: drawn in step, the tensors are bitwise the trainer's gathered weights and what is
  staged at once stays within a few tensors; drawn one channel after another (the contrast),
  the first channel's rows of every sharded tensor wait: most of the model staged.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.checkpoint.gather import sampler_share, sampler_state_dict
from temper.distributed.parallel_dims import MeshDegrees
from temper.distributed.placement import Placement
from temper.distributed.weight_pieces import WeightRows
from temper.distributed.weight_transfer import BucketReceiver, BucketSender
from temper.distributed.whole_tensors import WholeTensors, interleave
from temper.distributed.world import using_trainer_world
from temper.models.build import materialize
from temper.models.qwen3.sizes import qwen3_size
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

MiB = 2**20
MODEL = dataclasses.replace(
    qwen3_size("tiny"), vocab_size=1024, dim=256, num_layers=8, ffn_dim=512, tie_embeddings=False
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(8, 4, generator=generator),
        "norm": torch.randn(4, generator=generator),
        "w1": torch.randn(6, 4, generator=generator),
        "w2": torch.randn(5, 3, generator=generator),
        "scale": torch.tensor(2.0),
    }


def _fsdp_channels(state: dict[str, torch.Tensor]) -> list[list[WeightRows]]:
    """Two channels as `sampler_share` sends them: channel 0 the unsharded tensors whole,
    then its rows of the others; channel 1 its rows (w1 sent in two row ranges, as a tensor
    larger than a bucket is)."""
    whole = [WeightRows(name=n, start=0, value=state[n]) for n in ("norm", "scale")]
    sharded = [name for name in state if name not in ("norm", "scale")]
    half = {name: state[name].shape[0] // 2 for name in sharded}
    first = [WeightRows(name=n, start=0, value=state[n][: half[n]]) for n in sharded]
    second = [WeightRows(name=n, start=half[n], value=state[n][half[n] :]) for n in sharded]
    w1 = second[1]
    second[1:2] = [
        WeightRows(name="w1", start=w1.start, value=w1.value[:1]),
        WeightRows(name="w1", start=w1.start + 1, value=w1.value[1:]),
    ]
    return [whole + first, second]


def _reused(pieces: list[WeightRows]):
    """The pieces as a receiver yields them: each a view of one buffer, overwritten by the next."""
    buffer = torch.empty(64)
    for rows in pieces:
        view = buffer[: rows.value.numel()].view(rows.value.shape)
        view.copy_(rows.value)
        yield WeightRows(name=rows.name, start=rows.start, value=view)
        buffer.fill_(float("nan"))


def test_each_tensor_comes_out_once_whole_and_bitwise_as_its_rows_complete():
    state = _state()
    shapes = {name: tuple(value.shape) for name, value in state.items()}
    whole = WholeTensors(shapes=shapes)
    channels = _fsdp_channels(state)
    drawn: list[str] = []

    def recorded(stream):
        for rows in stream:
            drawn.append(rows.name)
            yield rows

    streams = [recorded(_reused(pieces)) for pieces in channels]
    out = list(whole(interleave(streams, shapes=shapes)))
    assert [name for name, _ in out] == ["norm", "scale", "embed", "w1", "w2"]
    assert all(torch.equal(value, state[name]) for name, value in out)
    # In step: channel 0's whole tensors, then each tensor's rows from both channels (channel
    # 0 draws first on a tie, so it runs one tensor ahead while channel 1's w1 comes in two).
    assert drawn == ["norm", "scale", "embed", "embed", "w1", "w1", "w2", "w1", "w2"]
    assert whole.peak_staged_bytes == state["w1"].nbytes + state["w2"].nbytes


def test_drawn_one_channel_after_another_every_sharded_tensor_waits():
    state = _state()
    shapes = {name: tuple(value.shape) for name, value in state.items()}
    whole = WholeTensors(shapes=shapes)
    pieces = [rows for channel in _fsdp_channels(state) for rows in channel]
    out = dict(whole(iter(pieces)))
    assert all(torch.equal(out[name], value) for name, value in state.items())
    assert whole.peak_staged_bytes == sum(state[n].nbytes for n in ("embed", "w1", "w2"))


def test_pairs_pass_as_they_are_and_a_stream_that_lacks_or_repeats_rows_fails():
    state = _state()
    shapes = {name: tuple(value.shape) for name, value in state.items()}
    out = dict(WholeTensors(shapes=shapes)(iter(state.items())))
    assert all(out[name] is value for name, value in state.items())
    pieces = _fsdp_channels(state)[0]
    with pytest.raises(ValueError, match=r"ended without \['embed', 'w1', 'w2'\]"):
        list(WholeTensors(shapes=shapes)(iter(pieces)))
    with pytest.raises(ValueError, match="'norm' arrived twice"):
        list(WholeTensors(shapes=shapes)(iter([pieces[0], pieces[0]])))
    with pytest.raises(ValueError, match="'other' is not a parameter"):
        list(WholeTensors(shapes=shapes)(iter([("other", torch.zeros(1))])))


def _received(pieces: list[WeightRows], whole: WholeTensors):
    """The pieces as a receiver with `whole.into` as its destination yields them: each one it
    places lands in its tensor there, the rest in a reused buffer."""
    buffer = torch.empty(64)
    for rows in pieces:
        target = whole.into(rows.name, rows.start, tuple(rows.value.shape), rows.value.dtype)
        if target is None:
            target = buffer[: rows.value.numel()].view(rows.value.shape)
        target.copy_(rows.value)
        yield WeightRows(name=rows.name, start=rows.start, value=target)
        buffer.fill_(float("nan"))


def test_pieces_received_into_place_come_out_whole_without_a_copy(monkeypatch):
    state = _state()
    shapes = {name: tuple(value.shape) for name, value in state.items()}
    whole = WholeTensors(shapes=shapes)
    streams = [_received(pieces, whole) for pieces in _fsdp_channels(state)]
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda self, src: copies.append(self.shape) or copy(self, src)
    )
    out = dict(whole(interleave(streams, shapes=shapes)))
    monkeypatch.undo()
    # The receiver's one copy of each piece, and none after it.
    pieces = [tuple(rows.value.shape) for channel in _fsdp_channels(state) for rows in channel]
    assert sorted(tuple(shape) for shape in copies) == sorted(pieces)
    assert out.keys() == state.keys()
    assert all(torch.equal(out[name], value) for name, value in state.items())
    assert whole.peak_staged_bytes == state["w1"].nbytes + state["w2"].nbytes
    # Rows that do not fit the tensor they name stay in the receiver's buffer.
    assert whole.into("w1", 1, (shapes["w1"][0], *shapes["w1"][1:]), torch.float32) is None
    assert whole.into("other", 0, (2,), torch.float32) is None


def _sync_main(rank: int) -> dict:
    """Three transfers of an FSDP-sharded model: drawn in step, then one channel after another,
    then in step with large pieces received in place."""
    placement = Placement(
        Placement.Config(mode="disaggregated", generator_ranks=1, bucket_mb=0.25), world_size=3
    )
    roles = placement.split(
        trainer_mesh=MeshDegrees(dp_replicate=1, dp_shard=2, tp=1), device_type="cpu"
    )
    if roles.is_generator:
        state = materialize(MODEL, init="empty").state_dict()
        shapes = {name: tuple(value.shape) for name, value in state.items()}
        whole = WholeTensors(shapes=shapes)
        streams = [
            BucketReceiver(channels=[channel], device=torch.device("cpu")).receive()
            for channel in roles.weight_channels
        ]
        in_step = {name: value.clone() for name, value in whole(interleave(streams, shapes=shapes))}
        in_step_peak = whole.peak_staged_bytes
        streams = [
            BucketReceiver(channels=[channel], device=torch.device("cpu")).receive(into=whole.into)
            for channel in roles.weight_channels
        ]
        in_place = dict(whole(interleave(streams, shapes=shapes)))
        receiver = BucketReceiver(channels=roles.weight_channels, device=torch.device("cpu"))
        in_order = dict(whole(receiver.receive()))
        return {
            "in_step": in_step,
            "in_order": in_order,
            "in_place": in_place,
            "peaks": (in_step_peak, whole.peak_staged_bytes),
            "largest": max(v.nbytes for v in in_step.values()),
        }
    trainer = materialize(MODEL, init="random", seed=1)
    with using_trainer_world(roles.trainer_world):
        Sharding(Sharding.Config(), model=trainer)
        sender = BucketSender(
            channel=roles.weight_channels[rank],
            bucket_bytes=placement.config.bucket_bytes,
            dtype=None,
            device=torch.device("cpu"),
        )
        for _ in range(3):
            sender.send(sampler_share(trainer, lead=rank == 0))
        return {"expected": sampler_state_dict(trainer)}


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    return spawn(_sync_main, world_size=3, out_dir=tmp_path_factory.mktemp("whole"))


def test_fsdp_rows_become_the_trainers_whole_tensors_staging_a_few_at_a_time(synced):
    expected, received = synced[0]["expected"], synced[2]
    for key in ("in_step", "in_order", "in_place"):
        assert received[key].keys() == expected.keys()
        assert all(torch.equal(received[key][k], v) for k, v in expected.items()), key
    in_step, in_order = received["peaks"]
    model_bytes = sum(v.nbytes for v in expected.values())
    # In step, only tensors whose rows are still arriving: here the largest one or two.
    assert in_step <= 2 * received["largest"], (in_step / MiB, received["largest"] / MiB)
    assert in_order > 0.8 * model_bytes  # the contrast: every sharded tensor waited
