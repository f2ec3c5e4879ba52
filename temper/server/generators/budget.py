"""The model memory of each generator rank of a disaggregated server, counted on rank 0.

Every generator rank has the budget one process has (--model-memory-mb), and rank 0 counts
what it sends each rank with the estimates one process uses (state/base_models.py, from
job/model_bytes.py), in a `ModelMemory` per rank (state/model_memory.py):

- the sampler of a base model or of a sampler checkpoint (`LoadBase`, `LoadCheckpoint`) is
  *releasable*, as a shared sampler is in one process: its weights and KV cache, released
  when idle for --model-idle-seconds or, least recently used first, to make room on its rank
  (never while a call on it is routed or running there). Its sampling sessions stay valid:
  the next call loads it again, on whichever rank has room;
- a LoRA snapshot (`LoadAdapter`) counts its adapter tensors, and the multi-LoRA sampler of
  its base that every LoRA snapshot on that rank shares (the base's weights and KV cache),
  held while an adapter on it is;
- a whole-weights snapshot (`LoadWeights`) counts its tensors and a sampler's caches;
- an in-flight target (`LoadInflight`) counts as its snapshot does, with two versions of
  its adapters (the one its calls decode on and the next).

Snapshots are pinned: rank 0 drops them by the snapshot retention rules (state/snapshots.py),
which count them in the snapshot budget as one process does. A load that fits no live rank
is refused with the 503 one process answers (`OverBudget`), naming the budget of a generator
rank and what holds it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from temper.observability.process_memory import device_memory_bytes
from temper.server.generators.messages import (
    Load,
    LoadAdapter,
    LoadBase,
    LoadCheckpoint,
    LoadInflight,
    LoadWeights,
)
from temper.server.state.base_models import BaseModels, load_base_model, model_dirs
from temper.server.state.config import ServerConfig
from temper.server.state.model_memory import MIB, ModelMemory, OverBudget


@dataclass(frozen=True)
class Holding:
    """One thing a load makes its rank hold, as the budget counts it."""

    key: str
    base_model: str
    what: str
    num_bytes: int
    pinned: bool


class LoadSizes:
    """What each load holds on a generator rank (the module docstring's estimates)."""

    def __init__(self, base_models: BaseModels) -> None:
        self.base_models = base_models

    @classmethod
    def of_config(cls, config: ServerConfig) -> LoadSizes:
        """The estimates of the server's models and sampler settings (config.json only)."""
        dirs = model_dirs(
            models=config.model, sample_only=config.sample_only_model, models_dir=config.models_dir
        )
        return cls(
            BaseModels(
                [
                    load_base_model(
                        path, trainable=trainable, sampler=config.sampler, dtype=config.dtype
                    )
                    for path, trainable in dirs
                ]
            )
        )

    def holdings(self, load: Load) -> list[Holding]:
        if isinstance(load, LoadInflight):
            held = self.holdings(load.load)
            if isinstance(load.load, LoadAdapter):
                adapters = held[-1]
                what = f"in-flight target of {load.load.model_id}: two adapter versions"
                held[-1] = replace(adapters, what=what, num_bytes=2 * adapters.num_bytes)
            return held
        base = self.base_models.resolve(load.base_model)
        if isinstance(load, (LoadBase, LoadCheckpoint)):
            source = "the base model" if isinstance(load, LoadBase) else load.model_path
            what = f"sampler of {source}"
            return [Holding(load.key, base.name, what, base.sampler_bytes, pinned=False)]
        snapshot = f"snapshot of {load.model_id} (version {load.version})"
        if isinstance(load, LoadAdapter):
            shared = Holding(
                shared_sampler_key(base.name),
                base.name,
                "multi-LoRA sampler its LoRA snapshots share",
                base.sampler_bytes,
                pinned=True,
            )
            adapters = Holding(load.key, base.name, f"{snapshot}: adapters", load.nbytes, True)
            return [shared, adapters]
        assert isinstance(load, LoadWeights), load
        caches = base.sampler_bytes - base.weights_bytes  # KV cache and prefix cache
        return [Holding(load.key, base.name, snapshot, load.nbytes + caches, pinned=True)]


class RankMemory:
    """One generator rank's budget: which loads it holds and what they count."""

    def __init__(
        self, *, rank: int, budget_bytes: int, idle_seconds: float, sizes: LoadSizes
    ) -> None:
        self.rank = rank
        self.sizes = sizes
        self.memory = ModelMemory(
            budget_bytes=budget_bytes,
            idle_seconds=idle_seconds,
            budget_name=f"model memory budget of generator rank {rank}",
        )
        self._adapters: dict[str, set[str]] = {}  # shared sampler key -> adapter load keys

    def room_for(self, load: Load, *, keep: Collection[str]) -> bool:
        """Whether `load` fits here once the releasable samplers not in `keep` are gone."""
        return self.memory.room_for(self._missing_bytes(load), keep=keep)

    def free_for(self, load: Load) -> bool:
        """Whether `load` fits here with nothing released."""
        used = sum(self.memory.loaded().values())
        return used + self._missing_bytes(load) <= self.memory.budget_bytes

    def admit(self, load: Load, *, keep: Collection[str]) -> list[str]:
        """Count `load` as held here (nothing if it is); returns the keys of the samplers
        released to make room (their rank must drop them). OverBudget if it cannot fit."""
        released: list[str] = []
        added: list[str] = []
        try:
            for holding in self.sizes.holdings(load):
                if self.memory.holds(holding.key):
                    continue
                released += self.memory.admit(
                    holding.key,
                    base_model=holding.base_model,
                    what=holding.what,
                    num_bytes=holding.num_bytes,
                    pinned=holding.pinned,
                    keep=keep,
                )
                added.append(holding.key)
        except OverBudget:
            for key in added:
                self.memory.release(key)
            raise
        adapter = load.load if isinstance(load, LoadInflight) else load
        if isinstance(adapter, LoadAdapter):
            shared = shared_sampler_key(self.sizes.base_models.resolve(adapter.base_model).name)
            self._adapters.setdefault(shared, set()).add(load.key)
        return released

    def refusal(self, load: Load) -> OverBudget:
        """The 503 for `load` on this rank, naming its budget and what holds it."""
        holdings = self.sizes.holdings(load)
        return self.memory.refusal(
            holdings[0].base_model,
            what=" and ".join(holding.what for holding in holdings),
            num_bytes=self._missing_bytes(load),
        )

    def use(self, key: str) -> None:
        self.memory.use(key)

    def release(self, key: str) -> None:
        """Forget `key`; the last adapter on a multi-LoRA sampler releases the sampler."""
        self.memory.release(key)
        for shared, keys in list(self._adapters.items()):
            keys.discard(key)
            if not keys:
                del self._adapters[shared]
                self.memory.release(shared)

    def release_idle(self, *, keep: Collection[str]) -> list[str]:
        return self.memory.release_idle(keep=keep)

    def clear(self) -> None:
        self.memory.clear()
        self._adapters.clear()

    def _missing_bytes(self, load: Load) -> int:
        return sum(h.num_bytes for h in self.sizes.holdings(load) if not self.memory.holds(h.key))


def shared_sampler_key(base_model: str) -> str:
    return f"multi-LoRA sampler of {base_model}"


def generator_budget_bytes(config: ServerConfig, *, nproc: int) -> int:
    """One generator rank's model memory budget: `model_memory_mb`, or half its device's
    memory (on CPU half the machine's RAM over the `nproc` ranks that share it)."""
    if config.model_memory_mb is not None:
        return int(config.model_memory_mb * MIB)
    device_bytes = device_memory_bytes(config.device)
    if torch.device(config.device).type == "cpu":
        device_bytes //= nproc
    return device_bytes // 2
