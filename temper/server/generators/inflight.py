"""The in-flight targets a generator rank holds (`LoadInflight`), and their clients.

One target per key (a training model's in-flight clients on rank 0 share it), built and moved
on by the same `InflightTarget` as in one process (client/inflight.py): the first save a rank
gets builds it on those weights; each later one is offered to it, and its call in progress
takes it between two decode steps. Each in-flight client on rank 0 is a prefix-cache
namespace, numbered there and sent with every call; this rank keeps one `SamplingClient` per
target and namespace, so the calls of one client decode together as they do in one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from temper.api.futures import Worker
from temper.client.inflight import InflightTarget, engine_of_its_own
from temper.client.sampling_client import SamplingClient
from temper.generator.seam import Generator
from temper.server.generators.messages import LoadAdapter, LoadInflight, LoadWeights
from temper.tokenizer import Tokenizer

Build = Callable[[LoadAdapter | LoadWeights], tuple[Generator, Tokenizer, object]]
"""A generator holding no weights yet for a load, its tokenizer, and what must live as long as
it (a LoRA target's shared base)."""


@dataclass(eq=False)
class _Held:
    target: InflightTarget
    tokenizer: Tokenizer
    worker: Worker
    save: int
    keep: object
    clients: dict[int, SamplingClient] = field(default_factory=dict)  # by namespace


class InflightTargets:
    def __init__(self, *, build: Build, worker: Callable[[str], Worker]) -> None:
        """`build`: the rank's generators for a load; `worker`: a training model's sampling
        worker on this rank."""
        self._build = build
        self._worker = worker
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    def load(self, op: LoadInflight) -> None:
        """Build the target of `op.key` on its weights, or offer them to it (on the link's
        reader: loads arrive one at a time, in rank 0's order)."""
        load = op.load
        with self._lock:
            held = self._held.get(op.key)
        if held is None:
            generator, tokenizer, keep = self._build(load)
            target = InflightTarget(engine_of_its_own(generator))
            target.publish(load.tensors, version=load.version)
            held = _Held(target, tokenizer, self._worker(load.model_id), save=op.save, keep=keep)
            with self._lock:
                self._held[op.key] = held
        elif op.save > held.save:  # an older save sent again (a rank loading it meanwhile)
            held.target.publish(load.tensors, version=load.version)
            held.save = op.save

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def client(self, key: str, *, namespace: int) -> SamplingClient | None:
        """The client of namespace `namespace` on the target of `key` (None: not held)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return None
            if namespace not in held.clients:
                held.clients[namespace] = SamplingClient(
                    snapshot=held.target.client(namespace=namespace),
                    worker=held.worker,
                    tokenizer=held.tokenizer,
                )
            return held.clients[namespace]

    def drop(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
