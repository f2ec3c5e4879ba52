"""Checks a request passes before it is queued, so bad input is a 4xx, not a failed future.

Training data gets one vectorized pass over the whole batch (cheap: it runs on every
request); when anything looks wrong, the trainer's own validation
(`temper.trainer.inputs.prepare`) runs to produce the engine's message naming the datum,
field and position. The engine checks again when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from tinker import types as tinker_types

from temper.api.types import Datum, ModelInput
from temper.client.service_client import lora_config
from temper.losses import LossSpec, get_loss, resolve_config
from temper.sampler.context_limits import prompt_too_long
from temper.server.http.errors import BadRequest
from temper.server.state.base_models import BaseModel, ModelLimits
from temper.server.state.model_memory import MIB
from temper.server.state.provenance import behaviour_data, check_spans
from temper.server.state.stability import StabilityStore
from temper.server.wire.codec import ForwardBackwardCall, SampleCall
from temper.trainer.inputs import misspelled_input, prepare

MAX_NUM_SAMPLES = 4096
MAX_TAGS = 64
"""Most tags a session carries."""
MAX_METADATA_ENTRIES = 64
"""Most user_metadata entries a session or model carries."""
MAX_LABEL_CHARS = 1024
"""Longest tag, and longest user_metadata key or value (as text)."""
MAX_PAGE = 1000
"""Most sessions, runs or checkpoints one listing request returns."""


def check_page(*, limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"limit must be in 1..{MAX_PAGE}, got {limit}")
    if offset < 0:
        raise BadRequest(f"offset must be >= 0, got {offset}")


def check_training_data(
    data: Sequence[Datum],
    *,
    loss_fn: str,
    loss_fn_config: Mapping[str, object],
    limits: ModelLimits,
) -> None:
    """A vectorized pass over the whole batch; if anything looks wrong, the engine's own
    validation runs to name the datum, field and position."""
    try:
        spec = get_loss(loss_fn)
        resolve_config(spec, loss_fn_config)
        if not _looks_valid(data, spec, limits=limits):
            prepare(
                data,
                required=spec.required_inputs,
                optional=spec.optional_inputs,
                defaults=spec.input_defaults,
                topk=spec.topk_inputs,
                vocab_size=limits.vocab_size,
                max_seq_len=limits.max_seq_len,
            )
    except (TypeError, ValueError) as error:
        raise BadRequest(f"forward_backward: {error}") from None


def resolve_provenance(
    call: ForwardBackwardCall, *, store: StabilityStore, session_id: str
) -> list[Datum]:
    """The datums to train on: provenance spans checked on every loss, and for
    stable_reinforce resolved against the recorded samples (state/provenance.py)."""
    try:
        check_spans(call.data, call.provenance)
        if call.loss_fn != "stable_reinforce":
            return call.data
        return behaviour_data(call.data, call.provenance, store=store, session_id=session_id)
    except ValueError as error:
        raise BadRequest(f"forward_backward: {error}") from None


def _looks_valid(data: Sequence[Datum], spec: LossSpec, *, limits) -> bool:
    if not data:
        return False
    allowed = set(spec.required_inputs) | set(spec.optional_inputs)
    unread: set[str] = set()  # names the loss ignores, unless one is a misspelling
    ids: list[int] = []
    values: list[float] = []
    for datum in data:
        tokens = datum.model_input.to_ints()
        if not 0 < len(tokens) <= limits.max_seq_len:
            return False
        inputs = datum.loss_fn_inputs
        if any(name not in inputs for name in spec.required_inputs):
            return False
        unread |= inputs.keys() - allowed
        ids += tokens
        # [T], or for top-K inputs [T, K] with one K for all of the datum's.
        topk_shapes = {tuple(inputs[n].shape) for n in spec.topk_inputs if n in inputs}
        topk_shape = topk_shapes.pop() if len(topk_shapes) == 1 else (len(tokens),)
        if topk_shape[0] != len(tokens) or len(topk_shape) > 2 or 0 in topk_shape:
            return False
        # A policy loss's [T, K] targets are a sampler's support: they need its mask.
        needs_mask = len(topk_shape) == 2 and "support_mask" in spec.topk_inputs
        if needs_mask and "support_mask" not in inputs:
            return False
        for name in allowed & inputs.keys():
            tensor = inputs[name]
            expected = topk_shape if name in spec.topk_inputs else (len(tokens),)
            if tuple(tensor.shape) != expected:
                return False
            (ids if name == "target_tokens" else values).extend(tensor.data)
    if any(misspelled_input(name, allowed=allowed) for name in unread):
        return False
    ids_array = np.asarray(ids)
    if ids_array.dtype.kind != "i":  # float target ids: let the engine check they are whole
        return False
    in_vocab = ids_array.size == 0 or (ids_array.min() >= 0 and ids_array.max() < limits.vocab_size)
    return bool(in_vocab and np.isfinite(np.asarray(values, dtype=np.float64)).all())


def sdk_verb(call: SampleCall) -> str:
    """The SDK verb an asample request comes from, for its errors: the SDK's
    compute_logprobs sends one sample of one token with the prompt's logprobs."""
    scoring = call.prompt_logprobs and call.num_samples == 1 and call.params.max_tokens == 1
    return "compute_logprobs" if scoring else "sample"


