"""The base models one server serves: their names, shapes, capabilities and memory estimates.

Each served model is a HF model directory, given with `--model DIR` (trainable and
sampleable), `--sample-only-model DIR` (sampling and prompt logprobs only: a teacher, grader
or answerer) or found in `--models-dir DIR` (every directory inside with a config.json,
trainable). A directory given as sample-only is sample-only wherever else it is listed.
Reading a model's config.json is all that happens at startup; weights load on first use
(model_memory.py).

A client may name a model by its canonical name (the directory's absolute path, which
get_info and the capabilities answer with), the string it was given as, the directory's name,
or its parent's name and its own as a HF repo id names a model (`Qwen/Qwen3-8B` for
/models/Qwen/Qwen3-8B, so the tinker SDK's model names find a download laid out that way); a
name two models share is refused at startup. A name with Tinker's variant suffix
`:peft:<context>` (`Qwen/Qwen3.6-35B-A3B:peft:262144`, the cookbook's rl_numerics_check
default) names the model without it: the variant selects a context length on Tinker, and here
each model samples up to its own context (docs/server.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from temper.checkpoint.composite import text_config
from temper.checkpoint.hf import read_hf_config
from temper.distributed.world import trainer_world
from temper.generator.choice import GeneratorChoice
from temper.job.model_bytes import ModelShapes, SamplerBytes, TrainerBytes
from temper.models.common.decoder import DecoderConfig
from temper.models.registry import family_for_hf_config, family_of_config
from temper.sampler.engine import SamplerEngine
from temper.server.http.errors import BadRequest, NotFound
from temper.trainer.sharding import Sharding

VARIANT_SUFFIX = re.compile(r":peft:\d+$")
"""Tinker's variant suffix on a model name (`<name>:peft:<context length>`)."""


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    vocab_size: int
    max_seq_len: int
    """Longest training sequence."""
    max_sample_len: int
    """Longest prompt + completion a sampler holds."""


@dataclass(frozen=True, kw_only=True)
class TrainerShare:
    """What one rank of a sharded trainer (--nproc) holds of a model: its FSDP shards of the
    weights, adapters, gradients and moments, as `temper plan` counts them
    (job/model_bytes.py: `TrainerBytes.of` over `num_ranks`, padding included)."""

    shapes: ModelShapes
    """The trainer's parameters, LoRA applied at rank 1 (`with_lora_rank` scales them)."""
    num_ranks: int
    """Ranks one copy of the weights is split over (the trainer's ranks / dp_replicate)."""
    dtype: str

    def held(self, *, lora_rank: int | None) -> TrainerBytes:
        """One rank's shard of a LoRA model at `lora_rank` (frozen base, trained adapters),
        or with None of a full fine-tuning model (every weight trained)."""
        shard = TrainerBytes.of(
            self.shapes.with_lora_rank(lora_rank or 0), dtype=self.dtype, num_ranks=self.num_ranks
        )
        if lora_rank is None:
            return TrainerBytes(frozen=0, trained=shard.frozen)
        return shard


