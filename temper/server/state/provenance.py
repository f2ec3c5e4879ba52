"""Provenance spans on datums (Tinker's `model_input_spans` / `loss_fn_input_spans`).

A span names a sampled sequence (its `sample_sequence_ids` entry) and claims that a run of
consecutive datum positions reproduces positions `[offset, offset + length)` of that
sequence's request prompt (`prompt`) or of its sampled tokens (`sampled`). The spans of a
field tile it in order: `model_input_spans` the input tokens, `loss_fn_input_spans` the
targets. tinker-cookbook attaches them to every RL datum, whatever the loss, so every loss
accepts them and `check_spans` only checks their shape. stable_reinforce resolves them
against the records of `record_stability_info` (`behaviour_data`): every named sequence must
be recorded, in the caller's session and unexpired; every span must lie inside it; model input
tokens and sampled-attributed targets must be the recorded tokens, and prompt-attributed
targets must carry no advantage. Prompt-attributed targets are not compared with the prompt:
the cookbook's rl_loop sends zeros there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from temper.api.types import Datum, TensorData
from temper.server.state.stability import SequenceRecord, StabilityStore

SpanKind = Literal["prompt", "sampled"]
_WIRE_NAMES = {"prompt": "prompt_tokens", "sampled": "sampled_tokens"}


@dataclass(frozen=True, kw_only=True)
class Span:
    kind: SpanKind
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """A datum's spans; the wire sends none (both empty) or both."""

    model_input: tuple[Span, ...]
    targets: tuple[Span, ...]


def check_spans(data: Sequence[Datum], provenance: Sequence[Provenance | None]) -> None:
    """Spans come as a pair, with ids, offsets and lengths >= 0, and tile their fields."""
    for index, (datum, spans) in enumerate(zip(data, provenance, strict=True)):
        if spans is None:
            continue
        if not spans.model_input or not spans.targets:
            raise ValueError(
                f"datum {index}: model_input_spans and loss_fn_input_spans come as a pair; got "
                f"{len(spans.model_input)} and {len(spans.targets)} spans"
            )
        targets = datum.loss_fn_inputs.get("target_tokens")
        sizes = {
            "model_input_spans": datum.model_input.length,
            "loss_fn_input_spans": None if targets is None else targets.shape[0],
        }
        for field, field_spans in zip(sizes, (spans.model_input, spans.targets), strict=True):
            for number, span in enumerate(field_spans):
                where = f"datum {index}: {field}[{number}]"
                if not span.sequence_id:
                    raise ValueError(f"{where}: sequence_id is empty")
                if span.offset < 0 or span.length < 0:
                    raise ValueError(
                        f"{where}: offset ({span.offset}) and length ({span.length}) must be >= 0"
                    )
            covered = sum(span.length for span in field_spans)
            if sizes[field] is not None and covered != sizes[field]:
                what = "model_input tokens" if field == "model_input_spans" else "target_tokens"
                raise ValueError(
                    f"datum {index}: {field} cover {covered} positions, but the datum has "
                    f"{sizes[field]} {what}; the spans must tile them"
                )


def behaviour_data(
    data: Sequence[Datum],
    provenance: Sequence[Provenance | None],
    *,
    store: StabilityStore,
    session_id: str,
) -> list[Datum]:
    """The datums with `logprobs` replaced by the recorded behaviour logprobs on sampled-
    attributed targets and `mask` 1 there, 0 on prompt-attributed ones; ValueError naming the
    datum and span when a span does not resolve. Restarts the named records' lifetime."""
    resolved, named = [], set()
    for index, (datum, spans) in enumerate(zip(data, provenance, strict=True)):
        if spans is None:
            raise ValueError(
                f"datum {index}: stable_reinforce needs provenance (model_input_spans and "
                "loss_fn_input_spans) naming sequences sampled with record_stability_info=True"
            )
        resolved.append(_resolved(datum, spans, index=index, store=store, session_id=session_id))
        named |= {span.sequence_id for span in (*spans.model_input, *spans.targets)}
    store.touch(named)
    return resolved


def _resolved(
    datum: Datum, spans: Provenance, *, index: int, store: StabilityStore, session_id: str
) -> Datum:
    inputs = datum.loss_fn_inputs
    tokens_N = np.asarray(datum.model_input.to_ints())
    targets_N = np.asarray(inputs["target_tokens"].data)
    advantages_N = np.asarray(inputs["advantages"].data, dtype=np.float32)
    behaviour_N = np.asarray(inputs["logprobs"].data, dtype=np.float32)
    mask_N = np.zeros(len(targets_N), dtype=np.float32)
    for field, field_spans, values_N in (
        ("model_input_spans", spans.model_input, tokens_N),
        ("loss_fn_input_spans", spans.targets, targets_N),
    ):
        start = 0
        for number, span in enumerate(field_spans):
            where = (
                f"datum {index}: {field}[{number}] ({_WIRE_NAMES[span.kind]} of sequence "
                f"{span.sequence_id!r}, offset {span.offset}, length {span.length})"
            )
            try:
                record = store.lookup(span.sequence_id, session_id=session_id)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            source = record.prompt_P if span.kind == "prompt" else record.tokens_S
            if span.offset + span.length > len(source):
                raise ValueError(
                    f"{where}: out of range; the sequence's {_describe(span.kind)} has "
                    f"{len(source)} tokens"
                )
            end = start + span.length
            claimed = source[span.offset : span.offset + span.length]
            if field == "model_input_spans" or span.kind == "sampled":
                _check_tokens(values_N[start:end], claimed, where=where, field=field, start=start)
            if field == "loss_fn_input_spans":
                _attribute_targets(
                    span, record, advantages_N, behaviour_N, mask_N, start=start, where=where
                )
            start = end
    if "mask" in inputs:  # a caller's own mask narrows the KL term further
        mask_N *= np.asarray(inputs["mask"].data, dtype=np.float32)
    return Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            **inputs,
            "logprobs": _float32(behaviour_N),
            "mask": _float32(mask_N),
        },
    )


def _attribute_targets(
    span: Span,
    record: SequenceRecord,
    advantages_N: np.ndarray,
    behaviour_N: np.ndarray,
    mask_N: np.ndarray,
    *,
    start: int,
    where: str,
) -> None:
    end = start + span.length
    if span.kind == "sampled":
        behaviour_N[start:end] = record.logprobs_S[span.offset : span.offset + span.length]
        mask_N[start:end] = 1.0
        return
    nonzero = np.flatnonzero(advantages_N[start:end])
    if nonzero.size:
        position = start + int(nonzero[0])
        raise ValueError(
            f"{where}: advantage {advantages_N[position]:g} at target position {position}; "
            "stable_reinforce only takes nonzero advantages on sampled tokens"
        )


def _check_tokens(
    values: np.ndarray, claimed: np.ndarray, *, where: str, field: str, start: int
) -> None:
    differ = np.flatnonzero(values != claimed)
    if differ.size:
        position = start + int(differ[0])
        what = "model_input token" if field == "model_input_spans" else "target token"
        raise ValueError(
            f"{where}: {what} {values[differ[0]]} at position {position} differs from the "
            f"recorded token {claimed[differ[0]]}"
        )


def _describe(kind: SpanKind) -> str:
    return "prompt" if kind == "prompt" else "sampled completion"


def _float32(values_N: np.ndarray) -> TensorData:
    return TensorData(data=values_N.tolist(), dtype="float32", shape=(len(values_N),))
