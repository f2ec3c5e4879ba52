"""MultiLoraSampler: one engine on a shared base serving many LoRA adapters, rows mixed.

Many LoRA clients of one base model sample through one `SamplerEngine` whose model carries
adapter slots (models/multi_lora.py): one copy of the base weights and one KV-cache pool for
all of them, and the requests of different adapters decode in the same batch, each row with
its own adapter.

- An `Adapter` is one adapter version: its config and a private copy of its tensors in host
  memory (`store_device`, the CPU by default), made when it is registered and never written
  afterwards; sampling snapshots hold one each (a few MiB, not a model).
- Resident slots: the engine's model holds up to `max_resident_adapters` adapters on its
  device. A call joining the engine's batch takes its adapter's resident slot, else loads it
  between decode steps into a free slot, else into the least recently used slot that no
  running or joining call uses (an idle adapter thus goes back to host memory only, where its
  copy already is); with every slot in use it waits for one to free.
- Capacity: at most `max_adapters` adapters are registered at once (live ones; an adapter
  nobody holds is forgotten); registering one more raises `AdapterCapacityError`, which
  names the setting (the server answers 429). Memory thus stays bounded; nothing OOMs.
- Batching: `generate` calls (from the sampling workers of different clients) join the
  engine's running batch at its next decode step (sampler/decode_loop.py), rows of every
  adapter in one forward; each call returns when its own sequences are done, with its own
  results or its own error (a bad request fails only its call).

`AdapterView` is the `Generator` one training client's snapshots use: this sampler plus one
adapter version. An in-flight target's view (client/inflight.py) has a `WeightSwitch`: an
adapter version offered there while its call decodes is taken between two decode steps, the
call's rows going on with it over the keys and values cached so far. It goes into the slot
the call uses, in place, when no other call or score holds that slot; else into another slot,
and the call's rows are repointed there (other calls' rows keep their slots).

On CPU the engine decodes on the model itself (no fused or packed twin, no helper processes:
those copy plain weights); on CUDA without graphs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from temper.api.types import SampleResponse
from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.models.lora import LoraConfig
from temper.models.multi_lora import install_slots, load_adapter, set_rows
from temper.sampler.engine import SamplerEngine
from temper.sampler.requests import RequestState, SampleRequest
from temper.sampler.weight_source import WeightUpdate
from temper.sampler.weight_switch import WeightSwitch
from temper.tokenizer import Tokenizer

MIB = 2**20


class AdapterCapacityError(RuntimeError):
    """More live adapters than `MultiLoraSampler.Config.max_adapters`."""


def check_capacity(*, held: int, config: MultiLoraSampler.Config) -> None:
    """AdapterCapacityError, naming the setting, when `held` versions fill the sampler."""
    if held >= config.max_adapters:
        raise AdapterCapacityError(
            f"{held} LoRA adapter versions are held (every live sampling snapshot of a LoRA "
            f"model holds one), the most this sampler takes (MultiLoraSampler.Config."
            f"max_adapters = {config.max_adapters}; temper serve: --multi-lora.max-adapters); "
            "drop sampling clients or raise it"
        )


@dataclass(frozen=True, eq=False)
class Adapter:
    """One adapter version: config and tensors (`lora_state_dict` names), never written."""

    config: LoraConfig
    tensors: Mapping[str, torch.Tensor]
    version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(eq=False)
class _Joined:
    """A call in the engine's batch: its request states and the adapter slot it holds."""

    states: Sequence[RequestState]
    slot: int
    follow: AdapterView | None
    """An in-flight target's view whose offers the call takes between steps."""
    switched: bool = False


