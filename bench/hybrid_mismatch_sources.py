"""Where the bf16 sampler-trainer mismatch of a hybrid (Qwen3.5) policy comes from, beside a
dense (Qwen3) one: a controlled measurement on fixed weights, no RL.

Each model (tiny Qwen3.5 and tiny Qwen3) is warmed up by its recipe's SFT warm-up for the same
number of steps and seed (an `RLJob` with no RL steps). Then, as an RL job under 'bf16-mixed'
does: the generator is a bf16 copy of the fp32 weights, sampled by Temper's engine with the
job's sampler settings (CPU wing, the fused decode twins, one process), `prompts` sum-of-digits
prompts x `group` samples; the trainer scores the sampled sequences with its full forward
(chunked Gated DeltaNet) under bf16 autocast over the fp32 weights. d = trainer logprob minus
sampler logprob at each sampled token; `kl` is the mean of exp(d) - 1 - d (`mismatch/kl`),
`max` the largest |d|, also split into the first completion token (its logits come from the
prompt's prefill, the chunked form on both sides) and the later ones (the sampler's one-token
decode steps: the recurrent form).

The gap splits in two, both measured on the same sampled tokens:
- `decode`: the sampler against the bf16 generator's own full forward (same weights and
  dtypes; step-by-step decode against one chunked forward);
- `placement`: the generator's full forward against the trainer's (same algorithm; where the
  bf16 roundings happen: bf16 weights and a bf16 residual stream against autocast over fp32).
The placement part is then attributed by running the trainer with pieces computed the
generator's way (`trainer_with`): `rounded` (the trainer's fp32 weights rounded to bf16
values: the small non-matmul parameters, norms, conv taps, A_log, dt_bias, embeddings, are
otherwise exact in the trainer), and on top of it each module kind run as the bf16 generator
runs it (bf16 weights, no autocast, bf16 inputs): `linear_attention` (the Gated DeltaNet
mixers), `attention`, `feed_forward`, and `all` of them (what is left is the residual stream's
dtype). Each is compared with the generator's full forward (`vs_generator_forward`) and with
the sampler (`vs_sampler`). Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python bench/hybrid_mismatch_sources.py
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import tempfile
from pathlib import Path

import torch
from torch import nn

from recipes.sum_digits import sum_digits_short_warmup
from recipes.sum_digits_hybrid import sum_digits_hybrid
from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained
from temper.models.common.logprobs import forward_logprobs
from temper.rl.job import RLJob
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tasks.sum_digits import SumDigits
from temper.tokenizer.tokenizer import load_tokenizer

RECIPES = {"hybrid": sum_digits_hybrid, "dense": sum_digits_short_warmup}
MODULE_KINDS = ("linear_attention", "attention", "feed_forward")


def _warm_up(recipe: str, *, args: argparse.Namespace, directory: Path) -> Path:
    """The recipe's SFT warm-up alone (fp32); the directory of its final weights."""
    config = RECIPES[recipe]()
    config.seed = args.seed
    config.warmup.steps = args.warmup_steps
    config.rl.steps = 0
    config.metrics.display = "none"
    run_dir = directory / recipe
    RLJob(config).run(run_dir=run_dir)
    return next(run_dir.glob("checkpoints/*/sampler_weights/final"))


class _AsGenerator(nn.Module):
    """A module run as the bf16 generator runs it, inside the trainer's autocast forward: its
    own bf16 weights, autocast off, floating inputs cast to bf16."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = copy.deepcopy(module).to(torch.bfloat16)

    def forward(self, *args, **kwargs):
        cast = [
            a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a
            for a in args
        ]
        with torch.autocast("cpu", enabled=False):
            return self.inner(*cast, **kwargs)


def _trainer_with(model: nn.Module, kinds: tuple[str, ...]) -> nn.Module:
    """A copy of the fp32 model, its weights rounded to bf16 values, with the blocks' modules
    of `kinds` computed the generator's way."""
    variant = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in variant.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    for block in variant.blocks:
        for kind in kinds:
            module = getattr(block, kind, None)
            if module is not None:
                setattr(block, kind, _AsGenerator(module))
    return variant


def _sample(generator: nn.Module, prompts: list[list[int]], *, args) -> list[tuple]:
    """(prompt, completion, sampler logprobs) of every sample, as the RL job's sampler."""
    engine = SamplerEngine.Config(
        max_batch=256, max_seq_len=64, cpu=CpuDecoding.Config(num_threads=1, processes=1)
    ).build(model=generator)
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=args.seed * 7919 + i)
        for i in range(len(prompts))
    ]
    requests = [
        SampleRequest(prompt=p, params=s, num_samples=args.group)
        for p, s in zip(prompts, params, strict=True)
    ]
    samples = []
    for prompt, response in zip(prompts, engine.generate(requests), strict=True):
        for sequence in response.sequences:
            samples.append((prompt, list(sequence.tokens), list(sequence.logprobs)))
    return samples


