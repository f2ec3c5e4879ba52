"""`temper plan serve [SERVE FLAGS]`: what each rank of `temper serve` would hold, per served
model, computed without starting it (config.json files are read, not weights).

The bytes are the estimates the server's model memory budget counts (server/state/
base_models.py, from job/model_bytes.py, the RL job's plan's pieces; a generator rank's:
server/generators/budget.py), so the plan says what the server admits. By placement:

- one process: every training model and sampler in one budget; the LoRA models on a base
  share its weights and multi-LoRA sampler (counted once), each adds its adapters, their
  gradients and AdamW moments.
- `--nproc N` (colocated): every rank holds its FSDP shard of each training model and a
  merged sampler for its snapshots; rank 0 also every base-model and checkpoint sampler.
- `--nproc N --placement.mode disaggregated --placement.generator_ranks G`: the N - G trainer
  ranks hold the shards only; each generator rank the samplers placed there: a model's
  sampler (weights, KV cache, prefix cache) for its base-model and checkpoint sampling and,
  on a trainable model, for its LoRA snapshots' adapters; a whole-weights snapshot (full
  fine-tuning) holds a sampler of its own.

A LoRA rank is the client's choice (`--lora-rank`, the SDK's default 32). Each rank's budget
is --model-memory-mb, or half the device's memory (`--gpu-memory-gib`, or on CPU this
machine's RAM over the ranks). Exit status: 0 when a sampler of every served model and one
training model of every trainable one each fit a rank's budget (the server answers 503 for
what does not), 1 when not, 2 for bad input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from temper.config import cli as config_cli

if TYPE_CHECKING:
    from temper.server import TemperServer
    from temper.server.state.base_models import BaseModel

GIB = 2**30
DEFAULT_LORA_RANK = 32
_OPTIONS = ("--lora-rank", "--gpu-memory-gib")


@dataclass(frozen=True)
class Item:
    """One thing a rank of a role holds for a model, and whether the plan requires it to fit."""

    model: str
    what: str
    num_bytes: int
    required: bool = True


@dataclass(frozen=True)
class Role:
    name: str
    """'one process', 'every rank', 'trainer ranks' or 'generator ranks'."""
    ranks: str
    items: list[Item]


def plan_serve(argv: Sequence[str]) -> int:
    """Print the serve plan of `argv` (serve's flags, `--nproc`, `--lora-rank`,
    `--gpu-memory-gib`); 0 when it fits, 1 when not. ValueError for bad input."""
    import tyro

    from temper.commands import serve_placement, serve_ranks
    from temper.config.cli import config_registry
    from temper.server import TemperServer

    nproc, _, args = serve_ranks.take_options(argv)
    options, args = config_cli.split_options(args, names=_OPTIONS)
    lora_rank = config_cli.count_option(options.get("--lora-rank"), flag="--lora-rank")
    gpu_memory_gib = _positive(options.get("--gpu-memory-gib", "80"), flag="--gpu-memory-gib")
    config = tyro.cli(
        TemperServer.Config, args=args, prog="temper plan serve", registry=config_registry()
    )
    serve_placement.check_placement(config, nproc=nproc)
    if nproc is not None:
        serve_ranks.check_models(config)
    roles = serve_roles(config, nproc=nproc, lora_rank=lora_rank or DEFAULT_LORA_RANK)
    budget = rank_budget_bytes(config, nproc=nproc or 1, gpu_memory_gib=gpu_memory_gib)
    text, fits = plan_text(roles, budget_bytes=budget)
    print(text)
    return 0 if fits else 1


def _positive(value: str, *, flag: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0 < number < float("inf"):
        raise ValueError(f"{flag} {value}: give a number > 0")
    return number


def serve_roles(config: TemperServer.Config, *, nproc: int | None, lora_rank: int) -> list[Role]:
    """What one rank of each role holds per served model (the module docstring)."""
    from temper.server.state.base_models import load_base_model, model_dirs

    disaggregated = config.placement.mode == "disaggregated"
    trainers = (nproc or 1) - (config.placement.generator_ranks if disaggregated else 0)
    sharding = config.trainer.sharding  # None: FSDP over the trainer ranks (serve_ranks.py)
    replicas = 1 if sharding is None else sharding.dims.dp_replicate
    shards = 1 if nproc is None else trainers // replicas
    dirs = model_dirs(
        models=config.model, sample_only=config.sample_only_model, models_dir=config.models_dir
    )
    bases = [
        load_base_model(
            path,
            trainable=trainable,
            sampler=config.sampler,
            dtype=config.dtype,
            trainer_shards=shards,
        )
        for path, trainable in dirs
    ]
    rank = None if config.fine_tuning == "full" else lora_rank
    if nproc is None:
        multi_lora = config.multi_lora.enabled
        items = [i for base in bases for i in _one_process(base, rank=rank, multi_lora=multi_lora)]
        return [Role("one process", "1", items)]
    trainer_items = [i for base in bases for i in _trainer(base, rank, samples=not disaggregated)]
    samplers = [_sampler(base) for base in bases]
    if not disaggregated:
        return [Role("every rank", f"{nproc} (rank 0 also samples)", trainer_items + samplers)]
    generators = config.placement.generator_ranks
    snapshots = [
        _snapshot(base, rank=rank, multi_lora=config.multi_lora.enabled)
        for base in bases
        if base.trainable
    ]
    return [
        Role("trainer ranks", f"{trainers} (FSDP over {shards})", trainer_items),
        Role("generator ranks", str(generators), samplers + snapshots),
    ]


def _one_process(base: BaseModel, *, rank: int | None, multi_lora: bool) -> list[Item]:
    items = [_sampler(base)]
    if not base.trainable:
        return items
    if rank is None:
        what = "each full fine-tuning model (weights x4; its sampler reads them)"
        return [*items, Item(base.name, what, base.training_bytes(lora_rank=None))]
    shared = "base weights and multi-LoRA sampler" if multi_lora else "base weights"
    first = base.lora_model_bytes(lora_rank=rank, shared_base=True, shared_sampler=multi_lora)
    each = base.training_bytes(lora_rank=rank, shared_sampler=multi_lora)
    return [
        *items,
        Item(base.name, f"first LoRA training model, rank {rank}, with the {shared}", first),
        Item(base.name, f"each further LoRA training model, rank {rank}", each, required=False),
    ]


def _trainer(base: BaseModel, rank: int | None, *, samples: bool) -> list[Item]:
    """A trainer rank's shard of one training model (and, colocated, its merged sampler)."""
    if not base.trainable:
        return []
    kind = "full fine-tuning model" if rank is None else f"LoRA training model, rank {rank}"
    held = "shard" + (" and merged sampler" if samples else "")
    num_bytes = base.training_bytes(
        lora_rank=rank, shared_base=False, sampler_reads_trainer=False, sampler=samples
    )
    return [Item(base.name, f"each {kind}: its {held}", num_bytes)]


