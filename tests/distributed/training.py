"""A few training steps of the trainer engine, the same on one process or on each rank."""

from __future__ import annotations

import dataclasses

import torch

from temper.api import AdamParams, Datum, ModelInput
from temper.checkpoint.gather import full_state_dict
from temper.distributed.parallel_dims import ParallelDims
from temper.models import llama_size, materialize, qwen3_moe_size, qwen3_size
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.sharding import Sharding

VOCAB = 31
NUM_DATUMS = 8
STEPS = 3
ADAM = AdamParams(learning_rate=1e-2, grad_clip_norm=1.0, weight_decay=0.01)


SIZES = {
    "qwen3": qwen3_size,
    "llama": llama_size,
    "qwen3_moe": qwen3_moe_size,
    "qwen3_5": qwen3_5_size,
    "qwen3_5_moe": qwen3_5_moe_size,
}
# Qwen3-MoE: 5 experts, split unevenly over 2 FSDP ranks (3 and 2), and a dense layer 0 beside
# the sparse layer 1, so both kinds of feed-forward are sharded.
# Qwen3.5 (-MoE): a Gated DeltaNet layer 0 and a gated full-attention layer 1 (the MoE each
# with 4 routed experts and a shared expert).
FAMILY_CHANGES = {
    "qwen3_moe": {"num_experts": 5, "mlp_only_layers": (0,)},
    "qwen3_5": {"layer_types": ("linear_attention", "full_attention")},
    "qwen3_5_moe": {"layer_types": ("linear_attention", "full_attention"), "num_experts": 4},
}


def tiny_model(*, family: str = "qwen3", **changes) -> torch.nn.Module:
    changes = {**FAMILY_CHANGES.get(family, {}), **changes}
    config = dataclasses.replace(
        SIZES[family]("tiny", vocab_size=VOCAB), num_layers=2, init_std=0.1, **changes
    )
    model = materialize(config, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # The Gated DeltaNet's dt_bias as a HF checkpoint fills it (1: short memory). The
            # from-scratch init (log-uniform small steps: long memory) leaves parameters whose
            # gradients sit near rounding level; at these tests' Adam rate (1e-2) a sharded
            # run's other reduction order then flips their first updates, and the runs part.
            if name.endswith("linear_attention.dt_bias"):
                parameter.fill_(1.0)
    return model


def batch(step: int) -> list[Datum]:
    """NUM_DATUMS datums of uneven lengths (a different batch each step)."""
    generator = torch.Generator().manual_seed(100 + step)
    data = []
    for index in range(NUM_DATUMS):
        tokens = torch.randint(0, VOCAB, (4 + (index * 5) % 11,), generator=generator).tolist()
        n = len(tokens) - 1
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
            )
        )
    return data


def engine(
    *,
    dims: ParallelDims.Config | None = None,
    lora: LoraConfig | None = None,
    max_tokens: int = 8192,
    activation_checkpointing: str = "none",
    family: str = "qwen3",
) -> TrainerEngine:
    sharding = (
        None
        if dims is None
        else Sharding.Config(dims=dims, activation_checkpointing=activation_checkpointing)
    )
    config = TrainerEngine.Config(max_tokens_per_microbatch=max_tokens, sharding=sharding)
    return config.build(model=tiny_model(family=family), lora=lora)


def engine_with_heads(*, dims: ParallelDims.Config, num_heads: int, num_kv_heads: int):
    config = TrainerEngine.Config(sharding=Sharding.Config(dims=dims))
    model = tiny_model(num_heads=num_heads, num_kv_heads=num_kv_heads)
    return config.build(model=model, lora=None)


def _custom_loss(data, logprobs):
    """A loss only the custom path computes: sum of squared logprobs."""
    loss = sum((logprobs_T**2).sum() for logprobs_T in logprobs)
    return loss, {}


def train(engine: TrainerEngine, *, share: slice = slice(None), custom: bool = False) -> dict:
    """STEPS steps on this rank's `share` of each batch; losses, grad norms, the loss of a
    forward() after each step (it runs between an optimizer step and the next backward), and
    the final weights."""
    losses, grad_norms, forward_losses = [], [], []
    for step in range(STEPS):
        data = batch(step)[share]
        if custom:
            output = engine.forward_backward_custom(data, _custom_loss)
        else:
            output = engine.forward_backward(data, "cross_entropy")
        losses.append(output.metrics["loss:sum"])
        grad_norms.append(engine.optim_step(ADAM).metrics["grad_norm:mean"])
        forward = engine.forward(batch(step + 1)[share], "cross_entropy")
        forward_losses.append(forward.metrics["loss:sum"])
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "forward_losses": forward_losses,
        "weights": full_state_dict(engine.model),
    }
