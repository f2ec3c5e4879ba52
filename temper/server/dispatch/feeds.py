"""Completion feeds: what `retrieve_futures` reports to a sampling client, and its clone ids.

With the client config's `sample_use_retrieve_futures`, a SamplingClient runs one poller per
(sampling session, clone) instead of polling each sample's future: it long-polls for the
requests of its target that finished since its cursor, then fetches each result with
`retrieve_future`. A clone is a copy of a SamplingClient (an unpickled one, in another
process); its sample `seq_id`s lie in its own block of a billion (`seq_id // 10**9` is its
clone id, 0 for the original), and `join_sampling_session` hands out the next free id.

Each feed is a list of (cursor, completion) entries, the cursor counting up per feed; a poll
drops the entries at or before the cursor it sends (the client has seen them). Feeds belong
to the session that created their sampling session and go when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable
from dataclasses import dataclass, field

from tinker import types as tinker_types

CLONE_BLOCK = 1_000_000_000
"""A clone's sample seq_ids are `clone_id * CLONE_BLOCK + n` (the SDK's scheme)."""


def feed_target(sampling_session_id: str, seq_id: int) -> tuple[str, int]:
    """The feed of a sample request: its sampling session and the clone its seq_id names."""
    return sampling_session_id, seq_id // CLONE_BLOCK


@dataclass
class _Feed:
    owner: str
    """The user whose sampling session it reports on."""
    scope: str
    """The session whose ending drops it."""
    entries: list[tuple[int, tinker_types.FutureCompletion]] = field(default_factory=list)
    cursor: int = 0
    """The cursor of the newest entry."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class SamplingFeeds:
    _feeds: dict[Hashable, _Feed] = field(default_factory=dict)
    _num_clones: dict[str, int] = field(default_factory=dict)
    """Clones of each sampling session that joined it (the original is clone 0)."""

    def owner_of(self, target: Hashable) -> str | None:
        """The user whose feed `target` is, or None if it has none yet."""
        feed = self._feeds.get(target)
        return None if feed is None else feed.owner

    def open(self, target: Hashable, *, owner: str, scope: str) -> str:
        """The feed of `target` ((sampling session, clone id)), created if new; its owner."""
        if target not in self._feeds:
            self._feeds[target] = _Feed(owner=owner, scope=scope)
        return self._feeds[target].owner

    def add(
        self, target: Hashable, completion: tinker_types.FutureCompletion, *, owner: str, scope: str
    ) -> None:
        """Report `completion` to the pollers of `target`."""
        self.open(target, owner=owner, scope=scope)
        feed = self._feeds[target]
        feed.cursor += 1
        feed.entries.append((feed.cursor, completion))
        feed.changed.set()

    async def poll(
        self, target: Hashable, *, after: int, timeout: float
    ) -> tuple[list[tinker_types.FutureCompletion], int]:
        """The completions after cursor `after` and the cursor to send next, waiting up to
        `timeout` seconds for one if there is none yet (the feed must be open)."""
        feed = self._feeds[target]
        feed.entries = [(cursor, entry) for cursor, entry in feed.entries if cursor > after]
        if not feed.entries and timeout > 0:
            feed.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(feed.changed.wait(), timeout)
        return [entry for _, entry in feed.entries], max(feed.cursor, after)

    def join(self, sampling_session_id: str) -> int:
        """A new clone id of the sampling session, never handed out before."""
        num_clones = self._num_clones.get(sampling_session_id, 0) + 1
        self._num_clones[sampling_session_id] = num_clones
        return num_clones

    def drop_scope(self, scope: str, *, sampling_session_ids: list[str]) -> None:
        """Forget the feeds and clone counts of an ended session."""
        for target, feed in list(self._feeds.items()):
            if feed.scope == scope:
                del self._feeds[target]
        for sampling_session_id in sampling_session_ids:
            self._num_clones.pop(sampling_session_id, None)
