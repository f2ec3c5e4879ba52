"""The numbers an RL step reports: rewards, lengths, entropy, and the sampler-trainer mismatch.

Shapes: N completion tokens of a step.

- `rollout/entropy` is -mean(sampler logprob of the sampled tokens): a one-sample, per-token
  estimate of the policy's entropy (standard; exact entropy needs the full distributions).
- Mismatch compares, on every sampled token, the sampler's logprob (the behaviour policy) with
  the trainer's logprob of the same token computed in forward_backward: max |delta| and the
  k3 KL estimate E[exp(d) - 1 - d] with d = trainer - sampler (nonnegative, unbiased for
  KL(sampler || trainer) under the sampler's distribution). On-policy it measures numerics
  only; with `max_staleness > 0` or `num_substeps > 1` it also measures how far the policy
  moved since sampling, which is what the importance ratio corrects. MoE policies whose
  sampler records routes add how often the trainer's top-k experts differ from the sampler's
  (`mismatch/topk_diff*`, from the trainer's `routing/*` metrics; 0 under routing replay).

On several ranks each rank measures its own share of the step as sums (`StepStats`), and
`StepStats.combine` turns every rank's sums into the metrics of the whole step: a mean over all
trajectories or tokens of all ranks (not a mean of rank means: shares differ in tokens), a
spread from the pooled sums of squares, a maximum over ranks, a rate as everything done over
the slowest rank's seconds. One process is the same computation with one part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from temper.api.types import ForwardBackwardOutput
from temper.models.common.moe_stats import router_metrics
from temper.rl.episodes import END_REASONS
from temper.rl.rollout import Trajectory
from temper.trainer.routing_replay import METRIC_PREFIX as ROUTING_PREFIX


@dataclass
class StepStats:
    """One rank's share of a step's metrics, as sums that add up over ranks."""

    means: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name -> (total, count); the metric is the total over the count."""
    spreads: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """name -> (total, total of squares, count); the metric is the population std."""
    maxima: dict[str, float] = field(default_factory=dict)
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)
    """name -> (amount, seconds); the metric is all amounts over the longest seconds."""
    values: dict[str, float] = field(default_factory=dict)
    """Metrics already equal on every rank (an optimizer's global grad norm), passed through."""

    def mean(self, name: str, total: float, count: float) -> None:
        old_total, old_count = self.means.get(name, (0.0, 0.0))
        self.means[name] = (old_total + float(total), old_count + float(count))

    def spread(self, name: str, values: Sequence[float]) -> None:
        self.spreads[name] = (
            float(sum(values)),
            float(sum(v * v for v in values)),
            float(len(values)),
        )

    def maximum(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    @staticmethod
    def combine(parts: Sequence[StepStats]) -> dict[str, float]:
        """The metrics of every rank's data together (one part per rank). A mean or spread
        with no data on any rank is left out."""
        metrics: dict[str, float] = dict(parts[0].values)
        for name in _names(parts, "means"):
            total = sum(p.means.get(name, (0.0, 0.0))[0] for p in parts)
            count = sum(p.means.get(name, (0.0, 0.0))[1] for p in parts)
            if count > 0:
                metrics[name] = total / count
        for name in _names(parts, "spreads"):
            sums = [sum(p.spreads.get(name, (0.0, 0.0, 0.0))[i] for p in parts) for i in range(3)]
            if sums[2] > 0:
                mean = sums[0] / sums[2]
                metrics[name] = math.sqrt(max(sums[1] / sums[2] - mean * mean, 0.0))
        for name in _names(parts, "maxima"):
            metrics[name] = max(p.maxima[name] for p in parts if name in p.maxima)
        for name in _names(parts, "rates"):
            amount = sum(p.rates[name][0] for p in parts if name in p.rates)
            seconds = max(p.rates[name][1] for p in parts if name in p.rates)
            metrics[name] = amount / seconds
        return metrics


def _names(parts: Sequence[StepStats], kind: str) -> list[str]:
    return list(dict.fromkeys(name for part in parts for name in getattr(part, kind)))


def rollout_stats(stats: StepStats, groups: Sequence[Sequence[Trajectory]]) -> None:
    flat = [t for group in groups for t in group]
    rewards = [t.reward for t in flat]
    stats.mean("reward/mean", sum(rewards), len(flat))
    stats.spread("reward/std", rewards)
    stats.mean("rollout/accuracy", sum(t.metrics.get("correct", 0.0) for t in flat), len(flat))
    stats.mean("rollout/response_length", sum(t.num_action_tokens for t in flat), len(flat))
    stats.mean("rollout/stopped", sum(t.stop_reason == "stop" for t in flat), len(flat))
    sampler_lp = [lp for t in flat for lp in t.action_values(t.sampler_logprobs)]
    stats.mean("rollout/entropy", -sum(sampler_lp), len(sampler_lp))


def mismatch_stats(
    stats: StepStats,
    trained: Sequence[tuple[Sequence[Trajectory], ForwardBackwardOutput]],
) -> None:
    """Over every (trajectories, forward_backward output) pair of this rank's step."""
    deltas = [torch.zeros(0, dtype=torch.float64)]
    for trajectories, output in trained:
        for trajectory, record in zip(trajectories, output.loss_fn_outputs, strict=True):
            trainer_lp = record["logprobs"].to_torch()[len(trajectory.prompt) - 1 :]
            sampler_lp = torch.tensor(trajectory.sampler_logprobs)
            if trajectory.action_mask is not None:  # the policy's tokens only
                sampled_C = torch.tensor(trajectory.action_mask) > 0
                trainer_lp, sampler_lp = trainer_lp[sampled_C], sampler_lp[sampled_C]
            deltas.append((trainer_lp - sampler_lp).double())
    delta_N = torch.cat(deltas)
    stats.mean("mismatch/kl", (delta_N.exp() - 1 - delta_N).sum().item(), delta_N.numel())
    if delta_N.numel():
        stats.maximum("mismatch/logprob_diff_max", delta_N.abs().max().item())


def inflight_stats(stats: StepStats, groups: Sequence[Sequence[Trajectory]]) -> None:
    """In-flight sampling: the share of trajectories whose tokens span several policy
    versions (`inflight/spanned`), and the versions per trajectory (`inflight/versions`).
    Trajectories of other sampling clients carry none."""
    flat = [t for group in groups for t in group if t.weight_versions]
    if not flat:
        return
    spanned = sum(len(t.weight_versions or ()) > 1 for t in flat)
    stats.mean("inflight/spanned", float(spanned), len(flat))
    stats.mean(
        "inflight/versions", float(sum(len(t.weight_versions or ()) for t in flat)), len(flat)
    )


def router_stats(stats: StepStats, outputs: Sequence[ForwardBackwardOutput]) -> None:
    """MoE policies: the trainer's router metrics (`moe/*`, models/common/moe_stats.py), each
    the mean over the step's substeps; with the sampler's routes recorded, how often the
    trainer's top-k differed from the sampler's (the trainer's `routing/*`, as
    `mismatch/topk_diff*`: trainer/routing_replay.py). The trainer reports them over every
    rank's data already, so they pass through as values; a dense policy has none."""
    per_output = [
        router_metrics(output.metrics) | _routing_metrics(output.metrics) for output in outputs
    ]
    for name in per_output[0] if per_output else ():
        stats.values[name] = sum(metrics[name] for metrics in per_output) / len(per_output)


def _routing_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """`routing/topk_diff:mean` -> `mismatch/topk_diff`, and the rest of the trainer's
    routing agreement metrics likewise."""
    return {
        "mismatch/" + name.removeprefix(ROUTING_PREFIX).partition(":")[0]: float(value)
        for name, value in metrics.items()
        if name.startswith(ROUTING_PREFIX)
    }


def episode_stats(stats: StepStats, groups: Sequence[Sequence[Trajectory]]) -> None:
    """Multi-turn episodes: turns, tool calls and failures, env seconds per episode, and the
    share of episodes that ended for each reason (`episode/end/<reason>`). Single-turn
    rollouts (whose trajectories count no turns, episodes.py) have none of these."""
    flat = [t for group in groups for t in group if "turns" in t.metrics]
    if not flat:
        return
    for name in ("turns", "tool_calls", "tool_failures", "env_seconds"):
        stats.mean(f"episode/{name}", sum(t.metrics.get(name, 0.0) for t in flat), len(flat))
    reasons = dict.fromkeys(END_REASONS)
    reasons.update(dict.fromkeys(k for t in flat for k in t.metrics if k.startswith("end/")))
    for reason in reasons:
        key = reason if reason.startswith("end/") else f"end/{reason}"
        stats.mean(f"episode/{key}", sum(t.metrics.get(key, 0.0) for t in flat), len(flat))