def _sampler(base: BaseModel) -> Item:
    what = "sampler: weights, KV cache, prefix cache"
    return Item(base.name, what + ("" if base.trainable else " (sample-only)"), base.sampler_bytes)


def _snapshot(base: BaseModel, *, rank: int | None, multi_lora: bool) -> Item:
    if rank is not None and multi_lora:
        what = f"each LoRA snapshot: its adapters, rank {rank} (on the sampler above)"
        return Item(base.name, what, rank * base.lora_bytes_per_rank, required=False)
    copy = base.sampler_copy_bytes(lora=rank is not None)
    return Item(base.name, "each whole-weights snapshot: a sampler of its own", copy)


def rank_budget_bytes(config: TemperServer.Config, *, nproc: int, gpu_memory_gib: float) -> int:
    """One rank's model memory budget as the server sets it (state/server.py,
    generators/budget.py), `gpu_memory_gib` standing for a GPU's memory."""
    import torch

    from temper.observability.process_memory import device_memory_bytes

    if config.model_memory_mb is not None:
        return int(config.model_memory_mb * 2**20)
    if torch.device(config.device).type == "cuda":
        return int(gpu_memory_gib * GIB) // 2
    return device_memory_bytes("cpu") // nproc // 2


def plan_text(roles: list[Role], *, budget_bytes: int) -> tuple[str, bool]:
    """The plan as tables (one per role) and whether every required item fits a rank."""
    import io

    import rich.box
    import rich.console
    import rich.table

    from temper.job.memory_report import format_bytes

    out = io.StringIO()
    console = rich.console.Console(file=out, width=200, color_system=None, soft_wrap=True)
    fits = True
    for role in roles:
        console.print(f"{role.name}: {role.ranks}; budget {format_bytes(budget_bytes)} a rank")
        table = rich.table.Table("model", "item", "bytes", "fit a rank", box=rich.box.MARKDOWN)
        for item in role.items:
            count = budget_bytes // item.num_bytes if item.num_bytes else "-"
            fits &= not item.required or item.num_bytes <= budget_bytes
            table.add_row(item.model, item.what, format_bytes(item.num_bytes), str(count))
        console.print(table)
    console.print(f"verdict: {_verdict(roles, fits=fits)}")
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    return "\n".join(line for line in lines if line), fits


def _verdict(roles: list[Role], *, fits: bool) -> str:
    """'fits', or the largest item that fits no rank and the settings that make it fit."""
    if fits:
        return "fits"
    from temper.job.memory_report import format_bytes

    required = [item for role in roles for item in role.items if item.required]
    largest = max(required, key=lambda item: item.num_bytes)
    smaller = ", or lower --sampler.max-batch (its KV cache)" if "sampler" in largest.what else ""
    return (
        f"does NOT fit (the server answers 503 for what does not): {largest.model}'s "
        f"{largest.what.partition(':')[0]} needs {format_bytes(largest.num_bytes)}; raise "
        f"--model-memory-mb to at least {math.ceil(largest.num_bytes / 2**20)}{smaller}"
    )
