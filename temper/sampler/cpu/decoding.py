"""The CPU speed wing of the sampler: its settings, and the decode path it picks at build.

`SamplerEngine.Config.cpu` holds every CPU speed setting; none has an effect on CUDA. When a
CPU engine is built, `CpuDecoding` decides once what its decode steps run on:
- a packed twin (packed_linear.py; fused as well when the model allows, fused_decoder.py;
  a MoE model's routers and experts packed too) for bf16 weights, or fp32 with
  `packed_linear='on'`, where oneDNN is available;
- else a fused twin for fp32 models (`fused_projections`; a MoE model's attention fused, its
  MoE blocks its own);
- else the model itself;
and whether a step's rows split over threads (`decode_shards`, decode_shards.py). A twin is a
copy of the weights as they were: it is made again when the engine's weights generation
changes (every `update_weights`, weight_source.py), never by watching tensors.

`processes` is not used here: with more than one, `SamplerEngine.Config.build` wraps the
engine in a `ProcessSplitSampler` (process_split.py), and each helper process builds its own
engine from the same config with `processes=1`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.sampler.cpu.decode_shards import DecodeShards
from temper.sampler.cpu.fused_decoder import FusedDecoder, fusable
from temper.sampler.cpu.hybrid_twin import FusedHybridDecoder, hybrid_fusable
from temper.sampler.cpu.packed_linear import PackedDecoder, packing_available
from temper.sampler.decoding import DecodeModel, Decoding, Result
from temper.sampler.weight_source import WeightSource

_FIELD = "SamplerEngine.Config.cpu"
"""Where these settings sit in the engine's config (named in errors)."""

Twin = Literal["packed", "fused", "none"]

SMALL_STEP_WORK = 2**29
"""With `num_threads='auto'`, a generate call whose decode steps multiply fewer than this many
weights by rows (its rows, up to the engine's slots, times the model's parameters) runs on one
thread. Measured on a 2-core VM (fp32, docs/benchmarks.md): one thread was faster at every size
under it (the tiny model 1.5-2.6x at batch 1-64, a 98 MiB model 1.1-1.2x at batch 1-16) and
two at every size over it (the 98 MiB model at batch 64, a 388 MiB one at 16-64, the 0.6B
shape in bf16 at 1 and 8)."""


