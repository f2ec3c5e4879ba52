"""WeightSync: one object owns a trainer's weight versions, the lock on them and its snapshots.

A sampling client made by a training client is a `Snapshot` of one version of the trainer's
weights for as long as it lives. With full fine-tuning Temper's engine reads the trainer's own
parameters (no copy); a LoRA client on a shared base registers a copy of its adapters on the
multi-LoRA sampler of that base (`AdapterFeed`); with a disaggregated placement the weights
are streamed to the generator ranks (`RemoteFeed`); otherwise the weights are merged or gathered
into the generator's own copy in memory (`MergedFeed`: LoRA on a private base, a sharded
trainer, another dtype, any vLLM engine). Every generator decodes in the trainer's compute
dtype: a 'bf16-mixed' trainer's fp32 weights reach it cast to bf16 at each sync (its own bf16
copy, refreshed in place when no snapshot holds the old one).

Copy-on-write keeps older snapshots valid. The lock keeps the trainer from changing weights
while a generator reads them, and just before the weights change the snapshot of the current
weights, if one is still alive, gets them for itself: when the generator reads the trainer's
own tensors, one private copy made before optim_step / load_state; when it has its own copy,
that copy, while the next snapshot builds a new one. A loop that drops its sampling client
before the next optimizer step never copies.

A generator that holds one version only (vLLM: a second copy would be a second engine) is
updated in place instead: the next snapshot waits until the requests already submitted on the
old one have run, then retires it, and a request made later on a retired snapshot is a
ValueError that says so (never a silent sample from newer weights).

The generator ranks of a disaggregated placement (`RemoteGenerator`) hold their weights apart
from the trainer and load them between requests themselves, so their reads take the lock only
to check and count themselves in: the trainer steps while they sample. When they overlap syncs
(`overlaps_sync`), the next snapshot sends them the new weights before it waits for the old
version's requests, outside the lock, and only then commits them.

This module knows nothing of clients: SamplingClient reads through its Snapshot, and
TrainingClient wraps its weight changes in `changing()` and asks `snapshot()` for new clients.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from torch import nn

from temper.checkpoint.gather import sampler_share
from temper.client.sampler_weights import sampler_model, sampler_update
from temper.generator.multi_lora import AdapterSampler, AdapterView
from temper.generator.remote import RemoteGenerator, RemoteGenerators
from temper.generator.seam import Generator
from temper.models.build import materialize
from temper.models.lora import lora_state_dict, merged_config
from temper.sampler.weight_source import WeightUpdate
from temper.tokenizer import Tokenizer
from temper.trainer.engine import TrainerEngine

NewGenerator = Callable[..., Generator]
"""Builds a generator: `new_generator(model=..., tokenizer=...)` (the service's backend)."""


class GeneratorFeed(Protocol):
    """How a trainer's weights reach its generator."""

    def generator(self) -> Generator:
        """A generator for the trainer's weights (loaded by `update_weights(weights())`)."""
        ...

    def weights(self) -> WeightUpdate:
        """What the generator loads for the trainer's current weights."""
        ...


class MergedFeed:
    """A generator on the trainer's own module (full fine-tuning), or on its own plain copy
    that takes merged LoRA weights, gathered shards or a cast: a mixed-precision trainer's
    generator decodes a copy in the trainer's compute dtype (bf16 of fp32 weights)."""

    def __init__(
        self, *, trainer: TrainerEngine, new_generator: NewGenerator, tokenizer: Tokenizer
    ) -> None:
        self._trainer, self._new_generator, self._tokenizer = trainer, new_generator, tokenizer

    def generator(self) -> Generator:
        trainer = self._trainer
        model = sampler_model(trainer.model, lora=trainer.lora, dtype=trainer.compute_dtype)
        return self._new_generator(model=model, tokenizer=self._tokenizer)

    def weights(self) -> WeightUpdate:
        return sampler_update(self._trainer.model, lora=self._trainer.lora)


class AdapterFeed:
    """A LoRA trainer's adapters, registered on a multi-LoRA sampler shared with the other
    clients of its base (generator/multi_lora.py): a version is a copy of the adapters."""

    def __init__(self, *, trainer: TrainerEngine, multi_lora: AdapterSampler) -> None:
        assert trainer.lora is not None
        self._trainer, self._multi_lora = trainer, multi_lora

    def generator(self) -> Generator:
        return AdapterView(self._multi_lora, config=self._trainer.lora)

    def weights(self) -> WeightUpdate:
        # In the base's dtype: a mixed-precision trainer keeps fp32 adapters on a bf16 base.
        dtype = self._trainer.compute_dtype
        return {name: t.to(dtype) for name, t in lora_state_dict(self._trainer.model).items()}


class RemoteFeed:
    """The generator ranks of a disaggregated placement (generator/remote.py): each version is
    streamed to them in buckets, every trainer rank sending its own rows of the sharded
    tensors and trainer rank 0 the rest whole (gathered, merged)."""

    def __init__(
        self, *, trainer: TrainerEngine, remote: RemoteGenerators, tokenizer: Tokenizer
    ) -> None:
        self._trainer, self._remote, self._tokenizer = trainer, remote, tokenizer

    def generator(self) -> Generator:
        model = self._trainer.model
        return self._remote.connect(
            model_config=merged_config(model),
            dtype=self._trainer.compute_dtype,
            tokenizer=self._tokenizer,
        )

    def weights(self) -> WeightUpdate:
        roles = self._remote.roles
        return sampler_share(self._trainer.model, lead=roles.rank == roles.trainer_ranks[0])


class Snapshot:
    """One policy version as its sampling clients see it; every client taken of one version
    of a trainer's weights shares it.

    While it is the trainer's current snapshot its generator is the trainer's (perhaps on the
    trainer's own tensors), read under the WeightSync's lock; before that generator or those
    tensors change, the WeightSync gives it a generator of its own (`keep`), or, for a
    generator that holds one version, retires it (`retire`). A snapshot without a WeightSync
    (a client made from a checkpoint or a base model) owns its generator.
    """

    def __init__(
        self, *, generator: Generator, version: int, sync: WeightSync | None = None
    ) -> None:
        self.version = version
        self._generator = generator
        self._sync = sync  # None once the generator is this snapshot's own
        self._retired: str | None = None  # why requests on it are refused
        self.pending: set[int] = set()
        """Ids of the requests submitted and not yet run (under the WeightSync's pending
        lock)."""

    @property
    def generator(self) -> Generator:
        return self._generator

    def check_usable(self) -> None:
        """A ValueError if this version was retired (see the module docstring)."""
        if self._retired is not None:
            raise ValueError(self._retired)

    def submitted(self, request: object) -> None:
        """`request` will read this snapshot (the WeightSync lets submitted requests run
        before it retires a snapshot)."""
        self.check_usable()
        if self._sync is not None:
            self._sync.submitted(self, request)

    @contextlib.contextmanager
    def reading(self, *, requests: Sequence[object] = ()) -> Iterator[Generator]:
        """The generator to use; weights shared with a trainer are held against changes.
        `requests`: the submitted requests this read runs (no longer pending after it)."""
        sync = self._sync
        if sync is None:  # a generator of its own never becomes shared again
            yield self._generator
            return
        if isinstance(self._generator, RemoteGenerator):
            with self._reading_remote(sync, requests=requests) as generator:
                yield generator
            return
        with sync.holding():
            try:
                self.check_usable()
                yield self._generator  # read under the lock: `keep` may have swapped it meanwhile
            finally:
                sync.ran(self, requests)

    @contextlib.contextmanager
    def _reading_remote(
        self, sync: WeightSync, *, requests: Sequence[object]
    ) -> Iterator[Generator]:
        """Generator ranks' weights: the read counts as a pending request (its version is not
        retired under it) and runs outside the lock."""
        read = object()
        with sync.holding():
            self.check_usable()
            sync.submitted(self, read)
        try:
            yield self._generator
        finally:
            with sync.holding():
                sync.ran(self, [*requests, read])

    def keep(self, generator: Generator) -> None:
        """Serve this version from `generator`, which no change of the trainer's weights
        touches, from now on (the WeightSync calls it under its lock, before the change)."""
        self._generator, self._sync = generator, None

    def retire(self, *, newer: int) -> None:
        """Refuse requests from now on: the generator moved to version `newer`."""
        self._retired = (
            f"this sampling client samples policy version {self.version}, which its generator "
            f"no longer holds: a {type(self._generator).__name__} keeps one version per training "
            f"model and now holds version {newer}; take a new sampling client "
            "(save_weights_and_get_sampling_client) for the new weights"
        )


class WeightSync:
    """The weight versions of one trainer, the lock on them, its generator and its live
    snapshot.

    Every call but `holding()` and the request counts runs on the training client's worker,
    so calls that change the weights and calls that take snapshots come in order.
    """

    def __init__(
        self,
        *,
        trainer: TrainerEngine,
        new_generator: NewGenerator,
        tokenizer: Tokenizer,
        feed: GeneratorFeed | None = None,
        sleep_while_training: bool = False,
    ) -> None:
        """`feed`: how the weights reach the generator; default `MergedFeed`.
        `sleep_while_training`: the generator releases its KV cache while the trainer runs
        forward_backward (`release_for_training`) and gets it back when next read."""
        self._trainer = trainer
        self._new_generator = new_generator
        self._tokenizer = tokenizer
        self._feed = feed or MergedFeed(
            trainer=trainer, new_generator=new_generator, tokenizer=tokenizer
        )
        # Held while the trainer changes weights and while a generator reads shared weights;
        # `_idle` waits on it for the requests pending on a snapshot about to be retired.
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # Guards the snapshots' pending sets: a request submitted while a generator decodes
        # (under `_lock`) is counted at once (the server submits from its event loop).
        self._pending_lock = threading.Lock()
        self._generation = 0  # bumped by every change of the trainer's weights
        self._generator: Generator | None = None  # built by the first snapshot
        self._synced_generation = -1  # the generation self._generator holds
        self._sent_generation = -1  # the generation sent ahead to self._generator, if any
        # The snapshot that reads self._generator; weak, so a snapshot nobody holds costs nothing.
        self._current: weakref.ref[Snapshot] | None = None
        self._num_snapshots = 0
        self._sleep_while_training = sleep_while_training
        self._asleep = False  # self._generator released its KV cache

    @property
    def num_snapshots(self) -> int:
        """Times a live snapshot was given the old weights before a change."""
        return self._num_snapshots

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """No change of the trainer's weights while inside (a generator reads them, awake)."""
        with self._lock:
            self._wake()
            yield

    def release_for_training(self) -> None:
        """Before the trainer's forward_backward: the generator lets its KV cache go, when
        asked to (`sleep_while_training`); the next read or sync takes it back."""
        if not self._sleep_while_training:
            return
        with self._lock:
            if self._generator is not None and not self._asleep:
                self._generator.sleep()
                self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            assert self._generator is not None
            self._generator.wake_up()
            self._asleep = False

    def submitted(self, snapshot: Snapshot, request: object) -> None:
        """Track the requests submitted on `snapshot` and not yet run, by identity (a batch
        that fails runs again request by request). Never waits for a read in progress."""
        with self._pending_lock:
            snapshot.pending.add(id(request))

    def ran(self, snapshot: Snapshot, requests: Sequence[object]) -> None:
        """`requests` of `snapshot` have run (called under the lock, inside `holding`)."""
        with self._pending_lock:
            snapshot.pending.difference_update(id(request) for request in requests)
            idle = not snapshot.pending
        if requests and idle:
            self._idle.notify_all()

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Around every change of the trainer's weights (optim_step, load_state)."""
        with self._lock:
            if self._generator is not None and self._generator.model is self._trainer.model:
                # The generator reads these very tensors: a live snapshot copies them first.
                self._detach(self._private_copy)
            try:
                yield
            finally:
                self._generation += 1

    def snapshot(self) -> Snapshot:
        """The trainer's current weights, brought into its generator if they changed."""
        self._send_ahead()
        with self._lock:
            current = None if self._current is None else self._current()
            if current is not None and self._synced_generation == self._generation:
                return current
            self._sync_generator()
            current = Snapshot(
                generator=self._generator, version=self._trainer.policy_version, sync=self
            )
            self._current = weakref.ref(current)
            return current

    def _sync_generator(self) -> None:
        """Build or update the trainer's generator to the current weights (under the lock)."""
        trainer = self._trainer
        self._wake()
        if self._generator is not None and self._synced_generation == self._generation:
            return
        if self._generator is not None and self._generator.holds_one_version:
            self._retire_current()
        elif self._generator is not None and self._generator.model is not trainer.model:
            # The update below rewrites the generator's own copy (LoRA merge, gathered
            # shards, another dtype): a live snapshot keeps the old copy.
            old_generator = self._generator
            if self._detach(lambda: old_generator):
                self._generator = None
        if self._generator is None:
            self._generator = self._feed.generator()
        if self._sent_generation == self._generation:
            assert isinstance(self._generator, RemoteGenerator)
            self._generator.commit_weights(version=trainer.policy_version)
        else:
            self._generator.update_weights(self._feed.weights(), version=trainer.policy_version)
        self._synced_generation = self._generation

    def _send_ahead(self) -> None:
        """Generator ranks that overlap syncs get the current weights before the old version's
        requests have run, outside the lock (on the training client's worker, the only
        thread that changes the weights)."""
        generator = self._generator
        if not (isinstance(generator, RemoteGenerator) and generator.overlaps_sync):
            return
        if self._generation in (self._synced_generation, self._sent_generation):
            return
        generator.send_weights(self._feed.weights(), version=self._trainer.policy_version)
        self._sent_generation = self._generation

    def _retire_current(self) -> None:
        """Let the requests submitted on the live snapshot run, then retire it (under the
        lock, which the wait gives up meanwhile)."""
        current = None if self._current is None else self._current()
        self._current = None
        if current is None:
            return
        self._idle.wait_for(lambda: self._no_pending(current))
        current.retire(newer=self._trainer.policy_version)

    def _no_pending(self, snapshot: Snapshot) -> bool:
        with self._pending_lock:
            return not snapshot.pending

    def _detach(self, make_generator: Callable[[], Generator]) -> bool:
        """Give the live snapshot that reads the trainer's generator one of its own
        (`make_generator()`, called only if there is one); returns whether there was."""
        current = None if self._current is None else self._current()
        self._current = None
        if current is None:
            return False
        current.keep(make_generator())
        self._num_snapshots += 1
        return True

    def _private_copy(self) -> Generator:
        """A generator on a private copy of the trainer's current (plain, unsharded) weights."""
        model: nn.Module = self._trainer.model
        parameter = next(model.parameters())
        copy = materialize(
            model.config, device=parameter.device, dtype=parameter.dtype, init="empty"
        )
        generator = self._new_generator(model=copy, tokenizer=self._tokenizer)
        generator.update_weights(model.state_dict(), version=self._trainer.policy_version)
        return generator
