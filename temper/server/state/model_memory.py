"""Which base models are loaded, and the memory budget they share (`--model-memory-mb`).

The server builds backend objects on a base model only when a request needs them, and counts
each at an estimate of what it holds (base_models.py):

- a training model (create_model, create-from-state) is *pinned*: it holds its memory until
  its session finishes (or its creation fails). A LoRA model counts its adapters, their
  gradients and moments, and its sampler; the frozen base weights that every LoRA model on
  one base shares (client/shared_base.py) are one more pinned holder, held from the first
  LoRA model on that base until the last is dropped (server.py). A full fine-tuning model
  counts its own copy of the weights x4 and its sampler;
- a shared sampler (the sampler of a base model or of a sampler checkpoint, which every
  sampling session on it uses) is *releasable*: one not sampled for `idle_seconds` is
  released, and the least recently used ones are released to make room for another. A
  sampling session on it stays valid; its next sample loads the sampler again.

A base model is loaded while anything on it is held (logged `base model ... loaded` and
`... released`). A request that needs more than the budget holds once every releasable
sampler is gone is refused with `OverBudget` (HTTP 503) naming the budget and what holds it;
a LoRA rank the whole budget could never hold is refused before it gets here, as the
request's error (400, `validation.check_lora_rank_fits`).
A training model's in-flight sampling target (client/inflight.py) is pinned from its first
in-flight save until the model is dropped (server.py: `admit_inflight`). Sampling snapshots
are counted by their own budget (snapshots.py), not this one. Every method is thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from temper.server.http.errors import Unavailable

log = logging.getLogger("temper.server")
MIB = 2**20


class OverBudget(Unavailable):
    """The budget cannot hold what a request needs (503)."""


@dataclass
class _Holder:
    base_model: str
    what: str
    num_bytes: int
    pinned: bool
    last_used: float


class ModelMemory:
    def __init__(
        self,
        *,
        budget_bytes: int,
        idle_seconds: float,
        per_rank: bool = False,
        budget_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`per_rank`: the budget is each rank's of a multi-rank server (the estimates are
        what rank 0 holds, the most any rank does); its refusals say so. `budget_name`: what
        the refusals call the budget instead (one generator rank's, say)."""
        self.budget_bytes = budget_bytes
        if budget_name is None:
            budget_name = "model memory budget of a rank" if per_rank else "model memory budget"
        self.budget_name = budget_name
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, _Holder] = {}

    def admit(
        self,
        key: str,
        *,
        base_model: str,
        what: str,
        num_bytes: int,
        pinned: bool,
        keep: Collection[str] = (),
    ) -> list[str]:
        """Count `key` (`what` on `base_model`, `num_bytes`) as held; first releases idle
        samplers, then the least recently used samplers until it fits (never those in
        `keep`: samplers in use). Returns the released keys (the caller drops their backend
        objects); raises OverBudget if it cannot fit."""
        with self._lock:
            assert key not in self._held, key
            released = self._release_idle(keep=keep)
            if not self._room_for(num_bytes, keep=keep):  # releasing samplers cannot help
                raise OverBudget(self._refusal(base_model, what=what, num_bytes=num_bytes))
            releasable = sorted(
                (k for k, h in self._held.items() if not h.pinned and k not in keep),
                key=lambda k: self._held[k].last_used,
            )
            while releasable and self._used() + num_bytes > self.budget_bytes:
                released.append(self._release(releasable.pop(0), why="to make room for " + what))
            if self._used() + num_bytes > self.budget_bytes:
                raise OverBudget(self._refusal(base_model, what=what, num_bytes=num_bytes))
            loads = base_model not in self.loaded()
            self._held[key] = _Holder(base_model, what, num_bytes, pinned, self._clock())
            if loads:
                log.info(
                    "base model %s loaded (%s, %.1f MiB; model memory %.1f of %.1f MiB)",
                    base_model,
                    what,
                    num_bytes / MIB,
                    self._used() / MIB,
                    self.budget_bytes / MIB,
                )
            return released

    def room_for(self, num_bytes: int, *, keep: Collection[str] = ()) -> bool:
        """Whether `num_bytes` more would fit once every releasable sampler not in `keep`
        is released (`admit` would not refuse them)."""
        with self._lock:
            return self._room_for(num_bytes, keep=keep)

    def refusal(self, base_model: str, *, what: str, num_bytes: int) -> OverBudget:
        """The 503 `admit` answers when `what` cannot fit."""
        with self._lock:
            return OverBudget(self._refusal(base_model, what=what, num_bytes=num_bytes))

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def use(self, key: str) -> None:
        """Mark `key` used now (a sample on a shared sampler)."""
        with self._lock:
            if key in self._held:
                self._held[key].last_used = self._clock()

    def release(self, key: str) -> None:
        """Forget `key` (a dropped training model, a sampler that failed to build)."""
        with self._lock:
            if key in self._held:
                self._release(key, why="no longer used")

    def release_idle(self, *, keep: Collection[str] = ()) -> list[str]:
        with self._lock:
            return self._release_idle(keep=keep)

    def clear(self) -> None:
        """Forget everything (what held it is gone: a generator rank that died)."""
        with self._lock:
            self._held.clear()

    def loaded(self) -> dict[str, int]:
        """Bytes held per loaded base model."""
        held: dict[str, int] = {}
        for holder in list(self._held.values()):
            held[holder.base_model] = held.get(holder.base_model, 0) + holder.num_bytes
        return held

    def _used(self) -> int:
        return sum(holder.num_bytes for holder in self._held.values())

    def _room_for(self, num_bytes: int, *, keep: Collection[str]) -> bool:
        kept = sum(h.num_bytes for k, h in self._held.items() if h.pinned or k in keep)
        return kept + num_bytes <= self.budget_bytes

    def _release_idle(self, *, keep: Collection[str] = ()) -> list[str]:
        now = self._clock()
        idle = [
            key
            for key, holder in self._held.items()
            if not holder.pinned and key not in keep and now - holder.last_used > self.idle_seconds
        ]
        why = f"idle for {self.idle_seconds:g} s (--model-idle-seconds)"
        return [self._release(key, why=why) for key in idle]

    def _release(self, key: str, *, why: str) -> str:
        holder = self._held.pop(key)
        if holder.base_model not in self.loaded():
            log.info("base model %s released: its %s was %s", holder.base_model, holder.what, why)
        return key

    def _refusal(self, base_model: str, *, what: str, num_bytes: int) -> str:
        if num_bytes > self.budget_bytes:  # finishing sessions cannot help
            return (
                f"base model {base_model} cannot be loaded: {what} needs "
                f"{num_bytes / MIB:.1f} MiB, more than the whole {self.budget_name} "
                f"(--model-memory-mb {self.budget_bytes / MIB:g}); raise --model-memory-mb"
            )
        holders = "; ".join(
            f"{holder.what} on {holder.base_model} ({holder.num_bytes / MIB:.1f} MiB)"
            for holder in self._held.values()
        )
        return (
            f"base model {base_model} cannot be loaded: {what} needs {num_bytes / MIB:.1f} MiB "
            f"and the {self.budget_name} (--model-memory-mb {self.budget_bytes / MIB:g}) "
            f"has {(self.budget_bytes - self._used()) / MIB:.1f} MiB free, held by "
            f"{holders or 'nothing'}; finish the sessions that hold training models, or "
            "raise --model-memory-mb"
        )
