"""Routing replay in the RL job on the tiny Qwen3-MoE, trained bf16-mixed (the generator
decodes a bf16 copy, the trainer runs bf16 autocast over fp32 weights: their numerics differ):
with --rl.routing_replay sampler every trained token's top-k is the sampler's
(mismatch/topk_diff 0) in single-turn and multi-turn runs (an episode's earlier turns' routes
come from the sampler's prefix cache), while with replay off and routes recorded the trainer's
router picks other experts for some tokens; replay on a dense model or with the vLLM backend
is refused before any work."""

from __future__ import annotations

import pytest

from temper.observability import read_metrics
from temper.rl.envs import GuessNumber
from temper.rl.episodes import EpisodeRunner
from temper.rl.job import RLJob
from tests.rl.conftest import tiny_rl_config


def _moe_config(**overrides) -> RLJob.Config:
    # Every group trains, uniform rewards or not: these runs measure routing, not learning.
    config = tiny_rl_config(drop_uniform_groups=False, **overrides)
    config.model.base_model = "qwen3_moe/tiny"
    config.model.dtype = "bf16-mixed"
    return config


def _rl_records(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_replay_leaves_no_topk_disagreement_and_off_reports_some(tmp_path, no_plots):
    on = _moe_config(routing_replay="sampler")
    assert on.sampler.record_routes is False  # the job turns it on for its own samplers
    RLJob(on).run(run_dir=tmp_path / "on")
    off = _moe_config()
    off.sampler.record_routes = True  # routes recorded, to measure; not replayed
    RLJob(off).run(run_dir=tmp_path / "off")
    replayed, routed = _rl_records(tmp_path / "on"), _rl_records(tmp_path / "off")
    assert len(replayed) == len(routed) == 6
    for record in replayed:
        assert record["mismatch/topk_diff"] == 0 and record["mismatch/topk_diff_layers"] == 0
        assert "mismatch/router_topk_diff" in record and "mismatch/kl" in record
    # bf16 decode against bf16-autocast training: some tokens' experts flip without replay
    # (measured with this seed: none in the first three steps, then 0.9%, 3.3%, 11.6%).
    assert max(r["mismatch/topk_diff"] for r in routed) > 0
    for record in routed:
        assert record["mismatch/topk_diff"] == record["mismatch/router_topk_diff"]


def test_multiturn_episodes_replay_every_turns_routes(tmp_path, no_plots):
    config = _moe_config(
        env=GuessNumber.Config(low=1, high=16),
        episodes=EpisodeRunner.Config(max_turns=4, max_context=32),
        max_tokens=4,
        eval_problems=8,
        routing_replay="sampler",
    )
    config.rl.steps = 3
    RLJob(config).run(run_dir=tmp_path / "run")
    records = _rl_records(tmp_path / "run")
    assert records and any(r["episode/turns"] > 1 for r in records)
    assert all(r["mismatch/topk_diff"] == 0 for r in records)


def test_replay_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="routing_replay='sampler' needs the sampler's routes"):
        _moe_config(routing_replay="sampler", generator=_vllm())
    with pytest.raises(ValueError, match=r"RLSteps\.Config\.routing_replay must be"):
        _moe_config(routing_replay="on")
    dense = tiny_rl_config(routing_replay="sampler")
    with pytest.raises(ValueError, match=r"routing_replay='sampler' \(--rl.routing_replay\)"):
        RLJob(dense).run(run_dir=tmp_path / "dense")
    assert not (tmp_path / "dense" / "metrics.jsonl").exists()


def _vllm():
    from temper.generator.choice import GeneratorChoice

    return GeneratorChoice.Config(backend="vllm")
