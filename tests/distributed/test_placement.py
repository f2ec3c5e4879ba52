"""Placement settings, the request links, and a remote generator on its own against the same
engine in one process (2 gloo ranks: one trainer, one generator)."""

from __future__ import annotations

import pytest
import torch

from temper.api.types import SamplingParams
from temper.distributed.placement import Placement, request_pairs
from temper.models.build import materialize
from temper.models.qwen3.sizes import qwen3_size
from temper.sampler.engine import SamplerEngine
from temper.sampler.generator_rank import GeneratorRank
from temper.sampler.remote import RemoteGenerators
from temper.sampler.requests import SampleRequest
from tests.distributed.spawn import spawn

ENGINE = SamplerEngine.Config(max_batch=8, max_seq_len=32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "split"}, "mode must be 'colocated' or 'disaggregated'"),
        ({"generator_ranks": 0}, "generator_ranks must be an int >= 1"),
        ({"generator_tp": 2}, "no tensor parallelism"),
        ({"bucket_mb": 0}, "bucket_mb must be > 0"),
        ({"timeout_s": -1}, "timeout_s must be > 0"),
    ],
)
def test_bad_settings_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        Placement.Config(**changes)


def test_a_split_must_leave_a_trainer_rank():
    config = Placement.Config(mode="disaggregated", generator_ranks=2)
    with pytest.raises(
        ValueError, match="generator_ranks=2 leaves no trainer rank in a world of 2"
    ):
        Placement(config, world_size=2)
    assert Placement(config, world_size=5).num_trainers == 3
    assert Placement(Placement.Config(), world_size=4).num_trainers == 4  # colocated


def test_every_trainer_and_every_generator_is_linked():
    assert request_pairs(2, (2,)) == [(0, 2), (1, 2)]
    assert request_pairs(1, (1, 2)) == [(0, 1), (0, 2)]
    assert request_pairs(4, (4, 5)) == [(0, 4), (1, 5), (2, 4), (3, 5)]


def _requests() -> list[SampleRequest]:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    return [
        SampleRequest(prompt=[1, 2, 3], params=params, num_samples=2),
        SampleRequest(prompt=[4, 5], params=params),
    ]


def _remote_main(rank: int) -> dict:
    placement = Placement(Placement.Config(mode="disaggregated", timeout_s=60), world_size=2)
    roles = placement.split(trainer_mesh=None, device_type="cpu")
    if roles.is_generator:
        GeneratorRank(roles=roles, engine=ENGINE, device=torch.device("cpu")).serve()
        return {}
    model = materialize(qwen3_size("tiny"), init="random", seed=4)
    remotes = RemoteGenerators(
        roles=roles, bucket_bytes=2**16, transfer_dtype=None, device=torch.device("cpu")
    )
    generator = remotes.connect(model_config=model.config, dtype=torch.float32, tokenizer=None)
    generator.update_weights(model, version=7)
    requests = _requests()
    remote = generator.generate(requests)
    scores = generator.score([[1, 2, 3, 4]], temperature=0.7)
    try:
        generator.generate([SampleRequest(prompt=[model.config.vocab_size + 5])])
        bad = None
    except ValueError as error:
        bad = str(error)
    again = generator.generate(requests)  # the generator serves on after a bad request
    remotes.close()
    local = ENGINE.build(model=model, tokenizer=None)
    return {
        "remote": remote,
        "again": again,
        "local": local.generate(requests),
        "scores": scores,
        "local_scores": local.score([[1, 2, 3, 4]], temperature=0.7),
        "bad": bad,
        "version": generator.version,
    }


def test_a_remote_generator_samples_what_the_engine_samples_in_process(tmp_path):
    trainer, _ = spawn(_remote_main, world_size=2, out_dir=tmp_path)
    assert trainer["version"] == 7
    assert trainer["remote"] == trainer["local"] == trainer["again"]
    pairs = zip(trainer["scores"], trainer["local_scores"], strict=True)
    assert all(torch.equal(remote, local) for remote, local in pairs)
    assert trainer["bad"].startswith("generator rank 1: ")
    assert "vocab" in trainer["bad"]
