"""A vLLM generator rank that stalls or dies in the middle of a weight sync (1 trainer rank +
1 generator rank, gloo): the trainer rank ends within the sync deadline + 5 s of the fault,
naming the generator rank, the sync's version and the bucket. A stalled rank (vLLM in this
process), once awake, ends too (closing its vLLM engine) and names the bucket and the bytes
it had received. A killed rank (vLLM in its own engine process, which was taking the version
then) leaves no process behind: vLLM's engine process and worker end with it
(generator/vllm_owner.py). `make test-vllm`."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from temper.generator.choice import GeneratorChoice
from tests.distributed.sync_faults import FAULT_VERSION, run_until_failure
from tests.distributed.test_sync_deadline import GRACE_S, rl_config

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402

DEADLINE_S = 40.0
"""Longer than Temper's engine's test: on a busy 2-core machine (the suite's other worker
running beside it) vLLM's load of a version, at its commit, which the next sync's first
command waits for, has taken over 20 s."""
KILLED_DEADLINE_S = 60.0
"""A dead rank ends the job at once, whatever the deadline; a long one keeps a slow start of
vLLM's engine process on a busy machine from ending the job before the fault."""


def _config(*, engine_process: str, deadline_s: float):
    config = rl_config()
    config.placement = dataclasses.replace(
        config.placement, sync_timeout_s=deadline_s, call_timeout_s=deadline_s
    )
    vllm = VllmGenerator.Config(kv_cache_mib=32, engine_process=engine_process)
    config.generator = GeneratorChoice.Config(backend="vllm", vllm=vllm)
    return config


def _check_trainer_ended_in_time(outcome: dict, *, why: str, deadline_s: float) -> None:
    assert outcome["fault"] is not None, outcome  # the job reached the fault
    assert outcome["trainers_alive"] == [False]  # nothing hangs
    trainer = outcome["trainers"][0]
    assert trainer["time"] - outcome["fault"]["time"] < deadline_s + GRACE_S, trainer
    message = trainer["error"]
    assert message.startswith("trainer rank 0: "), message
    assert f"weight sync of version {FAULT_VERSION}: sending bucket" in message, message
    assert "to generator rank 1" in message and why in message, message


def test_a_vllm_generator_rank_killed_mid_sync_ends_the_job_and_leaves_no_process(tmp_path):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "killed"
    out.mkdir()
    outcome = run_until_failure(
        _config(engine_process="separate", deadline_s=KILLED_DEADLINE_S),
        run_dir=tmp_path / "run",
        out=out,
        kind="kill",
        world_size=2,
        record_children=True,
    )
    children = outcome["fault"]["children"] if outcome["fault"] else []
    try:
        _check_trainer_ended_in_time(outcome, why="the peer stopped", deadline_s=KILLED_DEADLINE_S)
        assert outcome["generator_exit"] == 17
        assert len(children) >= 2, children  # vLLM's engine process and its worker
        left = _alive(psutil, children, wait_s=GRACE_S)
        assert not left, f"processes of the killed generator rank left behind: {left}"
    finally:
        for pid in _alive(psutil, children, wait_s=0):  # whatever this test left
            os.kill(pid, signal.SIGKILL)


def _alive(psutil, pids: list[int], *, wait_s: float) -> list[int]:
    """The processes of `pids` still running (a zombie has ended) after at most `wait_s`."""
    give_up = time.monotonic() + wait_s
    while True:
        alive = [pid for pid in pids if _running(psutil, pid)]
        if not alive or time.monotonic() >= give_up:
            return alive
        time.sleep(0.2)


def _running(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_vllm_generator_rank_stalled_mid_sync_ends_the_job_within_the_deadline(tmp_path):
    out = tmp_path / "stalled"
    out.mkdir()
    outcome = run_until_failure(
        _config(engine_process="inline", deadline_s=DEADLINE_S),
        run_dir=tmp_path / "run",
        out=out,
        kind="stall",
        world_size=2,
        stall_s=DEADLINE_S + 3,
        generator_grace_s=60,
    )
    _check_trainer_ended_in_time(
        outcome, why="no answer within the deadline", deadline_s=DEADLINE_S
    )
    generator = outcome["generator"]["error"]
    assert generator.startswith("generator rank 1: "), generator
    assert f"weight sync of version {FAULT_VERSION}: receiving bucket" in generator
    assert outcome["generator_exit"] == 0  # it ended by itself, its vLLM engine closed
