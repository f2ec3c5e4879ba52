"""The parts of one RL step that the synchronous and asynchronous loops share.

`submit` takes a sampling client on the current weights, draws the step's problems and seeds
from the run's RNG and sends the sample requests; `finish` waits for them, scores, applies the
optional KL penalty, trains (`forward_backward` + `optim_step`, once per substep), evaluates
and logs. The synchronous loop (loops.py) calls submit(k) then finish(k); the asynchronous
one submits up to `max_staleness` steps ahead, so sampling for later steps runs while this one
trains. Both call the RNG in the same order (submission order is step order), so they draw the
same problems.

On several ranks (SPMD) every rank draws the whole step's problems and seeds from its own copy
of the run's RNG (so the copies stay equal) and samples only its share of the groups, with its
own sampler. Training divides advantages by the step's completion tokens over all ranks, so
the summed gradient is the one a single process computes on the union of the groups. Metrics
are each rank's sums, combined over ranks (step_metrics.py); rank 0 writes the rollouts.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from temper.api.types import AdamParams, SamplingParams
from temper.client.sampling_client import SamplingClient
from temper.client.training_client import TrainingClient
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger, PhaseTimer
from temper.rl.advantages import group_advantages, is_uniform
from temper.rl.config import RLJobConfig
from temper.rl.env import EnvSource, make_groups
from temper.rl.episodes import EpisodeRunner, RunningEpisodes
from temper.rl.kl import kl_penalty, submit_reference_logprobs
from temper.rl.rollout import (
    PendingRollouts,
    Trajectory,
    policy_datum,
    score_rollouts,
    submit_rollouts,
)
from temper.rl.step_metrics import StepStats, episode_stats, mismatch_stats, rollout_stats
from temper.tasks.problem import Task
from temper.tokenizer import Tokenizer
from temper.trainer.schedule import warmup_cosine


@dataclass(frozen=True)
class SubmittedStep:
    rl_step: int
    """The RL step that will train on this batch."""
    steps_done: int
    """RL steps trained when it was submitted; rl_step - steps_done is its staleness."""
    rollouts: PendingRollouts | RunningEpisodes


class RLSteps:
    """Step functions over one training client."""

    def __init__(
        self,
        config: RLJobConfig,
        *,
        training: TrainingClient,
        task: Task,
        tokenizer: Tokenizer,
        rng: random.Random,
        reference: SamplingClient | None,
        logger: MetricsLogger,
        rollouts_file: IO[str] | None,
        evaluate: Callable[[], float],
        ranks: Ranks,
        env_source: EnvSource | None = None,
        episodes: EpisodeRunner | None = None,
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
        self.ranks = ranks
        self.env_source, self.episodes = env_source, episodes
        """Multi-turn: where episodes come from and what runs them (None: single-turn)."""
        self.share = ranks.share(config.prompts_per_step, field="RLJob.Config.prompts_per_step")
        """This rank's groups of each step (all of them in one process)."""
        self.timer = PhaseTimer()
        self.params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            stop=[tokenizer.eos_token_id],
        )
        self._started = time.perf_counter()

    def submit(self, rl_step: int, *, steps_done: int) -> SubmittedStep:
        config = self.config
        with self.timer.phase("sync"):
            sampler = self.training.save_weights_and_get_sampling_client()
        if self.env_source is not None:
            return SubmittedStep(
                rl_step=rl_step, steps_done=steps_done, rollouts=self._start_episodes(sampler)
            )
        groups = make_groups(
            self.task,
            tokenizer=self.tokenizer,
            rng=self.rng,
            num_groups=config.prompts_per_step,
            group_size=config.group_size,
            split="train",
        )
        # Every rank draws every group's seed, in order (as submit_rollouts(rng=) would), so
        # the RNG copies stay equal and a group gets the same seed on any number of ranks.
        seeds = [self.rng.getrandbits(63) for _ in groups]
        with self.timer.phase("sample"):
            rollouts = submit_rollouts(
                sampler, groups[self.share], params=self.params, seeds=seeds[self.share]
            )
        # `sampler` goes out of scope here: only the requests in flight keep its version alive,
        # so the trainer copies weights only if they are still running when it steps.
        return SubmittedStep(rl_step=rl_step, steps_done=steps_done, rollouts=rollouts)

    def _start_episodes(self, sampler: SamplingClient) -> RunningEpisodes:
        """Every group's episodes, started on `sampler`; each rank runs its share."""
        assert self.env_source is not None and self.episodes is not None
        config = self.config
        groups = [
            self.env_source.make_group(self.rng, split="train", group_size=config.group_size)
            for _ in range(config.prompts_per_step)
        ]
        # One seed per group from the run's RNG (as single-turn), then one per episode from it.
        group_seeds = [self.rng.getrandbits(63) for _ in groups]
        seeds = [
            seed
            for group_seed in group_seeds[self.share]
            for seed in _member_seeds(group_seed, config.group_size)
        ]
        with self.timer.phase("sample"):
            return self.episodes.start(sampler, groups[self.share], params=self.params, seeds=seeds)

    def finish(self, submitted: SubmittedStep) -> dict[str, float]:
        """Train on a submitted batch and log the step; returns its metrics (all ranks')."""
        config, timer = self.config, self.timer
        rollouts = submitted.rollouts
        if isinstance(rollouts, RunningEpisodes):
            with timer.phase("sample"):  # sampling and env steps, interleaved
                groups = rollouts.wait()
        else:
            with timer.phase("sample"):
                responses = rollouts.wait()
            with timer.phase("score"):
                groups = score_rollouts(rollouts.groups, responses)
        stats = StepStats()
        rollout_stats(stats, groups)
        if isinstance(rollouts, RunningEpisodes):
            episode_stats(stats, groups)
        stats.values["async/staleness"] = float(submitted.rl_step - submitted.steps_done)
        with timer.phase("train"):
            self._train_on(groups, stats, adam=self._adam(submitted.rl_step))
        rl_step = submitted.rl_step
        if (rl_step + 1) % config.eval_every == 0 or rl_step == config.steps - 1:
            with timer.phase("eval"):
                stats.values["eval/accuracy"] = self.evaluate()
        now = time.perf_counter()
        num_tokens = sum(t.num_action_tokens for g in groups for t in g)
        stats.rates["throughput/tokens_per_s"] = (num_tokens, now - self._started)
        self._started = now
        for name, seconds in timer.collect().items():
            stats.maximum(name, seconds)  # the slowest rank's time
        metrics = StepStats.combine(self.ranks.all_gather(stats))
        step = config.warmup.steps + rl_step
        self.logger.log(step, metrics)
        self._write_rollouts(step, groups)
        return metrics

    def _adam(self, rl_step: int) -> AdamParams:
        """The optimizer settings of RL step `rl_step`, its learning rate per `lr_schedule`."""
        config = self.config
        factor = 1.0
        if config.lr_schedule == "cosine":
            factor = warmup_cosine(rl_step, warmup_steps=0, total_steps=config.steps)
        return AdamParams(
            learning_rate=config.learning_rate * factor, beta2=0.95, grad_clip_norm=1.0
        )

    def _train_on(
        self, groups: list[list[Trajectory]], stats: StepStats, *, adam: AdamParams
    ) -> None:
        config = self.config
        stats.values["optim/lr"] = adam.learning_rate  # logged even when no group trains
        keep = [
            not (config.drop_uniform_groups and is_uniform([t.reward for t in g])) for g in groups
        ]
        stats.mean("rollout/groups_kept", sum(keep), len(groups))
        kept = [g for g, keep_g in zip(groups, keep, strict=True) if keep_g]
        flat = [t for g in kept for t in g]
        advantages = [
            a for g in kept for a in group_advantages([t.reward for t in g], mode=config.advantages)
        ]
        # Substeps split the step's groups in order (kept or not, so the split does not depend
        # on rewards) into equal minibatches, one optimizer step each; a group's place is its
        # index in the whole step, whichever rank holds it.
        groups_per_substep = config.prompts_per_step // config.num_substeps
        substep_of = [
            (self.share.start + index) // groups_per_substep
            for index, group in enumerate(groups)
            if keep[index]
            for _ in group
        ]
        # Sum losses (Tinker): dividing advantages by the minibatch's completion tokens (on
        # every rank) makes the loss a per-token mean, so the step size does not grow with
        # batch size.
        num_tokens = self.ranks.sum(
            [
                sum(flat[i].num_action_tokens for i, s in enumerate(substep_of) if s == substep)
                for substep in range(config.num_substeps)
            ]
        )
        if sum(num_tokens) == 0:
            return  # no group kept on any rank
        penalties = [[0.0] * len(t.completion) for t in flat]
        if config.kl_coef > 0:
            with self.timer.phase("reference"):
                references = submit_reference_logprobs(self.reference, flat).result()
                kl = kl_penalty(
                    flat,
                    references,
                    coef=config.kl_coef,
                    estimator=config.kl_estimator,
                    ranks=self.ranks,
                )
            penalties = kl.penalties
            stats.values |= kl.metrics
        trained, grad_norms = [], []
        for substep in range(config.num_substeps):
            if num_tokens[substep] == 0:
                continue
            # A rank may hold none of this minibatch's groups: it still takes part.
            indices = [i for i, s in enumerate(substep_of) if s == substep]
            data = [
                policy_datum(
                    flat[i],
                    advantage=[(advantages[i] - p) / num_tokens[substep] for p in penalties[i]],
                )
                for i in indices
            ]
            output = self.training.forward_backward(data, config.loss_fn).result()
            step = self.training.optim_step(adam).result()
            trained.append(([flat[i] for i in indices], output))
            grad_norms.append(step.metrics["grad_norm:mean"])
        mismatch_stats(stats, trained)
        stats.values["optim/grad_norm"] = sum(grad_norms) / len(grad_norms)

    def _write_rollouts(self, step: int, groups: list[list[Trajectory]]) -> None:
        """A few of this rank's groups (rank 0's, on several ranks; the others pass None)."""
        if self.rollouts_file is None:
            return
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


def _member_seeds(group_seed: int, group_size: int) -> list[int]:
    rng = random.Random(group_seed)
    return [rng.getrandbits(63) for _ in range(group_size)]
