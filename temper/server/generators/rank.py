"""A generator rank of a disaggregated server: every user's samplers that rank 0 placed here.

It holds an in-process `ServiceClient` for the server's sampler settings, and under keys that
rank 0 chooses: base-model samplers, sampler-checkpoint samplers and training snapshots (a
LoRA snapshot registers its adapter on the multi-LoRA sampler of its base, which every LoRA
snapshot on that base shares; a whole-weights snapshot gets a plain model and a generator of
its own). Base models load on first use. In-flight targets (server/generators/inflight.py)
are built from the same loads, and move on with each later in-flight save rank 0 sends.

The link's reader (one thread) runs loads and drops in arrival order, so a call that follows
a load on the link finds its sampler, and hands `Sample`/`Score` calls to a pool of threads:
many calls are in flight at once and those of one training model's snapshots decode together
(one `Worker` per training model, as in one process). A call that fails (bad input, a key this
rank does not hold) answers its error and the rank serves on; the rank ends when rank 0's
connection closes or its stdin does (the launcher stopping).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from typing import Any

from temper.api.futures import Worker
from temper.client.sampler_weights import resolve_base_model
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.shared_base import SharedBase
from temper.client.weight_sync import Snapshot
from temper.distributed.ranks import picklable_error
from temper.generator.multi_lora import AdapterSampler, AdapterView
from temper.generator.seam import Generator
from temper.models.build import materialize, parse_dtype
from temper.server.generators.inflight import InflightTargets
from temper.server.generators.messages import (
    Drop,
    Link,
    Load,
    LoadAdapter,
    LoadBase,
    LoadCheckpoint,
    LoadInflight,
    LoadWeights,
    Reply,
    Request,
    Sample,
    Score,
)
from temper.tokenizer import Tokenizer

log = logging.getLogger("temper.server")
MAX_CALLS = 256
"""Sample/score calls run at once on one generator rank (each waits on its sampler's batch)."""


class GeneratorRank:
    def __init__(self, service: ServiceClient, *, link: Link, index: int) -> None:
        self.service = service
        self.link = link
        self.index = index
        self.samplers: dict[str, SamplingClient] = {}
        self._owners: dict[str, str] = {}  # key -> training model id (snapshots only)
        self._workers: dict[str, Worker] = {}  # training model id -> its snapshots' worker
        self._tokenizers: dict[str, Tokenizer] = {}
        self._bases: dict[str, SharedBase] = {}  # key -> the shared base its adapter is on
        self._lock = threading.Lock()
        self._calls = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_CALLS, thread_name_prefix="temper-generator-call"
        )
        self.inflight = InflightTargets(build=self._inflight_generator, worker=self._worker)

    def serve(self) -> None:
        """Answer rank 0 until its connection closes."""
        try:
            while True:
                try:
                    request = self.link.receive()
                except (EOFError, OSError):
                    return
                if isinstance(request.op, (Sample, Score)):
                    self._calls.submit(self._answer, request)
                else:
                    self._answer(request)
        finally:
            self._calls.shutdown(wait=False, cancel_futures=True)
            self.samplers.clear()
            self.inflight.clear()

    def _answer(self, request: Request) -> None:
        try:
            reply = Reply(request.call_id, value=self._run(request.op))
        except Exception as error:
            reply = Reply(request.call_id, error=picklable_error(error))
        with contextlib.suppress(OSError):  # rank 0 gone: serve() ends at its next receive
            self.link.send(reply)

    def _run(self, op: object) -> Any:
        if isinstance(op, Sample):
            return self._sampler(op.key, op.namespace).sample(op.prompt, **op.options).result()
        if isinstance(op, Score):
            return self._sampler(op.key, op.namespace).compute_logprobs(op.prompt).result()
        if isinstance(op, Drop):
            self._drop(op.key)
            return None
        return self._load(op)

    def _sampler(self, key: str, namespace: int | None) -> SamplingClient:
        if namespace is not None:
            client = self.inflight.client(key, namespace=namespace)
        else:
            with self._lock:
                client = self.samplers.get(key)
        if client is None:
            raise ValueError(
                f"generator rank {self.index} does not hold sampler {key!r} (rank 0 reloads a "
                "snapshot a generator lost; this one was released)"
            )
        return client

    def _load(self, op: Load) -> None:
        service = self.service
        if isinstance(op, LoadInflight):
            self.inflight.load(op)
            with self._lock:
                self._owners[op.key] = op.load.model_id
            return
        if isinstance(op, LoadBase):
            client = service.create_sampling_client(base_model=op.base_model)
        elif isinstance(op, LoadCheckpoint):
            client = service.create_sampling_client(model_path=op.model_path)
        elif isinstance(op, LoadAdapter):
            client = self._adapter_client(op)
        else:
            client = self._weights_client(op)
        with self._lock:
            self.samplers[op.key] = client
            if isinstance(op, (LoadAdapter, LoadWeights)):
                self._owners[op.key] = op.model_id
        log.debug("generator %d holds %s", self.index, op.key)

    def _adapter_client(self, op: LoadAdapter) -> SamplingClient:
        view, shared = self._adapter_view(op)
        view.update_weights(op.tensors, version=op.version)
        with self._lock:  # the service holds its shared bases weakly: keep this one
            self._bases[op.key] = shared
        return SamplingClient(
            snapshot=Snapshot(generator=view, version=op.version),
            worker=self._worker(op.model_id),
            tokenizer=shared.tokenizer,
        )

    def _adapter_view(self, op: LoadAdapter) -> tuple[AdapterView, SharedBase]:
        """A view (no adapter yet) on the multi-LoRA sampler of `op`'s base, and that base."""
        service = self.service
        source = resolve_base_model(
            op.base_model,
            device=service.device,
            dtype=service.precision.base(lora=True),
        )
        shared = service.shared_bases.get(source)

        def make(model: Any) -> AdapterSampler:
            return service.generator_choice.adapter_sampler(
                service.multi_lora_config,
                engine=service.sampler_config,
                model=model,
                tokenizer=shared.tokenizer,
            )

        return AdapterView(shared.sampler(make), config=op.lora), shared

    def _weights_client(self, op: LoadWeights) -> SamplingClient:
        model = self._plain_model(op)
        model.load_state_dict(op.tensors, strict=True)
        tokenizer = self._tokenizer(op.base_model)
        generator = self.service.new_generator(model=model, tokenizer=tokenizer)
        return SamplingClient(
            snapshot=Snapshot(generator=generator, version=op.version),
            worker=self._worker(op.model_id),
            tokenizer=tokenizer,
        )

    def _plain_model(self, op: LoadWeights) -> Any:
        """A plain model of `op.model_config` in this rank's dtype (no weights loaded yet)."""
        service = self.service
        dtype = parse_dtype(service.generator_dtype)
        return materialize(op.model_config, device=service.device, dtype=dtype, init="empty")

    def _inflight_generator(
        self, op: LoadAdapter | LoadWeights
    ) -> tuple[Generator, Tokenizer, object]:
        """An in-flight target's generator for `op` (InflightTargets' `build`)."""
        if isinstance(op, LoadAdapter):
            view, shared = self._adapter_view(op)
            return view, shared.tokenizer, shared
        tokenizer = self._tokenizer(op.base_model)
        generator = self.service.new_generator(model=self._plain_model(op), tokenizer=tokenizer)
        return generator, tokenizer, None

    def _tokenizer(self, base_model: str) -> Tokenizer:
        with self._lock:
            if base_model not in self._tokenizers:
                service = self.service
                source = resolve_base_model(
                    base_model, device=service.device, dtype=service.generator_dtype
                )
                self._tokenizers[base_model] = source.build().tokenizer
            return self._tokenizers[base_model]

    def _worker(self, model_id: str) -> Worker:
        with self._lock:
            if model_id not in self._workers:
                self._workers[model_id] = Worker("temper-snapshot")
            return self._workers[model_id]

    def _drop(self, key: str) -> None:
        with self._lock:
            self.samplers.pop(key, None)
            self._bases.pop(key, None)
            self.inflight.drop(key)
            model_id = self._owners.pop(key, None)
            if model_id is not None and model_id not in self._owners.values():
                worker = self._workers.pop(model_id, None)
                if worker is not None:
                    worker.close(wait=False)
