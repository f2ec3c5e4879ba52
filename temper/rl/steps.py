"""The RL steps and their settings (`RLSteps.Config`: batch, sampling, loss, advantages, KL):
the parts of one RL step that the synchronous and asynchronous loops share.

`submit` takes a sampling client on the current weights, draws the step's groups and seeds
from the run's RNG and starts their episodes (episodes.py: single-turn problems and multi-turn
environments alike); `finish` waits for the trajectories, applies the optional KL penalty,
trains (`forward_backward` + `optim_step`, once per substep), evaluates and logs. The
synchronous loop (loops.py) calls submit(k) then finish(k); the asynchronous one submits up to
`max_staleness` steps ahead, so sampling for later steps runs while this one trains. Both call
the RNG in the same order (submission order is step order), so they draw the same problems.

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
from typing import IO, Literal

from temper.api.types import AdamParams, RoutingReplay, SamplingParams
from temper.client.sampling_client import SamplingClient
from temper.client.training_client import TrainingClient
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger, PhaseTimer
from temper.rl.advantages import AdvantageMode, group_advantages, is_uniform
from temper.rl.env import EnvSource
from temper.rl.episodes import EpisodeRunner, RunningEpisodes
from temper.rl.kl import KLEstimator, kl_penalty, submit_reference_logprobs
from temper.rl.rollout import Trajectory, policy_datum
from temper.rl.step_metrics import (
    StepStats,
    episode_stats,
    inflight_stats,
    mismatch_stats,
    rollout_stats,
    router_stats,
)
from temper.tokenizer import Tokenizer
from temper.trainer.routing_replay import ROUTING_REPLAY_CHOICES
from temper.trainer.schedule import warmup_cosine

SamplerKind = Literal["snapshot", "inflight"]
"""Which sampling client a step's episodes use (Tinker's `SamplingClientKind`)."""


@dataclass(frozen=True)
class SubmittedStep:
    rl_step: int
    """The RL step that will train on this batch."""
    steps_done: int
    """RL steps trained when it was submitted; rl_step - steps_done is its staleness."""
    rollouts: RunningEpisodes


_LEAST = {"steps": 0, "prompts_per_step": 1, "num_substeps": 1, "max_tokens": 1, "eval_every": 1}
"""The smallest valid value of each integer count of `RLSteps.Config`."""


class RLSteps(Configurable):
    """Step functions over one training client."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        steps: int = 60
        """RL steps."""
        prompts_per_step: int = 16
        """Problems (groups) per RL step."""
        group_size: int = 8
        """Completions (episodes) per problem, compared with each other (GRPO groups)."""
        num_substeps: int = 1
        """Optimizer steps per RL step: the step's problems split into this many equal
        minibatches (prompts_per_step must be divisible by it)."""
        max_tokens: int = 4
        """Most tokens per completion (per action, in a multi-turn episode)."""
        temperature: float = 1.0
        """Sampling temperature of rollouts."""
        top_p: float = 1.0
        """Nucleus (top-p) truncation of rollouts; 1 keeps every token."""
        top_k: int = -1
        """Top-k truncation of rollouts; -1 keeps every token (the vllm backend needs a
        top_k to return the support: the vocabulary size keeps top-p alone in force)."""
        sampling_support: Literal["full", "sampler"] = "full"
        """'sampler': the sampler returns each token's top-k/top-p support and the loss
        renormalises the trainer's distribution over it at the sampling temperature, so the
        importance ratio compares like with like (losses/support.py, docs/rl.md); 'full':
        the trainer's logprob is over the whole vocabulary at temperature 1."""
        loss_fn: Literal["ppo", "importance_sampling", "stable_reinforce"] = "ppo"
        """Policy loss; the sampler's logprobs give the importance ratios (stable_reinforce:
        truncated-importance-weighted REINFORCE, docs/server.md)."""
        learning_rate: float = 2e-4
        """AdamW learning rate of RL steps (the peak, under a schedule)."""
        lr_schedule: Literal["constant", "cosine"] = "constant"
        """constant, or cosine decay from `learning_rate` to a tenth of it at the last RL
        step."""
        advantages: AdvantageMode = "grpo"
        """grpo (std-normalized), dr_grpo (mean baseline only) or rloo."""
        drop_uniform_groups: bool = True
        """Skip groups whose rewards are all equal (no signal)."""
        kl_coef: float = 0.0
        """Weight of the KL penalty to the policy at the start of RL (0 = off)."""
        kl_estimator: KLEstimator = "k3"
        """Per-token KL estimator of the penalty: k1 (log-ratio) or k3 (nonnegative)."""
        eval_every: int = 20
        """RL steps between held-out evaluations (plus one at the last RL step)."""
        rollouts_per_step: int = 4
        """Decoded completions written to rollouts.jsonl per RL step."""
        routing_replay: RoutingReplay = "off"
        """MoE policies: 'sampler' records the experts the sampler routed every token to and
        computes the trainer's forward through the same ones (routing replay), so tiny
        numeric differences between sampler and trainer cannot flip a token's experts;
        'off': the trainer routes by its own router. Either way, when the sampler records
        routes (`--sampler.record_routes`), the step reports how often the trainer's top-k
        differs from the sampler's (`mismatch/topk_diff*`)."""

        def __post_init__(self) -> None:
            _check_config(self)

    def __init__(
        self,
        config: Config,
        *,
        training: TrainingClient,
        source: EnvSource,
        episodes: EpisodeRunner,
        tokenizer: Tokenizer,
        rng: random.Random,
        reference: SamplingClient | None,
        logger: MetricsLogger,
        rollouts_file: IO[str] | None,
        evaluate: Callable[[], float],
        ranks: Ranks,
        first_step: int = 0,
    ) -> None:
        """`source` makes the groups and `episodes` rolls them out; `first_step` is the run's
        step number of RL step 0 (the steps before it are the warm-up's)."""
        self.config = config
        self.training = training
        self.source, self.episodes = source, episodes
        self.tokenizer = tokenizer
        self.rng = rng
        self.reference = reference
        self.logger = logger
        self.rollouts_file = rollouts_file
        self.evaluate = evaluate
        self.ranks = ranks
        self.first_step = first_step
        self.share = ranks.share(config.prompts_per_step, field="RLJob.Config.rl.prompts_per_step")
        """This rank's groups of each step (all of them in one process)."""
        self.timer = PhaseTimer()
        self.params = SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            return_support=config.sampling_support == "sampler",
        )
        """Each request's stop tokens are its env's."""
        self._started = time.perf_counter()

    def submit(
        self, rl_step: int, *, steps_done: int, kind: SamplerKind = "snapshot"
    ) -> SubmittedStep:
        """Every group's episodes, started on the current weights; each rank runs its share.
        `kind` 'inflight': on the training client's in-flight target, which this save also
        moves on for the episodes of earlier steps still decoding (client/inflight.py)."""
        config = self.config
        with self.timer.phase("sync"):
            sampler = self.training.save_weights_and_get_sampling_client(kind=kind)
        groups = [
            self.source.make_group(self.rng, split="train", group_size=config.group_size)
            for _ in range(config.prompts_per_step)
        ]
        # Every rank draws every group's seed, in order, so the RNG copies stay equal and a
        # group gets the same seed on any number of ranks.
        seeds = [self.rng.getrandbits(63) for _ in groups]
        with self.timer.phase("sample"):
            rollouts = self.episodes.start(
                sampler,
                groups[self.share],
                params=self.params,
                seeds=seeds[self.share],
                turns=self.source.turns,
            )
        # `sampler` goes out of scope here: only the episodes in flight keep its version alive,
        # so the trainer copies weights only if they are still running when it steps.
        return SubmittedStep(rl_step=rl_step, steps_done=steps_done, rollouts=rollouts)

    def finish(self, submitted: SubmittedStep) -> dict[str, float]:
        """Train on a submitted batch and log the step; returns its metrics (all ranks')."""
        config, timer = self.config, self.timer
        with timer.phase("sample"):  # sampling and env steps (scoring), interleaved
            groups = submitted.rollouts.wait()
        stats = StepStats()
        rollout_stats(stats, groups)
        episode_stats(stats, groups)
        inflight_stats(stats, groups)
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
        step = self.first_step + rl_step
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
                    sampler_temperature=config.temperature,
                )
                for i in indices
            ]
            output = self.training.forward_backward(
                data, config.loss_fn, routing_replay=config.routing_replay
            ).result()
            step = self.training.optim_step(adam).result()
            trained.append(([flat[i] for i in indices], output))
            grad_norms.append(step.metrics["grad_norm:mean"])
        mismatch_stats(stats, trained)
        router_stats(stats, [output for _, output in trained])
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


