"""The sampling engine: batched KV-cache decoding with continuous batching and prefix sharing.

Shapes: B rows, T tokens, D model dim, V vocab, L layers, K kv heads, H head dim.

How a call to `generate` runs:
- Every request is validated first, on the caller's thread; a bad one raises before any work
  is done, and fails only its own call.
- The call joins the engine's decode loop (decode_loop.py), shared by every thread that calls
  `generate`: its requests join the batch in flight at the next step (continuous batching
  across calls), and the call returns once its own sequences are done.
- Admission: while slots are free, waiting requests (oldest first) are prefilled together, one
  row per prompt, writing their keys/values straight into the cache. A prompt is prefilled
  once however many samples it has: its other samples copy its cached rows, and samples that
  find no free slot yet keep a copy of the prompt's cache until they start. Each sample draws
  its first token from the prompt's last logits. While rows decode, a step prefills at most
  `prefill_chunk_tokens` prompt tokens, and a prompt longer than that is prefilled a chunk per
  step, at boundaries set by the prompt alone (chunked_prefill.py), so a long prompt joining
  stalls the running rows by one chunk per step at most.
- Decode: one forward over all active slots per step; finished sequences free their slot at
  once, and the next waiting sample takes it (continuous batching).
- Prefix cache: a finished sequence's keys/values are kept (prefix_cache.py, up to
  `prefix_cache_mib`), so a later prompt that extends it (a multi-turn episode's next turn)
  prefills only its new tokens. Emptied when the weights change.
- Routes (MoE models, `record_routes`): the experts every token was routed to, recorded in
  prefill and decode and kept with cached prefixes, come back with each sequence (routes.py).

Sampling is per row (temperature, top-k, top-p and seed may differ between rows), and each
row's random draw depends only on its seed and how many tokens it has drawn. On CPU a row's
logits are also the same in any batch up to float rounding (the test suite holds seeded
tokens equal and logprobs within 1e-5), so seeded results do not depend on which other
requests, or other calls, share it. On CUDA they can: cuBLAS picks its kernels by the
number of rows (and a CUDA graph pads them to its bucket), so a row's logits, and at a near
tie its token, move with the batch's size; its draws stay its own.

How a decode step runs is chosen once, when the engine is built (`self.decoding`,
decoding.py): the model itself, on CPU the speed wing's twins and row shards
(cpu/decoding.py), on CUDA a step's logits replayed from a CUDA graph (cuda_graphs.py;
not for a MoE model, whose routing reads device values on the host).
Splitting calls over processes is not done here: `Config.build` wraps the engine for that
(cpu/process_split.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

import temper.sampler.sampling as sampling
from temper.api.types import SampleResponse, SamplingParams
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.models.common.moe_stats import moe_layers
from temper.sampler.admission import Admission
from temper.sampler.chunked_prefill import ChunkedPrefill
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.process_split import ProcessSplitSampler
from temper.sampler.cuda_graphs import CudaGraphDecoding, capture_blocker, default_buckets
from temper.sampler.decode_loop import DecodeLoop
from temper.sampler.decoding import DecodeModel, Decoding, Draw
from temper.sampler.kv_cache import KVCache, KVCacheShape
from temper.sampler.prefix_cache import PrefixCache
from temper.sampler.recurrent_pool import RecurrentPoolShape
from temper.sampler.requests import OnePromptSampling, RequestState, SampleRequest
from temper.sampler.retirement import Retirement
from temper.sampler.routes import RouteRecorder, recording
from temper.sampler.row_adapters import RowAdapters
from temper.sampler.sequence_scoring import score_sequences
from temper.sampler.slots import SlotOwner, SlotTable
from temper.sampler.weight_source import WeightSource, WeightUpdate
from temper.tokenizer import Tokenizer


class SamplerEngine(Configurable, OnePromptSampling):
    holds_one_version = False  # a private copy keeps an old version (client/weight_sync.py)
    joins_running_batch = True  # calls from several threads share decode steps

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        max_batch: int = 64
        """Sequences decoded at once (KV-cache slots)."""
        max_seq_len: int = 2048
        """Longest prompt + completion; the cache holds this many positions per slot."""
        max_prefill_tokens: int = 8192
        """Prompt tokens prefilled in one forward (a longer single prompt still runs alone)."""
        max_score_tokens: int = 16384
        """Tokens per forward in `score()`."""
        prefix_cache_mib: float = 32.0
        """Memory for the keys/values of finished sequences, so a prompt that extends one (the
        next turn of a multi-turn episode) prefills only its new tokens; emptied when the
        weights change (temper/sampler/prefix_cache.py). 0 turns it off. The default holds
        16k positions of the tiny model (2 KiB each), about 290 of Qwen3-0.6B in bf16 (112
        KiB each): raise it with the model and the episodes in flight."""
        cuda_graphs: Literal["auto", "off"] = "auto"
        """'auto' replays decode steps as CUDA graphs on a CUDA device where the model allows
        (not a MoE model, whose routing syncs with the host: cuda_graphs.py); no effect on
        CPU."""
        graph_batch_sizes: tuple[int, ...] = ()
        """Batch-size buckets captured as graphs; () = powers of two up to max_batch."""
        cpu: CpuDecoding.Config = field(default_factory=CpuDecoding.Config)
        """The CPU speed wing (no effect on CUDA): threads, fused or packed decode twins,
        decode shards, helper processes (temper/sampler/cpu/decoding.py)."""
        prefill_chunk_tokens: int = 512
        """While rows decode, prompt tokens prefilled per step at most: a prompt longer than
        this is prefilled a chunk per step (chunks end at its multiples, counted from the
        prompt's start, alone or not: temper/sampler/chunked_prefill.py), and new prompts
        beside rows in flight wait for a step with room. Bounds how long a joining call
        stalls the calls already decoding. Prompts asking for prompt logprobs are prefilled
        whole."""
        record_routes: bool = False
        """MoE models: record the experts every token was routed to and return them with
        each sequence (`SampledSequence.routed_experts`), for a trainer to replay
        (routing_replay='sampler') or compare with its own (temper/sampler/routes.py). The
        RL job turns it on for --rl.routing_replay sampler. Dense models: ignored, with a
        warning."""

        def __post_init__(self) -> None:
            owner = "SamplerEngine.Config"
            names = ("max_batch", "max_seq_len", "max_prefill_tokens", "max_score_tokens")
            for name in (*names, "prefill_chunk_tokens"):
                check_range(getattr(self, name), field=f"{owner}.{name}", at_least=1)
            check_range(
                self.prefix_cache_mib,
                field=f"{owner}.prefix_cache_mib",
                at_least=0,
                hint="0 turns the prefix cache off",
            )
            for index, size in enumerate(self.graph_batch_sizes):
                check_range(
                    size,
                    field=f"{owner}.graph_batch_sizes[{index}]",
                    integer=True,
                    at_least=1,
                    at_most=self.max_batch,
                    hint="at most max_batch",
                )
            check_choice(self.cuda_graphs, field=f"{owner}.cuda_graphs", choices=("auto", "off"))
            if not isinstance(self.cpu, CpuDecoding.Config):
                raise TypeError(
                    "SamplerEngine.Config.cpu must be a CpuDecoding.Config, got "
                    f"{type(self.cpu).__name__}"
                )

        def build(
            self, *, model: nn.Module, tokenizer: Tokenizer | None = None
        ) -> SamplerEngine | ProcessSplitSampler:
            """The engine on `model`; on CPU with `cpu.processes` > 1, a
            `ProcessSplitSampler` around it (used the same way)."""
            engine = super().build(model=model, tokenizer=tokenizer)
            processes = self.cpu.num_processes()
            if processes < 2 or engine.device.type != "cpu":
                return engine
            return ProcessSplitSampler(engine, processes=processes)

        def prefix_cache_bytes(self) -> int:
            """The most the prefix cache holds (what a memory estimate counts for it)."""
            return int(self.prefix_cache_mib * 2**20)

        def kv_cache_bytes(self, model_config: Any, *, dtype: torch.dtype) -> int:
            """Bytes the KV cache will take for a model, known before anything is allocated."""
            return self.kv_cache_shape(model_config).nbytes(dtype)

        def kv_cache_shape(self, model_config: Any) -> KVCacheShape:
            """Keys/values of every layer; a hybrid model's full-attention layers only."""
            return KVCacheShape.for_model(
                model_config, num_slots=self.max_batch, max_seq_len=self.max_seq_len
            )

        def recurrent_state_bytes(self, model_config: Any, *, dtype: torch.dtype) -> int:
            """Bytes the recurrent-state pool of a hybrid model will take beside the KV cache
            (0 for a model without linear-attention layers): the same at any max_seq_len."""
            shape = self.recurrent_pool_shape(model_config)
            return 0 if shape is None else shape.nbytes(dtype)

        def recurrent_pool_shape(self, model_config: Any) -> RecurrentPoolShape | None:
            return RecurrentPoolShape.for_model(model_config, num_slots=self.max_batch)

    def __init__(
        self, config: Config, *, model: nn.Module, tokenizer: Tokenizer | None = None
    ) -> None:
        self.config = config
        model_config = model.config
        if config.max_seq_len > model_config.max_seq_len:
            raise ValueError(
                f"SamplerEngine.Config.max_seq_len={config.max_seq_len} exceeds the model's "
                f"max_seq_len={model_config.max_seq_len}"
            )
        self.weights = WeightSource(model)
        self.tokenizer = tokenizer
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.vocab_size = model_config.vocab_size
        self.cache = KVCache(
            config.kv_cache_shape(model_config),
            dtype=self.dtype,
            device=self.device,
            states=config.recurrent_pool_shape(model_config),
        )
        self.slots = SlotTable(
            num_slots=config.max_batch, max_new_tokens=config.max_seq_len, device=self.device
        )
        # A hybrid model's cached sequences are used whole: recurrent states do not rewind.
        self.prefix_cache = PrefixCache(
            max_bytes=config.prefix_cache_bytes(), whole_only=self.cache.states is not None
        )
        self.adapters = RowAdapters(model)
        self.routes = self._route_recorder(model)
        """Records of the routes taken (MoE models with record_routes); None otherwise."""
        self._entropy = random.Random()
        self.admission = Admission(
            weights=self.weights,
            cache=self.cache,
            prefix_cache=self.prefix_cache,
            slots=self.slots,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
            max_seq_len=config.max_seq_len,
            max_prefill_tokens=config.max_prefill_tokens,
            entropy=self._entropy,
            adapters=self.adapters,
            routes=self.routes,
        )
        self.chunks = ChunkedPrefill(
            weights=self.weights,
            cache=self.cache,
            prefix_cache=self.prefix_cache,
            slots=self.slots,
            adapters=self.adapters,
            routes=self.routes,
            chunk_tokens=config.prefill_chunk_tokens,
        )
        self.retirement = Retirement(
            slots=self.slots, cache=self.cache, prefix_cache=self.prefix_cache, routes=self.routes
        )
        self.decoding = self._pick_decoding(model)
        self._waiting: deque[RequestState] = deque()  # joined, some sample not in a slot yet
        self._decoder: DecodeModel | None = None  # the driving thread's (`session`)
        self.loop = DecodeLoop(self, max_rows=config.max_batch)
        """The decode loop every `generate` call joins (decode_loop.py)."""
        self.between_steps: Callable[[SamplerEngine], bool] | None = None
        """Called at the start of each step of the decode loop, on its driving thread; returns
        whether it changed the weights (an in-flight target's `WeightSwitch.between_steps`,
        weight_switch.py)."""

    @property
    def model(self) -> nn.Module:
        return self.weights.model

    @property
    def version(self) -> int:
        """Policy version of the weights in use (set by `update_weights`)."""
        return self.weights.version

    def describe(self) -> str:
        mib = self.cache.nbytes / 2**20
        prefixes = (
            f"up to {self.config.prefix_cache_mib:g} MiB" if self.prefix_cache.enabled else "off"
        )
        states = ""
        if self.cache.states is not None:
            shape = self.cache.states.shape
            states = (
                f"; recurrent states {self.cache.states.nbytes / 2**20:.1f} MiB: "
                f"{self.config.max_batch} slots x {shape.num_layers} linear-attention layers"
            )
        return (
            f"KV cache {mib:.1f} MiB: {self.config.max_batch} slots x {self.config.max_seq_len} "
            f"positions, {str(self.dtype).removeprefix('torch.')}{states}; prefix cache "
            f"{prefixes}"
        )

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """Sample from new weights from now on; the cache is kept, and a module of matching
        dtype and device is used in place, without a copy.

        Whoever changes the weights calls this, also after writing the module in place (an
        optimizer step on a trainer module the engine reads): copies made from the weights
        (the CPU wing's twins, helper processes) are made again only after it. Calls
        submitted before it finish on the old weights first; later ones wait for it (a
        barrier between decode steps: no weight changes under running rows)."""

        self.loop.between_steps(lambda: self.switch_weights(source, version=version), barrier=True)

    def switch_weights(self, source: WeightUpdate, *, version: int) -> None:
        """`update_weights`' work, done now: only between decode steps, on the loop's driving
        thread (a barrier task, or an in-flight switch: rows in flight then go on with the new
        weights over the keys and values already cached)."""
        with torch.inference_mode(False):  # as outside the loop: no inference tensors
            self.weights.update(source, version=version)
            self.decoding.weights_changed()

    def forget_prefixes(self, *, adapter: int) -> None:
        """Drop the cached prefixes of one adapter slot: a multi-LoRA sampler calls this
        before it loads another adapter into the slot (no weights generation counts that)."""
        self.prefix_cache.drop_adapter(adapter)

    def sleep(self) -> None:
        """Release the KV cache (with a hybrid model's recurrent states) and the prefix cache
        until `wake_up` (the weights stay: they may be the trainer's); after the calls in
        flight."""

        def sleep() -> None:
            self.prefix_cache.clear()
            self.decoding.sleep()  # first: CUDA graphs' pool goes back with the cache's memory
            self.cache.release()

        self.loop.between_steps(sleep, barrier=True)

    def wake_up(self) -> None:
        """Allocate the KV cache again (zeros, as when built)."""

        def wake_up() -> None:
            with torch.inference_mode(False):  # a cache of plain tensors, as when built
                self.cache.reacquire()
                self.decoding.wake_up()

        self.loop.between_steps(wake_up, barrier=True)

    def close(self) -> None:
        """Stop the decode threads (the engine stays usable: they start again if needed)."""
        self.decoding.close()

    def _route_recorder(self, model: nn.Module) -> RouteRecorder | None:
        if not self.config.record_routes:
            return None
        if not moe_layers(model):
            warnings.warn(
                "SamplerEngine.Config.record_routes is ignored: the model has no MoE layers",
                stacklevel=3,
            )
            return None
        return RouteRecorder(
            model,
            num_slots=self.config.max_batch,
            max_new_tokens=self.config.max_seq_len,
            device=self.device,
        )

    def _pick_decoding(self, model: nn.Module) -> Decoding:
        """How decode steps run, chosen once: on CPU the speed wing; on CUDA graphs (unless
        off, per-row adapter slots, which graphs do not capture, or a model whose forward
        syncs with the host, e.g. MoE routing); else the plain path."""
        config = self.config
        if self.device.type == "cpu":
            return config.cpu.build(model=model, batch_hint=config.max_batch)
        graphs = self.device.type == "cuda" and config.cuda_graphs != "off"
        if graphs and self.adapters.rows is None and capture_blocker(model) is None:
            buckets = config.graph_batch_sizes or default_buckets(config.max_batch)
            return CudaGraphDecoding(self.weights, cache=self.cache, buckets=buckets)
        return Decoding()

    def generate(
        self,
        requests: Sequence[SampleRequest],
        *,
        num_threads: int | None = None,
        adapter_gate: Callable[[Sequence[RequestState]], int | None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> list[SampleResponse]:
        """Run requests to completion with continuous batching, beside the calls of other
        threads; responses in request order. On CPU, on `num_threads` threads if given (else
        `cpu.num_threads`) while this thread drives the loop. `adapter_gate` (a multi-LoRA
        sampler's): called between steps with the call's request states until it gives the
        adapter slot they join with (None: not yet); `on_done`: called once the joined call
        ended."""
        states = [self.admission.start(request, index) for index, request in enumerate(requests)]
        if not self.cache.allocated:
            raise ValueError("generate: the engine sleeps (its KV cache is released); wake it up")
        gate = None
        if adapter_gate is not None:

            def gate() -> bool:
                slot = adapter_gate(states)
                if slot is None:
                    return False
                for state in states:
                    state.request = dataclasses.replace(state.request, adapter=slot)
                return True

        return self.loop.generate(states, gate=gate, on_done=on_done, num_threads=num_threads)

    def repoint(self, states: Sequence[RequestState], *, adapter: int) -> list[SlotOwner]:
        """Between decode steps, on the loop's driving thread: the sequences of `states` (a
        joined call's) sample with adapter slot `adapter` from the next step on, in their
        slots and waiting ones alike; the keys and values cached so far stay. Returns the
        owners of their slots (sequences being decoded)."""
        ours = {id(state) for state in states}
        for state in states:
            state.request = dataclasses.replace(state.request, adapter=adapter)
        slots = self.slots
        moved = [row for row in range(slots.num_active) if id(slots.owners[row].state) in ours]
        for row in moved:
            slots.adapters[row] = adapter
        if moved:
            slots.adapter_S[torch.tensor(moved, device=self.device)] = adapter
        return [slots.owners[row] for row in moved]

    # -- the decode loop's runner (decode_loop.py) -----------------------------------------

    @contextlib.contextmanager
    def session(self, *, num_threads: int | None, rows: int) -> Iterator[None]:
        """Around the steps one thread drives: inference mode (less per-op work than
        no_grad; nothing made here leaves as a tensor) and the call's threads."""
        with torch.inference_mode(), self.decoding.threads(num_threads, rows=rows):
            # Made on the driving threads too: on the process's default threads a twin's
            # copies (torch.cat) wake a second thread, whose core a helper process may be
            # decoding on (1.9 ms vs 49 ms to build the tiny model's on a busy 2-core box).
            self._decoder = self.decoding.decoder(self.weights)
            try:
                yield
            finally:
                self._decoder = None

    def join(self, states: Sequence[RequestState]) -> None:
        """A call's requests wait for slots (long prompts for their chunks) from now on."""
        self.prefix_cache.follow(self.weights.generation)
        for state in states:
            (self.chunks.queue if self.chunks.wants(state) else self._waiting).append(state)

    @property
    def busy(self) -> bool:
        return bool(self.slots.num_active or self._waiting or self.chunks.busy)

    def step(self) -> None:
        """One step: a long prompt's next chunk, admission into free slots (within the
        step's prefill budget while rows decode), then one decode step of every row."""
        assert self._decoder is not None
        if self.between_steps is not None and self.between_steps(self):
            self._decoder = self.decoding.decoder(self.weights)
        decoding = self.slots.num_active > 0
        budget = self.config.prefill_chunk_tokens if decoding else self.config.max_prefill_tokens
        spent, ready = self.chunks.step()
        if ready is not None:
            self._waiting.append(ready)
        if self._waiting and self.slots.num_free and spent < budget:
            admitted = self.admission.admit(self._waiting, budget=budget - spent)
            if admitted is not None:
                self._draw_and_record(admitted.first_slot, admitted.logits_BV)
        if self.slots.num_active:
            self._decode_step(self._decoder)

    def abort(self) -> None:
        """Free every slot and drop the waiting requests (a step raised) so the engine
        keeps serving."""
        self.slots.clear()
        self._waiting.clear()
        self.chunks.abort()

    def refresh(self) -> None:
        """After work between steps (a weight update): the decoder of the weights now."""
        if self._decoder is not None:
            self._decoder = self.decoding.decoder(self.weights)

    def seeded(self, requests: Sequence[SampleRequest]) -> list[SampleRequest]:
        """`requests`, validated, with each unseeded one given the seed `generate` would draw
        for it (the same entropy, in request order): a call split into parts (cpu/
        process_split.py) then returns what one call would."""
        seeded = [self._seeded(request) for request in requests]
        for index, request in enumerate(seeded):
            self.admission.start(request, index)
        return seeded

    def _seeded(self, request: SampleRequest) -> SampleRequest:
        if not isinstance(request.params, SamplingParams) or request.params.seed is not None:
            return request  # (a wrong type fails validation next)
        params = dataclasses.replace(request.params, seed=self._entropy.getrandbits(63))
        return dataclasses.replace(request, params=params)

    @torch.no_grad()
    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Logprob of tokens[1:] of each sequence given the ones before it (fp32 tensors):
        full forwards, bitwise the trainer's logprobs for the same batch
        (sequence_scoring.py)."""
        return score_sequences(
            self.model, sequences, temperature=temperature, max_tokens=self.config.max_score_tokens
        )

    # -- decoding --------------------------------------------------------------------------

    def _decode_step(self, decoder: DecodeModel) -> None:
        num_rows = self.slots.num_active
        positions_B = self.slots.positions_S[:num_rows]
        width = self.decoding.width(positions_B)
        # The rows at once, or in groups (CPU decode shards).
        draws = self.decoding.map_rows(
            lambda rows: self._decode_rows(rows, decoder=decoder, width=width), num_rows
        )
        positions_B += 1
        self._record(0, Draw.concat(draws))

    def _decode_rows(self, rows: range, *, decoder: DecodeModel, width: int) -> Draw:
        """Forward and draw for active rows `rows` (slots of the same numbers)."""
        positions_B = self.slots.positions_S[rows.start : rows.stop]
        tokens_B = self.slots.last_token_S[rows.start : rows.stop]
        self.adapters.use(self.slots.adapters[rows.start : rows.stop])
        with recording(self.routes, self.model) as tape:
            logits_BV = self.decoding.logits(
                decoder,
                self.cache,
                tokens_B=tokens_B,
                positions_B=positions_B,
                width=width,
                first_slot=rows.start,
            )
        if tape is not None:
            counts_B = self.slots.num_generated_S[rows.start : rows.stop]
            self.routes.store_decoded(rows, counts_B=counts_B, tape=tape)
        return self._draw(rows, logits_BV)

    def _draw(self, rows: range, logits_BV: torch.Tensor) -> Draw:
        """One token for each slot in `rows` (its logits row by row), with its logprobs."""
        slots = self.slots
        rows = slice(rows.start, rows.stop)
        temperature_B = slots.temperature_S[rows]
        # Host-side hints: which sampling work some row needs (no device sync to find out).
        draw_mode = sampling.draw_mode(slots.greedy[rows])
        logprobs_BV = sampling.sampling_logprobs(
            logits_BV,
            temperature_B=temperature_B,
            top_k_B=slots.top_k_S[rows],
            top_p_B=slots.top_p_S[rows],
            sort_width=sampling.batch_sort_width(slots.sort_widths[rows]),
        )
        if draw_mode == "greedy":
            tokens_B = logits_BV.argmax(dim=-1)
        else:
            tokens_B = sampling.draw_tokens(
                logits_BV,
                logprobs_BV,
                uniforms_B=sampling.stream_uniforms(
                    slots.stream_starts_S[rows], slots.num_generated_S[rows]
                ),
                greedy_B=temperature_B == 0,
                draw_mode=draw_mode,
            )
        token_logprobs_B = sampling.gather_logprobs(logprobs_BV, tokens_B)
        return Draw(tokens_B=tokens_B, token_logprobs_B=token_logprobs_B, logprobs_BV=[logprobs_BV])

    def _draw_and_record(self, first_slot: int, logits_BV: torch.Tensor) -> None:
        """Draw one token for slots first_slot.. (to the last active) and record it."""
        self._record(first_slot, self._draw(range(first_slot, self.slots.num_active), logits_BV))

    def _record(self, first_slot: int, draw: Draw) -> None:
        """Store the tokens drawn for slots first_slot.. (to the last active), and retire
        the sequences that are done."""
        slots = self.slots
        rows = slice(first_slot, slots.num_active)
        tokens_B = draw.tokens_B
        counts_B = slots.num_generated_S[rows]
        slot_ids_B = torch.arange(first_slot, slots.num_active, device=self.device)
        slots.tokens_SM[slot_ids_B, counts_B] = tokens_B
        slots.logprobs_SM[slot_ids_B, counts_B] = draw.token_logprobs_B
        counts_B += 1
        slots.last_token_S[rows] = tokens_B
        if any(slots.has_stop_ids[rows]):
            stopped_B = (tokens_B[:, None] == slots.stop_ids_SX[rows]).any(dim=-1)
        else:
            stopped_B = torch.zeros_like(tokens_B, dtype=torch.bool)
        if slots.num_python_rows:
            logprobs_BV = torch.cat(draw.logprobs_BV)
            self.retirement.per_token_python_work(first_slot, tokens_B, logprobs_BV, stopped_B)
        done_B = stopped_B | (counts_B >= slots.max_new_S[rows])
        finished = torch.nonzero(done_B).flatten().tolist()
        if finished:
            stopped = stopped_B[finished].tolist()
            self.retirement.finish([first_slot + row for row in finished], stopped=stopped)