def _score(model: nn.Module, samples: list[tuple], *, autocast: bool) -> list[torch.Tensor]:
    """Each sample's completion logprobs from one full forward (right-padded batch)."""
    rows = [prompt + completion for prompt, completion, _ in samples]
    T = max(len(r) for r in rows) - 1
    inputs_BT = torch.zeros(len(rows), T, dtype=torch.long)
    targets_BT = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        inputs_BT[b, : len(row) - 1] = torch.tensor(row[:-1])
        targets_BT[b, : len(row) - 1] = torch.tensor(row[1:])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logprobs_BT = forward_logprobs(model, inputs_BT, targets_BT).float()
    return [
        logprobs_BT[b, len(prompt) - 1 : len(prompt) - 1 + len(completion)].double()
        for b, (prompt, completion, _) in enumerate(samples)
    ]


def _gap(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Mismatch figures of d = reference - other, over all tokens, the first (prefill) and
    the later (decode) completion tokens."""
    d_all = torch.cat([r - o for r, o in zip(reference, other, strict=True)])
    d_first = torch.stack([(r - o)[0] for r, o in zip(reference, other, strict=True)])
    d_later = torch.cat([(r - o)[1:] for r, o in zip(reference, other, strict=True)])
    figures = {}
    for name, d in (("", d_all), ("first_", d_first), ("later_", d_later)):
        figures[f"{name}kl"] = float((d.exp() - 1 - d).mean()) if d.numel() else None
        figures[f"{name}max"] = float(d.abs().max()) if d.numel() else None
    figures["tokens"] = d_all.numel()
    return figures


def _measure(weights: Path, *, prompts: list[list[int]], args) -> dict:
    trainer = load_pretrained(weights, dtype=torch.float32).eval()
    generator = load_pretrained(weights, dtype=torch.bfloat16).eval()  # the job's cast copy
    samples = _sample(generator, prompts, args=args)
    sampler = [torch.tensor(lp, dtype=torch.float64) for _, _, lp in samples]
    scored = _score(trainer, samples, autocast=True)
    generator_forward = _score(generator, samples, autocast=False)
    fp32 = _score(trainer, samples, autocast=False)
    figures = {
        "total": _gap(scored, sampler),
        "decode": _gap(generator_forward, sampler),
        "placement": _gap(scored, generator_forward),
        "fp32_vs_sampler": _gap(fp32, sampler),
        "fp32_vs_trainer": _gap(fp32, scored),
        "trainer_with": {},
    }
    variants = {"rounded": ()} | {kind: (kind,) for kind in MODULE_KINDS}
    variants["all"] = MODULE_KINDS
    for name, kinds in variants.items():
        if kinds and not any(
            hasattr(trainer.blocks[0], k) or hasattr(trainer.blocks[-1], k) for k in kinds
        ):
            continue
        variant = _score(_trainer_with(trainer, kinds), samples, autocast=True)
        figures["trainer_with"][name] = {
            "vs_generator_forward": _gap(variant, generator_forward),
            "vs_sampler": _gap(variant, sampler),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4, help="the RL recipes' 4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default="", help="hybrid=DIR,dense=DIR: skip warm-ups")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    load_before = os.getloadavg()[0]
    given = dict(item.split("=", 1) for item in args.weights.split(",") if item)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for recipe in RECIPES:
            weights = (
                Path(given[recipe])
                if recipe in given
                else _warm_up(recipe, args=args, directory=Path(directory))
            )
            tokenizer = load_tokenizer(weights)
            task, rng = SumDigits(SumDigits.Config()), random.Random(args.seed)
            prompts = [
                tokenizer.encode(task.sample(rng, split="train").prompt)
                for _ in range(args.prompts)
            ]
            results[recipe] = _measure(weights, prompts=prompts, args=args)
    ratio = {
        part: results["hybrid"][part]["kl"] / results["dense"][part]["kl"]
        for part in ("total", "decode", "placement")
    }
    print(
        json.dumps(
            {
                "bench": "hybrid_mismatch_sources",
                "config": {
                    "models": {"hybrid": "qwen3_5/tiny", "dense": "tiny (qwen3)"},
                    "warmup_steps": args.warmup_steps,
                    "prompts": args.prompts,
                    "group": args.group,
                    "max_tokens": args.max_tokens,
                    "seed": args.seed,
                    "weights": given or "warmed up here",
                    "generator": "bf16 copy, SamplerEngine max_batch 256, CPU wing, 1 process",
                    "trainer": "fp32 weights, bf16 autocast, full forward",
                },
                "kl_hybrid_over_dense": ratio,
                **results,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
