"""Decode steps with static shapes, captured as CUDA graphs (one per batch-size bucket): the
engine's `Decoding` on CUDA unless `cuda_graphs='off'`, its model has multi-LoRA slots, or
its forward reads device values on the host (`capture_blocker`: a MoE model).

Shapes: S slots, B rows (a bucket), V vocab.

A CUDA graph replays fixed kernels on fixed buffers, which removes the per-op launch cost that
dominates decoding small batches on a GPU. The step is made static: the active rows are padded
up to the next bucket size, and attention always spans the whole cache width (the mask hides
what a row has not written). Padding rows decode token 0 at position 0 in slots no sequence
occupies; a slot's position 0 is always rewritten when a sequence claims it.

`capture=False` runs the same static step eagerly, which is how its padding logic is tested on
CPU. Capturing writes to cache position 0 of the bucket's slots, so it happens only while no
sequence is active: when the engine is built, when its weights move to another module
(replaying a graph reads the parameters it was captured with) and when it wakes up (graphs
hold the KV cache's pointers, so they go when it sleeps).

Capture is serialized over the process (`CAPTURE_LOCK`: engines are built on several threads,
e.g. a snapshot's at an optimizer step while another thread decodes, and two captures at once
corrupt each other) and in thread-local mode: another thread's allocations and syncs during a
capture are its own business, where the global mode fails them ("operation not permitted when
stream is capturing").

A capture cannot hold a read of device values by the host: the host would see the capture's
values, not the replay's, and CUDA refuses the sync while a stream captures. A MoE block
(temper/models/common/moe.py) makes such reads in every forward: `torch.bincount` on CUDA
reads the input's largest value to size its output, and outside bf16 on a GPU with
`F.grouped_mm` the per-expert counts go to the host (`tolist`) to slice the rows. So a MoE
model decodes eagerly on CUDA (`capture_blocker` says why; tested on CPU, and on a GPU that
capturing its forward fails).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

import torch
from torch import nn

from temper.models.common.moe import MoE
from temper.sampler.decoding import DecodeModel, Decoding
from temper.sampler.hybrid_backends import decode_backend
from temper.sampler.kv_cache import KVCache
from temper.sampler.weight_source import WeightSource

CAPTURE_LOCK = threading.Lock()
"""Held while a decoder captures its graphs: one capture at a time in this process."""


def capture_blocker(model: nn.Module) -> str | None:
    """Why decode steps of `model` cannot be captured as CUDA graphs (None: they can): the
    first module whose forward reads device values on the host (see the module docstring)."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            return (
                f"{name} is a MoE block, whose routing reads expert counts on the host "
                "(torch.bincount sizes its output from the largest expert id; per-expert row "
                "counts unless F.grouped_mm runs)"
            )
    return None


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself."""
    sizes = {1 << shift for shift in range(max_batch.bit_length()) if 1 << shift <= max_batch}
    return sorted(sizes | {max_batch})


class StaticDecoder:
    def __init__(
        self, *, model: nn.Module, cache: KVCache, buckets: Sequence[int], capture: bool
    ) -> None:
        if not buckets or max(buckets) > cache.num_slots or min(buckets) < 1:
            raise ValueError(f"buckets {list(buckets)} must lie in 1..{cache.num_slots}")
        self.model = model
        self.cache = cache
        self.buckets = sorted(buckets)
        device = cache.k_LSKCH.device
        self.tokens_S = torch.zeros(cache.num_slots, dtype=torch.long, device=device)
        self.positions_S = torch.zeros(cache.num_slots, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def _step(self, bucket: int) -> torch.Tensor:
        positions_B = self.positions_S[:bucket]
        attention = decode_backend(self.cache, positions_B, width=self.cache.max_seq_len)
        hidden_B1D = self.model.hidden_states(
            self.tokens_S[:bucket, None], positions_BT=positions_B[:, None], attention=attention
        )
        return self.model.logits(hidden_B1D[:, 0]).float()

    @torch.no_grad()
    def _capture_all(self) -> None:
        with CAPTURE_LOCK:
            self._capture_buckets()

    def _capture_buckets(self) -> None:
        self.tokens_S.zero_()
        self.positions_S.zero_()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:  # warm-up: allocator and kernel selection
                self._step(bucket)
        torch.cuda.current_stream().wait_stream(side)
        for bucket in reversed(self.buckets):  # largest first, so smaller ones reuse its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits_BV = self._step(bucket)
            self.graphs[bucket] = (graph, logits_BV)

    @torch.no_grad()
    def logits(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """Next-token logits [B, V] (fp32) for rows 0..B-1, as an eager decode step gives."""
        num_rows = tokens_B.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_rows)]
        self.tokens_S[:num_rows].copy_(tokens_B)
        self.positions_S[:num_rows].copy_(positions_B)
        self.tokens_S[num_rows:bucket].zero_()
        self.positions_S[num_rows:bucket].zero_()
        if bucket in self.graphs:
            graph, logits_BV = self.graphs[bucket]
            graph.replay()
            return logits_BV[:num_rows]
        return self._step(bucket)[:num_rows]


class CudaGraphDecoding(Decoding):
    """The plain path with each decode step's logits replayed from a CUDA graph: a step's rows
    in one group, over the whole cache width (see the module docstring)."""

    def __init__(
        self,
        weights: WeightSource,
        *,
        cache: KVCache,
        buckets: Sequence[int],
        capture: bool = True,
    ) -> None:
        self.weights = weights
        self.cache = cache
        self.buckets = buckets
        self.capture = capture
        self.static: StaticDecoder | None = self._static_decoder()

    def _static_decoder(self) -> StaticDecoder:
        return StaticDecoder(
            model=self.weights.model, cache=self.cache, buckets=self.buckets, capture=self.capture
        )

    def width(self, positions_B: torch.Tensor) -> int:
        """The whole cache, which the graphs attend over (and no device sync to find less)."""
        return self.cache.max_seq_len

    def logits(
        self,
        decoder: DecodeModel,
        cache: KVCache,
        *,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        width: int,
        first_slot: int,
    ) -> torch.Tensor:
        """The step's logits from the graph of its bucket (`decoder` is the model the graphs
        were captured on)."""
        assert self.static is not None, "decode while the engine sleeps"
        assert first_slot == 0 and cache is self.cache and width == cache.max_seq_len
        return self.static.logits(tokens_B, positions_B)

    def weights_changed(self) -> None:
        """Capture again if the weights moved to another module (graphs hold parameter
        pointers); in-place writes need nothing."""
        if self.static is not None and self.static.model is not self.weights.model:
            self.static = self._static_decoder()

    def sleep(self) -> None:
        self.static = None  # the graphs hold the released cache's pointers

    def wake_up(self) -> None:
        self.static = self._static_decoder()
