"""The parts of one RL step that the synchronous and asynchronous loops share.

`submit` takes a sampling client on the current weights, draws the step's problems and seeds
from the run's RNG and sends the sample requests; `finish` waits for them, scores, applies the
optional KL penalty, trains (`forward_backward` + `optim_step`, once per substep), evaluates
and logs. loop_sync.py calls submit(k) then finish(k); loop_async.py submits up to
`max_staleness` steps ahead, so sampling for later steps runs while this one trains. Both call
the RNG in the same order (submission order is step order), so they draw the same problems.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from temper.api.types import AdamParams, SamplingParams
from temper.observability import MetricsLogger, PhaseTimer
from temper.rl.advantages import group_advantages, is_uniform
from temper.rl.env import Task, make_groups
from temper.rl.kl import kl_penalty, submit_reference_logprobs
from temper.rl.rollout import (
    PendingRollouts,
    Trajectory,
    policy_datum,
    score_rollouts,
    submit_rollouts,
)
from temper.rl.step_metrics import mismatch_metrics, rollout_metrics


@dataclass(frozen=True)
class SubmittedStep:
    rl_step: int
    """The RL step that will train on this batch."""
    steps_done: int
    """RL steps trained when it was submitted; rl_step - steps_done is its staleness."""
    rollouts: PendingRollouts


class RLSteps:
    """Step functions over one training client; `config` is an `RLJob.Config`."""

    def __init__(
        self,
        config: Any,
        *,
        training,
        task: Task,
        tokenizer: Any,
        rng: random.Random,
        reference,
        logger: MetricsLogger,
        rollouts_file: IO[str],
        evaluate: Callable[[], float],
    ) -> None:
        self.config = config
        self.training = training
        self.task = task
        self.tokenizer = tokenizer
        self.rng = rng
        self.reference = reference
        self.logger = logger
        self.rollouts_file = rollouts_file
        self.evaluate = evaluate
        self.timer = PhaseTimer()
        self.params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            stop=[tokenizer.eos_token_id],
        )
        self.adam = AdamParams(learning_rate=config.learning_rate, beta2=0.95, grad_clip_norm=1.0)
        self._started = time.perf_counter()

    def submit(self, rl_step: int, *, steps_done: int) -> SubmittedStep:
        config = self.config
        with self.timer.phase("sync"):
            sampler = self.training.save_weights_and_get_sampling_client()
        groups = make_groups(
            self.task,
            tokenizer=self.tokenizer,
            rng=self.rng,
            num_groups=config.prompts_per_step,
            group_size=config.group_size,
            split="train",
        )
        with self.timer.phase("sample"):
            rollouts = submit_rollouts(sampler, groups, params=self.params, rng=self.rng)
        # `sampler` goes out of scope here: only the requests in flight keep its version alive,
        # so the trainer copies weights only if they are still running when it steps.
        return SubmittedStep(rl_step=rl_step, steps_done=steps_done, rollouts=rollouts)

    def finish(self, submitted: SubmittedStep) -> dict[str, float]:
        """Train on a submitted batch and log the step; returns its metrics."""
        config, timer = self.config, self.timer
        with timer.phase("sample"):
            responses = submitted.rollouts.wait()
        with timer.phase("score"):
            groups = score_rollouts(submitted.rollouts.groups, responses)
        metrics = rollout_metrics(groups)
        metrics["async/staleness"] = float(submitted.rl_step - submitted.steps_done)
        with timer.phase("train"):
            metrics |= self._train_on(groups)
        rl_step = submitted.rl_step
        if (rl_step + 1) % config.eval_every == 0 or rl_step == config.steps - 1:
            with timer.phase("eval"):
                metrics["eval/accuracy"] = self.evaluate()
        now = time.perf_counter()
        num_tokens = sum(len(t.completion) for g in groups for t in g)
        metrics["throughput/tokens_per_s"] = num_tokens / (now - self._started)
        self._started = now
        step = config.warmup.steps + rl_step
        self.logger.log(step, metrics | timer.collect())
        self._write_rollouts(step, groups)
        return metrics

    def _train_on(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        config = self.config
        keep = [
            not (config.drop_uniform_groups and is_uniform([t.reward for t in g])) for g in groups
        ]
        metrics = {"rollout/groups_kept": sum(keep) / len(groups)}
        kept = [g for g, keep_g in zip(groups, keep, strict=True) if keep_g]
        if not kept:
            return metrics
        flat = [t for g in kept for t in g]
        advantages = [
            a for g in kept for a in group_advantages([t.reward for t in g], mode=config.advantages)
        ]
        penalties = [[0.0] * len(t.completion) for t in flat]
        if config.kl_coef > 0:
            with self.timer.phase("reference"):
                futures = submit_reference_logprobs(self.reference, flat)
                kl = kl_penalty(flat, futures, coef=config.kl_coef, estimator=config.kl_estimator)
            penalties, metrics = kl.penalties, metrics | kl.metrics
        # Substeps split the step's groups in order (kept or not, so the split does not depend
        # on rewards) into equal minibatches, one optimizer step each.
        groups_per_substep = len(groups) // config.num_substeps
        substep_of = [
            index // groups_per_substep
            for index, group in enumerate(groups)
            if keep[index]
            for _ in group
        ]
        trained, grad_norms = [], []
        for substep in range(config.num_substeps):
            indices = [i for i, s in enumerate(substep_of) if s == substep]
            if not indices:
                continue
            # Sum losses (Tinker): dividing advantages by the completion tokens makes the loss a
            # per-token mean over the minibatch, so the step size does not grow with batch size.
            num_tokens = sum(len(flat[i].completion) for i in indices)
            data = [
                policy_datum(
                    flat[i], advantage=[(advantages[i] - p) / num_tokens for p in penalties[i]]
                )
                for i in indices
            ]
            output = self.training.forward_backward(data, config.loss_fn).result()
            step = self.training.optim_step(self.adam).result()
            trained.append(([flat[i] for i in indices], output))
            grad_norms.append(step.metrics["grad_norm:mean"])
        return (
            metrics
            | mismatch_metrics(trained)
            | {
                "optim/grad_norm": sum(grad_norms) / len(grad_norms),
                "optim/lr": self.adam.learning_rate,
            }
        )

    def _write_rollouts(self, step: int, groups: list[list[Trajectory]]) -> None:
        for group in groups[: self.config.rollouts_per_step]:
            trajectory = group[0]
            record = {
                "step": step,
                "prompt": self.tokenizer.decode(trajectory.prompt),
                "completion": self.tokenizer.decode(trajectory.completion),
                "reward": trajectory.reward,
            }
            self.rollouts_file.write(json.dumps(record) + "\n")
        self.rollouts_file.flush()
