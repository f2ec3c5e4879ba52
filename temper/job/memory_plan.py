"""Planned GPU memory of an RL job per rank role, computed from shapes alone (nothing runs).

`plan_memory(PlanSettings(...))` returns a `MemoryPlan` (plan_types.py): for each role
(every rank when colocated; trainer and generator ranks when disaggregated) rows of (item,
bytes, phase), the phase saying when a row is held (`always`, while `training`, at a weight
`sync`); a role's peak is what it always holds plus its larger phase. A job's settings
come from its configs (`plan_settings`, job/placement.py); memory_report.py renders plans;
`temper plan RECIPE` prints them and a job logs its rank's. The bytes of each piece come from
model_bytes.py, which the server's estimates use too, and what a process holds besides tensors
from runtime_bytes.py.

What is counted, per rank (W = world size, T trainer ranks, G generator ranks):

- Trainer: FSDP2 shards dim 0 of every parameter over T ranks, padded to ceil(dim0 / T)
  rows, in the trainer's parameter dtype: weights (with LoRA: the frozen base and the
  adapters), gradients (training only) and AdamW's two moments, all in that dtype: fp32 under
  'bf16-mixed' (the master weights), bf16 under pure 'bfloat16' (no master copy; see
  `--model.dtype`). While training FSDP also holds the root (embedding, output, final norm:
  kept gathered for the whole step) and two gathered blocks (one in use, one prefetched), in
  the compute dtype; full fine-tuning adds the unsharded gradients of the root and a block
  (compute dtype), and under 'bf16-mixed' the fp32 copy of the larger of them that FSDP
  reduces. An unsharded 'bf16-mixed' trainer instead keeps autocast's bf16 casts of the
  weights for backward.
- MoE models: the routed experts are stacked [E, ...] parameters, sharded on the expert
  dimension over the FSDP ranks like every dim 0 (ceil(E / T) experts per rank), and their
  weights get rows of their own, the trainer's and the generator's. A gathered block is the
  largest one (a sparse block holds all its experts). With expert parallelism (`ep`) each
  layer's experts are split into ep parts first, each FSDP-sharded over T / ep ranks
  (ceil(E / ep / (T / ep)) experts per rank), and a gathered sparse block holds one part
  (E / ep experts). The activations are counted as without it: with even routing a rank's
  experts receive as many rows as its tokens send out.
- Activations (an estimate): what autograd keeps for one micro-batch of
  min(micro_batch_tokens, the rank's share of the step) tokens, per token and layer as
  measured on this model code (model_bytes.py; tests/job/test_memory_plan.py pins it;
  a sparse layer's follow its top_k experts' width and its router, not ffn_dim; a hybrid
  model's are counted term by term from its config, hybrid_activations.py);
  flash-style attention keeps no T x T matrix. With full activation checkpointing each block
  keeps only its input, and backward recomputes one block (the largest) at a time. The fp32
  logits of one chunk (<= 256 MiB, logprobs.py) and their log-softmax come on top.
- Generator: whole weights in the generator's dtype (the trainer's compute dtype unless set;
  1/generator_tp of them with tensor parallelism), and the KV cache the engine preallocates:
  `max_batch` slots (default: the engine's share of the batch) x `max_seq_len` positions x
  layers x 2 x kv heads x head dim (a hybrid model's full-attention layers only), and a
  hybrid model's recurrent-state pool beside it: per slot and linear-attention layer a conv
  state [conv channels, kernel - 1] in the generator's dtype and a delta-rule state [value
  heads, key head dim, value head dim] in fp32 (sampler/recurrent_pool.py's formula), the
  same at any sequence length. Colocated in one process with full fine-tuning in one
  dtype, the sampler reads the trainer's own tensors (no copy); otherwise (LoRA, a sharded
  trainer, 'bf16-mixed': a bf16 copy of the fp32 weights) it holds a copy of its own.
- Weight sync, `bucketed` (what jobs run): two buckets of `bucket_mb` (a tensor larger than a
  bucket is split by rows) on every rank that sends or receives. `whole` (`sampler_state_dict`
  gathering whole tensors, a what-if no job runs): every trainer rank gathers a whole copy,
  and LoRA merging makes new tensors for every adapted weight while the gathered ones are
  still alive. Merging LoRA keeps three fp32 tensors the size of the largest adapted weight
  (the weight, B @ A scaled, their sum).
- Async mode, colocated: the snapshot of the previous version keeps its own engine (weights
  and KV cache) while the next one samples (`client/weight_sync.py`; max_staleness 1).
  Disaggregated generators update in place between requests (no copy; vLLM through its
  weight-transfer protocol, staging only the tensors whose rows are still arriving, not
  counted here), unless they overlap the transfer with sampling (`overlap_sync`): then each
  holds a second copy of the weights.
- A KL reference (`rl.kl_coef > 0`) is one more sampler on every colocated rank: weights and its
  own KV cache. Disaggregated, it loads on the generator ranks as whole weights that only
  score (no KV cache), and the trainer ranks hold none of it.

- What a GPU process holds besides tensors (runtime_bytes.py, estimates that a GPU run's
  measurements should replace): a CUDA context on every rank; the buffers of each NCCL
  communicator the rank takes part in (colocated: the default group, and the two mesh
  dimensions of a hybrid dp_replicate x dp_shard trainer; a disaggregated trainer rank: the
  default group, the trainers' group, its mesh's groups and its weight channel; a generator
  rank: the default group and a weight channel per trainer rank); and the CUDA graph pool of
  each of Temper's engines (the generator, and colocated the async previous version's and
  the KL reference's): one decode step's temporaries at `max_batch` slots. A tensor-parallel
  generator is vLLM's, which runs eagerly: no graph pool.

Not counted (the headroom is for them): prefill and decode scratch outside the graphs, the
allocator's fragmentation. Nor is the engine process of a vLLM generator (its own CUDA
context, on the rank's GPU): the plan does not know the generator's backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from temper.checkpoint.composite import text_config
from temper.checkpoint.hf import read_hf_config
from temper.client.named_models import named_model
from temper.job.model_bytes import (
    ModelShapes,
    SamplerBytes,
    TrainerBytes,
    activation_bytes,
    autocast_copy_bytes,
    logits_bytes,
    num_active_params,
)
from temper.job.plan_settings import PlanSettings
from temper.job.plan_types import MIB, MemoryPlan, PlanRow, RolePlan
from temper.job.runtime_bytes import (
    CUDA_CONTEXT_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    Role,
    graph_pool_bytes,
    nccl_communicators,
)
from temper.models.build import parse_dtype
from temper.models.common.decoder import DecoderConfig
from temper.models.registry import family_for_hf_config
from temper.trainer.precision import Precision


def model_config(model: str) -> DecoderConfig:
    """The config of a model directory's config.json, or of a named size
    (client/named_models.py): its published shapes, or with a built-in tokenizer
    ('tiny:letters') that tokenizer's vocabulary, as `temper train` builds it."""
    if Path(model).expanduser().is_dir():
        hf_config = text_config(read_hf_config(Path(model).expanduser()))
        return family_for_hf_config(hf_config).config_from_hf(hf_config)
    return named_model(model, what="model").config()


