"""How long sampling snapshots (`save_weights_and_get_sampling_client`) stay valid.

Tinker has no call that releases a snapshot, so the server decides. A live snapshot other
than its model's newest holds a sampler copy of its own once the trainer's weights change
(copy-on-write, temper/client/weight_sync.py); each such copy is counted at `copy_bytes` (the
sampler's weights, KV cache and prefix cache: `BaseModel.sampler_copy_bytes`, base_models.py).
Two rules, both Temper's own (Tinker publishes none):

- memory: taking a snapshot first evicts the least recently used snapshots until the copies
  the server would then hold fit `budget_bytes`. A model's newest snapshot costs no copy (it
  reads the trainer's sampler), so the memory rule never evicts it.
- age: a snapshot not sampled for `idle_seconds` expires (checked when it is looked up, when
  a snapshot is taken and by the server's periodic sweep).

A reference client that is sampled every step (DPO) thus outlives any number of snapshots
that are taken, used once and dropped (evaluators, an RL loop's previous policies). An evicted
snapshot's id is remembered with the reason, so sampling on it answers 404 saying why and
which setting keeps it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("temper.server")
MIB = 2**20
_REMEMBERED = 10_000
"""Evicted ids whose reason is kept (oldest forgotten first)."""


@dataclass
class _Snapshot:
    model_id: str
    last_used: float
    copy_bytes: int


class SnapshotRetention:
    """Which snapshots are live; every method is thread-safe."""

    def __init__(
        self,
        *,
        copy_bytes: int,
        budget_bytes: int,
        idle_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.copy_bytes = copy_bytes
        self.budget_bytes = budget_bytes
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, _Snapshot] = {}
        self._newest: dict[str, str] = {}  # model id -> its newest snapshot
        self._gone: OrderedDict[str, str] = OrderedDict()  # evicted id -> why

    @property
    def num_copies_in_budget(self) -> int:
        return self.budget_bytes // max(self.copy_bytes, 1)

    def log_settings(self) -> None:
        copy_mib, budget_mib = self.copy_bytes / MIB, self.budget_bytes / MIB
        if self.num_copies_in_budget == 0:
            log.warning(
                "--snapshot-memory-mb %.0f holds no sampler copy (%.1f MiB each): only each "
                "model's newest sampling snapshot stays valid (a DPO reference client does "
                "not)",
                budget_mib,
                copy_mib,
            )
        log.info(
            "sampling snapshots: %.1f MiB per older snapshot (a sampler copy: weights, KV "
            "cache, prefix cache), budget %.0f MiB (%d copies), idle expiry %g s",
            copy_mib,
            budget_mib,
            self.num_copies_in_budget,
            self.idle_seconds,
        )

    def make_room(self, model_id: str) -> list[str]:
        """Before `model_id` takes a snapshot: evict idle snapshots, then the least recently
        used ones until the copies held afterwards fit the budget; returns the evicted ids."""
        with self._lock:
            evicted = self._evict_idle()
            # Once the new snapshot exists, the model's current newest one costs a copy too.
            copies = [sid for sid in self._live if sid not in self._newest.values()]
            copies += [self._newest[model_id]] if model_id in self._newest else []
            copies.sort(key=lambda sid: self._live[sid].last_used)
            held = sum(self._live[sid].copy_bytes for sid in copies)
            while copies and held > self.budget_bytes:
                held -= self._live[copies[0]].copy_bytes
                evicted.append(self._evict(copies.pop(0), reason=self._budget_reason()))
            return evicted

    def add(self, snapshot_id: str, *, model_id: str, copy_bytes: int | None = None) -> None:
        """`copy_bytes`: what the snapshot holds once its model's weights change (default
        `copy_bytes`: a sampler copy; a LoRA snapshot on a multi-LoRA sampler: its adapters)."""
        with self._lock:
            self._live[snapshot_id] = _Snapshot(
                model_id=model_id,
                last_used=self._clock(),
                copy_bytes=self.copy_bytes if copy_bytes is None else copy_bytes,
            )
            self._newest[model_id] = snapshot_id

    def use(self, snapshot_id: str) -> str | None:
        """Mark a snapshot used now; returns why it is gone if it is (else None). Ids that are
        not snapshots (base model and checkpoint sessions) pass through as None."""
        with self._lock:
            snapshot = self._live.get(snapshot_id)
            if snapshot is None:
                return self._gone.get(snapshot_id)
            now = self._clock()
            if now - snapshot.last_used > self.idle_seconds:
                self._evict(snapshot_id, reason=self._age_reason())
                return self._gone[snapshot_id]
            snapshot.last_used = now
            return None

    def has_snapshots(self, model_ids: set[str]) -> bool:
        with self._lock:
            return any(snap.model_id in model_ids for snap in self._live.values())

    def evict_oldest(self, model_ids: set[str], *, reason: str) -> str | None:
        """Evict the least recently used snapshot of `model_ids` (None if they have none)."""
        with self._lock:
            mine = [sid for sid, snap in self._live.items() if snap.model_id in model_ids]
            if not mine:
                return None
            oldest = min(mine, key=lambda sid: self._live[sid].last_used)
            return self._evict(oldest, reason=reason)

    def evict_idle(self) -> list[str]:
        with self._lock:
            return self._evict_idle()

    def drop_model(self, model_id: str) -> None:
        """Forget a model's snapshots (its session finished)."""
        with self._lock:
            for snapshot_id in [s for s, snap in self._live.items() if snap.model_id == model_id]:
                self._evict(snapshot_id, reason="its session finished")
            self._newest.pop(model_id, None)

    def _evict_idle(self) -> list[str]:
        now = self._clock()
        idle = [sid for sid, snap in self._live.items() if now - snap.last_used > self.idle_seconds]
        return [self._evict(sid, reason=self._age_reason()) for sid in idle]

    def _evict(self, snapshot_id: str, *, reason: str) -> str:
        snapshot = self._live.pop(snapshot_id)
        if self._newest.get(snapshot.model_id) == snapshot_id:
            del self._newest[snapshot.model_id]
        self._gone[snapshot_id] = reason
        while len(self._gone) > _REMEMBERED:
            self._gone.popitem(last=False)
        return snapshot_id

    def _budget_reason(self) -> str:
        return (
            f"evicted to fit the snapshot memory budget (--snapshot-memory-mb "
            f"{self.budget_bytes / MIB:g}; each older snapshot holds a sampler copy of up to "
            f"{self.copy_bytes / MIB:.1f} MiB, a LoRA one on the shared sampler its adapters; "
            "the least recently used goes first); raise --snapshot-memory-mb to keep more"
        )

    def _age_reason(self) -> str:
        return (
            f"expired after {self.idle_seconds:g} s without a sample (--snapshot-idle-seconds); "
            "raise --snapshot-idle-seconds to keep idle snapshots longer"
        )