@dataclass(frozen=True, kw_only=True)
class BaseModel:
    name: str
    """Canonical name: the directory's absolute path (get_info's model_name and tokenizer_id,
    so the SDK's `get_tokenizer()` loads it offline)."""
    names: frozenset[str]
    """Every name a client may use for it."""
    arch: str
    limits: ModelLimits
    trainable: bool
    sampleable: bool
    weights_bytes: int
    """Its parameters in the served dtype (a full copy; LoRA clients share one)."""
    sampler_bytes: int
    """One sampler on it: weights, KV cache (--sampler.max-batch x --sampler.max-seq-len) and
    at most its prefix cache."""
    merged_sampler_bytes: int
    """One sampler on a LoRA model's merged weights: `sampler_bytes`, and for a model with
    tied embeddings its untied output projection (merging the unembedding adapter unties it)."""
    lora_bytes_per_rank: int
    """Adapter parameters of rank 1 on every target (attention, MLP, unembedding), in the
    served dtype; rank R takes R times this."""
    trainer_share: TrainerShare | None = None
    """With a sharded trainer (--nproc), what one rank holds of a training model; None: a
    trainer holds whole tensors (one process)."""

    def trainer_bytes(self, *, lora_rank: int | None) -> TrainerBytes:
        """What one rank's trainer holds of a training model on this base (LoRA at
        `lora_rank`, or full fine-tuning with None): whole tensors, or its shard of them."""
        if self.trainer_share is not None:
            return self.trainer_share.held(lora_rank=lora_rank)
        if lora_rank is None:
            return TrainerBytes(frozen=0, trained=self.weights_bytes)
        return TrainerBytes(frozen=self.weights_bytes, trained=lora_rank * self.lora_bytes_per_rank)

    def training_bytes(
        self,
        *,
        lora_rank: int | None,
        shared_base: bool = True,
        shared_sampler: bool = False,
        sampler_reads_trainer: bool = True,
        sampler: bool = True,
    ) -> int:
        """Estimate for one training model on one rank (job/model_bytes.py): what it trains
        (every weight for full fine-tuning, else its adapters) with their gradients and AdamW
        moments, and the sampler its snapshots read. A sharded trainer (--nproc) holds its
        rank's shard of all that (`trainer_bytes`), and every rank's sampler whole merged
        weights. A LoRA model's frozen base weights are shared by every LoRA model on this base
        and counted once, as `weights_bytes` (server.py), unless not `shared_base` (a sharded
        trainer: each model has its own); with `shared_sampler` the base's multi-LoRA sampler
        is counted there too, and a model adds its adapters. A full fine-tuning model's sampler
        decodes on the trainer's own tensors when `sampler_reads_trainer` (one process,
        Temper's engine), adding only its caches. Without `sampler` the snapshots sample
        elsewhere (generator ranks, server/generators/budget.py): the trainer alone."""
        held = self.trainer_bytes(lora_rank=lora_rank)
        if not sampler:
            return held.total
        if lora_rank is None:
            sampler = self.sampler_bytes
            if sampler_reads_trainer:
                sampler -= self.weights_bytes
            return held.total + sampler
        trainer = TrainerBytes(frozen=0 if shared_base else held.frozen, trained=held.trained)
        # A sampling snapshot's (whole) adapters, or a merged sampler of its own.
        adapters = lora_rank * self.lora_bytes_per_rank
        sampler = adapters if shared_sampler else self.merged_sampler_bytes
        return trainer.total + sampler

    def sampler_copy_bytes(self, *, lora: bool) -> int:
        """What an older sampling snapshot's own sampler holds (snapshots.py): the plain
        sampler, or a LoRA model's merged one."""
        return self.merged_sampler_bytes if lora else self.sampler_bytes

    def shared_bytes(self, *, shared_sampler: bool) -> int:
        """What the LoRA models on this base share, counted once: its weights, or with
        `shared_sampler` the multi-LoRA sampler that reads them (weights and KV cache)."""
        return self.sampler_bytes if shared_sampler else self.weights_bytes

    def lora_model_bytes(
        self, *, lora_rank: int, shared_base: bool, shared_sampler: bool, sampler: bool = True
    ) -> int:
        """A LoRA training model with what it cannot do without: `training_bytes`, and the
        weights it shares with other LoRA models when it shares them (`shared_base`)."""
        shared = self.shared_bytes(shared_sampler=shared_sampler) if shared_base else 0
        return shared + self.training_bytes(
            lora_rank=lora_rank,
            shared_base=shared_base,
            shared_sampler=shared_sampler,
            sampler=sampler,
        )

    def largest_lora_rank(
        self, *, budget_bytes: int, shared_base: bool, shared_sampler: bool, sampler: bool = True
    ) -> int:
        """The largest LoRA rank whose training model (`lora_model_bytes`) fits `budget_bytes`
        with nothing else held; 0 when not even rank 1 fits. A search, since the estimate
        grows with the rank but not in equal steps on a sharded trainer (FSDP pads a shard of
        an adapter's R rows to ceil(R / ranks))."""
        sharing = {"shared_base": shared_base, "shared_sampler": shared_sampler, "sampler": sampler}

        def fits(lora_rank: int) -> bool:
            return self.lora_model_bytes(lora_rank=lora_rank, **sharing) <= budget_bytes

        if not fits(1):
            return 0
        assert self.lora_model_bytes(lora_rank=2, **sharing) > self.lora_model_bytes(
            lora_rank=1, **sharing
        ), "a LoRA adapter of a higher rank holds more parameters"
        low, high = 1, 2  # fits(low), and high is doubled until it does not fit
        while fits(high):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


class BaseModels:
    """The served base models, looked up by any of their names."""

    def __init__(self, models: list[BaseModel]) -> None:
        assert models, "a server serves at least one model"
        self.models = models
        self._by_name: dict[str, BaseModel] = {}
        for model in models:
            for name in model.names:
                other = self._by_name.setdefault(name, model)
                if other is not model:
                    raise ValueError(
                        f"two served models answer to the name {name!r}: {other.name} and "
                        f"{model.name}; serve directories with distinct names"
                    )

    def __iter__(self):
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def first(self) -> BaseModel:
        return self.models[0]

    def resolve(self, name: str) -> BaseModel:
        """The served model called `name` (with or without a `:peft:NNN` variant suffix); 404
        naming the served ones otherwise."""
        model = self._by_name.get(name) or self._by_name.get(VARIANT_SUFFIX.sub("", name))
        if model is None:
            raise NotFound(f"base model {name!r} is not served here; {self.summary()}")
        return model

    def trainable(self, name: str) -> BaseModel:
        """The served model called `name` if it can be trained; 400 saying why otherwise."""
        model = self.resolve(name)
        if not model.trainable:
            trainable = [m.name for m in self.models if m.trainable]
            raise BadRequest(
                f"base model {name!r} is served for sampling only (--sample-only-model), so "
                f"it cannot be trained; trainable models here: {trainable}"
            )
        return model

    def largest_sampler_copy(self, *, lora: bool) -> int:
        """The most an older sampling snapshot of a trainable model holds (snapshots.py)."""
        trainable = [model for model in self.models if model.trainable]
        return max((model.sampler_copy_bytes(lora=lora) for model in trainable), default=0)

    def summary(self) -> str:
        described = [
            f"{model.name!r}" + ("" if model.trainable else " (sample-only)")
            for model in self.models
        ]
        return f"this server serves {', '.join(described)}"


