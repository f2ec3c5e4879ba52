"""In-flight sampling clients of a disaggregated server: rank 0's side.

A training model's in-flight target lives on the generator ranks (server/generators/
inflight.py); rank 0 keeps `RemoteTarget`, the target's key and its newest save (the adapter
tensors or whole weights the replayed `sampler_payload` gathered, in host memory, as for a
snapshot). Each in-flight save sends the newer weights to every generator rank holding the
target, which takes them between decode steps; a rank that gets the target later (first use,
load spreading, a rank that died) is sent the newest. The save returns once the ranks holding
the target have the weights, not when their calls in progress end.

`RemoteInflight` is one in-flight client: the target, the version saved when it was made, and
a prefix-cache namespace of its own, sent with each call.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator

from temper.api.futures import APIFuture
from temper.api.prompt_targets import PromptTargets
from temper.api.types import ModelInput, SampleResponse, SamplingParams
from temper.server.generators.messages import LoadAdapter, LoadInflight, LoadWeights, Sample, Score
from temper.server.generators.pool import GeneratorPool

_namespaces = itertools.count(1)


class RemoteTarget:
    """Rank 0's handle on one training model's in-flight target; the generator ranks forget
    it once this and every client on it are gone."""

    def __init__(self, pool: GeneratorPool, *, key: str) -> None:
        self.key = key
        self.pool = pool
        self._saves = 0
        self.load: LoadInflight | None = None
        """The newest save (what a rank that takes on the target is sent)."""
        weakref.finalize(self, pool.drop, key)

    def publish(self, load: LoadAdapter | LoadWeights) -> RemoteInflight:
        """Move the target to `load`'s weights (its key is the target's); a client on it."""
        assert load.key == self.key
        self._saves += 1
        inflight = LoadInflight(load=load, save=self._saves)
        self.pool.publish(inflight)
        if self.load is None:
            self.pool.place(inflight)  # a bad load fails the save that made it
        self.load = inflight
        return RemoteInflight(self, version=load.version)


class RemoteInflight:
    """Rank 0's `SamplingBackend` for one in-flight client (see the module docstring)."""

    def __init__(self, target: RemoteTarget, *, version: int) -> None:
        self._target = target
        self._pool = target.pool
        self._version = version
        self.namespace = next(_namespaces)

    @property
    def version(self) -> int:
        """The policy version saved when the client was made; samples run on it or newer."""
        return self._version

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: PromptTargets | None = None,
    ) -> APIFuture[SampleResponse]:
        options = dict(locals())  # the SamplingBackend.sample arguments, by name
        del options["self"], options["prompt"]
        op = Sample(self._target.key, prompt=prompt, options=options, namespace=self.namespace)
        return APIFuture(self._pool.call(self._newest(), op, sequences=op.num_sequences))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        op = Score(self._target.key, prompt=prompt, namespace=self.namespace)
        return APIFuture(self._pool.call(self._newest(), op))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Nothing to hold: calls that reach a generator rank together decode together."""
        yield

    def _newest(self) -> LoadInflight:
        load = self._target.load
        assert load is not None
        return load
