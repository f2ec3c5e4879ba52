"""A vLLM generator rank that stalls in the middle of a weight sync (1 trainer rank + 1
generator rank running vLLM in its own engine process, gloo): the trainer rank ends within
the sync deadline + 5 s of the stall, naming the generator rank, the sync's version and the
bucket; the generator rank, once awake, ends too (closing its vLLM engine) and names the
bucket and the bytes it had received. `make test-vllm`."""

from __future__ import annotations

import dataclasses

import pytest

from temper.generator.choice import GeneratorChoice
from tests.distributed.sync_faults import FAULT_VERSION, run_until_failure
from tests.distributed.test_sync_deadline import GRACE_S, rl_config

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402

DEADLINE_S = 20.0
"""Longer than Temper's engine's test: on a busy 2-core machine vLLM's load of a version (at
its commit, which the next sync's first command waits for) has taken over 10 s."""


def test_a_vllm_generator_rank_stalled_mid_sync_ends_the_job_within_the_deadline(tmp_path):
    config = rl_config()
    config.placement = dataclasses.replace(
        config.placement, sync_timeout_s=DEADLINE_S, call_timeout_s=DEADLINE_S
    )
    config.generator = GeneratorChoice.Config(
        backend="vllm", vllm=VllmGenerator.Config(kv_cache_mib=32)
    )
    out = tmp_path / "stalled"
    out.mkdir()
    outcome = run_until_failure(
        config,
        run_dir=tmp_path / "run",
        out=out,
        kind="stall",
        world_size=2,
        stall_s=DEADLINE_S + 3,
        generator_grace_s=60,
    )
    assert outcome["trainers_alive"] == [False]  # nothing hangs
    trainer = outcome["trainers"][0]
    assert trainer["time"] - outcome["fault"]["time"] < DEADLINE_S + GRACE_S, trainer
    message = trainer["error"]
    assert message.startswith("trainer rank 0: "), message
    assert f"weight sync of version {FAULT_VERSION}: sending bucket" in message, message
    assert "to generator rank 1" in message and "no answer within the deadline" in message
    generator = outcome["generator"]["error"]
    assert generator.startswith("generator rank 1: "), generator
    assert f"weight sync of version {FAULT_VERSION}: receiving bucket" in generator
    assert outcome["generator_exit"] == 0  # it ended by itself, its vLLM engine closed
