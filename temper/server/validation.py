"""Checks a request passes before it is queued, so bad input is a 4xx, not a failed future.

Training data goes through the trainer's own validation (`temper.trainer.batching.prepare`
and the loss registry), so the server rejects exactly what the engine would, with the same
messages naming the datum and field; the engine checks again when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from temper.api.types import Datum, ModelInput
from temper.losses import get_loss, resolve_config
from temper.server.errors import BadRequest
from temper.server.server import ModelLimits
from temper.trainer.batching import prepare

MAX_NUM_SAMPLES = 4096


def check_training_data(
    data: Sequence[Datum],
    *,
    loss_fn: str,
    loss_fn_config: Mapping[str, object],
    limits: ModelLimits,
) -> None:
    try:
        spec = get_loss(loss_fn)
        resolve_config(spec, loss_fn_config)
        prepare(
            data,
            required=spec.required_inputs,
            optional=spec.optional_inputs,
            vocab_size=limits.vocab_size,
            max_seq_len=limits.max_seq_len,
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(f"forward_backward: {error}") from None


def check_prompt(prompt: ModelInput, *, num_samples: int, limits: ModelLimits) -> None:
    """A longer completion than fits is not an error: it stops at the limit ('length')."""
    tokens = prompt.to_ints()
    if not tokens:
        raise BadRequest("sample: prompt is empty")
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"sample: prompt token {bad} at position {tokens.index(bad)} is outside the "
            f"vocabulary; valid ids are 0..{limits.vocab_size - 1}"
        )
    if len(tokens) >= limits.max_sample_len:
        raise BadRequest(
            f"sample: prompt has {len(tokens)} tokens; the sampler holds at most "
            f"{limits.max_sample_len} (prompt + completion)"
        )
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise BadRequest(f"sample: num_samples must be in 1..{MAX_NUM_SAMPLES}, got {num_samples}")