def plan_memory(settings: PlanSettings, *, decoder: DecoderConfig | None = None) -> MemoryPlan:
    """The memory plan of `settings`; `decoder` (a model config) replaces `settings.model`'s
    (a job passes the config of the model it built)."""
    decoder = model_config(settings.model) if decoder is None else decoder
    _check_model(settings, decoder)
    shapes = ModelShapes.of(decoder, lora_rank=settings.lora_rank)
    rows = _Rows(settings, decoder=decoder, shapes=shapes)
    if settings.placement == "colocated":
        world = settings.world_size
        roles = (
            RolePlan(
                role="colocated",
                num_ranks=world,
                description=f"{world} ranks, each a {_shard(settings)} and a generator",
                rows=(
                    *rows.trainer(),
                    *rows.generator(colocated=True),
                    *rows.sender_sync(),
                    *rows.process("colocated"),
                ),
            ),
        )
    else:
        trainers, generators = settings.trainer_ranks, settings.generator_ranks
        tp = settings.generator_tp
        roles = (
            RolePlan(
                role="trainer",
                num_ranks=trainers,
                description=f"{trainers} trainer ranks ({_layout(settings)})",
                rows=(*rows.trainer(), *rows.sender_sync(), *rows.process("trainer")),
            ),
            RolePlan(
                role="generator",
                num_ranks=generators,
                description=f"{generators} generator ranks ({settings.num_engines} engines"
                + (f", tp {tp})" if tp > 1 else ")"),
                rows=(
                    *rows.generator(colocated=False),
                    *rows.receiver_sync(),
                    *rows.process("generator"),
                ),
            ),
        )
    return MemoryPlan(
        settings=settings,
        model_name=settings.model,
        num_params=decoder.num_params,
        num_active_params=num_active_params(decoder),
        roles=roles,
    )


