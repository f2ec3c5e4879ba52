"""The numbers an RL step reports: rewards, lengths, entropy, and the sampler-trainer mismatch.

Shapes: N completion tokens of a step.

- `rollout/entropy` is -mean(sampler logprob of the sampled tokens): a one-sample, per-token
  estimate of the policy's entropy (standard; exact entropy needs the full distributions).
- Mismatch compares, on every sampled token, the sampler's logprob (the behaviour policy) with
  the trainer's logprob of the same token computed in forward_backward: max |delta| and the
  k3 KL estimate E[exp(d) - 1 - d] with d = trainer - sampler (nonnegative, unbiased for
  KL(sampler || trainer) under the sampler's distribution). On-policy it measures numerics
  only; with `max_staleness > 0` or `num_substeps > 1` it also measures how far the policy
  moved since sampling, which is what the importance ratio corrects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from temper.api.types import ForwardBackwardOutput
from temper.rl.rollout import Trajectory


def rollout_metrics(groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
    flat = [t for group in groups for t in group]
    rewards = torch.tensor([t.reward for t in flat])
    lengths = torch.tensor([float(len(t.completion)) for t in flat])
    sampler_lp = torch.tensor([lp for t in flat for lp in t.sampler_logprobs])
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std(correction=0).item(),
        "rollout/accuracy": sum(t.metrics.get("correct", 0.0) for t in flat) / len(flat),
        "rollout/response_length": lengths.mean().item(),
        "rollout/stopped": sum(t.stop_reason == "stop" for t in flat) / len(flat),
        "rollout/entropy": -sampler_lp.mean().item(),
    }


def mismatch_metrics(
    trained: Sequence[tuple[Sequence[Trajectory], ForwardBackwardOutput]],
) -> dict[str, float]:
    """Over every (trajectories, forward_backward output) pair of a step."""
    deltas = []
    for trajectories, output in trained:
        for trajectory, record in zip(trajectories, output.loss_fn_outputs, strict=True):
            trainer_lp = record["logprobs"].to_torch()[len(trajectory.prompt) - 1 :]
            sampler_lp = torch.tensor(trajectory.sampler_logprobs)
            deltas.append(trainer_lp - sampler_lp)
    delta_N = torch.cat(deltas)
    return {
        "mismatch/logprob_diff_max": delta_N.abs().max().item(),
        "mismatch/kl": (delta_N.exp() - 1 - delta_N).mean().item(),
    }