def model_dirs(
    *, models: list[str], sample_only: list[str], models_dir: str | None
) -> list[tuple[str, bool]]:
    """(directory as given, trainable) for each served model, in order: --model, then
    --models-dir, then --sample-only-model; one entry per directory."""
    given = [(path, True) for path in models]
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"--models-dir {models_dir}: no such directory")
        found = sorted(child for child in root.iterdir() if (child / "config.json").is_file())
        if not found:
            raise FileNotFoundError(
                f"--models-dir {models_dir} holds no HF model directory (one with config.json)"
            )
        given += [(str(child), True) for child in found]
    given += [(path, False) for path in sample_only]
    sample_only_dirs = {_canonical(path) for path in sample_only}
    entries: dict[str, tuple[str, bool]] = {}
    for path, trainable in given:
        canonical = _canonical(path)
        if canonical not in entries:
            entries[canonical] = (path, trainable and canonical not in sample_only_dirs)
    return list(entries.values())


def load_base_model(
    path: str,
    *,
    trainable: bool,
    sampler: SamplerEngine.Config,
    dtype: str,
    trainer_shards: int = 1,
) -> BaseModel:
    """Read a model directory's config (not its weights). `trainer_shards`: ranks a sharded
    trainer splits one copy of a model's weights over (1: a trainer holds whole tensors)."""
    model_dir = Path(path).expanduser()
    decoder = read_model_config(path)
    arch = family_of_config(decoder).name
    # Shapes of models built on the meta device: nothing is allocated.
    plain = ModelShapes.of(decoder, lora_rank=None)
    adapted = ModelShapes.of(decoder, lora_rank=1)
    name = str(model_dir.resolve())
    return BaseModel(
        name=name,
        names=frozenset({path, name, model_dir.name, str(model_dir), _repo_id(model_dir)}),
        arch=arch,
        limits=ModelLimits(
            vocab_size=decoder.vocab_size,
            max_seq_len=decoder.max_seq_len,
            max_sample_len=min(decoder.max_seq_len, sampler.max_seq_len),
        ),
        trainable=trainable,
        sampleable=True,
        weights_bytes=TrainerBytes.of(plain, dtype=dtype).weights,
        lora_bytes_per_rank=TrainerBytes.of(adapted, dtype=dtype).trained,
        sampler_bytes=SamplerBytes.of_engine(decoder, plain, engine=sampler, dtype=dtype).total,
        merged_sampler_bytes=SamplerBytes.of_engine(
            decoder, adapted, engine=sampler, dtype=dtype
        ).total,
        trainer_share=None
        if trainer_shards == 1
        else TrainerShare(shapes=adapted, num_ranks=trainer_shards, dtype=dtype),
    )


def trainer_shards(sharding: Sharding.Config | None) -> int:
    """Ranks a trainer with `sharding` splits one copy of a model's weights over, as `temper
    plan` counts them: the trainer's ranks (every rank, colocated) / dp_replicate; 1
    unsharded."""
    if sharding is None:
        return 1
    return trainer_world().size // sharding.dims.dp_replicate


def read_model_config(path: str) -> DecoderConfig:
    """The model config of a directory's config.json (its text model's), or a ValueError
    naming the directory."""
    hf_config = text_config(read_hf_config(Path(path).expanduser()))
    try:
        return family_for_hf_config(hf_config).config_from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"model directory {path}: {error}") from None


def check_generator(paths: list[str], *, generator: GeneratorChoice.Config, dtype: str) -> None:
    """Refuse, at startup, a served model the generator backend cannot run on this machine in
    `dtype` (vLLM's CPU build and a hybrid model: generator/vllm_hybrid.py), naming the
    directory; the first request for it would fail otherwise."""
    for path in paths:
        try:
            generator.check_model(read_model_config(path), dtype=dtype)
        except ValueError as error:
            raise ValueError(f"model directory {path}: {error}") from None


def describe(model: BaseModel) -> dict:
    return {
        "name": model.name,
        "trainable": model.trainable,
        "limits": dataclasses.asdict(model.limits),
        "weights_mib": round(model.weights_bytes / 2**20, 1),
    }


def _canonical(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _repo_id(model_dir: Path) -> str:
    """'<parent>/<name>' of the directory (its absolute path, symlinks kept): the name a
    HF repo id gives a model downloaded under it. Two directories share it only if they share
    their name too, so it adds no clash of names."""
    absolute = Path(os.path.abspath(model_dir))
    return f"{absolute.parent.name}/{absolute.name}"
