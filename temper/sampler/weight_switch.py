"""WeightSwitch: newer weights offered to a generator while it decodes, taken between steps.

An in-flight sampling target (temper/client/inflight.py) is one generator whose weights
follow a trainer's in-flight saves. A save must not wait for the sequences being decoded, and
those sequences go on with the newer weights: the save `offer`s the weights (a private copy,
so the trainer may step on) and returns; the generator takes them at its next chance:

- before a call starts (`take`), for every generator;
- between two decode steps of Temper's engine (`between_steps`, which the engine calls at the
  top of each turn of its decode loop when the hook is set). The keys and values already in
  the KV cache stay: the next step feeds the old cache to the new weights. Only the newest
  offer is kept; an older one not yet taken is dropped.
- between two engine steps of vLLM (`between_vllm_steps`, generator/vllm.py's hook on its
  step driver, generator/vllm_steps.py): the same, over vLLM's KV cache; the requests still
  decoding then are noted by their position in the call, all samples of a request together
  (a sample that finished before its siblings is reported with their versions too).
- between two decode steps of a multi-LoRA sampler (generator/multi_lora.py), which `pop`s
  an offer (a registered adapter version) and moves the rows of the target's call to it,
  `note`-ing the switch here.

It also records which weight versions each sequence of the call ran under (`spans`): at each
switch the sequences in their slots then span both versions. A sequence that starts and ends
within one turn of the loop (one sampled token) is reported with the versions of the whole
call (a superset: it ran under one of them).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from temper.api.types import SampleResponse
from temper.sampler.weight_source import WeightUpdate


class WeightSwitch:
    """A one-slot mailbox of newer weights for one generator; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[WeightUpdate, int] | None = None
        self._call_versions: list[int] = []
        self._spans: dict[tuple[int, int], list[int]] = {}
        self._request_spans: dict[int, list[int]] = {}  # by request, every sample (vLLM)
        self.num_switches = 0
        """Switches taken between decode steps (not at a call's start)."""

    @property
    def has_pending(self) -> bool:
        with self._lock:
            return self._pending is not None

    def offer(self, weights: WeightUpdate, *, version: int) -> None:
        """Weights for the generator to take at its next chance (replaces an older offer)."""
        with self._lock:
            self._pending = (weights, version)

    def take(self, generator: Any) -> bool:
        """Load the pending offer into `generator` now (it must not be decoding); returns
        whether there was one."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        weights, version = pending
        generator.update_weights(weights, version=version)
        return True

    # -- the engine's hook -------------------------------------------------------------------

    def begin_call(self, *, version: int) -> None:
        """A call starts on weights `version` (after `take`)."""
        self._call_versions = [version]
        self._spans = {}
        self._request_spans = {}

    def between_steps(self, engine: Any) -> bool:
        """Called by `SamplerEngine.generate` between decode steps: take a pending offer into
        `engine` and note it against the sequences in their slots; returns whether the
        weights changed (the engine then rebuilds its step function)."""
        if self._pending is None:  # unlocked peek: the common case costs one read
            return False
        pending = self.pop()
        if pending is None:
            return False
        slots = engine.slots
        before = engine.version
        active = [slots.owners[slot] for slot in range(slots.num_active)]
        weights, version = pending
        engine.switch_weights(weights, version=version)  # on the loop's thread: no barrier
        self.note(active, before=before, after=engine.version)
        return True

    def between_vllm_steps(self, generator: Any) -> bool:
        """Called by a vLLM generator between engine steps, on its stepping thread: take a
        pending offer (`switch_weights`: no task queue, no barrier) and note it against the
        requests still decoding; returns whether the weights changed."""
        pending = self.pop()
        if pending is None:
            return False
        before = generator.version
        decoding = generator.requests_in_flight()
        weights, version = pending
        generator.switch_weights(weights, version=version)
        self.num_switches += 1
        self._call_versions.append(generator.version)
        for index in decoding:
            self._request_spans.setdefault(index, [before]).append(generator.version)
        return True

    def pop(self) -> tuple[WeightUpdate, int] | None:
        """The pending offer (weights, version), taken out of the mailbox; None if none."""
        if self._pending is None:  # unlocked peek (see `between_steps`)
            return None
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def put_back(self, weights: WeightUpdate, *, version: int) -> None:
        """A popped offer that could not be taken yet, back in the mailbox (unless a newer
        one arrived meanwhile)."""
        with self._lock:
            if self._pending is None:
                self._pending = (weights, version)

    def note(self, owners: Sequence[Any], *, before: int, after: int) -> None:
        """A switch between decode steps from weights `before` to `after`, under the sequences
        of `owners` (the call's `SlotOwner`s in their slots then)."""
        self.num_switches += 1
        self._call_versions.append(after)
        for owner in owners:
            spans = self._spans.setdefault((owner.state.index, owner.sample_index), [before])
            spans.append(after)

    def stamped(self, responses: Sequence[SampleResponse]) -> list[SampleResponse]:
        """`responses` with each sequence's `weight_versions` (see the module docstring)."""
        whole_call = tuple(sorted(set(self._call_versions)))
        out = []
        for index, response in enumerate(responses):
            sequences = []
            for sample, sequence in enumerate(response.sequences):
                spans = self._spans.get((index, sample)) or self._request_spans.get(index)
                versions = _first_version(spans, whole_call)
                sequences.append(dataclasses.replace(sequence, weight_versions=versions))
            out.append(dataclasses.replace(response, sequences=sequences))
        return out


def _first_version(spans: list[int] | None, whole_call: tuple[int, ...]) -> tuple[int, ...]:
    """A sequence seen at a switch spans the versions noted; one never seen at a switch ran
    on one version of the call: the only one, or (a call with switches) one of them."""
    if spans is not None:
        return tuple(dict.fromkeys(spans))
    return whole_call[:1] if len(whole_call) == 1 else whole_call
