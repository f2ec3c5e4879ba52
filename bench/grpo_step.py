"""Seconds per GRPO step: Temper's client API (as the RL loop drives it) against TRL's GRPOTrainer.

One step = 16 prompts x 8 samples x 8 new tokens on the tiny random Qwen3 (4 layers, width 128,
the built-in digits vocabulary), then one PPO-loss forward_backward + AdamW optim_step on all
128 completions. No stop token (Temper `stop=[]`, TRL `min_new_tokens=8`), so every completion
is exactly 8 tokens on both sides. Both load the same model directory (one random checkpoint
saved once) and see the same problems in the same order, step for step (drawn once from
`SumDigits` with a fixed seed; TRL's dataset unshuffled), and TRL runs without a reference
model (beta 0), as Temper's loop does.

TRL runs on Temper's configuration, not its own GPU defaults: fp32 weights and compute
(`bf16=False`), no gradient checkpointing, the same AdamW (torch's multi-tensor kernel, betas
0.9/0.95, eps 1e-12, no weight decay, gradient norm clipped to 1) at a constant learning rate,
the same clip range (0.2) and token-mean loss (`dapo`: one completion length, so equal to
Temper's advantage / tokens), sampling at temperature 1 with no top-k/top-p. The JSON line
prints both sides' configuration as read back from the live objects (`temper_config`,
`trl_config`), so a mismatch shows.

Temper's step is the RL loop's: `save_weights_and_get_sampling_client`, a group of
`ProblemEnv`s per problem (what `ProblemSource.make_group` builds, here without EOS stops)
rolled out as one-turn episodes by the `EpisodeRunner` (the "sample" phase), then group
advantages, `policy_datum`, `forward_backward("ppo")` and `optim_step` ("train"), on the
default recipe's engines (what `RLJob.Config()` runs: helper sampler processes, two trainer
thread shards). TRL's "sample" phase is its `_generate_and_score_completions` (generate,
decode, reward, advantages). Each side is timed over `--steps` steps after `--warmup` untimed
steps (default 5), in `--rounds` rounds (default 6) that alternate which side runs first; each
round's medians and ratio are printed (`per_round`), and the speedup is the median of the
rounds' ratios. Before the timed rounds, `--warmup-rounds` (default 2) whole rounds of both
sides run untimed: each side's first runs in a process are slower than its later ones
(first-call setup, the heap growing to the step's size; Temper's first run also starts its
sampler helper process), and without these rounds the first timed rounds would flatter
whichever side they slowed less. The load average before and after is printed (the machine may
be shared). Prints one JSON line. Without `trl` installed (the `bench` extra), only Temper's
numbers are printed, with the reason in `trl_skipped`.

    OMP_WAIT_POLICY=PASSIVE python bench/grpo_step.py [--steps 10 --rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from temper.api import AdamParams, SamplingParams
from temper.checkpoint.hf import save_pretrained
from temper.checkpoint.model_source import ModelSource
from temper.client.service_client import ServiceClient
from temper.config.recipes import default_recipe
from temper.rl.advantages import group_advantages
from temper.rl.env import ProblemEnv
from temper.rl.episodes import EpisodeRunner
from temper.rl.rollout import policy_datum
from temper.tasks import Problem, SumDigits

PROMPTS = 16
GROUP_SIZE = 8
NEW_TOKENS = 8
LEARNING_RATE = 2e-4
ADAM = AdamParams(learning_rate=LEARNING_RATE, beta2=0.95, grad_clip_norm=1.0)
"""Temper's AdamParams for the step; TRL gets the same AdamW (betas, eps, weight decay, clip)."""


Times = dict[str, list[float]]


def draw_problems(count: int) -> list[Problem]:
    """The problems both sides train on, in order: `PROMPTS` per step (seeded, so every round
    and both sides see the same ones)."""
    task, rng = SumDigits.Config().build(), random.Random(0)
    return [task.sample(rng, split="train") for _ in range(count)]


