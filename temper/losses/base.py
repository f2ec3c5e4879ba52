"""What a built-in loss is (`LossSpec`) and how a request's `loss_fn_config` is checked.

Shapes: N = loss positions of a micro-batch, datums concatenated; K = target tokens scored
per position (top-K cross-entropy).

A loss is a plain function from the trainer's logprobs of the target tokens and the datums'
`loss_fn_inputs` (flattened the same way) to an elementwise loss. The trainer engine sums it
and back-propagates, so every loss here is a SUM over tokens and datums (Tinker semantics);
normalization, if wanted, is the caller's job through `weights` or `advantages`. A loss that
couples a datum's positions (gspo's one ratio per sequence) says so (`segmented`) and is
also given each position's datum.

Checking input names and shapes is the engine's job (it has the datums); this file only
resolves the scalar config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch


class LossFn(Protocol):
    def __call__(
        self,
        *,
        logprobs_N: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float],
    ) -> torch.Tensor: ...


class SegmentedLossFn(Protocol):
    def __call__(
        self,
        *,
        logprobs_N: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        config: Mapping[str, float],
        segments_N: torch.Tensor,
    ) -> torch.Tensor:
        """`segments_N` (int64): the datum of each position, numbered 0, 1, ... in order
        within the micro-batch (a datum's positions are contiguous and never split)."""
        ...


class PositionLogprobs(Protocol):
    def __call__(
        self, logprobs_NK: torch.Tensor, *, inputs: Mapping[str, torch.Tensor]
    ) -> torch.Tensor: ...


InputDefault = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]
"""A missing loss input, computed from the datum's other (converted) inputs."""


@dataclass(frozen=True, kw_only=True)
class LossSpec:
    """A built-in loss: its function and the inputs and config keys it accepts."""

    name: str
    fn: LossFn | SegmentedLossFn
    required_inputs: tuple[str, ...]
    """`loss_fn_inputs` every datum must carry (`target_tokens` included)."""
    optional_inputs: tuple[str, ...] = ()
    """`loss_fn_inputs` the loss uses when present (per-token overrides of config values)."""
    input_defaults: Mapping[str, InputDefault] = field(default_factory=dict)
    """Optional inputs filled in for a datum that lacks them, so every datum has them."""
    topk_inputs: tuple[str, ...] = ()
    """Inputs that may be [T, K] instead of [T] (K target tokens scored per position); a
    datum's are all one shape, and its logprobs and elementwise loss come back [T, K]."""
    segmented: bool = False
    """`fn` is a `SegmentedLossFn`: it is also given each position's datum."""
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    """Config keys that may be omitted, with their values."""
    required_config: tuple[str, ...] = ()
    """Config keys with no default."""
    check_config: Callable[[Mapping[str, float]], None] | None = None
    """Raises ValueError when resolved values are inconsistent (e.g. clip bounds crossed)."""
    position_logprobs: PositionLogprobs | None = None
    """Maps the trainer's logprobs of the targets ([N], or [N, K]) to the one logprob per
    position the loss reads and the `logprobs` output reports (losses/support.py); None:
    used as they are."""

    @property
    def config_keys(self) -> tuple[str, ...]:
        return (*self.config_defaults, *self.required_config)


def resolve_config(spec: LossSpec, loss_fn_config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's full config: `loss_fn_config` over the defaults, every value a finite float."""
    given = dict(loss_fn_config or {})
    valid = ", ".join(spec.config_keys) or "none"
    for key in given:
        if key not in spec.config_keys:
            raise ValueError(
                f"loss_fn_config key {key!r} is not accepted by loss {spec.name!r}; "
                f"valid keys: {valid}"
            )
    missing = [key for key in spec.required_config if key not in given]
    if missing:
        raise ValueError(
            f"loss {spec.name!r} needs loss_fn_config key(s) {', '.join(missing)}; "
            f"valid keys: {valid}"
        )
    resolved = dict(spec.config_defaults)
    for key, value in given.items():
        # bool is an int subclass; True as a clip bound is a mistake, not 1.0.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"loss_fn_config[{key!r}] for loss {spec.name!r} must be a number, got {value!r}"
            )
        if not math.isfinite(value):
            raise ValueError(
                f"loss_fn_config[{key!r}] for loss {spec.name!r} must be finite, got {value}"
            )
        resolved[key] = float(value)
    if spec.check_config is not None:
        spec.check_config(resolved)
    return resolved
