"""The GRPO recipe learns: a fixed-seed run through `temper train` lifts held-out accuracy
(about four minutes on two cores: RL does the learning, see docs/rl.md)."""

from __future__ import annotations

import json

from temper.cli import main
from temper.observability import read_metrics


def test_grpo_after_a_short_warmup_improves_accuracy_and_reward(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_short_warmup", "--run-dir", str(run_dir)]
    argv += ["--metrics.display", "none"]
    assert main(argv) == 0

    records = read_metrics(run_dir / "metrics.jsonl")
    warmup_steps = 150
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    after_warmup = next(acc for step, acc in evals if step == warmup_steps - 1)
    final = evals[-1][1]
    # Measured with this seed on an AVX2 CPU (runs are reproducible; rounding-level changes
    # to kernels move the numbers): 0.33 after warm-up, 0.92 after 1500 GRPO steps; rollout
    # reward 0.23 over the first 100 steps, 0.63 over the last 100. Seeds 1 and 2: see docs/rl.md.
    assert after_warmup < 0.5, evals  # RL, not the warm-up, does the learning
    assert final >= after_warmup + 0.35, evals

    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(rewards) == 1500
    first, last = sum(rewards[:100]) / 100, sum(rewards[-100:]) / 100
    assert last > first + 0.2, (first, last)

    rl_record = next(r for r in records if "reward/mean" in r)
    for key in ("mismatch/logprob_diff_max", "mismatch/kl", "optim/grad_norm", "time/sample"):
        assert key in rl_record, key
    assert rl_record["mismatch/logprob_diff_max"] < 1e-4  # on-policy: same weights both sides
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and {"prompt", "completion", "reward"} <= rollouts[0].keys()
    assert (run_dir / "plots" / "learning.png").is_file()
    assert (run_dir / "checkpoints").is_dir()
