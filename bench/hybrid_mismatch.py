"""The sampler-trainer logprob mismatch of a hybrid (Qwen3.5) policy beside a dense (Qwen3) one
on the same RL run.

The sampler decodes a Gated DeltaNet layer token by token (the recurrent form, after a chunked
prefill of the prompt); the trainer scores the whole sequence with the chunked form. They are
two computations of one function, so their logprobs of the sampled tokens differ by rounding,
as a dense model's decode (attention over the KV cache) and full forward do. Runs, one after
the other with the same seed and settings: `sum_digits_hybrid` (tiny Qwen3.5) and the same
run on the dense tiny Qwen3 (`sum_digits_short_warmup` shortened alike), in each precision
asked: `float32`, and `bf16-mixed` (the generator decodes a bf16 copy of the weights, the
trainer runs bf16 autocast over fp32 weights). Per run: `mismatch/kl` (mean over tokens of
exp(d) - 1 - d, d the trainer's minus the sampler's logprob) and `mismatch/logprob_diff_max`
(largest |d| of a step), as mean and max over the RL steps, with the run's reward and seconds
per RL step. Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python bench/hybrid_mismatch.py [--rl-steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from rl_figures import rl_figures

from recipes.sum_digits import sum_digits_short_warmup
from recipes.sum_digits_hybrid import sum_digits_hybrid
from temper.config.serialize import config_to_dict
from temper.observability import read_metrics
from temper.rl.job import RLJob

MEANS = ("mismatch/kl", "mismatch/logprob_diff_max")
RECIPES = {"hybrid": sum_digits_hybrid, "dense": sum_digits_short_warmup}


def _config(recipe: str, *, args: argparse.Namespace, dtype: str) -> RLJob.Config:
    config = RECIPES[recipe]()
    config.model.dtype = dtype
    config.seed = args.seed
    config.warmup.steps = args.warmup_steps
    config.rl.steps = args.rl_steps
    config.rl.eval_every = args.rl_steps
    config.rl.learning_rate = args.learning_rate
    config.metrics.display = "none"
    return config


def _run(config: RLJob.Config, *, run_dir: Path) -> dict:
    RLJob(config).run(run_dir=run_dir)
    rl = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    return rl_figures(rl, means=MEANS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bf16-mixed", help="comma-separated")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    cases, configs = [], {}
    with tempfile.TemporaryDirectory() as directory:
        for dtype in args.dtypes.split(","):
            case: dict = {"dtype": dtype}
            for recipe in RECIPES:
                config = _config(recipe, args=args, dtype=dtype)
                configs[recipe] = config_to_dict(config)
                case[recipe] = _run(config, run_dir=Path(directory) / f"{recipe}-{dtype}")
            case["kl_hybrid_over_dense"] = (
                case["hybrid"]["mismatch/kl:mean"] / case["dense"]["mismatch/kl:mean"]
            )
            cases.append(case)
    print(
        json.dumps(
            {
                "bench": "hybrid_mismatch",
                "config": {
                    "models": {"hybrid": "qwen3_5/tiny", "dense": "tiny (qwen3)"},
                    "warmup_steps": args.warmup_steps,
                    "rl_steps": args.rl_steps,
                    "learning_rate": args.learning_rate,
                    "seed": args.seed,
                    "jobs": configs,
                },
                "cases": cases,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
