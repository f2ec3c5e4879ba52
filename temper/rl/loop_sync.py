"""The synchronous RL loop (GRPO-style), written only against the public client API.

One step: a sampling client on the current weights -> `group_size` completions for each of
`prompts_per_step` problems (one batched decode) -> rewards -> group-relative advantages ->
`forward_backward(loss_fn)` -> `optim_step`. An optional supervised warm-up runs first. The
same loop runs in-process (here) or against a Tinker-compatible server.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from temper.api.client import ServiceClient
from temper.api.types import AdamParams, SamplingParams
from temper.config.configurable import Configurable
from temper.observability import MetricsLogger, PhaseTimer, plot_metrics
from temper.rl.advantages import AdvantageMode, group_advantages, is_uniform
from temper.rl.env import make_groups
from temper.rl.evaluation import greedy_accuracy, heldout_problems
from temper.rl.rollout import Trajectory, policy_datum, rollout_groups
from temper.rl.step_metrics import mismatch_metrics, rollout_metrics
from temper.rl.tasks import SumDigits, TaskConfig
from temper.rl.warmup import SFTWarmup
from temper.sampler.engine import SamplerEngine


@dataclass(frozen=True)
class RLResult:
    warmup_accuracy: float | None
    final_accuracy: float
    reward_first: float
    reward_last: float
    sampler_path: str


class RLJob(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        base_model: str = "tiny"
        """Model directory, or a named size with a built-in vocabulary (e.g. 'tiny')."""
        lora_rank: int | None = None
        """LoRA rank; None trains every parameter."""
        task: TaskConfig = field(default_factory=SumDigits.Config)
        """The task problems and rewards come from."""
        warmup: SFTWarmup.Config = field(default_factory=SFTWarmup.Config)
        """Supervised warm-up before RL."""
        steps: int = 60
        """RL steps."""
        prompts_per_step: int = 16
        """Problems per RL step."""
        group_size: int = 8
        """Completions per problem, compared with each other (GRPO groups)."""
        max_tokens: int = 4
        """Most tokens per completion."""
        temperature: float = 1.0
        """Sampling temperature of rollouts."""
        loss_fn: Literal["ppo", "importance_sampling"] = "ppo"
        """Policy loss; the sampler's logprobs give the importance ratios."""
        learning_rate: float = 2e-4
        """AdamW learning rate of RL steps."""
        advantages: AdvantageMode = "grpo"
        """grpo (std-normalized), dr_grpo (mean baseline only) or rloo."""
        drop_uniform_groups: bool = True
        """Skip groups whose rewards are all equal (no signal)."""
        eval_every: int = 20
        """RL steps between held-out evaluations (plus one after warm-up and one at the end)."""
        eval_problems: int = 256
        """Held-out problems per evaluation (a fixed set)."""
        seed: int = 0
        """Seed of the problem stream and of LoRA initialization."""
        rollouts_per_step: int = 4
        """Decoded completions written to rollouts.jsonl per RL step."""
        sampler: SamplerEngine.Config = field(
            default_factory=lambda: SamplerEngine.Config(
                max_batch=256, max_seq_len=64, num_threads=1
            )
        )
        """The sampling engine behind the sampling clients."""
        metrics: MetricsLogger.Config = field(
            default_factory=lambda: MetricsLogger.Config(
                progress_keys=("reward/mean", "eval/accuracy", "warmup/loss"), table_every=100
            )
        )
        """Console, metrics.jsonl and TensorBoard logging."""

        def __post_init__(self) -> None:
            if self.group_size < 2:
                raise ValueError(
                    f"RLJob.Config.group_size must be >= 2 (GRPO compares members of a group), "
                    f"got {self.group_size}"
                )
            for name in ("steps", "prompts_per_step", "max_tokens", "eval_every", "eval_problems"):
                if getattr(self, name) < (0 if name == "steps" else 1):
                    raise ValueError(f"RLJob.Config.{name} is out of range: {getattr(self, name)}")
            if self.lora_rank is not None and self.lora_rank < 1:
                raise ValueError(
                    f"RLJob.Config.lora_rank must be >= 1 or None, got {self.lora_rank}"
                )

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: Path) -> RLResult:
        config, run_dir = self.config, Path(run_dir)
        service = ServiceClient(storage_dir=run_dir / "checkpoints", sampler=config.sampler)
        if config.lora_rank is None:
            training = service.create_training_client(config.base_model)
        else:
            training = service.create_lora_training_client(
                config.base_model, rank=config.lora_rank, seed=config.seed
            )
        tokenizer, task = training.get_tokenizer(), config.task.build()
        rng = random.Random(config.seed)
        heldout = heldout_problems(task, count=config.eval_problems)
        warmup = config.warmup.build()

        def evaluate() -> float:
            sampler = training.save_weights_and_get_sampling_client()
            accuracy, _ = greedy_accuracy(
                sampler, heldout, task=task, tokenizer=tokenizer, max_tokens=config.max_tokens
            )
            return accuracy

        total_steps = config.warmup.steps + config.steps
        with MetricsLogger(
            config.metrics, run_dir=run_dir, total_steps=total_steps, description="GRPO"
        ) as logger:
            warmup_accuracy = None
            if config.warmup.steps:
                logger.console.print(f"SFT warm-up: {config.warmup.steps} steps")

                def on_warmup_step(step: int, metrics: dict[str, float]) -> None:
                    if step == config.warmup.steps - 1:
                        metrics = {**metrics, "eval/accuracy": evaluate()}
                    logger.log(step, metrics)

                warmup.run(
                    training, task=task, tokenizer=tokenizer, rng=rng, on_step=on_warmup_step
                )
                warmup_accuracy = logger.latest["eval/accuracy"]
            logger.console.print(
                f"RL ({config.loss_fn}, {config.advantages}): {config.steps} steps"
            )
            rewards = self._rl_steps(
                training,
                task=task,
                tokenizer=tokenizer,
                rng=rng,
                logger=logger,
                evaluate=evaluate,
                run_dir=run_dir,
            )
            final_accuracy = logger.latest.get("eval/accuracy", evaluate())
            sampler_path = training.save_weights_for_sampler("final").result().path
            plots = plot_metrics(run_dir)
            logger.summary(
                {
                    "held-out accuracy": {
                        "after warm-up": warmup_accuracy if warmup_accuracy is not None else "-",
                        "final": final_accuracy,
                    },
                    "rollout reward": {
                        "first RL step": rewards[0] if rewards else "-",
                        "last RL step": rewards[-1] if rewards else "-",
                    },
                },
                title="GRPO done",
            )
            logger.console.print(f"plots: {plots[0].parent}\nsampler weights: {sampler_path}")
        return RLResult(
            warmup_accuracy=warmup_accuracy,
            final_accuracy=final_accuracy,
            reward_first=rewards[0] if rewards else float("nan"),
            reward_last=rewards[-1] if rewards else float("nan"),
            sampler_path=sampler_path,
        )

    def _rl_steps(
        self, training, *, task, tokenizer, rng, logger, evaluate, run_dir
    ) -> list[float]:
        config = self.config
        params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            stop=[tokenizer.eos_token_id],
        )
        adam = AdamParams(learning_rate=config.learning_rate, beta2=0.95, grad_clip_norm=1.0)
        timer, rewards = PhaseTimer(), []
        with (run_dir / "rollouts.jsonl").open("a") as rollouts_file:
            for rl_step in range(config.steps):
                step = config.warmup.steps + rl_step
                started = time.perf_counter()
                with timer.phase("sample"):
                    sampler = training.save_weights_and_get_sampling_client()
                    groups = make_groups(
                        task,
                        tokenizer=tokenizer,
                        rng=rng,
                        num_groups=config.prompts_per_step,
                        group_size=config.group_size,
                        split="train",
                    )
                    trajectories = rollout_groups(sampler, groups, params=params, rng=rng)
                metrics = rollout_metrics(trajectories)
                rewards.append(metrics["reward/mean"])
                with timer.phase("train"):
                    metrics |= self._train_on(training, trajectories, adam=adam)
                if (rl_step + 1) % config.eval_every == 0 or rl_step == config.steps - 1:
                    with timer.phase("eval"):
                        metrics["eval/accuracy"] = evaluate()
                num_tokens = sum(len(t.completion) for g in trajectories for t in g)
                metrics["throughput/tokens_per_s"] = num_tokens / (time.perf_counter() - started)
                logger.log(step, metrics | timer.collect())
                self._write_rollouts(rollouts_file, step, trajectories, tokenizer)
        return rewards

    def _train_on(self, training, groups: list[list[Trajectory]], *, adam) -> dict[str, float]:
        config = self.config
        kept = [
            g
            for g in groups
            if not (config.drop_uniform_groups and is_uniform([t.reward for t in g]))
        ]
        metrics = {"rollout/groups_kept": len(kept) / len(groups)}
        if not kept:
            return metrics
        # Sum losses (Tinker): dividing advantages by the completion tokens makes the loss a
        # per-token mean over the step, so the step size does not grow with batch size.
        num_tokens = sum(len(t.completion) for g in kept for t in g)
        data, flat = [], []
        for group in kept:
            advantages = group_advantages([t.reward for t in group], mode=config.advantages)
            for trajectory, advantage in zip(group, advantages, strict=True):
                data.append(policy_datum(trajectory, advantage=advantage / num_tokens))
                flat.append(trajectory)
        output = training.forward_backward(data, config.loss_fn).result()
        step = training.optim_step(adam).result()
        return (
            metrics
            | mismatch_metrics(flat, output)
            | {
                "optim/grad_norm": step.metrics["grad_norm:mean"],
                "optim/lr": adam.learning_rate,
            }
        )

    def _write_rollouts(self, file, step: int, groups, tokenizer) -> None:
        for group in groups[: self.config.rollouts_per_step]:
            trajectory = group[0]
            record = {
                "step": step,
                "prompt": tokenizer.decode(trajectory.prompt),
                "completion": tokenizer.decode(trajectory.completion),
                "reward": trajectory.reward,
            }
            file.write(json.dumps(record) + "\n")
        file.flush()