def optimizer_config(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """The AdamW settings a torch optimizer steps with (its first param group)."""
    group = optimizer.param_groups[0]
    return {
        "optimizer": type(optimizer).__name__,
        "foreach": group.get("foreach"),
        "fused": group.get("fused"),
        "betas": list(group["betas"]),
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
    }


def checkpointing(model) -> bool:
    """Whether a transformers model recomputes activations in backward (the property's name
    changed in transformers 5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    raise AttributeError(f"{type(model).__name__} says nothing of activation checkpointing")


class _FixedLengthEnv(ProblemEnv):
    """A problem without stop tokens: every completion has `NEW_TOKENS` tokens, as TRL's."""

    def stop_token_ids(self) -> list[int]:
        return []


def temper_steps(
    model_dir: Path, problems: list[Problem], *, steps: int, warmup: int
) -> tuple[Times, dict[str, object]]:
    """Seconds of the sample and train phases and of whole steps, per timed step, and the
    configuration the step ran with; step i trains on `problems[i * PROMPTS:][:PROMPTS]`."""
    with tempfile.TemporaryDirectory() as storage:
        # The default recipe's engines (sampler, trainer), as `make demo` runs them.
        job = default_recipe().fn()
        service = ServiceClient(storage_dir=storage, sampler=job.sampler, trainer=job.trainer)
        training = service.create_training_client(str(model_dir))
        tokenizer, task = training.get_tokenizer(), SumDigits.Config().build()
        rng = random.Random(0)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)
        runner = EpisodeRunner.Config().build(max_seq_len=job.sampler.max_seq_len)
        times: Times = {"sample": [], "train": [], "total": []}
        prompt_tokens = 0
        for step in range(warmup + steps):
            started = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client()
            # ProblemSource's groups, on this step's problems rather than fresh draws.
            groups = [
                [
                    _FixedLengthEnv(problem, task=task, tokenizer=tokenizer)
                    for _ in range(GROUP_SIZE)
                ]
                for problem in problems[step * PROMPTS : (step + 1) * PROMPTS]
            ]
            prompt_tokens += sum(len(group[0].initial_observation()) for group in groups)
            seeds = [rng.getrandbits(63) for _ in groups]
            running = runner.start(sampler, groups, params=params, seeds=seeds, turns="single")
            trajectories = running.wait()
            # As the RL loop does: no client holds this version while the trainer steps, so
            # optim_step changes the weights in place instead of copying them for the client.
            del sampler
            sampled = time.perf_counter()
            assert all(len(t.completion) == NEW_TOKENS for g in trajectories for t in g)
            num_tokens = PROMPTS * GROUP_SIZE * NEW_TOKENS
            data = [
                policy_datum(trajectory, advantage=advantage / num_tokens)
                for group in trajectories
                for trajectory, advantage in zip(
                    group, group_advantages([t.reward for t in group], mode="grpo"), strict=True
                )
            ]
            training.forward_backward(data, "ppo").result()
            training.optim_step(ADAM).result()
            done = time.perf_counter()
            if step >= warmup:
                times["sample"].append(sampled - started)
                times["train"].append(done - sampled)
                times["total"].append(done - started)
        engine = training.engine
        config = {
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
            "gradient_checkpointing": False,  # the one-process trainer has none
            **optimizer_config(engine.optimizer.torch_optimizer),
            "grad_clip_norm": ADAM.grad_clip_norm,
            "learning_rate": ADAM.learning_rate,
            "lr_schedule": "constant",
            "loss": "ppo, clip 0.8-1.2, advantage / tokens (token mean)",
            "advantages": "grpo: (r - mean) / (population std + 1e-6)",
            "reference_model": None,
            "prompts": PROMPTS,
            "group_size": GROUP_SIZE,
            "new_tokens": NEW_TOKENS,
            "prompt_tokens_per_step": prompt_tokens / (warmup + steps),
            "temperature": params.temperature,
            "threads": torch.get_num_threads(),
            "sampler": repr(job.sampler),
            "trainer": repr(job.trainer),
        }
    return times, config


