"""The sum_digits_inflight recipe: asynchronous GRPO on in-flight weights (mode='inflight')
lifts held-out accuracy above the warm-up's, with every trajectory's weight versions
reported."""

from __future__ import annotations

from temper.cli import main
from temper.config import get_recipe, list_recipes
from temper.observability import read_metrics
from temper.rl.job import RLJob

LIFT = 0.02
"""Held-out accuracy gained over the warm-up's, with a margin under what was measured."""


def test_the_recipe_is_listed_and_builds():
    assert "sum_digits_inflight" in {info.name for info in list_recipes()}
    config = get_recipe("sum_digits_inflight").fn()
    assert config.mode == "inflight" and isinstance(config.build(), RLJob)


def test_inflight_grpo_lifts_the_warmup(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "sum_digits_inflight", "--run-dir", str(run_dir)]
    argv += ["--metrics.display", "none", "--eval_problems", "256"]
    assert main(argv) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    (_, after_warmup), (_, final) = evals[-2:]
    # Measured on the 2-core CPU with seed 0: see docs/benchmarks.md (inflight_rl.py).
    assert final >= after_warmup + LIFT, evals
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == 40
    assert all(r["inflight/versions"] >= 1 for r in rl)
    assert [r["async/staleness"] for r in rl[:3]] == [0.0, 1.0, 2.0]
