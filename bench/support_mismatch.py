"""Sampler-trainer mismatch under top-p 0.9, with and without renormalising the trainer over
the sampler's support: the arithmetic recipe, one RL run per mode, same seed and settings.

Modes (`--rl.sampling_support`): `full`, the trainer's logprob over the whole vocabulary at
temperature 1 against the sampler's truncated one; `sampler`, the sampler returns each
token's kept set and the loss renormalises the trainer over it (losses/support.py). Both runs
sample with `--rl.top_p` (0.9) and `--rl.top_k` (the vocabulary size unless told, which
leaves top-p alone in force and lets the vllm backend return the support too). Per run: the
means and maxima over the RL steps of `mismatch/kl` and `mismatch/logprob_diff_max`, reward
over the first and last tenth of the steps, held-out accuracy at the end, and seconds per RL
step (sample + train). Prints one JSON line with both runs' settings.

    OMP_WAIT_POLICY=PASSIVE python bench/support_mismatch.py [--rl-steps 20] [--backend vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rl_figures import rl_figures

from recipes.arithmetic import arithmetic
from temper.observability import read_metrics
from temper.rl.job import RLJob

MEANS = ("mismatch/kl", "mismatch/logprob_diff_max")


def _config(mode: str, *, args: argparse.Namespace):
    config = arithmetic()
    config.seed = args.seed
    config.model.dtype = args.dtype
    config.warmup.steps = args.warmup_steps
    config.rl.steps = args.rl_steps
    config.rl.eval_every = args.rl_steps
    config.rl.top_p = args.top_p
    config.rl.temperature = args.temperature
    config.rl.sampling_support = mode
    config.metrics.display = "none"
    config.generator.backend = args.backend
    return config


def _run(mode: str, *, args: argparse.Namespace, directory: Path) -> dict:
    config = _config(mode, args=args)
    if args.top_k is not None:
        config.rl.top_k = args.top_k
    run_dir = directory / mode
    started = time.perf_counter()
    RLJob(config).run(run_dir=run_dir)
    seconds = time.perf_counter() - started
    records = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in records if "reward/mean" in r]
    figures: dict = {
        "settings": {
            "top_p": config.rl.top_p,
            "top_k": config.rl.top_k,
            "temperature": config.rl.temperature,
            "sampling_support": config.rl.sampling_support,
            "loss_fn": config.rl.loss_fn,
            "backend": config.generator.backend,
        },
        "seconds": round(seconds, 1),
        "eval_final": [r["eval/accuracy"] for r in records if "eval/accuracy" in r][-1],
        **rl_figures(rl, means=MEANS),
    }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", help="--model.dtype of the runs")
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=None, help="default: the vocabulary size")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--backend", default="temper", choices=("temper", "vllm"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="full,sampler")
    args = parser.parse_args()
    if args.top_k is None:
        args.top_k = _vocab_size(args)
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for mode in args.modes.split(","):
            results[mode] = _run(mode, args=args, directory=Path(directory))
    print(
        json.dumps(
            {
                "bench": "support_mismatch",
                "recipe": "arithmetic",
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


def _vocab_size(args: argparse.Namespace) -> int:
    """The arithmetic task's vocabulary (the built-in digits one)."""
    from temper.tokenizer import build_builtin_tokenizer

    return build_builtin_tokenizer("digits").vocab_size


if __name__ == "__main__":
    main()
