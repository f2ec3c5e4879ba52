"""Which models share a base model's weights and sampler, and room for LoRA adapters there.

LoRA models on one base share its weights (unless the trainer is sharded, --nproc) and one
multi-LoRA sampler (generator/multi_lora.py, or a vLLM engine: generator/vllm_lora.py); each
live sampling snapshot of theirs holds one adapter version there, at most
`--multi-lora.max-adapters`. The
server asks its backend how full that sampler is (`TrainingBackend.adapter_slots`). Before a
model takes a snapshot at that limit, the least recently sampled snapshots of the LoRA models
on the same base are evicted (sampling on one answers 404 naming the setting); when none is
left to evict (each model keeps its newest version), the snapshot is refused with 429 naming
the setting. `check_room` answers that 429 before the request is queued, when it is already
certain.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from temper.api.backend import AdapterSlots
from temper.server.http.errors import TooManyRequests
from temper.server.state.config import ServerConfig
from temper.server.state.sessions import ServedModel
from temper.server.state.snapshots import SnapshotRetention


class AdapterRoom:
    """The server's sharing rules (from its config) and its room for snapshot adapters."""

    def __init__(self, config: ServerConfig, *, snapshots: SnapshotRetention) -> None:
        self.config = config
        self.snapshots = snapshots

    def shares_base(self, served: ServedModel) -> bool:
        """A LoRA model shares its base's weights (a sharded trainer, --nproc, does not)."""
        return served.is_lora and self.config.trainer.sharding is None

    def shares_sampler(self, served: ServedModel) -> bool:
        """Its snapshots sample on the base's multi-LoRA sampler (Temper's engine or vLLM)."""
        return self.shares_base(served) and self.config.multi_lora.enabled

    def sampler_reads_trainer(self) -> bool:
        """A full fine-tuning model's sampler decodes on the trainer's own tensors (one
        process, Temper's engine; client/sampler_weights.py): it holds no copy of the weights."""
        return self.config.trainer.sharding is None and self.config.generator.backend == "temper"

    def samplers_on_generator_ranks(self) -> bool:
        """Every sampler runs on a generator rank (a disaggregated placement), whose own
        budget counts it (server/generators/budget.py), not this process's."""
        return self.config.placement.mode == "disaggregated"

    def snapshot_bytes(self, served: ServedModel) -> int | None:
        """What a snapshot of `served` holds once its weights change: its adapters on the
        multi-LoRA sampler, else None (a sampler copy: the retention's default)."""
        if not self.shares_sampler(served):
            return None
        return served.lora_rank * served.base.lora_bytes_per_rank

    def make_room(
        self,
        served: ServedModel,
        *,
        lora_models: set[str],
        forget: Callable[[list[str]], None],
    ) -> None:
        """Evict snapshots of `lora_models` (the LoRA models on `served`'s base) until
        `served`'s next adapter version fits; `forget` drops the evicted ones' sampling
        sessions, which frees their adapters. Runs on the model's queue."""
        slots = _slots(served)
        if slots is None:
            return
        reason = (
            f"evicted to make room on its base model's multi-LoRA sampler (--multi-lora."
            f"max-adapters {slots.limit} adapter versions; the least recently used goes first)"
        )
        while slots.held >= slots.limit:
            evicted = self.snapshots.evict_oldest(lora_models, reason=reason)
            if evicted is None:
                raise TooManyRequests(
                    _full(served, slots) + ", and none is an older snapshot to evict"
                )
            forget([evicted])
            slots = _slots(served)
            if slots.held >= slots.limit:
                gc.collect()  # an adapter in a reference cycle leaves the count only now
                slots = _slots(served)

    def check_room(self, served: ServedModel, *, lora_models: set[str]) -> None:
        """429 before queueing a snapshot that `make_room` could not make room for."""
        slots = _slots(served)
        if slots is None or slots.held < slots.limit:
            return
        if not self.snapshots.has_snapshots(lora_models):
            raise TooManyRequests(_full(served, slots))


def _slots(served: ServedModel) -> AdapterSlots | None:
    training = served.training
    return None if training is None else training.adapter_slots()


def _full(served: ServedModel, slots: AdapterSlots) -> str:
    return (
        f"the multi-LoRA sampler of base model {served.base.name!r} holds {slots.held} "
        f"adapter versions, its limit (--multi-lora.max-adapters {slots.limit}); raise it or "
        "finish sessions"
    )