def _shard(settings: PlanSettings) -> str:
    """What one trainer rank holds of the weights, in a role's description."""
    ranks, replicas = settings.shard_ranks, settings.dp_replicate
    if ranks == 1:
        return f"whole trainer (DDP over {replicas})" if replicas > 1 else "whole trainer"
    copies = f", {replicas} replicas" if replicas > 1 else ""
    experts = f", experts ep {settings.ep}" if settings.ep > 1 else ""
    return f"trainer shard (1/{ranks}{copies}{experts})"


def _layout(settings: PlanSettings) -> str:
    """How the trainer ranks hold the weights, in the trainer role's description."""
    ranks, replicas = settings.shard_ranks, settings.dp_replicate
    experts = f", experts ep {settings.ep}" if settings.ep > 1 else ""
    if replicas == 1:
        return f"FSDP over {ranks}{experts}"
    if ranks == 1:
        return f"DDP over {replicas}"
    return f"FSDP over {ranks}, {replicas} replicas{experts}"


def _check_model(settings: PlanSettings, decoder: DecoderConfig) -> None:
    if settings.ep > 1:
        num_experts = getattr(decoder, "num_experts", None)
        if num_experts is None or num_experts % settings.ep:
            what = "a dense model" if num_experts is None else f"num_experts ({num_experts})"
            raise ValueError(
                f"ep={settings.ep} must divide the model's routed experts; it has {what}"
            )
    if settings.max_seq_len > decoder.max_seq_len:
        raise ValueError(
            f"max_seq_len={settings.max_seq_len} exceeds the model's max_seq_len "
            f"({decoder.max_seq_len})"
        )
    tp = settings.generator_tp
    heads_ok = decoder.num_kv_heads % tp == 0 or tp % decoder.num_kv_heads == 0
    if decoder.num_heads % tp or not heads_ok:
        raise ValueError(
            f"generator_tp={tp} must divide the model's num_heads ({decoder.num_heads}) and "
            f"divide or be a multiple of its num_kv_heads ({decoder.num_kv_heads})"
        )