def trl_steps(
    model_dir: Path, problems: list[Problem], *, steps: int, warmup: int
) -> tuple[Times, dict[str, object]]:
    """The same measurement for TRL's GRPOTrainer (transformers generate on CPU), on Temper's
    configuration and the same problems in the same order."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    problems = problems[: PROMPTS * (warmup + steps)]
    dataset = datasets.Dataset.from_list(
        [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    )
    # Each generation batch's prompts, in order, to check they are Temper's.
    seen_prompts: list[str] = []
    prompt_tokens: list[int] = []  # per generation batch, each prompt once

    def exact_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    step_times: list[float] = []
    sample_times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=PROMPTS * GROUP_SIZE,  # completions, not prompts
            num_generations=GROUP_SIZE,
            max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS},
            shuffle_dataset=False,  # Temper's order of problems
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            # Temper's configuration, not TRL's GPU defaults (bf16, gradient checkpointing,
            # betas 0.9/0.999, eps 1e-8, linearly decaying learning rate).
            bf16=False,
            gradient_checkpointing=False,
            learning_rate=ADAM.learning_rate,
            adam_beta1=ADAM.beta1,
            adam_beta2=ADAM.beta2,
            adam_epsilon=ADAM.eps,
            weight_decay=ADAM.weight_decay,
            max_grad_norm=ADAM.grad_clip_norm,
            lr_scheduler_type="constant",
            loss_type="dapo",
            epsilon=0.2,
            beta=0.0,
            max_steps=warmup + steps,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # The same AdamW as Temper's trainer (temper/trainer/optim.py): torch's multi-tensor
        # kernel, which transformers' `adamw_torch` does not pick on CPU.
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=ADAM.learning_rate,
            betas=(ADAM.beta1, ADAM.beta2),
            eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
            foreach=True,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = GRPOTrainer(
            model=model,
            processing_class=transformers.AutoTokenizer.from_pretrained(model_dir),
            reward_funcs=exact_match,
            args=config,
            train_dataset=dataset,
            callbacks=[StepTimer()],
            optimizers=(optimizer, schedule),
        )
        trainer.remove_callback(transformers.PrinterCallback)  # stdout is one JSON line
        generate_and_score = trainer._generate_and_score_completions

        def timed_generate_and_score(*args, **kwargs):
            started = time.perf_counter()
            result = generate_and_score(*args, **kwargs)
            sample_times.append(time.perf_counter() - started)
            assert result["completion_ids"].shape[1] == NEW_TOKENS
            inputs = args[0] if args else kwargs["inputs"]
            seen_prompts.extend(example["prompt"] for example in inputs[::GROUP_SIZE])
            prompt_tokens.append(int(result["prompt_mask"].sum()) // GROUP_SIZE)
            return result

        trainer._generate_and_score_completions = timed_generate_and_score
        trainer.train()
        trained = trainer.model
        used = {
            "dtype": str(next(trained.parameters()).dtype).removeprefix("torch."),
            "bf16": config.bf16,
            "gradient_checkpointing": checkpointing(trained),
            **optimizer_config(optimizer),
            "grad_clip_norm": config.max_grad_norm,
            "learning_rate": optimizer.param_groups[0]["lr"],
            "lr_schedule": "constant",
            "loss": f"{config.loss_type}, clip {config.epsilon} (token mean)",
            "advantages": f"scale_rewards={config.scale_rewards}: (r - mean) / (std + 1e-4)",
            "reference_model": None if config.beta == 0 else "beta",
            "prompts": config.per_device_train_batch_size // config.num_generations,
            "group_size": config.num_generations,
            "new_tokens": config.max_completion_length,
            "prompt_tokens_per_step": sum(prompt_tokens) / len(prompt_tokens),
            "shuffle_dataset": config.shuffle_dataset,
            "temperature": config.temperature,
            "top_k": config.top_k,
            "top_p": config.top_p,
            "num_iterations": config.num_iterations,
            "threads": torch.get_num_threads(),
        }
    assert len(step_times) == len(sample_times) == warmup + steps
    assert seen_prompts == [p.prompt for p in problems], "TRL saw other problems than Temper"
    step_s, sample_s = step_times[warmup:], sample_times[warmup:]
    times = {
        "sample": sample_s,
        "train": [t - s for t, s in zip(step_s, sample_s, strict=True)],
        "total": step_s,
    }
    return times, used


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {f"{name}_s": round(statistics.median(values), 4) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds; sides alternate first")
    parser.add_argument(
        "--warmup-rounds", type=int, default=2, help="untimed rounds of both sides first"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.warmup_rounds < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup and --warmup-rounds >= 0")
    report: dict[str, object] = {
        "bench": "grpo_step",
        "model": "tiny",
        "prompts": PROMPTS,
        "group_size": GROUP_SIZE,
        "new_tokens": NEW_TOKENS,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "warmup_rounds": args.warmup_rounds,
        "load_average_before": round(os.getloadavg()[0], 2),
    }
    try:
        import trl
    except ImportError as error:
        trl = None
        report["trl_skipped"] = (
            f"TRL not compared ({error}); pip install -e '.[bench]' (or put trl on PYTHONPATH, "
            "docs/benchmarks.md) to run it on the same configuration"
        )
    temper: Times = {"sample": [], "train": [], "total": []}
    baseline: Times = {"sample": [], "train": [], "total": []}
    configs: dict[str, dict[str, object]] = {}
    ratios = []
    per_round: list[dict[str, object]] = []
    problems = draw_problems(PROMPTS * (args.warmup + args.steps))
    with tempfile.TemporaryDirectory() as directory:
        base = ModelSource.Config(size="tiny", tokenizer="digits", seed=0).build()
        model_dir = save_pretrained(base.model, Path(directory) / "model", tokenizer=base.tokenizer)
        runners = [("temper", temper_steps), ("trl", trl_steps)][: 1 if trl is None else 2]
        for _ in range(args.warmup_rounds):  # untimed: each side's first run in the process
            for _, run in runners:
                run(model_dir, problems, steps=args.steps, warmup=args.warmup)
        # Rounds alternate which side runs first, and each round's ratio compares steps timed
        # seconds apart, so the machine's drift (a shared VM) does not favour either side.
        for round_index in range(args.rounds):
            runners = [("temper", temper_steps), ("trl", trl_steps)]
            if trl is None:
                runners = runners[:1]
            elif round_index % 2:
                runners.reverse()
            this_round = {}
            for name, run in runners:
                this_round[name], configs[name] = run(
                    model_dir, problems, steps=args.steps, warmup=args.warmup
                )
            for phase, values in this_round["temper"].items():
                temper[phase] += values
            summary = {"first": runners[0][0]}
            summary |= {
                f"{name}_total_s": medians(this_round[name])["total_s"] for name, _ in runners
            }
            if trl is not None:
                for phase, values in this_round["trl"].items():
                    baseline[phase] += values
                ratios.append(
                    statistics.median(this_round["trl"]["total"])
                    / statistics.median(this_round["temper"]["total"])
                )
                summary["speedup"] = round(ratios[-1], 2)
            per_round.append(summary)
    report["load_average_after"] = round(os.getloadavg()[0], 2)
    report["temper"] = medians(temper)
    report["temper_config"] = configs["temper"]
    report["per_round"] = per_round
    if trl is not None:
        report["trl_version"] = trl.__version__
        report["trl"] = medians(baseline)
        report["trl_config"] = configs["trl"]
        report["speedup_per_round"] = [round(r, 2) for r in ratios]
        report["speedup_vs_trl"] = round(statistics.median(ratios), 2)
    else:
        report["trl"] = None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
