"""Built-in Tinker losses by name (`loss_fn` of forward_backward).

Each is a `LossSpec` whose function maps the trainer's target logprobs and the flattened
`loss_fn_inputs` (and, for a `segmented` loss, each position's datum) to an elementwise loss
that the engine sums. Losses computed by the client
(`forward_backward_custom`) need nothing here: they reach the server as `cross_entropy` with
real-valued weights.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from temper.losses.base import LossFn, LossSpec, SegmentedLossFn, resolve_config
from temper.losses.cispo import CISPO
from temper.losses.cross_entropy import CROSS_ENTROPY
from temper.losses.dro import DRO
from temper.losses.gspo import GSPO
from temper.losses.importance_sampling import IMPORTANCE_SAMPLING
from temper.losses.ppo import PPO
from temper.losses.stable_reinforce import STABLE_REINFORCE
from temper.losses.support import with_support

# Every policy loss also takes a sampler's support (losses/support.py).
LOSSES: Mapping[str, LossSpec] = types.MappingProxyType(
    {
        spec.name: spec
        for spec in (
            CROSS_ENTROPY,
            *map(with_support, (IMPORTANCE_SAMPLING, PPO, CISPO, DRO, GSPO, STABLE_REINFORCE)),
        )
    }
)


def get_loss(name: str) -> LossSpec:
    """The built-in loss called `name`; ValueError naming the valid ones otherwise."""
    if name not in LOSSES:
        raise ValueError(
            f"unknown loss_fn {name!r}; built-in losses: {', '.join(LOSSES)}. Other losses run "
            "client-side through forward_backward_custom (sent to the server as cross_entropy)."
        )
    return LOSSES[name]


__all__ = ["LOSSES", "LossFn", "LossSpec", "SegmentedLossFn", "get_loss", "resolve_config"]
