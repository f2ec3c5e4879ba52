"""A generator rank that dies mid-run (2 trainer ranks + 1 generator rank on gloo): the trainer
ranks stop with an error naming the generator rank instead of hanging, and the run resumes
from its last checkpoint on a fresh world and finishes (that a resumed run equals one that
never stopped is tested for colocated runs in tests/rl/ and tests/distributed/test_rl_spmd.py;
this resume goes through the same checkpoint code). The run has a KL penalty: the fresh
generator rank loads the saved reference again."""

from __future__ import annotations

import json
import os
import re
import time

from temper.distributed.placement import Placement
from temper.generator import generator_rank, remote
from temper.rl.job import RLJob
from tests.distributed.rl_runs import skip_plots
from tests.distributed.spawn import free_port, rank_processes, spawn
from tests.rl.conftest import comparable_metrics, tiny_rl_config

CALLS_BEFORE_DYING = 3  # the warm-up's evaluation, RL steps 0 and 1 (2 trainer ranks' calls)


def rl_config() -> RLJob.Config:
    config = tiny_rl_config(
        steps=4, prompts_per_step=4, eval_every=10, eval_problems=8, kl_coef=0.05
    )
    config.warmup.steps = 2
    config.checkpoint_every = 3  # after the warm-up and RL step 0
    config.placement = Placement.Config(mode="disaggregated", generator_ranks=1, sync_timeout_s=60)
    return config


def _dying_run(rank: int, run_dir) -> str | None:
    """The job, with the generator rank exiting abruptly after a few calls."""
    skip_plots()
    answer = generator_rank.GeneratorRank._answer
    calls = []

    def answer_then_die(self, call):
        calls.append(isinstance(call, remote.GenerateCall))  # not the reference's scores
        if sum(calls) > CALLS_BEFORE_DYING * 2:
            os._exit(17)  # as if the process were killed: no goodbye on any link
        return answer(self, call)

    generator_rank.GeneratorRank._answer = answer_then_die
    started = time.monotonic()
    try:
        RLJob(rl_config()).run(run_dir=run_dir)
    except RuntimeError as error:
        return f"{time.monotonic() - started:.1f}s: {error}"
    return None


def _resumed_run(rank: int, run_dir) -> None:
    skip_plots()
    RLJob(rl_config()).run(run_dir=run_dir, resume=True)


def test_a_dead_generator_rank_stops_the_job_with_its_name_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    out_dir = tmp_path / "dying"
    out_dir.mkdir()
    processes = rank_processes(
        _dying_run, world_size=3, port=free_port(), out_dir=out_dir, args=(run_dir,)
    )
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=240)
    assert not any(process.is_alive() for process in processes)  # nothing hangs
    assert processes[2].exitcode == 17
    for rank in (0, 1):
        message = (out_dir / f"rank{rank}.pt").exists() and _load(out_dir, rank)
        assert message, f"trainer rank {rank} did not report the failure"
        # The rank's generate call (sending it, or awaiting its answer) or, where the generator
        # answered this rank before dying on the other's call, the weight sync that follows.
        assert f"trainer rank {rank}: " in message, message
        assert re.search(r"policy version \d+ to generator ranks? \(?2\b", message), message
        assert "the peer stopped" in message, message
        assert "resume" in message
    state = json.loads((run_dir / "run_state" / "state.json").read_text())
    assert state["step"] == 3  # the checkpoint after the warm-up and RL step 0

    (tmp_path / "resumed").mkdir()
    spawn(_resumed_run, world_size=3, out_dir=tmp_path / "resumed", args=(run_dir,))
    steps = [record["step"] for record in comparable_metrics(run_dir)]
    assert steps == list(range(2 + 4))  # each step once: the failed run's tail was cut
    resumed = [r for r in comparable_metrics(run_dir) if r["step"] >= 3]
    assert any("kl/k1" in record for record in resumed)  # scored on the reloaded reference
    assert json.loads((run_dir / "run_state" / "state.json").read_text())["step"] == 6


def _load(out_dir, rank):
    import torch

    return torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
