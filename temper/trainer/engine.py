"""The trainer engine: forward_backward / forward / optim_step on one model (LoRA or full).

Shapes: B datums in a micro-batch, T padded length, N loss positions.

Losses are sums over tokens (Tinker semantics), so a batch split into micro-batches by a token
budget gives the whole-batch gradient up to float rounding, with memory bounded by the budget.
Gradients accumulate across calls until `optim_step`.

A failed call changes nothing: inputs are validated before the model runs, and the gradients
accumulated by earlier calls are set aside while a call computes its own, then added back (on
success) or restored untouched (on failure).

Sharded (`Config.sharding`, under torchrun): every rank calls each verb with its own share of
the datums and gets its own datums' outputs back; gradients are summed over ranks (the
gradient of the union of the data), and `loss:sum` is summed over the data-parallel ranks. A
rank with fewer micro-batches runs empty ones so that every rank enters the same collectives,
and a request any rank rejects is rejected on every rank before the model runs. Given
`weights` (sharded loading), the model arrives on the meta device and each rank allocates and
fills only its own shards after sharding (temper/checkpoint/sharded_load.py).

MoE models: forward_backward also reports router metrics (`moe/*`) and, with
`Config.router_aux_loss="add"`, back-propagates the load-balancing loss too (router_stats.py).
Datums that carry the sampler's routes (`Datum.routed_experts`) add how often the trainer's
top-k differs from them (`routing/*`), and every verb's `routing_replay="sampler"` computes
each datum token through the sampler's experts (routing_replay.py).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from temper.api.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepResponse,
    RoutingReplay,
    TensorData,
)
from temper.checkpoint.sharded_load import DeferredWeights
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.distributed.fsdp import reshard_root
from temper.distributed.thread_shards import ThreadShards, split_by_tokens, sum_gradients
from temper.losses import get_loss, resolve_config
from temper.models.common.logprobs import forward_logprobs
from temper.models.common.moe_stats import moe_layers
from temper.models.lora import LoraConfig, apply_lora
from temper.trainer.custom_loss import CustomLossFn, custom_loss_weights
from temper.trainer.expert_threads import expert_threads_for
from temper.trainer.gradient_stash import GradientStash
from temper.trainer.inputs import MicroBatch, micro_batches, prepare, split_per_datum
from temper.trainer.optim import AdamW
from temper.trainer.precision import compute_in, keep_trained_in_fp32
from temper.trainer.router_stats import (
    AuxLossMode,
    RouterCall,
    RouterStats,
    backpropagate,
    call_metrics,
    objective,
    recording,
)
from temper.trainer.routing_replay import RouteReplay, RouteShape
from temper.trainer.sharding import Sharding
from temper.trainer.shared_prefix import packed_logprobs, packing_is_exact


class TrainerEngine(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        max_tokens_per_microbatch: int = 8192
        """Padded tokens per forward/backward; bigger calls are split (same gradient)."""
        sharding: Sharding.Config | None = None
        """Shard the model over the ranks of torch.distributed (torchrun); None: one process."""
        share_prefixes: bool = True
        """Run a prefix shared by consecutive datums (a GRPO group's prompt) once per batch
        instead of once per datum, when that saves >= 15% of the positions; logprobs and
        gradients equal the padded path's up to float rounding. Off for hybrid models
        (linear-attention layers), on which the packed layout is not exact (shared_prefix.py)."""
        shard_threads: int = 1
        """CPU, one process: run forward and forward_backward calls as this many shards of
        the datums at once, one thread each with single-threaded ops, summing the shards'
        gradients in order (deterministic, equal to the unsharded result up to float rounding;
        the token budget is shared between them). For small models, whose ops are too small
        to keep several cores busy; one per core. Costs a gradient buffer per shard. 1: off."""
        expert_threads: Literal["auto", "off"] = "auto"
        """MoE on CPU, one process, shard_threads 1: 'auto' runs whole experts per thread
        (trainer/expert_threads.py); 'off': torch's intra-op threads inside each expert."""
        router_aux_loss: AuxLossMode = "report"
        """MoE models: 'report' measures the load-balancing loss on every forward_backward
        and reports it (`moe/aux_loss`, with each layer's load and router entropy); 'add'
        also adds `router_aux_loss_coef` times it to what is back-propagated, so the gradient
        includes it (router_stats.py). Dense models measure nothing."""
        router_aux_loss_coef: float | None = None
        """Weight of the load-balancing loss under router_aux_loss='add'; None: the model
        config's `router_aux_loss_coef` (0.001 for Qwen3-MoE, as its config.json has it)."""

        def __post_init__(self) -> None:
            for name in ("max_tokens_per_microbatch", "shard_threads"):
                check_range(getattr(self, name), field=f"TrainerEngine.Config.{name}", at_least=1)
            check_choice(
                self.router_aux_loss,
                field="TrainerEngine.Config.router_aux_loss",
                choices=("report", "add"),
            )
            check_choice(
                self.expert_threads,
                field="TrainerEngine.Config.expert_threads",
                choices=("auto", "off"),
            )
            check_range(
                self.router_aux_loss_coef,
                field="TrainerEngine.Config.router_aux_loss_coef",
                at_least=0,
                also=(None,),
            )

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        lora: LoraConfig | None,
        weights: DeferredWeights | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """`weights`: a meta-device `model` is sharded first and then given only this rank's
        shards, filled from `weights` (sharded loading); None: `model` holds its weights.
        `compute_dtype`: mixed precision (see the module docstring): the trained parameters
        are kept in fp32 (cast if they are not: a bf16 LoRA base's adapters), frozen ones as
        given, and the forward's matmuls run in this dtype; None: everything in the
        parameters' dtype. Like `lora`, it describes the model the caller built (the
        ServiceClient, from its precision)."""
        self.config = config
        self.model = model
        self.lora = lora
        if lora is not None:
            apply_lora(model, lora)  # before sharding: the adapters are sharded with the model
        if compute_dtype == torch.float32:
            raise ValueError("compute_dtype float32 is not mixed precision; pass None")
        self.compute_dtype = compute_dtype or next(model.parameters()).dtype
        """The dtype matmuls run in; the generator of this trainer decodes in it."""
        self._autocast = compute_dtype  # None: fp32 and pure bf16 run as they are
        if compute_dtype is not None:
            keep_trained_in_fp32(model)  # before sharding: FSDP shards the fp32 masters
        self.sharding = None
        if config.sharding is not None:
            device = None if weights is None else weights.device
            self.sharding = config.sharding.build(
                model=model, device=device, compute_dtype=self._autocast
            )
        if weights is not None:
            weights.materialize(model, lora=lora)
        self.router = None
        """The MoE blocks' statistics; None for a dense model."""
        self.route_shape = RouteShape.of(model)
        """What a datum's routed_experts look like for this model; None for a dense one."""
        self.route_replay = None if self.route_shape is None else RouteReplay(model)
        if moe_layers(model):
            coef = config.router_aux_loss_coef
            coef = model.config.router_aux_loss_coef if coef is None else coef
            self.router = RouterStats(model, mode=config.router_aux_loss, coef=coef)
        elif config.router_aux_loss != "report":
            warnings.warn(
                f"TrainerEngine.Config.router_aux_loss={config.router_aux_loss!r} is ignored: "
                "the model has no MoE layers",
                stacklevel=2,
            )
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.policy_version = 0
        self.device = next(model.parameters()).device
        self.thread_shards = None
        if config.shard_threads > 1:
            if self.sharding is not None or self.device.type != "cpu":
                raise ValueError(
                    f"TrainerEngine.Config.shard_threads={config.shard_threads} needs a CPU "
                    f"model in one process (device {self.device}, sharding "
                    f"{config.sharding}); use 1"
                )
            self.thread_shards = ThreadShards(config.shard_threads)
        self.expert_threads = expert_threads_for(
            model,
            mode=config.expert_threads,
            moe=self.router is not None,
            one_cpu_process=self.device.type == "cpu" and self.sharding is None,
            shard_threads=self.thread_shards is not None,
        )
        # The optimizer steps in parts on the shard threads too (bitwise the same update).
        self.optimizer = AdamW(self.trainable, threads=self.thread_shards)

    # -- the Tinker verbs ------------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> ForwardBackwardOutput:
        """Loss, per-datum outputs and gradients (accumulated until `optim_step`).
        `routing_replay="sampler"` (MoE models): each datum's tokens go to the experts of its
        `routed_experts` (routing_replay.py)."""
        return self._run(data, loss_fn, loss_fn_config, backward=True, replay=routing_replay)

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> ForwardBackwardOutput:
        """Loss and per-datum outputs; gradients are not touched."""
        return self._run(data, loss_fn, loss_fn_config, backward=False, replay=routing_replay)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn, *, routing_replay: RoutingReplay = "off"
    ) -> ForwardBackwardOutput:
        """A loss computed by `loss_fn` from the per-datum logprobs.

        Two passes keep memory bounded: the logprobs are computed without a graph, the user's
        loss is differentiated with respect to them, and a second, micro-batched pass
        back-propagates sum(logprobs * dloss/dlogprobs), whose gradient equals the loss's.
        Both passes replay the same routes with `routing_replay="sampler"`.
        """
        prepared = self._prepare(
            data, required=("target_tokens",), topk=("target_tokens",), replay=routing_replay
        )
        batches = self._batches(prepared, replay=routing_replay)
        num_empty = self._num_empty_passes(len(batches))
        with torch.no_grad():
            logprobs = []
            for batch in batches:
                with self._replaying(batch, routing_replay):
                    logprobs += self._logprobs(batch)
            self._empty_passes(num_empty, backward=False)
        reshard_root(self.model)
        error, result = None, None
        try:
            result = custom_loss_weights(loss_fn, data, logprobs)
        except Exception as caught:
            if self.sharding is None:
                raise
            error = caught
        if self.sharding is not None:
            # Before the second pass's collectives: a loss_fn failing on one rank fails all.
            self.sharding.agree_or_raise(error)
        loss, metrics, weights = result

        def surrogate(batch: MicroBatch) -> torch.Tensor:
            logprobs_N = self._logprobs_N(batch)
            rows = [d.index for d in batch.datums]
            return (logprobs_N * torch.cat([weights[row] for row in rows])).sum()

        router = self._router_call(prepared)
        with self._atomic_gradients(), recording(router):
            for batch in batches:
                with self._replaying(batch, routing_replay):
                    backpropagate(surrogate(batch), batch, router)
            self._empty_passes(num_empty, backward=True)
        outputs = [{"logprobs": TensorData.from_torch(lp)} for lp in logprobs]
        metrics = {**metrics, "loss:sum": self._sum_over_dp(float(loss.detach()))}
        return ForwardBackwardOutput(
            loss_fn_outputs=outputs, metrics=metrics | call_metrics(router)
        )

    def optim_step(self, params: AdamParams) -> OptimStepResponse:
        """One AdamW step on the accumulated gradients; bumps the policy version."""
        if not isinstance(params, AdamParams):
            raise TypeError(f"optim_step takes AdamParams, got {type(params).__name__}")
        grad_norm = self.optimizer.step(params)
        self.policy_version += 1
        return OptimStepResponse(
            metrics={
                "grad_norm:mean": grad_norm,
                "learning_rate:mean": params.learning_rate,
                "policy_version:max": float(self.policy_version),
            }
        )

    def reset_optimizer(self) -> None:
        """A fresh optimizer (no moments), as after loading weights without optimizer state."""
        self.optimizer = AdamW(self.trainable, threads=self.thread_shards)

    def zero_grad(self) -> None:
        for parameter in self.trainable:
            parameter.grad = None

    # -- internals -------------------------------------------------------------------------

    def _prepare(
        self,
        data: Sequence[Datum],
        *,
        required,
        optional=(),
        defaults=None,
        topk=(),
        replay: RoutingReplay = "off",
    ) -> list:
        model_config = self.model.config
        checks = dict(
            required=required,
            optional=optional,
            defaults=defaults,
            topk=topk,
            vocab_size=model_config.vocab_size,
            max_seq_len=model_config.max_seq_len,
            route_shape=self.route_shape,
            routing_replay=replay,
        )
        if self.sharding is None:
            return prepare(data, **checks)
        # Sharded: a rank may hold no datums this call (the others do); any rank's bad input
        # fails the call on every rank.
        prepared, error = [], None
        try:
            if len(data) > 0:
                prepared = prepare(data, **checks)
        except (ValueError, TypeError) as caught:
            error = caught
        self.sharding.agree_or_raise(error)
        if self.sharding.max_over_ranks(len(prepared)) == 0:
            raise ValueError("data is empty on every rank; pass at least one Datum")
        return prepared

    def _num_empty_passes(self, num_batches: int) -> int:
        """Sharded: how many empty passes this rank runs after its micro-batches so that it
        enters as many FSDP/TP collectives as the rank with the most. Agreed before any
        model work (a rank still in a forward could not answer)."""
        if self.sharding is None:
            return 0
        return self.sharding.max_over_ranks(num_batches) - num_batches

    def _empty_passes(self, count: int, *, backward: bool) -> None:
        for _ in range(count):
            tokens_BT = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            with compute_in(self.device, self._autocast):
                logprobs_BT = forward_logprobs(self.model, tokens_BT, tokens_BT)
            if backward:
                (logprobs_BT.sum() * 0.0).backward()

    def _sum_over_dp(self, value: float) -> float:
        return value if self.sharding is None else self.sharding.sum_over_dp(value)

    def _batches(
        self, prepared, *, max_tokens: int | None = None, replay: RoutingReplay = "off"
    ) -> list[MicroBatch]:
        return list(
            micro_batches(
                prepared,
                max_tokens=max_tokens or self.config.max_tokens_per_microbatch,
                share_prefixes=self.config.share_prefixes and packing_is_exact(self.model.config),
                replaying=replay == "sampler",
            )
        )

    def _replaying(
        self, batch: MicroBatch, replay: RoutingReplay
    ) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: its routes replayed, if asked."""
        if replay == "off":
            return contextlib.nullcontext()
        assert self.route_replay is not None and batch.routes is not None  # checked in prepare
        return self.route_replay.replaying(
            batch.routes, rows_N=batch.token_rows(self.device), num_rows=batch.num_rows
        )

    def _logprobs(self, batch: MicroBatch) -> list[torch.Tensor]:
        """The trainer's logprob of each datum's targets, [T_i] per datum."""
        return split_per_datum(self._logprobs_N(batch), batch.datums)

    def _logprobs_N(self, batch: MicroBatch) -> torch.Tensor:
        """The same, datums concatenated in order: [N] (or [N, K]), fp32."""
        with compute_in(self.device, self._autocast):
            if batch.layout is not None:
                targets_N = batch.flat_targets(self.device)
                return packed_logprobs(self.model, batch.layout, targets_N)
            logprobs_BT = forward_logprobs(
                self.model, batch.tokens_BT.to(self.device), batch.targets_BT.to(self.device)
            )
        return logprobs_BT[batch.mask_BT.to(self.device)]

    def _run(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
        *,
        backward: bool,
        replay: RoutingReplay,
    ) -> ForwardBackwardOutput:
        spec = get_loss(loss_fn)
        config = resolve_config(spec, loss_fn_config)
        prepared = self._prepare(
            data,
            required=spec.required_inputs,
            optional=spec.optional_inputs,
            defaults=spec.input_defaults,
            topk=spec.topk_inputs,
            replay=replay,
        )
        outputs: list[dict[str, TensorData]] = [{} for _ in prepared]
        total_loss = 0.0
        batches = self._batches(prepared, replay=replay) if self.thread_shards is None else []
        num_empty = self._num_empty_passes(len(batches))
        router = self._router_call(prepared) if backward else None
        with self._atomic_gradients() if backward else torch.no_grad(), recording(router):
            if self.thread_shards is not None:
                total_loss = self._run_in_threads(
                    prepared, spec, config, outputs, backward=backward, router=router, replay=replay
                )
            for batch in batches:
                with self._replaying(batch, replay):
                    loss = self._batch_loss(batch, spec, config, outputs)
                    if backward:
                        backpropagate(loss, batch, router)
                total_loss += float(loss.detach())
            self._empty_passes(num_empty, backward=backward)
        if not backward:
            reshard_root(self.model)
        metrics = {"loss:sum": self._sum_over_dp(total_loss)} | call_metrics(router)
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=metrics)

    def _router_call(self, prepared: list) -> RouterCall | None:
        """A forward_backward's router statistics (MoE models), opened on every rank."""
        if self.router is None:
            return None
        return RouterCall(self.router, prepared, device=self.device, sharding=self.sharding)

    def _batch_loss(self, batch: MicroBatch, spec, config, outputs: list) -> torch.Tensor:
        """The batch's summed loss; its datums' outputs go into `outputs`."""
        logprobs_N = self._logprobs_N(batch)  # [N], or [N, K] with K targets per position
        inputs = batch.flat_inputs(self.device)
        if spec.position_logprobs is not None:  # e.g. renormalised over a sampler's support
            logprobs_N = spec.position_logprobs(logprobs_N, inputs=inputs)
        with compute_in(self.device, self._autocast):
            if spec.segmented:
                segments_N = batch.segments(self.device)
                loss_N = spec.fn(
                    logprobs_N=logprobs_N, inputs=inputs, config=config, segments_N=segments_N
                )
            else:
                loss_N = spec.fn(logprobs_N=logprobs_N, inputs=inputs, config=config)
        # Outputs leave as Python lists: one conversion per batch, sliced per datum.
        per_position = logprobs_N.shape[1:]
        width = math.prod(per_position)
        logprobs = logprobs_N.detach().float().cpu().reshape(-1).tolist()
        losses = loss_N.detach().float().cpu().reshape(-1).tolist()
        start = 0
        for datum in batch.datums:
            end = start + len(datum.tokens) * width
            shape = (len(datum.tokens), *per_position)
            outputs[datum.index] = {
                "logprobs": _float32_data(logprobs[start:end], shape=shape),
                "elementwise_loss": _float32_data(losses[start:end], shape=shape),
            }
            start = end
        return loss_N.sum()

    def _run_in_threads(
        self,
        prepared,
        spec,
        config,
        outputs: list,
        *,
        backward: bool,
        router: RouterCall | None,
        replay: RoutingReplay,
    ) -> float:
        """`_run`'s batches as concurrent shards (see thread_shards.py); sets the gradients."""
        ranges = split_by_tokens(
            [d.tokens_T.shape[0] for d in prepared], self.thread_shards.num_threads
        )
        max_tokens = max(1, self.config.max_tokens_per_microbatch // len(ranges))

        def shard_pass(shard: range) -> tuple[float, list[torch.Tensor | None] | None]:
            total, grads = 0.0, None
            with torch.set_grad_enabled(backward):  # grad mode is per thread
                for batch in self._batches(
                    prepared[shard.start : shard.stop], max_tokens=max_tokens, replay=replay
                ):
                    with self._replaying(batch, replay):
                        loss = self._batch_loss(batch, spec, config, outputs)
                        if backward:
                            target = objective(loss, batch, router)
                            batch_grads = torch.autograd.grad(
                                target, self.trainable, allow_unused=True
                            )
                            grads = (
                                batch_grads
                                if grads is None
                                else sum_gradients([grads, batch_grads])
                            )
                    total += float(loss.detach())
            return total, grads

        results = self.thread_shards.map(shard_pass, ranges)
        if backward:
            # Summed on a worker too: elementwise adds, too small for intra-op threads.
            totals = self.thread_shards.run(lambda: sum_gradients([g for _, g in results]))
            for parameter, grad in zip(self.trainable, totals, strict=True):
                parameter.grad = grad
        return sum(total for total, _ in results)

    def _atomic_gradients(self) -> GradientStash:
        return GradientStash(self.trainable)


def _float32_data(values: list[float], *, shape: tuple[int, ...]) -> TensorData:
    """TensorData of values read from a float32 tensor (exact in float32 already)."""
    return TensorData(data=values, dtype="float32", shape=shape)
