"""A rolled-out episode (`Trajectory`), and the Datums that train on it.

Shapes: P prompt tokens, C completion tokens; a datum has P + C - 1 positions.

Episodes are rolled out by the episode runner (episodes.py), single-turn problems and
multi-turn environments alike. A datum's loss inputs cover every position; prompt positions
get advantage 0 and logprob 0, so they contribute nothing to the importance-sampling and PPO
losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from temper.api.types import Datum, ModelInput, RoutedExperts


@dataclass(frozen=True)
class Trajectory:
    prompt: list[int]
    completion: list[int]
    sampler_logprobs: list[float]
    reward: float
    stop_reason: str
    metrics: dict[str, float]
    action_mask: list[float] | None = None
    """Multi-turn episodes: 1.0 on each completion token the policy sampled, 0.0 on the
    environment's observation tokens between turns (their `sampler_logprobs` are 0.0). None:
    every completion token was sampled (single-turn)."""
    sampler_support: list[list[int]] | None = None
    """With the sampler's support returned (`RLSteps.Config.sampling_support` 'sampler'):
    per completion token, the token ids top-k/top-p kept when it was drawn (an observation
    token of a multi-turn episode: itself alone)."""
    routed_experts: RoutedExperts | None = None
    """MoE policies sampled with recorded routes: the experts of every position of the
    datum (prompt + completion[:-1]), from the last action's sample (its context is the
    whole episode before it: earlier turns' routes come from the sampler's prefix cache, or
    from the prefill that ran them again)."""
    weight_versions: tuple[int, ...] | None = None
    """In-flight sampling (`RLJob.Config.mode` 'inflight'): the policy versions its tokens
    were sampled with, oldest first (several when the weights moved while it decoded)."""

    @property
    def num_action_tokens(self) -> int:
        """Completion tokens the policy sampled (those the loss trains on)."""
        if self.action_mask is None:
            return len(self.completion)
        return sum(1 for weight in self.action_mask if weight)

    def action_values(self, values: Sequence[float]) -> list[float]:
        """The entries of a per-completion-token list at the sampled tokens."""
        if self.action_mask is None:
            return list(values)
        return [v for v, weight in zip(values, self.action_mask, strict=True) if weight]


def policy_datum(
    trajectory: Trajectory, *, advantage: float | Sequence[float], sampler_temperature: float = 1.0
) -> Datum:
    """Inputs for `importance_sampling` / `ppo`: targets, sampler logprobs, advantages.

    `advantage` is one number for every completion token, or one per completion token (e.g.
    with a per-token KL penalty). The losses are sums over tokens; the caller folds any
    normalization into `advantage`. Observation tokens of a multi-turn episode (its
    `action_mask` is 0 there) get advantage 0 and logprob 0, like prompt tokens. With the
    sampler's support on the trajectory, the targets are [T, K] with a `support_mask` and the
    `sampler_temperature` the tokens were drawn at, so the loss renormalises the trainer's
    distribution over the same support (losses/support.py)."""
    tokens = trajectory.prompt + trajectory.completion
    num_prompt_targets = len(trajectory.prompt) - 1
    num_completion = len(trajectory.completion)
    if isinstance(advantage, Sequence):
        advantages_C = list(advantage)
        if len(advantages_C) != num_completion:
            raise ValueError(
                f"policy_datum: {len(advantages_C)} advantages for {num_completion} completion "
                "tokens; give one per token or a single number"
            )
    else:
        advantages_C = [advantage] * num_completion
    if trajectory.action_mask is not None:
        # Observation tokens of a multi-turn episode: the environment wrote them, nothing trains.
        advantages_C = [
            a if m else 0.0 for a, m in zip(advantages_C, trajectory.action_mask, strict=True)
        ]
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": [0.0] * num_prompt_targets + trajectory.sampler_logprobs,
        "advantages": [0.0] * num_prompt_targets + advantages_C,
    }
    if trajectory.sampler_support is not None:
        supports = [[token] for token in trajectory.prompt[1:]] + trajectory.sampler_support
        inputs |= support_inputs(tokens[1:], supports, temperature=sampler_temperature)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=inputs,
        routed_experts=trajectory.routed_experts,
    )


def support_inputs(
    targets: Sequence[int], supports: Sequence[Sequence[int]], *, temperature: float
) -> dict[str, list]:
    """`target_tokens` [T, K] (each position's target first, then the rest of its support,
    padded by repeating the target), `support_mask` [T, K] and `sampler_temperature` [T]."""
    if len(supports) != len(targets):
        raise ValueError(f"{len(supports)} supports for {len(targets)} target positions")
    rows = []
    for target, support in zip(targets, supports, strict=True):
        if target not in support:
            raise ValueError(f"target token {target} is not in its support {list(support)}")
        rows.append([target, *(token for token in support if token != target)])
    width = max(len(row) for row in rows)
    return {
        "target_tokens": [row + [row[0]] * (width - len(row)) for row in rows],
        "support_mask": [[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows],
        "sampler_temperature": [temperature] * len(rows),
    }


def supervised_datum(
    prompt: Sequence[int], completion: Sequence[int], *, weight: float = 1.0
) -> Datum:
    """Inputs for `cross_entropy` with `weight` on each completion token, 0 on the prompt."""
    tokens = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [weight] * len(completion)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )
