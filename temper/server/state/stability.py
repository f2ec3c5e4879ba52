"""What a sample with `record_stability_info` leaves behind for `stable_reinforce`.

Shapes: P prompt tokens, S sampled tokens of one sequence.

One record per sampled sequence, under the `sample_sequence_ids` that `asample` returned: the
session that sampled it, its prompt and sampled tokens, the sampler's logprob of each sampled
token (under the distribution it was drawn from: after temperature, top-k, top-p) and the
weights it came from. Training requests name records through provenance spans
(provenance.py), and stable_reinforce takes its behaviour logprobs from them rather than from
the client.

A record belongs to the session that sampled it, and lives `ttl_s` (one day) after it was
sampled or last named by a training request that passed validation. The store holds at most
`max_tokens` tokens (prompt + sampled, counted per sequence, about 8 bytes each: int32 ids,
float32 logprobs); past that the least recently used records are dropped. A bounded list of
the ids that expired or were dropped keeps the error for them precise. Runs on the event
loop (sample results are recorded as they are encoded, spans resolved in the route), so
nothing here locks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from temper.api.types import RoutedExperts
from temper.config.checks import check_range
from temper.config.configurable import Configurable

MAX_GONE_IDS = 1 << 16
"""Ids of expired or dropped records remembered for their error message."""


@dataclass(frozen=True, kw_only=True)
class SequenceRecord:
    session_id: str
    prompt_P: np.ndarray
    """int32; shared by the samples of one request."""
    tokens_S: np.ndarray
    """int32 sampled tokens (a stop token included)."""
    logprobs_S: np.ndarray
    """float32 sampler logprob of each sampled token."""
    weights: str
    """The sampler's weights: a training model id, sampler checkpoint path or base model."""
    weights_version: int | None
    """The backend's policy version of those weights, where it has one."""
    routes: RoutedExperts | None = None
    """MoE models on a server with routing_replay='sampler': the experts of the prompt's
    tokens and of each sampled token but the last (`SampledSequence.routed_experts`), a few
    bytes per token and layer, which the store's token count leaves out."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_P) + len(self.tokens_S)


@dataclass
class _Entry:
    record: SequenceRecord
    last_used: float


class StabilityStore(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        ttl_s: float = 86400.0
        """Seconds a recorded sequence stays usable after it was sampled or last named by a
        training request (Tinker: one day)."""
        max_tokens: int = 1 << 24
        """Most tokens (prompt + sampled, per sequence) recorded at once, about 8 bytes each
        (16.8M: at most ~130 MiB); past it the least recently used sequences are dropped."""

        def __post_init__(self) -> None:
            check_range(self.ttl_s, field="StabilityStore.Config.ttl_s", greater_than=0)
            check_range(self.max_tokens, field="StabilityStore.Config.max_tokens", at_least=1)

    def __init__(self, config: Config, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        """Least recently used first, so expired entries sit at the front."""
        self._gone: OrderedDict[str, str] = OrderedDict()
        """Id -> why it is gone ('expired' or 'dropped'), oldest first."""
        self.num_tokens = 0

    def record(self, sequence_id: str, record: SequenceRecord) -> None:
        now = self._clock()
        self._expire(now)
        self._remove(sequence_id)
        self._entries[sequence_id] = _Entry(record, now)
        self.num_tokens += record.num_tokens
        while self.num_tokens > self.config.max_tokens and len(self._entries) > 1:
            self._forget(next(iter(self._entries)), why="dropped")

    def lookup(self, sequence_id: str, *, session_id: str) -> SequenceRecord:
        """The record of `sequence_id` for a request of `session_id`; ValueError saying why not."""
        self._expire(self._clock())
        entry = self._entries.get(sequence_id)
        if entry is None:
            raise ValueError(self._missing(sequence_id))
        if entry.record.session_id != session_id:
            raise ValueError(
                f"sequence {sequence_id!r} was sampled in another session; a training request "
                "can only name sequences sampled in its own session"
            )
        return entry.record

    def touch(self, sequence_ids: set[str]) -> None:
        """Restart the lifetime of each (a training request that names them passed)."""
        now = self._clock()
        for sequence_id in sequence_ids:
            entry = self._entries.get(sequence_id)
            if entry is not None:
                entry.last_used = now
                self._entries.move_to_end(sequence_id)

    def drop_session(self, session_id: str) -> None:
        for sequence_id in [
            key for key, entry in self._entries.items() if entry.record.session_id == session_id
        ]:
            self._remove(sequence_id)

    def __len__(self) -> int:
        return len(self._entries)

    def _missing(self, sequence_id: str) -> str:
        why = self._gone.get(sequence_id)
        if why == "expired":
            return (
                f"sequence {sequence_id!r} expired: it was not named by a training request for "
                f"{self.config.ttl_s:g} s after it was sampled or last used"
            )
        if why == "dropped":
            return (
                f"sequence {sequence_id!r} was dropped: the server records at most "
                f"{self.config.max_tokens} tokens and this sequence was the least recently used "
                "(raise --stability.max-tokens, or train on samples sooner)"
            )
        return (
            f"unknown sequence {sequence_id!r}: no sequence with this id was sampled with "
            "record_stability_info=True on this server"
        )

    def _expire(self, now: float) -> None:
        while self._entries:
            sequence_id, entry = next(iter(self._entries.items()))
            if now - entry.last_used <= self.config.ttl_s:
                return
            self._forget(sequence_id, why="expired")

    def _forget(self, sequence_id: str, *, why: str) -> None:
        self._remove(sequence_id)
        self._gone[sequence_id] = why
        if len(self._gone) > MAX_GONE_IDS:
            self._gone.popitem(last=False)

    def _remove(self, sequence_id: str) -> None:
        entry = self._entries.pop(sequence_id, None)
        if entry is not None:
            self.num_tokens -= entry.record.num_tokens