def check_prompt(prompt: ModelInput, *, num_samples: int, limits: ModelLimits, verb: str) -> None:
    """A longer completion than fits is not an error: it stops at the limit ('length').
    Errors name `verb`, the call the user made."""
    tokens = prompt.to_ints()
    if not tokens:
        raise BadRequest(f"{verb}: prompt is empty")
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise BadRequest(
            f"{verb}: prompt token {bad} at position {tokens.index(bad)} is outside the "
            f"vocabulary; valid ids are 0..{limits.vocab_size - 1}"
        )
    if len(tokens) >= limits.max_sample_len:
        raise BadRequest(
            prompt_too_long(
                f"{verb}: prompt",
                num_tokens=len(tokens),
                context=limits.max_sample_len,
                holder="the sampler",
            )
        )
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise BadRequest(f"{verb}: num_samples must be in 1..{MAX_NUM_SAMPLES}, got {num_samples}")


def check_sample(call: SampleCall, *, limits: ModelLimits) -> None:
    """The prompt (`check_prompt`), and what else the sampler would only reject once queued."""
    check_prompt(call.prompt, num_samples=call.num_samples, limits=limits, verb=sdk_verb(call))
    vocab_size = limits.vocab_size
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        value = getattr(call, name)
        if not 0 <= value <= vocab_size:
            raise BadRequest(f"sample: {name} must be in 0..{vocab_size}, got {value}")
    if call.target_prompt_logprobs is not None:
        try:
            call.target_prompt_logprobs.check(
                prompt_length=call.prompt.length, vocab_size=vocab_size
            )
        except ValueError as error:
            raise BadRequest(f"sample: {error}") from None
    bad = [token for token in call.params.stop_token_ids if token >= vocab_size]
    if bad:
        raise BadRequest(
            f"sampling_params: stop token ids {bad} are outside the vocabulary; valid ids are "
            f"0..{vocab_size - 1}"
        )


def check_lora(config: tinker_types.LoraConfig) -> None:
    """A create_model LoRA config the trainer accepts (else it would fail once queued)."""
    try:
        lora_config(
            rank=config.rank,
            seed=config.seed,
            train_mlp=config.train_mlp,
            train_attn=config.train_attn,
            train_unembed=config.train_unembed,
        )
    except (TypeError, ValueError) as error:
        raise BadRequest(f"create_model: lora_config: {error}") from None


def check_optimizer_config(config: tinker_types.OptimizerConfig | None, *, route: str) -> None:
    """AdamW, or none (AdamW); any other optimizer family (Tinker's `dimuon`) is a 400 naming
    the field: Temper trains with AdamW only (docs/server.md says why)."""
    if config is None or config.type == "adamw":
        return
    raise BadRequest(
        f"{route}: optimizer_config type {config.type!r} is not supported; this server trains "
        "with AdamW only (optimizer_config type 'adamw', the SDK's default)"
    )


def check_lora_rank_fits(
    base: BaseModel,
    rank: int,
    *,
    budget_bytes: int,
    shared_base: bool,
    shared_sampler: bool,
    field: str,
    sampler: bool = True,
) -> None:
    """400 naming `field` and the largest rank that fits, for a LoRA rank whose training
    model the model memory budget could not hold even with nothing else loaded: no session
    finishing can make room for it, so it is the request's to change. A base model that does
    not fit at any rank is the server's setting at fault, and left to the budget's 503."""
    sharing = {"shared_base": shared_base, "shared_sampler": shared_sampler, "sampler": sampler}
    largest = base.largest_lora_rank(budget_bytes=budget_bytes, **sharing)
    if largest < 1 or rank <= largest:
        return
    needs = base.lora_model_bytes(lora_rank=rank, **sharing)
    raise BadRequest(
        f"{field} {rank} does not fit: a LoRA training model of that rank on base model "
        f"{base.name} needs {needs / MIB:.1f} MiB, more than the whole model memory budget "
        f"(--model-memory-mb {budget_bytes / MIB:g}); the largest rank that fits is {largest}"
    )


def check_prompt_json(body: object) -> None:
    """A big asample body's prompt tokens are integers (checked before pydantic, which takes
    seconds to build and format an error for each of a million bad tokens)."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    for index, chunk in enumerate(chunks if isinstance(chunks, list) else []):
        tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
        if isinstance(tokens, list) and not all(type(token) is int for token in tokens):
            raise BadRequest(
                f"sample: prompt.chunks[{index}].tokens must be a list of integer token ids"
            )


def check_tags(tags: Sequence[str], *, route: str) -> None:
    """At most MAX_TAGS tags of at most MAX_LABEL_CHARS characters each."""
    if len(tags) > MAX_TAGS:
        raise BadRequest(f"{route}: tags has {len(tags)} entries; at most {MAX_TAGS} are allowed")
    for index, tag in enumerate(tags):
        if len(tag) > MAX_LABEL_CHARS:
            raise BadRequest(
                f"{route}: tags[{index}] has {len(tag)} characters; at most {MAX_LABEL_CHARS}"
            )


def check_user_metadata(metadata: Mapping[str, object] | None, *, route: str) -> None:
    """At most MAX_METADATA_ENTRIES entries; each key and value (as text, the way it is
    stored) at most MAX_LABEL_CHARS characters."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise BadRequest(
            f"{route}: user_metadata has {len(metadata)} entries; at most "
            f"{MAX_METADATA_ENTRIES} are allowed"
        )
    for key, value in metadata.items():
        if len(key) > MAX_LABEL_CHARS:
            raise BadRequest(
                f"{route}: user_metadata key {key[:40]!r}... has {len(key)} characters; at "
                f"most {MAX_LABEL_CHARS}"
            )
        if len(text := str(value)) > MAX_LABEL_CHARS:
            raise BadRequest(
                f"{route}: user_metadata[{key!r}] has {len(text)} characters as text; at most "
                f"{MAX_LABEL_CHARS}"
            )
