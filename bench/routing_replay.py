"""Routing replay's effect on an RL run: the sum_digits_moe recipe with replay off and on.

The recipe (tiny Qwen3-MoE from scratch: SFT warm-up, then GRPO with the load-balancing loss)
in bf16-mixed precision unless told: the generator decodes a bf16 copy of the weights, the
trainer runs bf16 autocast over fp32 weights, so the two round apart and some tokens' top-k
experts differ between them. Runs, one after the other in this process, with the same seed:
- `off`: the trainer routes by its own router; the sampler records its routes
  (`--sampler.record_routes`) so the disagreement is measured;
- `sampler`: `--rl.routing_replay sampler`, the trainer replays the sampler's routes;
- `unrecorded` (only if asked): off without recording, the time baseline.
Per run: the share of trained tokens whose top-k (any sparse layer) differs between sampler
and trainer (`mismatch/topk_diff`; the trainer router's own, `mismatch/router_topk_diff`,
which under replay is what replay overrode), per token-layer pair, the logprob mismatch
(`mismatch/kl`, `mismatch/logprob_diff_max`), all as means over the RL steps (max too for the
logprob gap), held-out accuracy after the warm-up (the same in every run: the warm-up has no
routes) and at the end, reward over the first and last tenth of the steps, and seconds per RL
step (sample + train). Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE python bench/routing_replay.py [--rl-steps 100] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rl_figures import rl_figures

from recipes.sum_digits_moe import sum_digits_moe
from temper.observability import read_metrics
from temper.rl.job import RLJob

MEANS = (
    "mismatch/topk_diff",
    "mismatch/topk_diff_layers",
    "mismatch/router_topk_diff",
    "mismatch/router_topk_diff_layers",
    "mismatch/kl",
    "mismatch/logprob_diff_max",
)


def _run(mode: str, *, args: argparse.Namespace, directory: Path) -> dict:
    config = sum_digits_moe()
    config.model.dtype = args.dtype
    config.seed = args.seed
    config.warmup.steps = args.warmup_steps
    config.rl.steps = args.rl_steps
    config.rl.eval_every = args.rl_steps
    config.metrics.display = "none"
    config.rl.routing_replay = "sampler" if mode == "sampler" else "off"
    config.sampler.record_routes = mode == "off"
    run_dir = directory / mode
    started = time.perf_counter()
    RLJob(config).run(run_dir=run_dir)
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in records if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    figures: dict = {
        "seconds": round(seconds, 1),
        "eval_after_warmup": next(a for s, a in evals if s == args.warmup_steps - 1),
        "eval_final": evals[-1][1],
        **rl_figures(rl, means=MEANS),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16-mixed", help="--model.dtype of the runs")
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--rl-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="off,sampler", help="off, sampler, unrecorded")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for mode in args.modes.split(","):
            results[mode] = _run(mode, args=args, directory=Path(directory))
    print(
        json.dumps(
            {
                "bench": "routing_replay",
                "recipe": "sum_digits_moe",
                "dtype": args.dtype,
                "seed": args.seed,
                "warmup_steps": args.warmup_steps,
                "rl_steps": args.rl_steps,
                "results": results,
                "load_before": load_before,
                "load_after": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
