"""Supervised fine-tuning on a task's problems, with held-out greedy accuracy.

This is the smallest real end-to-end job on the foundation: build (or load) a model, train it
with next-token cross-entropy on the answers, evaluate exact-match accuracy on held-out
problems, log metrics, plot them, and export the result as a HF model directory. The RL loop
uses it as its warm-up stage.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from temper.api import SamplingParams
from temper.checkpoint.hf import save_pretrained
from temper.config.configurable import Configurable
from temper.models.base_model import BaseModel
from temper.models.common.logprobs import forward_logprobs
from temper.observability import MetricsLogger, PhaseTimer, plot_metrics
from temper.rl.evaluation import heldout_problems
from temper.rl.tasks import Problem, SumDigits, TaskConfig
from temper.sampler import SamplerEngine, SampleRequest
from temper.sft.batches import TokenBatch, completion_batch
from temper.trainer.schedule import warmup_cosine


@dataclass(frozen=True)
class SFTResult:
    steps: int
    heldout_accuracy: float
    best_heldout_accuracy: float
    model_dir: Path | None


class SFTJob(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        model: BaseModel.Config = field(default_factory=BaseModel.Config)
        """The model to train."""
        task: TaskConfig = field(default_factory=SumDigits.Config)
        """The task whose problems are trained on and evaluated."""
        steps: int = 400
        """Optimizer steps."""
        batch_size: int = 64
        """Problems per step."""
        learning_rate: float = 2e-3
        """Peak AdamW learning rate."""
        warmup_steps: int = 20
        """Steps of linear learning-rate warm-up; then cosine decay to 10% of the peak."""
        weight_decay: float = 0.0
        """AdamW weight decay."""
        grad_clip_norm: float = 1.0
        """Clip the global gradient norm to this (0 disables clipping)."""
        eval_every: int = 50
        """Steps between held-out evaluations (and one at the end)."""
        eval_problems: int = 256
        """Held-out problems per evaluation (a fixed set)."""
        max_new_tokens: int = 4
        """Most tokens generated per answer during evaluation."""
        sampler: SamplerEngine.Config = field(
            default_factory=lambda: SamplerEngine.Config(
                max_batch=256, max_seq_len=64, num_threads=1
            )
        )
        """The engine that decodes evaluation answers (greedy)."""
        seed: int = 0
        """Seed of the problem stream."""
        export: Literal["hf", "none"] = "hf"
        """'hf' writes the trained model (and tokenizer) to RUN_DIR/model."""
        metrics: MetricsLogger.Config = field(
            default_factory=lambda: MetricsLogger.Config(
                progress_keys=("train/loss", "eval/accuracy"), table_every=100
            )
        )
        """Console, metrics.jsonl and TensorBoard logging."""

        def __post_init__(self) -> None:
            for name in ("steps", "batch_size", "eval_every", "eval_problems", "max_new_tokens"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"SFTJob.Config.{name} must be > 0, got {getattr(self, name)}")
            if self.learning_rate <= 0:
                raise ValueError(
                    f"SFTJob.Config.learning_rate must be > 0, got {self.learning_rate}"
                )

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: Path) -> SFTResult:
        config = self.config
        run_dir = Path(run_dir)
        base = config.model.build()
        model, tokenizer = base.model, base.tokenizer
        task = config.task.build()
        # The engine reads the training module itself, so it always sees the current weights.
        engine = config.sampler.build(model=model, tokenizer=tokenizer)
        rng = random.Random(config.seed)
        heldout = heldout_problems(task, count=config.eval_problems)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.95),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        accuracies: list[float] = []
        timer = PhaseTimer()
        with MetricsLogger(
            config.metrics,
            run_dir=run_dir,
            total_steps=config.steps,
            description=f"SFT {type(task).__name__}",
        ) as logger:
            for step in range(config.steps):
                with timer.phase("train"):
                    problems = [task.sample(rng, split="train") for _ in range(config.batch_size)]
                    batch = self._batch(problems, tokenizer).to(base.device)
                    metrics = self._train_step(model, optimizer, batch)
                    schedule.step()
                last = step == config.steps - 1
                if (step + 1) % config.eval_every == 0 or last:
                    with timer.phase("eval"):
                        accuracy = self._evaluate(engine, tokenizer, task, heldout)
                    accuracies.append(accuracy)
                    metrics["eval/accuracy"] = accuracy
                phases = timer.collect()
                metrics["train/tokens_per_s"] = batch.inputs_BT.numel() / phases["time/train"]
                logger.log(step, {**metrics, **phases})
            self._show_examples(logger, engine, tokenizer, task, heldout[:4])
            model_dir = None
            if config.export == "hf":
                model_dir = save_pretrained(model, run_dir / "model", tokenizer=tokenizer)
            plots = plot_metrics(run_dir)
            logger.summary(
                {
                    "held-out accuracy": {"final": accuracies[-1], "best": max(accuracies)},
                    "train/loss": {"final": logger.latest["train/loss"]},
                },
                title=f"SFT done: {config.steps} steps, plots in {plots[0].parent}",
            )
        return SFTResult(
            steps=config.steps,
            heldout_accuracy=accuracies[-1],
            best_heldout_accuracy=max(accuracies),
            model_dir=model_dir,
        )

    def _lr_factor(self, step: int) -> float:
        config = self.config
        return warmup_cosine(step, warmup_steps=config.warmup_steps, total_steps=config.steps)

    @staticmethod
    def _batch(problems: list[Problem], tokenizer) -> TokenBatch:
        examples = [
            (tokenizer.encode(p.prompt), [*tokenizer.encode(p.answer), tokenizer.eos_token_id])
            for p in problems
        ]
        return completion_batch(examples, pad_token_id=tokenizer.pad_token_id or 0)

    def _train_step(self, model, optimizer, batch: TokenBatch) -> dict[str, float]:
        model.train()
        logprobs_BT = forward_logprobs(model, batch.inputs_BT, batch.targets_BT)
        loss = -(logprobs_BT * batch.weights_BT).sum() / batch.num_loss_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        max_norm = self.config.grad_clip_norm if self.config.grad_clip_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return {
            "train/loss": loss.item(),
            "optim/grad_norm": grad_norm.item(),
            "optim/lr": optimizer.param_groups[0]["lr"],
        }

    def _complete(self, engine: SamplerEngine, tokenizer, problems: list[Problem]) -> list[str]:
        engine.model.eval()
        params = SamplingParams(max_tokens=self.config.max_new_tokens, temperature=0.0)
        responses = engine.generate(
            [SampleRequest(prompt=tokenizer.encode(p.prompt), params=params) for p in problems]
        )
        return [
            tokenizer.decode(response.sequences[0].tokens, skip_special_tokens=True)
            for response in responses
        ]

    def _evaluate(self, engine, tokenizer, task, problems: list[Problem]) -> float:
        completions = self._complete(engine, tokenizer, problems)
        return sum(task.reward(p, c) for p, c in zip(problems, completions, strict=True)) / len(
            problems
        )

    def _show_examples(self, logger, engine, tokenizer, task, problems: list[Problem]) -> None:
        completions = self._complete(engine, tokenizer, problems)
        for problem, completion in zip(problems, completions, strict=True):
            mark = "ok" if task.reward(problem, completion) == 1.0 else "wrong"
            logger.console.print(f"  {problem.prompt}{completion}  ({mark})")
