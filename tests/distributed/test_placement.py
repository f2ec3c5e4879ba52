"""Placement settings, the request links, and a remote generator on its own against the same
engine in one process (2 gloo ranks: one trainer, one generator); with `overlap_sync`, the
next version's weights travel while the generator still samples the current one."""

from __future__ import annotations

import threading

import pytest
import torch

from temper.api.types import SamplingParams
from temper.distributed.placement import Placement, request_pairs
from temper.generator.generator_rank import GeneratorRank
from temper.generator.remote import RemoteGenerators
from temper.models.build import materialize
from temper.models.qwen3.sizes import qwen3_size
from temper.sampler.engine import SamplerEngine
from temper.sampler.requests import SampleRequest
from tests.distributed.spawn import spawn

ENGINE = SamplerEngine.Config(max_batch=8, max_seq_len=32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mode": "split"}, "mode must be 'colocated' or 'disaggregated'"),
        ({"generator_ranks": 0}, "generator_ranks must be an int >= 1"),
        ({"generator_tp": 2}, "generator_tp=2 is for mode 'disaggregated'"),
        ({"generator_ranks": 2}, "generator_ranks=2 is for mode 'disaggregated'"),
        ({"overlap_sync": True}, "overlap_sync=True is for mode 'disaggregated'"),
        (
            {"mode": "disaggregated", "generator_ranks": 3, "generator_tp": 2},
            "generator_tp=2 must divide generator_ranks=3",
        ),
        ({"bucket_mb": 0}, "bucket_mb must be > 0"),
        ({"sync_timeout_s": -1}, "sync_timeout_s must be > 0"),
        ({"call_timeout_s": 0}, "call_timeout_s must be > 0"),
        ({"overlap_sync": "yes"}, "overlap_sync must be true or false"),
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
    placement = Placement(Placement.Config(mode="disaggregated", sync_timeout_s=60), world_size=2)
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


def _overlap_main(rank: int) -> dict:
    """A call on version 7 that the generator holds until version 8 has fully arrived: it
    can only finish if the weights travel while it runs."""
    config = Placement.Config(mode="disaggregated", sync_timeout_s=60, overlap_sync=True)
    roles = Placement(config, world_size=2).split(trainer_mesh=None, device_type="cpu")
    if roles.is_generator:
        arrived, waits = threading.Event(), []
        receive, generate = GeneratorRank._receive, SamplerEngine.generate

        def receive_then_tell(self, version):
            receive(self, version)
            if version == 8:
                arrived.set()

        def generate_once_arrived(self, requests):
            if self.version == 7 and not waits:
                waits.append(arrived.wait(timeout=30))
            return generate(self, requests)

        GeneratorRank._receive = receive_then_tell
        SamplerEngine.generate = generate_once_arrived
        GeneratorRank(
            roles=roles, engine=ENGINE, device=torch.device("cpu"), overlap_sync=True
        ).serve()
        return {"waits": waits}
    old, new = (materialize(qwen3_size("tiny"), init="random", seed=seed) for seed in (4, 5))
    remotes = RemoteGenerators(
        roles=roles,
        bucket_bytes=2**16,
        transfer_dtype=None,
        device=torch.device("cpu"),
        overlap_sync=True,
    )
    generator = remotes.connect(model_config=old.config, dtype=torch.float32, tokenizer=None)
    generator.update_weights(old, version=7)
    answers = {}
    sampling = threading.Thread(target=lambda: answers.update(old=generator.generate(_requests())))
    sampling.start()
    generator.send_weights(new, version=8)
    sampling.join()
    generator.commit_weights(version=8)
    answers["new"] = generator.generate(_requests())
    remotes.close()
    for name, model in (("old", old), ("new", new)):
        answers[f"local_{name}"] = ENGINE.build(model=model, tokenizer=None).generate(_requests())
    return answers | {"version": generator.version}


def test_with_overlap_sync_weights_travel_while_the_current_version_samples(tmp_path):
    trainer, generator = spawn(_overlap_main, world_size=2, out_dir=tmp_path)
    assert generator["waits"] == [True]  # the version-7 call ran until version 8 arrived
    assert trainer["old"] == trainer["local_old"]  # and sampled version 7 all the same
    assert trainer["new"] == trainer["local_new"] != trainer["old"]
    assert trainer["version"] == 8
