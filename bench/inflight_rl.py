"""Asynchronous RL on in-flight weights against snapshot-based asynchronous RL, same task.

Runs the `sum_digits_inflight` recipe twice on an identical configuration but for the mode:
`mode="async"` (each batch samples a snapshot of the weights it was submitted on) and
`mode="inflight"` (every batch samples the in-flight target, which each step's save moves on,
also under the episodes still decoding). Prints ONE JSON line: per mode the RL steps per
second (wall clock between the first and last RL step), the sampler-vs-trainer mismatch
(`mismatch/kl`, `mismatch/logprob_diff_max`: the trainer's logprobs of the sampled tokens
against the sampler's), the share of trajectories whose tokens span two policy versions, and
held-out accuracy after the warm-up and at the end.

    PYTHONPATH=. python bench/inflight_rl.py [--rl-steps 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from recipes.sum_digits_inflight import sum_digits_inflight
from temper.observability import MetricsLogger, read_metrics
from temper.rl.job import RLJob

MODES = ("async", "inflight")


def run(mode: str, *, rl_steps: int, seed: int, root: Path) -> dict:
    config = sum_digits_inflight()
    config.mode = mode
    config.seed = seed
    config.rl.steps = rl_steps
    config.rl.eval_every = rl_steps
    config.metrics = MetricsLogger.Config(display="none")
    run_dir = root / mode
    RLJob(config).run(run_dir=run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in records if "reward/mean" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    span = rl[-1]["time"] - rl[0]["time"]

    def mean(name: str) -> float | None:
        values = [r[name] for r in rl if name in r]
        return sum(values) / len(values) if values else None

    return {
        "rl_steps_per_s": round((len(rl) - 1) / span, 4),
        "mismatch_kl_mean": mean("mismatch/kl"),
        "logprob_diff_max_mean": mean("mismatch/logprob_diff_max"),
        "spanned_share_mean": mean("inflight/spanned") or 0.0,
        "accuracy_after_warmup": evals[-2],
        "accuracy_final": evals[-1],
        "config": {
            "mode": config.mode,
            "max_staleness": config.max_staleness,
            "warmup_steps": config.warmup.steps,
            "rl_steps": config.rl.steps,
            "prompts_per_step": config.rl.prompts_per_step,
            "group_size": config.rl.group_size,
            "learning_rate": config.rl.learning_rate,
            "seed": seed,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        results = {
            mode: run(mode, rl_steps=args.rl_steps, seed=args.seed, root=Path(root))
            for mode in MODES
        }
    print(json.dumps({"bench": "inflight_rl", **results}))


if __name__ == "__main__":
    main()
