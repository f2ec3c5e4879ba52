"""WeightSync: one object owns a trainer's weight versions, the lock on them and its snapshots.

A sampling client made by a training client is a `Snapshot` of one version of the trainer's
weights for as long as it lives. With full fine-tuning the trainer's sampler reads the
trainer's own parameters (no copy); with LoRA the adapters are merged into the sampler's own
copy in memory (so is a sharded trainer's gathered weights, or another dtype's).

Copy-on-write keeps older snapshots valid. The lock keeps the trainer from changing weights
while a sampler reads them, and just before the weights change the snapshot of the current
weights, if one is still alive, gets them for itself: when the sampler reads the trainer's own
tensors, one private copy made before optim_step / load_state; when it has its own copy, that
copy, while the next snapshot builds a new one. A loop that drops its sampling client before
the next optimizer step never copies.

This module knows nothing of clients: SamplingClient reads through its Snapshot, and
TrainingClient wraps its weight changes in `changing()` and asks `snapshot()` for new clients.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

from temper.client.sampler_weights import sampler_model, sampler_update
from temper.models.build import materialize
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import Tokenizer
from temper.trainer.engine import TrainerEngine


class Snapshot:
    """One policy version as its sampling clients see it; every client taken of one version
    of a trainer's weights shares it.

    While it is the trainer's current snapshot its engine is the trainer's sampler (perhaps
    on the trainer's own tensors), read under the WeightSync's lock; before that sampler or
    those tensors change, the WeightSync gives it an engine of its own (`keep`). A snapshot
    without a WeightSync (a client made from a checkpoint or a base model) owns its engine.
    """

    def __init__(
        self, *, engine: SamplerEngine, version: int, sync: WeightSync | None = None
    ) -> None:
        self.version = version
        self._engine = engine
        self._sync = sync  # None once the engine is this snapshot's own

    @property
    def engine(self) -> SamplerEngine:
        return self._engine

    @contextlib.contextmanager
    def reading(self) -> Iterator[SamplerEngine]:
        """The engine to use; weights shared with a trainer are held against changes."""
        sync = self._sync
        if sync is None:  # an engine of its own never becomes shared again
            yield self._engine
            return
        with sync.holding():
            yield self._engine  # read under the lock: `keep` may have swapped it meanwhile

    def keep(self, engine: SamplerEngine) -> None:
        """Serve this version from `engine`, which no change of the trainer's weights
        touches, from now on (the WeightSync calls it under its lock, before the change)."""
        self._engine, self._sync = engine, None


class WeightSync:
    """The weight versions of one trainer, the lock on them, its sampler and its live snapshot.

    Every call but `holding()` runs on the training client's worker, so calls that change the
    weights and calls that take snapshots come in order.
    """

    def __init__(
        self,
        *,
        trainer: TrainerEngine,
        sampler_config: SamplerEngine.Config,
        tokenizer: Tokenizer,
    ) -> None:
        self._trainer = trainer
        self._sampler_config = sampler_config
        self._tokenizer = tokenizer
        # Held while the trainer changes weights and while a sampler reads shared weights.
        self._lock = threading.Lock()
        self._generation = 0  # bumped by every change of the trainer's weights
        self._sampler: SamplerEngine | None = None  # built by the first snapshot
        self._synced_generation = -1  # the generation self._sampler holds
        # The snapshot that reads self._sampler; weak, so a snapshot nobody holds costs nothing.
        self._current: weakref.ref[Snapshot] | None = None
        self._num_snapshots = 0

    @property
    def num_snapshots(self) -> int:
        """Times a live snapshot was given the old weights before a change."""
        return self._num_snapshots

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """No change of the trainer's weights while inside (a sampler reads them)."""
        with self._lock:
            yield

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Around every change of the trainer's weights (optim_step, load_state)."""
        with self._lock:
            if self._sampler is not None and self._sampler.model is self._trainer.model:
                # The sampler reads these very tensors: a live snapshot copies them first.
                self._detach(self._private_copy)
            try:
                yield
            finally:
                self._generation += 1

    def snapshot(self) -> Snapshot:
        """The trainer's current weights, brought into its sampler if they changed."""
        with self._lock:
            current = None if self._current is None else self._current()
            if current is not None and self._synced_generation == self._generation:
                return current
            self._sync_sampler()
            current = Snapshot(
                engine=self._sampler, version=self._trainer.policy_version, sync=self
            )
            self._current = weakref.ref(current)
            return current

    def _sync_sampler(self) -> None:
        """Build or update the trainer's sampler to the current weights (under the lock)."""
        trainer = self._trainer
        if self._sampler is not None and self._synced_generation == self._generation:
            return
        if self._sampler is not None and self._sampler.model is not trainer.model:
            # The update below rewrites the sampler's own copy (LoRA merge, gathered shards,
            # another dtype): a live snapshot keeps the old copy.
            old_sampler = self._sampler
            if self._detach(lambda: old_sampler):
                self._sampler = None
        if self._sampler is None:
            self._sampler = self._sampler_config.build(
                model=sampler_model(trainer.model, lora=trainer.lora), tokenizer=self._tokenizer
            )
        self._sampler.update_weights(
            sampler_update(trainer.model, lora=trainer.lora), version=trainer.policy_version
        )
        self._synced_generation = self._generation

    def _detach(self, make_engine: Callable[[], SamplerEngine]) -> bool:
        """Give the live snapshot that reads the trainer's sampler an engine of its own
        (`make_engine()`, called only if there is one); returns whether there was."""
        current = None if self._current is None else self._current()
        self._current = None
        if current is None:
            return False
        current.keep(make_engine())
        self._num_snapshots += 1
        return True

    def _private_copy(self) -> SamplerEngine:
        """A sampler on a private copy of the trainer's current (plain, unsharded) weights."""
        model = self._trainer.model
        parameter = next(model.parameters())
        copy = materialize(
            model.config, device=parameter.device, dtype=parameter.dtype, init="empty"
        )
        engine = self._sampler_config.build(model=copy, tokenizer=self._tokenizer)
        engine.update_weights(model.state_dict(), version=self._trainer.policy_version)
        return engine
