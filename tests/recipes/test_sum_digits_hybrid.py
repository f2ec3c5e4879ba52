"""The sum_digits_hybrid recipe: on a tiny hybrid Qwen3.5 from random weights, GRPO after a
short warm-up lifts held-out accuracy and reward (a shortened fixed-seed run through
`temper train`), with the sampler's recurrent decode and the trainer's chunked forward
agreeing on the sampled tokens' logprobs."""

from __future__ import annotations

from temper.cli import main
from temper.config import get_recipe, list_recipes
from temper.config.serialize import load_config, save_config
from temper.observability import read_metrics
from temper.rl.job import RLJob

RL_STEPS = 60
LIFT = 0.08
REWARD_LIFT = 0.01


def test_the_recipe_is_listed_and_round_trips(tmp_path):
    assert "sum_digits_hybrid" in {info.name for info in list_recipes()}
    config = get_recipe("sum_digits_hybrid").fn()
    assert config.model.base_model == "qwen3_5/tiny"
    assert isinstance(config.build(), RLJob)
    save_config(tmp_path / "config.json", config, recipe="sum_digits_hybrid")
    assert load_config(tmp_path / "config.json").config == config


def test_grpo_lifts_a_tiny_hybrid_after_a_short_warmup(tmp_path):
    # The recipe with RL_STEPS of its 200 RL steps (its cosine then spans RL_STEPS).
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_hybrid", "--run-dir", str(run_dir), "--metrics.display", "none"]
    argv += ["--rl.steps", str(RL_STEPS), "--rl.eval_every", str(RL_STEPS)]
    argv += ["--eval_problems", "256"]
    assert main(argv) == 0

    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert [step for step, _ in evals] == [99, 99 + RL_STEPS], evals
    (_, after_warmup), (_, final) = evals
    # Measured on the 2-core CPU with this seed (0): held-out accuracy 0.375 after the
    # warm-up, 0.516 after 60 GRPO steps; rollout reward 0.266 over the first quarter of the
    # steps, 0.295 over the last. Seed 1 (not asserted) lifts less: 0.340 -> 0.363, reward
    # 0.225 -> 0.272.
    assert after_warmup < 0.5, evals  # RL, not the warm-up, does the learning
    assert final >= after_warmup + LIFT, evals
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(rewards) == RL_STEPS
    quarter = RL_STEPS // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first + REWARD_LIFT, (first, last)
    # Recurrent decode (sampler) against chunked forward (trainer), fp32, equal weights.
    assert max(r["mismatch/logprob_diff_max"] for r in records if "reward/mean" in r) < 1e-3
