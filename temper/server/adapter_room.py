"""Room for LoRA adapters on a base model's multi-LoRA sampler (generator/multi_lora.py).

LoRA models on one base share its weights and, with Temper's engine, one multi-LoRA sampler;
each live sampling snapshot of theirs holds one adapter version there, at most
`--multi-lora.max-adapters`. Before a model takes a snapshot at that limit, the least
recently sampled snapshots of the LoRA models on the same base are evicted (sampling on one
answers 404 naming the setting); when none is left to evict (each model keeps its newest
version), the snapshot is refused with 429 naming the setting. `check_room` answers that 429
before the request is queued, when it is already certain.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from temper.generator.multi_lora import MultiLoraSampler
from temper.server.errors import TooManyRequests
from temper.server.sessions import ServedModel

if TYPE_CHECKING:
    from temper.server.server import TemperServer


def shares_base(config: TemperServer.Config, served: ServedModel) -> bool:
    """A LoRA model shares its base's weights (a sharded trainer, --nproc, does not)."""
    return served.is_lora and config.trainer.sharding is None


def shares_sampler(config: TemperServer.Config, served: ServedModel) -> bool:
    """Its snapshots sample on the base's multi-LoRA sampler."""
    return (
        shares_base(config, served)
        and config.multi_lora.enabled
        and config.generator.backend == "temper"
    )


def sampler_reads_trainer(config: TemperServer.Config) -> bool:
    """A full fine-tuning model's sampler decodes on the trainer's own tensors (one process,
    Temper's engine; client/sampler_weights.py): it holds no copy of the weights."""
    return config.trainer.sharding is None and config.generator.backend == "temper"


def snapshot_bytes(config: TemperServer.Config, served: ServedModel) -> int | None:
    """What a snapshot of `served` holds once its weights change: its adapters on the
    multi-LoRA sampler, else None (a sampler copy: the retention's default)."""
    if not shares_sampler(config, served):
        return None
    return served.lora_rank * served.base.lora_bytes_per_rank


def adapter_sampler(served: ServedModel) -> MultiLoraSampler | None:
    training = served.training
    return None if training is None else getattr(training, "adapter_sampler", None)


def make_room(server: TemperServer, served: ServedModel) -> None:
    """Evict snapshots until `served`'s next adapter version fits (on its queue)."""
    sampler = adapter_sampler(served)
    if sampler is None:
        return
    limit = sampler.config.max_adapters
    reason = (
        f"evicted to make room on its base model's multi-LoRA sampler (--multi-lora."
        f"max-adapters {limit} adapter versions; the least recently used goes first)"
    )
    models = server.lora_models_on(served.base.name)
    while sampler.num_adapters >= limit:
        evicted = server.snapshots.evict_oldest(models, reason=reason)
        if evicted is None:
            raise TooManyRequests(
                _full(served, sampler) + ", and none is an older snapshot to evict"
            )
        server.forget_snapshots([evicted])
        if sampler.num_adapters >= limit:
            gc.collect()  # an adapter in a reference cycle leaves the count only now


def check_room(server: TemperServer, served: ServedModel) -> None:
    """429 before queueing a snapshot that `make_room` could not make room for."""
    sampler = adapter_sampler(served)
    if sampler is None or sampler.num_adapters < sampler.config.max_adapters:
        return
    if not server.snapshots.has_snapshots(server.lora_models_on(served.base.name)):
        raise TooManyRequests(_full(served, sampler))


def _full(served: ServedModel, sampler: MultiLoraSampler) -> str:
    return (
        f"the multi-LoRA sampler of base model {served.base.name!r} holds "
        f"{sampler.num_adapters} adapter versions, its limit (--multi-lora.max-adapters "
        f"{sampler.config.max_adapters}); raise it or finish sessions"
    )