class MultiLoraSampler(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        max_resident_adapters: int = 32
        """Adapters held on the engine's device at once (slots); a batch with more runs in
        rounds, and idle ones make room (their copy stays in host memory)."""
        max_adapters: int = 1024
        """Adapter versions registered at once (every live LoRA sampling snapshot holds
        one); one more is refused with a capacity error naming this setting."""
        store_device: str = "cpu"
        """Where registered adapters are kept while not resident."""
        batch_window_s: float = 0.002
        """vLLM's multi-LoRA sampler (generator/vllm_lora.py): a call that finds the engine
        idle waits for calls of other clients to decode with, while they keep coming within
        this of each other (at most ten times this). Temper's engine needs no window: calls
        join its running batch at the next decode step."""
        enabled: bool = True
        """False: each LoRA client samples merged weights in a sampler of its own (a whole
        copy of the weights and a KV cache each; on CPU a single adapter decodes faster
        there)."""

        def __post_init__(self) -> None:
            owner = "MultiLoraSampler.Config"
            check_range(
                self.batch_window_s,
                field=f"{owner}.batch_window_s",
                at_least=0,
                at_most=1,
                hint="seconds",
            )
            for name in ("max_resident_adapters", "max_adapters"):
                value = getattr(self, name)
                check_range(value, field=f"{owner}.{name}", integer=True, at_least=1)

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        tokenizer: Tokenizer | None,
        engine: SamplerEngine.Config,
    ) -> None:
        """`model`: a plain model on the shared base weights (only read); `engine`: the
        sampler settings, used without the CPU twins and helper processes."""
        self.config = config
        install_slots(model)
        cpu = dataclasses.replace(engine.cpu, packed_linear="off", fused_projections=False)
        engine = dataclasses.replace(engine, cpu=cpu)
        # Built directly: a process split would copy plain weights to its helpers.
        self.engine = SamplerEngine(engine, model=model, tokenizer=tokenizer)
        self._live: weakref.WeakSet[Adapter] = weakref.WeakSet()
        self._registry_lock = threading.Lock()
        self._resident: OrderedDict[int, weakref.ref[Adapter]] = (
            OrderedDict()
        )  # slot -> adapter, LRU first
        self._pins: dict[int, int] = {}  # slot -> calls and scores using it (slot lock)
        self._slot_lock = threading.Lock()
        self._following: list[_Joined] = []  # joined calls of in-flight targets (loop thread)
        self.engine.between_steps = self._take_offers
        self.num_loads = 0
        """Adapters copied into a slot so far."""

    @property
    def num_batches(self) -> int:
        """Times the engine started decoding from idle (calls that join a running batch do
        not count)."""
        return self.engine.loop.num_batches

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_adapters(self) -> int:
        with self._registry_lock:
            return len(self._live)

    def register(
        self, *, config: LoraConfig, tensors: Mapping[str, torch.Tensor], version: int
    ) -> Adapter:
        """A new adapter version with a private copy of `tensors` (see the module docstring)."""
        with self._registry_lock:
            check_capacity(held=len(self._live), config=self.config)
            device = self.config.store_device
            copies = {name: t.detach().to(device, copy=True) for name, t in tensors.items()}
            adapter = Adapter(config=config, tensors=copies, version=version)
            self._live.add(adapter)
            return adapter

    def generate(
        self,
        requests: Sequence[SampleRequest],
        *,
        adapter: Adapter,
        follow: AdapterView | None = None,
    ) -> list[SampleResponse]:
        """`requests` sampled with `adapter`, joining the engine's running batch. `follow`: an
        in-flight target's view; the adapter versions offered to its switch while the call
        decodes are taken between steps (see the module docstring)."""
        joined: list[_Joined] = []  # the call, once it joined

        def gate(states: Sequence[RequestState]) -> int | None:
            slot = self._pin(adapter)
            if slot is not None:
                joined.append(_Joined(states=states, slot=slot, follow=follow))
                if follow is not None:
                    self._following.append(joined[0])
            return slot

        def done() -> None:
            call = joined[0]
            if call.follow is not None:
                self._following.remove(call)
                if call.switched:  # keys and values of two versions: never a prefix again
                    self.engine.forget_prefixes(adapter=call.slot)
            self._unpin(call.slot)

        return self.engine.generate(requests, adapter_gate=gate, on_done=done)

    def _take_offers(self, engine: SamplerEngine) -> bool:
        """The engine's hook between decode steps (on its driving thread): each following
        call takes the newest adapter version offered to its target. Returns False: the
        base weights stay, and the forwards read the adapter slots as they are."""
        for call in self._following:
            assert call.follow is not None and call.follow.switch is not None
            switch = call.follow.switch
            offer = switch.pop()
            if offer is None:
                continue
            update, version = offer
            assert isinstance(update, Registered) and isinstance(update.adapter, Adapter)
            with self._slot_lock:
                slot = self._switch_slot(call.slot, adapter=update.adapter)
            if slot is None:  # every other slot is held by running calls: at the next step
                switch.put_back(update, version=version)
                continue
            before = call.follow.version
            call.follow.adapter = update.adapter
            owners = engine.repoint(call.states, adapter=slot)
            call.slot, call.switched = slot, True
            switch.note(owners, before=before, after=version)
        return False

    def _switch_slot(self, slot: int, *, adapter: Adapter) -> int | None:
        """Where a call holding `slot` goes on with `adapter` (slot lock held): `slot` itself,
        loaded in place, when the call alone holds it; else another slot, pinned for the call
        in place of `slot`; None when every other slot is held."""
        if self._pins[slot] == 1:
            self.engine.forget_prefixes(adapter=slot)
            load_adapter(self.engine.model, slot, config=adapter.config, tensors=adapter.tensors)
            self.num_loads += 1
            self._resident[slot] = weakref.ref(adapter)
            self._resident.move_to_end(slot)
            return slot
        other = self._resident_slot(adapter)
        if other is None:
            return None
        self._pins[other] = self._pins.get(other, 0) + 1
        self._release(slot)
        return other

    def score(
        self, sequences: Sequence[Sequence[int]], *, adapter: Adapter, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Full forwards on this thread (beside the decode loop, which only reads the
        weights); the adapter is made resident between decode steps."""
        slot = None
        while slot is None:
            slot = self.engine.loop.between_steps(lambda: self._pin(adapter))
            if slot is None:
                time.sleep(0.005)  # every slot in use by running calls
        try:
            set_rows(self.engine.model, slot)
            return self.engine.score(sequences, temperature=temperature)
        finally:
            self._unpin(slot)

    def _pin(self, adapter: Adapter) -> int | None:
        """The slot holding `adapter`, loaded if need be, and held until `_unpin`; None when
        every slot is in use (between decode steps, on the loop's driving thread)."""
        with self._slot_lock:
            slot = self._resident_slot(adapter)
            if slot is None:
                return None
            self._pins[slot] = self._pins.get(slot, 0) + 1
            return slot

    def forget_adapter_prefixes(self, adapter: Adapter) -> None:
        """Drop the cached prefixes of `adapter`'s slot, if it is resident (an in-flight
        client's prefix-cache namespace ends: temper/client/inflight.py); between steps."""

        def forget() -> None:
            with self._slot_lock:
                for slot, ref in self._resident.items():
                    if ref() is adapter:
                        self.engine.forget_prefixes(adapter=slot)

        self.engine.loop.between_steps(forget)

    def _unpin(self, slot: int) -> None:
        with self._slot_lock:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    def _resident_slot(self, adapter: Adapter) -> int | None:
        """The slot of `adapter`, loading it into a free or unpinned slot (None: none is)."""
        for slot, ref in list(self._resident.items()):
            held = ref()
            if held is None and slot not in self._pins:
                del self._resident[slot]  # its adapter was dropped: the slot is free
            elif held is adapter:
                self._resident.move_to_end(slot)
                return slot
        slot = self._free_slot()
        if slot is None:
            return None
        self.engine.forget_prefixes(adapter=slot)  # they were computed with the old adapter
        load_adapter(self.engine.model, slot, config=adapter.config, tensors=adapter.tensors)
        self.num_loads += 1
        self._resident[slot] = weakref.ref(adapter)
        return slot

    def _free_slot(self) -> int | None:
        for slot in range(self.config.max_resident_adapters):
            if slot not in self._resident and slot not in self._pins:
                return slot
        for slot in self._resident:  # least recently used first
            if slot not in self._pins:
                del self._resident[slot]
                return slot
        return None

    def describe(self) -> str:
        return (
            f"multi-LoRA sampler: {self.num_adapters} adapters, at most "
            f"{self.config.max_resident_adapters} resident; {self.engine.describe()}"
        )


class AdapterVersion(Protocol):
    """One registered adapter version, as its sampler hands it out."""

    @property
    def version(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class AdapterSampler(Protocol):
    """A sampler of many adapters on one base: Temper's engine (`MultiLoraSampler`) or vLLM
    (generator/vllm_lora.py), with the same capacity rules (`MultiLoraSampler.Config`)."""

    config: MultiLoraSampler.Config

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_adapters(self) -> int: ...

    def register(
        self, *, config: LoraConfig, tensors: Mapping[str, torch.Tensor], version: int
    ) -> AdapterVersion: ...

    def generate(
        self, requests: Sequence[SampleRequest], *, adapter: Any
    ) -> list[SampleResponse]: ...

    def score(
        self, sequences: Sequence[Sequence[int]], *, adapter: Any, temperature: float = 1.0
    ) -> list[torch.Tensor]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Registered:
    """An adapter version already registered on a view's sampler, as a weight update: an
    in-flight save registers its adapter when it is made (so a full sampler refuses the
    save, not a later sample) and offers it to the target's switch."""

    adapter: AdapterVersion


class AdapterView:
    """The `Generator` of one LoRA trainer's snapshots: a shared sampler and one adapter
    version (replaced, not written, by `update_weights`: a version that fails to register
    leaves the previous one serving)."""

    holds_one_version = False

    def __init__(self, sampler: AdapterSampler, *, config: LoraConfig) -> None:
        self.sampler = sampler
        self.lora = config
        self.adapter: AdapterVersion | None = None
        self.switch: WeightSwitch | None = None
        """An in-flight target's (client/inflight.py): on Temper's multi-LoRA sampler a call
        takes the versions offered there between decode steps; elsewhere at the next call."""

    @property
    def model(self) -> None:
        return None  # it reads its own copy of the adapters, never the trainer's tensors

    @property
    def version(self) -> int:
        return 0 if self.adapter is None else self.adapter.version

    @property
    def vocab_size(self) -> int:
        return self.sampler.vocab_size

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """`source`: the trainer's adapter tensors (`lora_state_dict`), or a version already
        `registered`."""
        if isinstance(source, Registered):
            self.adapter = source.adapter
            return
        if not isinstance(source, Mapping):
            raise TypeError(
                "AdapterView.update_weights takes adapter tensors by name, got "
                f"{type(source).__name__}"
            )
        self.adapter = self.sampler.register(config=self.lora, tensors=source, version=version)

    def registered(self, tensors: Mapping[str, torch.Tensor], *, version: int) -> Registered:
        """`tensors` registered on the sampler as a version to switch to later."""
        return Registered(self.sampler.register(config=self.lora, tensors=tensors, version=version))

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        if self.switch is not None and isinstance(self.sampler, MultiLoraSampler):
            return self.sampler.generate(requests, adapter=self._current(), follow=self)
        return self.sampler.generate(requests, adapter=self._current())

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        return self.sampler.score(sequences, adapter=self._current(), temperature=temperature)

    def _current(self) -> AdapterVersion:
        if self.adapter is None:
            raise RuntimeError("AdapterView: no adapter yet (update_weights first)")
        return self.adapter

    def sleep(self) -> None:
        """Nothing: the engine and its cache are shared with other adapters."""

    def wake_up(self) -> None:
        """Nothing (see `sleep`)."""

    def describe(self) -> str:
        size = 0 if self.adapter is None else self.adapter.nbytes
        return (
            f"LoRA adapter version {self.version} ({size / MIB:.1f} MiB) on a "
            f"{self.sampler.describe()}"
        )

    def close(self) -> None:
        """Nothing: the shared sampler outlives its views."""
