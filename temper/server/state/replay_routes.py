"""Routing replay over HTTP: a datum's routes from the server's own sampling records.

A Tinker client cannot send routes: its datums have tokens, loss inputs and provenance spans
only. With `--routing-replay sampler` the server records, with every sequence sampled with
`record_stability_info` (stability.py), the experts its sampler routed each token to, and
gives a training request's datum the routes of the sequence its last model_input span names
(provenance.py), when that sequence's prompt and sampled tokens but the last are exactly the
datum's model_input. An RL datum is that sequence, in one turn or many, as tinker-cookbook
builds it: its input is the last request's prompt (the whole episode before the last action,
whose earlier turns' routes the sampler took from its prefix cache) and the last action but
its final token, which was never fed through the model.

The call replays (`routing_replay="sampler"`, every loss) when every datum got routes; else it
trains on the trainer's own routing, as without the setting, the routes it found still feeding
the `routing/*` metrics. `routing/replayed:mean` in the response says which (1 or 0). A span
that does not resolve is never an error here (only stable_reinforce requires its spans to
resolve): the datum simply has no routes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from temper.api.types import Datum
from temper.server.state.provenance import Provenance
from temper.server.state.stability import SequenceRecord, StabilityStore

REPLAYED_METRIC = "routing/replayed:mean"


def with_sampler_routes(
    data: Sequence[Datum],
    provenance: Sequence[Provenance | None],
    *,
    store: StabilityStore,
    session_id: str,
) -> list[Datum]:
    """The datums, each with its recorded routes where its provenance finds them."""
    routed = []
    for datum, spans in zip(data, provenance, strict=True):
        record = _named_record(spans, store=store, session_id=session_id)
        if record is not None and _is_input_of(record, datum):
            datum = dataclasses.replace(datum, routed_experts=record.routes)
        routed.append(datum)
    return routed


def _named_record(
    spans: Provenance | None, *, store: StabilityStore, session_id: str
) -> SequenceRecord | None:
    if spans is None or not spans.model_input:
        return None
    try:
        return store.lookup(spans.model_input[-1].sequence_id, session_id=session_id)
    except ValueError:  # unknown, expired or another session's: no routes
        return None


def _is_input_of(record: SequenceRecord, datum: Datum) -> bool:
    """Whether the record's routes are the datum's: its prompt and sampled tokens but the
    last are the datum's model_input."""
    if record.routes is None:
        return False
    tokens = datum.model_input.to_ints()
    num_prompt = len(record.prompt_P)
    return (
        record.routes.num_tokens == len(tokens)
        and record.prompt_P.tolist() == tokens[:num_prompt]
        and record.tokens_S[:-1].tolist() == tokens[num_prompt:]
    )