class _Rows:
    """The rows of each role for one plan."""

    def __init__(
        self, settings: PlanSettings, *, decoder: DecoderConfig, shapes: ModelShapes
    ) -> None:
        self.settings, self.decoder, self.shapes = settings, decoder, shapes
        precision = Precision(settings.dtype)
        self.precision = settings.dtype
        self.dtype = precision.parameters  # trained weights, gradients, moments
        self.frozen_dtype = precision.base(lora=True)  # a LoRA base: no master copy
        self.compute_dtype = precision.compute  # matmuls, FSDP's gathered copies
        self.mixed = precision.mixed
        self.generator_dtype = settings.generator_dtype or self.compute_dtype
        self.transfer_dtype = settings.transfer_dtype or self.generator_dtype
        self.lora = settings.lora_rank is not None

    def trainer(self) -> list[PlanRow]:
        """A trainer rank: its shards, then what only a training step holds."""
        return [*self._trainer_state(), *self._training_step()]

    def _trainer_state(self) -> list[PlanRow]:
        settings = self.settings
        ranks = settings.shard_ranks
        held = TrainerBytes.of(
            self.shapes,
            dtype=self.dtype,
            num_ranks=ranks,
            frozen_dtype=self.frozen_dtype,
            ep=settings.ep,
        )
        share = f"1/{ranks} of " if ranks > 1 else ""
        if self.lora:
            base = f"{share}{self.frozen_dtype}"
            rows = self._weights(
                "base weights (frozen)", base, held.frozen, dtype=self.frozen_dtype
            )
            rows.append(
                PlanRow(
                    item=f"LoRA adapters, {share}rank {settings.lora_rank}", num_bytes=held.trained
                )
            )
        else:
            master = " (master)" if self.mixed else ""
            rows = self._weights("weights", f"{share}{self.dtype}{master}", held.weights)
        rows.append(PlanRow(item=f"AdamW moments (2), {share}trained", num_bytes=held.moments))
        rows.append(PlanRow(item="gradients", num_bytes=held.gradients, phase="training"))
        return rows

    def _weights(
        self, what: str, how: str, num_bytes: int, *, dtype: str | None = None
    ) -> list[PlanRow]:
        """One row for a trainer rank's weights, `num_bytes` of them in `dtype` (None: the
        trained dtype); a MoE model's routed experts on a row of their own (sharded over
        the FSDP ranks like the rest; split ep ways first with expert parallelism)."""
        if not self.shapes.expert_numel:
            return [PlanRow(item=f"{what}, {how}", num_bytes=num_bytes)]
        ranks, ep = self.settings.shard_ranks, self.settings.ep
        experts = self.shapes.shard_numel(ranks, experts=True, trainable=not self.lora, ep=ep)
        experts *= _itemsize(dtype or self.dtype)
        split = f", ep {ep} x FSDP {ranks // ep}" if ep > 1 else ""
        return [
            PlanRow(item=f"{what}: routed experts, {how}{split}", num_bytes=experts),
            PlanRow(item=f"{what}: the rest, {how}", num_bytes=num_bytes - experts),
        ]

    def _training_step(self) -> list[PlanRow]:
        settings, shapes = self.settings, self.shapes
        ranks, size = settings.trainer_ranks, _itemsize(self.compute_dtype)
        rows = []
        # FSDP gathers copies when it shards, or casts them (mixed precision) even unsharded.
        if settings.shard_ranks > 1 or (self.mixed and ranks > 1):
            rows.extend(self._fsdp_copies(size))
        elif self.mixed:
            copies = autocast_copy_bytes(shapes, dtype=self.compute_dtype)
            item = f"autocast: {self.compute_dtype} casts of the weights"
            rows.append(PlanRow(item=item, num_bytes=copies, phase="training"))
        share = math.ceil(settings.batch / ranks) * settings.max_seq_len
        tokens = min(settings.micro_batch_tokens, share)
        activations = activation_bytes(
            self.decoder,
            tokens=tokens,
            dtype=self.precision,
            lora=self.lora,
            checkpointing=settings.activation_checkpointing,
        )
        kept = "checkpointed" if settings.activation_checkpointing == "full" else "kept"
        item = f"activations (estimate): {tokens} tokens, {kept}"
        rows.append(PlanRow(item=item, num_bytes=activations, phase="training"))
        logits = logits_bytes(self.decoder, tokens=tokens)
        rows.append(
            PlanRow(item="logits: fp32 chunk + log-softmax", num_bytes=logits, phase="training")
        )
        return rows

    def _fsdp_copies(self, size: int) -> list[PlanRow]:
        """What FSDP gathers (or casts) while training, `size` bytes an element."""
        shapes = self.shapes
        root, block = shapes.numel(root=True), shapes.gathered_block_numel(ep=self.settings.ep)
        part = f" (1/{self.settings.ep} of the experts)" if self.settings.ep > 1 else ""
        rows = [
            PlanRow(
                item=f"FSDP gathered: embeddings, output, 2 blocks{part}",
                num_bytes=(root + 2 * block) * size,
                phase="training",
            )
        ]
        if not self.lora:
            rows.append(
                PlanRow(
                    item="FSDP unsharded gradients: root, 1 block",
                    num_bytes=(root + block) * size,
                    phase="training",
                )
            )
            if self.mixed:
                rows.append(
                    PlanRow(
                        item=f"FSDP gradient reduction in {self.dtype}: the root or 1 block",
                        num_bytes=max(root, block) * _itemsize(self.dtype),
                        phase="training",
                    )
                )
        return rows

    def generator(self, *, colocated: bool) -> list[PlanRow]:
        """A generator's weights and KV cache, and the extra samplers async and KL keep."""
        settings = self.settings
        tp = 1 if colocated else settings.generator_tp
        slots = settings.max_batch or math.ceil(settings.batch / settings.num_engines)
        engine = SamplerBytes.of(
            self.decoder,
            self.shapes,
            num_slots=slots,
            max_seq_len=settings.max_seq_len,
            dtype=self.generator_dtype,
            prefix_cache_mib=settings.prefix_cache_mib,
            tp=tp,
        )
        weights, kv, prefix = engine.weights, engine.kv_cache, engine.prefix_cache
        states = engine.recurrent_states
        if colocated and not self.sampler_copy:
            rows = [PlanRow(item="generator weights: the trainer's own (no copy)", num_bytes=0)]
        elif self.shapes.expert_numel:
            how = f"{f'1/{tp} of ' if tp > 1 else ''}whole {self.generator_dtype}"
            itemsize = _itemsize(self.generator_dtype)
            experts = math.ceil(self.shapes.expert_numel * itemsize / tp)
            rows = [
                PlanRow(item=f"generator weights: routed experts, {how}", num_bytes=experts),
                PlanRow(item=f"generator weights: the rest, {how}", num_bytes=weights - experts),
            ]
        else:
            share = f"1/{tp} of " if tp > 1 else ""
            item = f"generator weights, {share}whole {self.generator_dtype}"
            rows = [PlanRow(item=item, num_bytes=weights)]
        kv_item = f"KV cache: {slots} slots x {settings.max_seq_len} tokens"
        linear = len(getattr(self.decoder, "linear_layers", ()))
        if linear:
            attention = self.decoder.num_layers - linear
            kv_item += f", {attention} full-attention layers of {self.decoder.num_layers}"
        rows.append(PlanRow(item=kv_item, num_bytes=kv))
        if states:
            item = f"recurrent states: {slots} slots x {linear} linear-attention layers"
            rows.append(PlanRow(item=item, num_bytes=states))
        if prefix:
            item = "prefix cache, at most"
            rows.append(PlanRow(item=item, num_bytes=prefix))
        if not colocated and settings.overlap_sync:
            item = "second copy of the weights (overlap_sync)"
            rows.append(PlanRow(item=item, num_bytes=weights))
        if colocated and settings.mode == "async":
            rows.append(
                PlanRow(
                    item="previous version's sampler (async)",
                    num_bytes=weights + kv + states + prefix,
                )
            )
        if settings.kl_reference and colocated:
            item = "KL reference sampler"
            rows.append(PlanRow(item=item, num_bytes=weights + kv + states + prefix))
        elif settings.kl_reference:  # whole weights that only score: no KV cache
            whole = self.shapes.sampler_numel * _itemsize(self.generator_dtype)
            where = " on each engine's first rank" if tp > 1 else ""
            item = (
                f"KL reference weights, whole {self.generator_dtype}{where}: scores only, "
                "no KV cache"
            )
            rows.append(PlanRow(item=item, num_bytes=whole))
        # A tensor-parallel engine is vLLM's, run eagerly: no graphs; nor on CPU.
        if tp == 1 and settings.device == "cuda":
            rows.append(self._graph_pools(slots, colocated=colocated))
        return rows

    def _graph_pools(self, slots: int, *, colocated: bool) -> PlanRow:
        """One graph pool per engine that decodes: the generator's, and colocated the async
        previous version's and the KL reference's (disaggregated, the reference only scores)."""
        settings = self.settings
        engines = 1
        if colocated:
            engines += (settings.mode == "async") + settings.kl_reference
        pool = graph_pool_bytes(self.decoder, num_slots=slots, dtype=self.generator_dtype)
        what = f"pools (estimate): {engines} engines x" if engines > 1 else "pool (estimate):"
        return PlanRow(item=f"CUDA graph {what} {slots} slots", num_bytes=engines * pool)

    def process(self, role: Role) -> list[PlanRow]:
        """What every process of `role` holds besides tensors: its CUDA context and the
        buffers of its NCCL communicators."""
        settings = self.settings
        if settings.device == "cpu":
            return []
        rows = [PlanRow(item="CUDA context (estimate)", num_bytes=CUDA_CONTEXT_BYTES)]
        groups = nccl_communicators(
            role,
            world_size=settings.world_size,
            trainer_ranks=settings.trainer_ranks,
            dp_replicate=settings.dp_replicate,
            ep=settings.ep,
        )
        if groups:
            count = f"{len(groups)} communicator" + ("s" if len(groups) > 1 else "")
            item = f"NCCL buffers (estimate): {count}"
            rows.append(PlanRow(item=item, num_bytes=len(groups) * NCCL_COMMUNICATOR_BYTES))
        return rows

    @property
    def sampler_copy(self) -> bool:
        """Whether a colocated generator holds weights of its own."""
        settings = self.settings
        return self.lora or settings.world_size > 1 or self.generator_dtype != self.dtype

    def sender_sync(self) -> list[PlanRow]:
        """Trainer ranks (colocated: every rank) while weights go to the generator."""
        settings, shapes = self.settings, self.shapes
        if settings.placement == "colocated" and not self.sampler_copy:
            return []
        # What gathering and merging copy: the weights as the trainer holds them (with LoRA,
        # mostly the base).
        size = _itemsize(self.frozen_dtype if self.lora else self.dtype)
        rows = []
        if settings.weight_sync == "bucketed":
            rows.append(self._buckets())
        elif settings.trainer_ranks > 1:
            gathered = shapes.numel() * size
            rows.append(PlanRow(item="gathered whole weights", num_bytes=gathered, phase="sync"))
        if self.lora and settings.weight_sync == "whole":
            merged = shapes.adapted_numel * size
            item = "merged copies of the adapted weights"
            rows.append(PlanRow(item=item, num_bytes=merged, phase="sync"))
        if self.lora:
            scratch = 3 * shapes.largest_adapted_numel * 4
            item = "LoRA merge: 3 fp32 tensors of the largest"
            rows.append(PlanRow(item=item, num_bytes=scratch, phase="sync"))
        return rows

    def receiver_sync(self) -> list[PlanRow]:
        """Generator ranks (disaggregated) while they receive weights."""
        if self.settings.weight_sync == "bucketed":
            return [self._buckets()]
        size = _itemsize(self.transfer_dtype)
        received = math.ceil(self.shapes.sampler_numel * size / self.settings.generator_tp)
        return [PlanRow(item="received whole weights", num_bytes=received, phase="sync")]

    def _buckets(self) -> PlanRow:
        """Two buckets: the one being sent or received, and the rows being gathered into it
        (a tensor larger than a bucket is split by rows); a model smaller than a bucket
        never fills one."""
        model = self.shapes.sampler_numel * _itemsize(self.transfer_dtype)
        bucket = min(self.settings.bucket_mb * MIB, model)
        what = f"{self.settings.bucket_mb} MiB buckets"
        if bucket < self.settings.bucket_mb * MIB:
            what = f"{bucket / MIB:.1f} MiB (the whole model)"
        return PlanRow(item=f"weight-sync buffers: 2 x {what}", num_bytes=2 * bucket, phase="sync")


def _itemsize(dtype: str) -> int:
    return parse_dtype(dtype).itemsize
