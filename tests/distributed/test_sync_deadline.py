"""A generator rank that dies or stalls in the middle of a weight sync (2 trainer ranks + 1
generator rank of Temper's engine, gloo): every trainer rank ends within the sync deadline
(10 s here) + 5 s of the fault, trainer rank 0's error names the generator rank, the phase
(the sync's version, the bucket, the bytes so far) and whether the peer died or stalled; the
run then resumes from its last checkpoint (`temper train --resume`'s path) and finishes."""

from __future__ import annotations

import json

from temper.distributed.placement import Placement
from temper.rl.job import RLJob
from tests.distributed.rl_runs import skip_plots
from tests.distributed.spawn import spawn
from tests.distributed.sync_faults import FAULT_VERSION, run_until_failure
from tests.rl.conftest import comparable_metrics, tiny_rl_config

DEADLINE_S = 10.0
GRACE_S = 5.0


def rl_config() -> RLJob.Config:
    config = tiny_rl_config(steps=3, prompts_per_step=4, eval_every=10, eval_problems=8)
    config.warmup.steps = 2
    config.checkpoint_every = 3  # after the warm-up and RL step 0
    config.placement = Placement.Config(
        mode="disaggregated",
        generator_ranks=1,
        bucket_mb=0.05,  # many buckets: the fault comes mid-sync
        sync_timeout_s=DEADLINE_S,
        call_timeout_s=DEADLINE_S,
    )
    return config


def _check_ended_in_time(outcome: dict) -> None:
    assert not any(outcome["trainers_alive"]), outcome  # nothing hangs
    fault_time = outcome["fault"]["time"]
    for rank, result in enumerate(outcome["trainers"]):
        assert result is not None and result["error"], f"trainer rank {rank}: {result}"
        took = result["time"] - fault_time
        assert took < DEADLINE_S + GRACE_S, (rank, took, result["error"])


def _check_message(message: str, *, why: str) -> None:
    assert message.startswith("trainer rank 0: "), message
    assert f"weight sync of version {FAULT_VERSION}: sending bucket" in message, message
    assert "to generator rank 2" in message, message
    assert "sent before it" in message, message  # how far it got
    assert why in message, message
    assert "temper train --resume" in message, message


def _resumed(rank: int, run_dir) -> None:
    skip_plots()
    RLJob(rl_config()).run(run_dir=run_dir, resume=True)


def test_a_generator_rank_killed_mid_sync_ends_the_job_in_time_and_it_resumes(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "killed"
    out.mkdir()
    outcome = run_until_failure(rl_config(), run_dir=run_dir, out=out, kind="kill")
    assert outcome["generator_exit"] == 17
    _check_ended_in_time(outcome)
    _check_message(outcome["trainers"][0]["error"], why="the peer stopped")
    state = json.loads((run_dir / "run_state" / "state.json").read_text())
    assert state["step"] == 3  # the checkpoint before the failed sync

    (tmp_path / "resumed").mkdir()
    spawn(_resumed, world_size=3, out_dir=tmp_path / "resumed", args=(run_dir,))
    steps = [record["step"] for record in comparable_metrics(run_dir)]
    assert steps == list(range(2 + 3))  # each step once
    assert json.loads((run_dir / "run_state" / "state.json").read_text())["step"] == 5


def test_a_generator_rank_stalled_mid_sync_ends_the_job_within_the_deadline(tmp_path):
    out = tmp_path / "stalled"
    out.mkdir()
    outcome = run_until_failure(
        rl_config(),
        run_dir=tmp_path / "run",
        out=out,
        kind="stall",
        stall_s=DEADLINE_S + 3,
        generator_grace_s=30,
    )
    _check_ended_in_time(outcome)
    message = outcome["trainers"][0]["error"]
    _check_message(message, why="no answer within the deadline")
    assert f"sync_timeout_s={DEADLINE_S:g}" in message, message
    # Once awake, the generator rank finds its trainers gone and ends, saying where it was.
    generator = outcome["generator"]["error"]
    assert generator.startswith("generator rank 2: "), generator
    assert f"weight sync of version {FAULT_VERSION}: receiving bucket" in generator
    assert "received) from trainer rank 0" in generator, generator