class CpuDecoding(Configurable, Decoding):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        num_threads: int | Literal["auto"] | None = "auto"
        """CPU threads (torch intra-op) while generating. 'auto' (the engine's default): one
        for a call whose decode steps are small (rows x parameters under `SMALL_STEP_WORK`:
        their ops are too small to split, and waking another thread costs more than it saves),
        else the process's; None: always the process's; an int: that many."""
        packed_linear: Literal["auto", "on", "off"] = "auto"
        """Decode linear layers from weights prepacked for oneDNN (a copy: as much memory
        again, and one pass over the weights whenever they change). 'auto' packs bf16
        weights (bitwise the same results, faster); 'on' also fp32 (faster for large
        matrices, not bitwise equal to torch's default kernel)."""
        fused_projections: bool = True
        """Decode with each layer's q/k/v and gate/up projections fused into one matmul each
        (a copy of those weights; bitwise the same results, fewer ops; see
        fused_decoder.py): fp32 models, and packed weights (packed_linear)."""
        decode_shards: int | Literal["auto"] = 1
        """Decode steps split their rows into this many consecutive groups that run at
        once, one thread each with single-threaded ops (see decode_shards.py); tokens and
        logprobs are bitwise those of num_threads=1 unsplit (a fp32 MoE model's logprobs: to
        float rounding). 'auto': as many groups as the
        threads generate runs on (num_threads, else torch's), each of at least
        decode_shard_min_rows rows; 1 = never split (the default: on a shared 2-core VM a
        split step was slower, docs/benchmarks.md)."""
        decode_shard_min_rows: int = 16
        """With decode_shards='auto', the fewest rows per group worth splitting a step for."""
        processes: int | Literal["auto"] = "auto"
        """Generate calls split their requests over up to this many processes: the
        engine's own and helpers started on first use, each with its own KV cache, reading
        the same weights through shared memory (see helper_processes.py). Tokens are those
        of one process (logprobs to float rounding, as with any batch composition). 'auto'
        (the default): one per core this process may run on (a choice that does not depend
        on the machine's load, so a seeded run splits its calls the same way every time).
        Only calls with at least
        process_min_rows samples per part split, so small calls never start a helper; 1:
        never split."""
        process_min_rows: int = 16
        """With processes > 1, the fewest samples per process worth splitting a call for."""

        def __post_init__(self) -> None:
            check_range(
                self.num_threads,
                field=f"{_FIELD}.num_threads",
                integer=True,
                at_least=1,
                also=("auto", None),
            )
            check_choice(
                self.packed_linear, field=f"{_FIELD}.packed_linear", choices=("auto", "on", "off")
            )
            check_choice(
                self.fused_projections, field=f"{_FIELD}.fused_projections", choices=(True, False)
            )
            for name in ("decode_shards", "processes"):
                value = getattr(self, name)
                check_range(
                    value, field=f"{_FIELD}.{name}", integer=True, at_least=1, also=("auto",)
                )
            for name in ("decode_shard_min_rows", "process_min_rows"):
                value = getattr(self, name)
                check_range(value, field=f"{_FIELD}.{name}", integer=True, at_least=1)

        def num_processes(self) -> int:
            """`processes`, with 'auto' as the cores this process may run on (Linux; else
            all the machine's)."""
            if self.processes != "auto":
                return self.processes
            affinity = getattr(os, "sched_getaffinity", None)
            return len(affinity(0)) if affinity else os.cpu_count() or 1

        def with_auto_processes_at_most(self, cores: int) -> CpuDecoding.Config:
            """This config, with 'auto' processes resolved to no more than `cores` (for a
            caller that keeps cores for other work); an explicit count is kept."""
            if self.processes != "auto":
                return self
            return replace(self, processes=min(cores, self.num_processes()))

    def __init__(self, config: Config, *, model: nn.Module, batch_hint: int) -> None:
        """`batch_hint`: the rows a decode step usually has (the engine's slots), which
        packed weights are laid out for."""
        self.config = config
        self.batch_hint = batch_hint
        self.twin = _pick_twin(config, dtype=next(model.parameters()).dtype)
        """What decode steps run on, chosen here once (see the module docstring)."""
        self.num_parameters = sum(parameter.numel() for parameter in model.parameters())
        self.shards = DecodeShards(
            setting=config.decode_shards, min_rows=config.decode_shard_min_rows
        )
        self._decoder: DecodeModel | None = None
        self._generation: int | None = None  # the weights generation `_decoder` was made from

    def decoder(self, weights: WeightSource) -> DecodeModel:
        """The model, or the chosen twin of it, made again after any weights update."""
        if self.twin == "none":
            return weights.model
        if self._generation != weights.generation:
            self._decoder = None  # drop the old copy before making the new one
            self._decoder = self._make_twin(weights.model)
            self._generation = weights.generation
        assert self._decoder is not None
        return self._decoder

    def _make_twin(self, model: nn.Module) -> DecodeModel:
        # A module that cannot be fused (LoRA-wrapped projections, another block layout)
        # decodes on its own layers: packed, or as they are.
        batch_hint = self.batch_hint if self.twin == "packed" else None
        if self.config.fused_projections and fusable(model):
            return FusedDecoder(model, batch_hint=batch_hint)
        if self.config.fused_projections and hybrid_fusable(model):
            return FusedHybridDecoder(model, batch_hint=batch_hint)
        if self.twin == "packed":
            return PackedDecoder(model, batch_hint=self.batch_hint)
        return model

    @contextlib.contextmanager
    def threads(self, num_threads: int | None, *, rows: int) -> Iterator[None]:
        """Around a generate call of `rows` rows at most per decode step: torch on
        `num_threads` threads, else the config's (see `Config.num_threads`); restored
        afterwards."""
        num_threads = num_threads or self.auto_threads(rows=rows)
        previous = torch.get_num_threads()
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def auto_threads(self, *, rows: int) -> int | None:
        """The config's thread count for a call of `rows` rows, 'auto' resolved (None: the
        process's threads)."""
        if self.config.num_threads != "auto":
            return self.config.num_threads
        return 1 if rows * self.num_parameters < SMALL_STEP_WORK else None

    def map_rows(self, step: Callable[[range], Result], num_rows: int) -> list[Result]:
        """`step` over consecutive row groups of a decode step, at once (one group: no
        split); results in row order."""
        return self.shards.map(step, self.shards.plan(num_rows))

    def close(self) -> None:
        """Stop the decode-shard threads (they start again if needed)."""
        self.shards.close()


def _pick_twin(config: CpuDecoding.Config, *, dtype: torch.dtype) -> Twin:
    packs = config.packed_linear == "on" or (
        config.packed_linear == "auto" and dtype == torch.bfloat16
    )
    if packs and packing_available(dtype):
        return "packed"
    if config.fused_projections and dtype == torch.float32:
        return "fused"
    return "none"
