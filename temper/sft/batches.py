"""Supervised datums for `cross_entropy`, normalized to a mean loss per trained token.

A `WeightedTokens` sequence of n tokens becomes one datum of n - 1 positions: inputs are the
tokens without the last, targets the tokens shifted by one, and the weight of a position is the
weight of its target token. Losses are sums (Tinker); every weight of a batch is divided by the
batch's number of weighted tokens, so the summed loss is the mean loss per trained token and
the step size does not depend on how many tokens a batch happens to train on.
"""

from __future__ import annotations

from collections.abc import Sequence

from temper.api.types import Datum, ModelInput
from temper.tokenizer.renderers import WeightedTokens


def completion_tokens(prompt: Sequence[int], completion: Sequence[int]) -> WeightedTokens:
    """A prompt (weight 0) followed by a completion (weight 1)."""
    if not prompt or not completion:
        raise ValueError(
            f"prompt and completion must both be non-empty, got {len(prompt)} prompt and "
            f"{len(completion)} completion tokens"
        )
    return WeightedTokens(
        tokens=[*prompt, *completion], weights=[0.0] * len(prompt) + [1.0] * len(completion)
    )


def supervised_data(examples: Sequence[WeightedTokens]) -> list[Datum]:
    """One datum per example; the summed `cross_entropy` of all of them is a per-token mean."""
    # The first token is never predicted, so its weight (0 in every renderer) cannot count.
    num_weighted = sum(sum(w > 0 for w in example.weights[1:]) for example in examples)
    if num_weighted == 0:
        raise ValueError(f"none of the {len(examples)} examples has a token to train on")
    scale = 1.0 / num_weighted
    return [
        Datum(
            model_input=ModelInput.from_ints(example.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": example.tokens[1:],
                "weights": [weight * scale for weight in example.weights[1:]],
            },
        )
        for example in examples
    ]
