"""Routing replay with generator ranks (disaggregated placement, 2 gloo ranks: one trainer, one
generator) on the tiny Qwen3-MoE: the generator rank records the routes and sends them back
with its samples, so the trainer replays every datum's (a datum without routes would fail the
step) and no trained token's top-k differs from the sampler's."""

from __future__ import annotations

from temper.distributed.placement import Placement
from temper.observability import read_metrics
from temper.rl.job import RLJob
from tests.distributed.rl_runs import skip_plots
from tests.distributed.spawn import spawn
from tests.rl.conftest import tiny_rl_config


def _config() -> RLJob.Config:
    config = tiny_rl_config(
        steps=3, prompts_per_step=4, eval_every=3, eval_problems=8, drop_uniform_groups=False
    )
    config.model.base_model = "qwen3_moe/tiny"
    config.rl.routing_replay = "sampler"
    config.warmup.steps = 2
    config.placement = Placement.Config(mode="disaggregated", generator_ranks=1, bucket_mb=1)
    return config


def _rank_main(rank: int, directory) -> bool:
    skip_plots()
    return RLJob(_config()).run(run_dir=directory / "run") is not None


def test_generator_ranks_send_the_routes_the_trainer_replays(tmp_path_factory):
    directory = tmp_path_factory.mktemp("replay")
    trained = spawn(
        _rank_main, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"), args=(directory,)
    )
    assert trained == [True, False]  # rank 1 only generates
    records = [r for r in read_metrics(directory / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(records) == 3
    for record in records:
        assert record["mismatch/topk_diff"] == 0 and "mismatch/router_topk_diff" in record