def _check_config(config: RLSteps.Config) -> None:
    """Bad settings fail when the config is made, before any model is built."""
    name = "RLSteps.Config"
    check_range(
        config.group_size,
        field=f"{name}.group_size",
        at_least=2,
        hint="GRPO compares members of a group",
    )
    for field_name, least in _LEAST.items():
        check_range(getattr(config, field_name), field=f"{name}.{field_name}", at_least=least)
    # 0 is allowed (a run that only samples)
    check_range(config.learning_rate, field=f"{name}.learning_rate", at_least=0)
    if config.prompts_per_step % config.num_substeps:
        raise ValueError(
            f"{name}.prompts_per_step ({config.prompts_per_step}) must be divisible by "
            f"num_substeps ({config.num_substeps}): each substep trains on an equal share"
        )
    check_range(config.kl_coef, field=f"{name}.kl_coef", at_least=0, hint="0 turns the penalty off")
    check_choice(config.lr_schedule, field=f"{name}.lr_schedule", choices=("constant", "cosine"))
    check_choice(config.kl_estimator, field=f"{name}.kl_estimator", choices=("k1", "k3"))
    check_choice(
        config.routing_replay, field=f"{name}.routing_replay", choices=ROUTING_REPLAY_CHOICES
    )
    check_choice(
        config.sampling_support, field=f"{name}.sampling_support", choices=("full", "sampler")
    )
    check_range(config.top_p, field=f"{name}.top_p", greater_than=0, at_most=1)
    if config.top_k < 1 and config.top_k != -1:
        raise ValueError(f"{name}.top_k must be >= 1, or -1 for no limit, got {config.top_k}")
    if config.sampling_support == "sampler" and config.temperature == 0:
        raise ValueError(
            f"{name}.sampling_support='sampler' needs temperature > 0 (a greedy token has no "
            "support to renormalise over)"
        )


def check_support_backend(config: RLSteps.Config, *, backend: str, name: str) -> None:
    """vLLM returns a token's support only under a top-k (its sampling mask, or the finite
    processed logprobs, exist only then): refused before the job starts, not at its first
    RL step."""
    if config.sampling_support == "sampler" and backend == "vllm" and config.top_k == -1:
        raise ValueError(
            f"{name}.sampling_support='sampler' with the vllm backend needs {name}.top_k >= 1 "
            f"(--rl.top_k; the vocabulary's size keeps every token, leaving top_p alone in force)"
        )
