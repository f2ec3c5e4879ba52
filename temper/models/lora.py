"""LoRA adapters: low-rank trainable additions to a frozen decoder's projections.

Shapes: B batch, T tokens, D model dim, V vocab, R LoRA rank, I/O a linear's in/out features,
E experts.

`apply_lora` swaps each target `nn.Linear` for a `LoraLinear` that keeps the very same
`weight`/`bias` Parameter objects, so base state-dict keys (`blocks.0.attention.wq.weight`)
and any code holding those Parameters are unaffected; only `lora_A`/`lora_B` are added. In a
MoE block, `train_mlp` adapts every routed expert's gate, up and down projections instead, one
low-rank pair per expert held stacked (lora_experts.py); the router is never adapted. The
unembedding is adapted through the decoder's `output_adapter` hook rather than by wrapping a
module, because a tied model has no output module: the adapter extends both factors of
`logits = hidden @ weight.T` (see `LoraUnembedding.augment`), so the input embedding stays
untouched and chunked logprobs stay exact. This is what PEFT does for `lm_head` on a tied
model too (it wraps `lm_head` only, sharing the base weight with the embedding).

Initialization follows PEFT: A ~ kaiming_uniform(a=sqrt(5)), B = 0, scale = alpha / rank, so a
fresh adapter changes nothing. A is drawn in fp32 on the CPU from one generator seeded with
`LoraConfig.seed` (same seed, same adapter, whatever the model's device) and then cast to the
model's dtype and device; `initial_lora_A` yields those draws again, for a model whose adapters
were applied on the meta device and sharded before they had values. The E experts' A of one
projection are drawn as one [E * R, I] matrix, so each expert's [R, I] has a dense adapter's
bound (PEFT draws its stacked expert adapters the same way).

Targets are chosen by the three `train_*` switches; a switch whose projections a model lacks
fails in `apply_lora` before anything is changed, naming the switch and the valid ones.
`train_attn` adapts each block's token mixer: a full-attention layer's q, k, v, o (a gated
attention's q projection includes its gate half), a linear-attention (Gated DeltaNet) layer's
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj; the conv, decay and norm parameters
of a Gated DeltaNet are never adapted (they are not linears). `train_mlp` adapts a MoE block's
shared expert (its gate, up, down; never its sigmoid gate) beside the routed experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from temper.config.checks import check_range
from temper.models.common.decoder import Decoder, DecoderConfig
from temper.models.common.moe import MoE
from temper.models.lora_experts import (
    ADAPTER_SUFFIX,
    EXPERT_TARGETS,
    ExpertsLora,
    LoraGroupedExperts,
)

ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
"""A Gated DeltaNet's projections, by their attribute on the layer (the HF names)."""
MLP_TARGETS = ("w_gate", "w_up", "w_down")
SHARED_EXPERT = "shared_expert"
"""The attribute of a MoE block's shared expert (a SwiGLU), where a family has one."""
LORA_SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Which projections get a LoRA adapter, and its rank, scale and seed."""

    rank: int
    """Rank R of every adapter (the inner width of B @ A)."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B @ A to each weight."""
    train_attn: bool = True
    """Adapt the token mixers' projections: attention's q, k, v, o; a linear-attention
    layer's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj."""
    train_mlp: bool = True
    """Adapt the feed-forward projections (gate, up, down): a dense layer's, and in a MoE
    layer every routed expert's (one pair per expert) and a shared expert's; the router and
    the shared expert's gate are never adapted."""
    train_unembed: bool = True
    """Adapt the unembedding (output projection; the input embedding is never changed)."""
    seed: int = 0
    """Seed of the random init of the A matrices."""

    def __post_init__(self) -> None:
        check_range(self.rank, field="LoraConfig.rank", integer=True, at_least=1)
        check_range(self.seed, field="LoraConfig.seed", integer=True)
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"LoraConfig.seed must be in [-2**63, 2**64), got {self.seed}")
        check_range(self.alpha, field="LoraConfig.alpha", greater_than=0, finite=True)
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError(
                "LoraConfig: at least one of train_attn, train_mlp, train_unembed must be True "
                "(all are False, so nothing would be trained)"
            )


def _draw_lora_A(*, rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    lora_A_RI = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(lora_A_RI, a=math.sqrt(5), generator=generator)
    return lora_A_RI


class LoraLinear(nn.Linear):
    """An `nn.Linear` plus scale * B @ A, sharing the base linear's weight and bias objects.

    `lora_A_RI` is the initial A (fp32), cast to the weight's dtype and device."""

    def __init__(self, base: nn.Linear, *, lora_A_RI: torch.Tensor, alpha: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a fresh weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        rank = lora_A_RI.shape[0]
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(lora_A_RI.to(device=base.weight.device, dtype=base.weight.dtype))
        self.lora_B = nn.Parameter(base.weight.new_zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scale * delta

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A [O, I] in fp32 (what merging adds to the weight)."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


class LoraUnembedding(nn.Module):
    """LoRA on the unembedding, applied by extending both factors of the logit product."""

    def __init__(self, *, weight_VD: torch.Tensor, lora_A_RI: torch.Tensor, alpha: float) -> None:
        super().__init__()
        vocab_size = weight_VD.shape[0]
        rank = lora_A_RI.shape[0]
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(lora_A_RI.to(device=weight_VD.device, dtype=weight_VD.dtype))
        self.lora_B = nn.Parameter(weight_VD.new_zeros(vocab_size, rank))

    def augment(
        self, hidden_BTD: torch.Tensor, weight_VD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden', weight') with hidden' @ weight'.T = hidden @ (weight + scale * B @ A).T.

        hidden' = [hidden, scale * hidden @ A.T] and weight' = [weight, B] (R extra columns),
        so the merged [V, D] unembedding is never formed.
        """
        low_rank_BTR = self.scale * F.linear(hidden_BTD, self.lora_A)
        return torch.cat([hidden_BTD, low_rank_BTR], -1), torch.cat([weight_VD, self.lora_B], -1)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A [V, D] in fp32."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


LoraModule = LoraLinear | LoraUnembedding | ExpertsLora
"""What `lora_modules` finds: an adapted linear, the unembedding's adapter, or one expert
projection's stacked adapters."""
UNEMBEDDING_ADAPTER = "output_adapter"


def mixer(block: nn.Module) -> tuple[str, nn.Module, tuple[str, ...]]:
    """(attribute, module, linear names to adapt) of a block's token mixer: `attention` with
    q, k, v, o, or a hybrid block's `linear_attention` with its five projections."""
    linear = getattr(block, "linear_attention", None)
    if linear is not None:
        return "linear_attention", linear, LINEAR_ATTENTION_TARGETS
    return "attention", block.attention, ATTENTION_TARGETS


def shared_expert(feed_forward: nn.Module) -> nn.Module | None:
    """A MoE block's shared expert (a SwiGLU beside the routed experts), or None."""
    return getattr(feed_forward, SHARED_EXPERT, None)


def _targets(model: Decoder, config: LoraConfig) -> dict[str, tuple[nn.Module, str]]:
    """Adapter module name -> (parent, attribute) of every weight to adapt, in a fixed order
    (it fixes the init): a linear by its parent module, a MoE block's stacked expert weight by
    the block and the weight's name in its experts."""
    _check_switches(model, config)
    targets = {}
    for index, block in enumerate(model.blocks):
        prefix = f"blocks.{index}"
        if config.train_attn:
            part, module, names = mixer(block)
            for name in names:
                targets[f"{prefix}.{part}.{name}"] = (module, name)
        feed_forward = block.feed_forward
        if config.train_mlp and isinstance(feed_forward, MoE):
            for name in EXPERT_TARGETS:
                adapter = f"{prefix}.feed_forward.experts.{name}{ADAPTER_SUFFIX}"
                targets[adapter] = (feed_forward, name)
            shared = shared_expert(feed_forward)
            if shared is not None:
                for name in MLP_TARGETS:
                    targets[f"{prefix}.feed_forward.{SHARED_EXPERT}.{name}"] = (shared, name)
        elif config.train_mlp:
            for name in MLP_TARGETS:
                targets[f"{prefix}.feed_forward.{name}"] = (feed_forward, name)
    return targets


def _check_switches(model: Decoder, config: LoraConfig) -> None:
    """A ValueError naming the first switch of `config` whose projections `model` lacks, and
    the switches valid for it."""
    for field in ("train_attn", "train_mlp"):
        missing = _missing_targets(model, field) if getattr(config, field) else None
        if missing is not None:
            valid = [f for f in ("train_attn", "train_mlp") if _missing_targets(model, f) is None]
            raise ValueError(
                f"LoraConfig.{field}=True, but {missing}; valid for this model: "
                f"{', '.join([*valid, 'train_unembed'])} (set {field}=False)"
            )


def _missing_targets(model: Decoder, field: str) -> str | None:
    """What lacks the projections switch `field` adapts, or None when every block has them."""
    for index, block in enumerate(model.blocks):
        if field == "train_attn":
            part, module, names = mixer(block)
        elif isinstance(block.feed_forward, MoE):
            continue  # the experts' stacked weights
        else:
            part, names = "feed_forward", MLP_TARGETS
            module = block.feed_forward
        if not all(isinstance(getattr(module, name, None), nn.Linear) for name in names):
            return (
                f"block {index}'s {part} ({type(module).__name__}) has no linear projections "
                f"{', '.join(names)} to adapt"
            )
    return None


def _in_features(parent: nn.Module, attribute: str) -> tuple[int | None, int]:
    """(experts or None for a linear, input features) of a target's weight."""
    if isinstance(parent, MoE):
        num_experts, _, in_features = getattr(parent.experts, attribute).shape
        return num_experts, in_features
    return None, getattr(parent, attribute).in_features


def initial_lora_A(model: Decoder, config: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(adapter module name, initial A in fp32 on the CPU: [R, I], or [E, R, I] for experts)
    of every adapter `config` adds to `model`, in the order `apply_lora` draws them from one
    generator seeded with `config.seed`: the values `apply_lora` gives them. One tensor at a
    time."""
    generator = torch.Generator().manual_seed(config.seed)
    for name, (parent, attribute) in _targets(model, config).items():
        num_experts, in_features = _in_features(parent, attribute)
        if num_experts is None:
            yield name, _draw_lora_A(rank=config.rank, in_features=in_features, generator=generator)
        else:
            lora_A = _draw_lora_A(
                rank=num_experts * config.rank, in_features=in_features, generator=generator
            )
            yield name, lora_A.view(num_experts, config.rank, in_features)
    if config.train_unembed:
        dim = model.config.dim
        yield (
            UNEMBEDDING_ADAPTER,
            _draw_lora_A(rank=config.rank, in_features=dim, generator=generator),
        )


def apply_lora(model: Decoder, config: LoraConfig) -> None:
    """Add LoRA adapters to `model` in place and freeze everything else.

    Afterwards only `lora_A`/`lora_B` parameters require grad. B starts at zero, so the model
    computes the function it computed without adapters until B moves away from zero. A MoE
    block's experts become `LoraGroupedExperts` (same weights) and its router stays frozen.
    """
    if not isinstance(config, LoraConfig):
        raise TypeError(f"apply_lora: config must be a LoraConfig, got {type(config).__name__}")
    if has_lora(model):
        raise ValueError("apply_lora: the model already has LoRA adapters; apply it once")
    targets = _targets(model, config)  # checks the targets exist before anything changes
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name, lora_A in initial_lora_A(model, config):
        if name == UNEMBEDDING_ADAPTER:
            model.output_adapter = LoraUnembedding(
                weight_VD=model.output_weight_VD, lora_A_RI=lora_A, alpha=config.alpha
            )
            continue
        parent, attribute = targets[name]
        if isinstance(parent, MoE):
            if not isinstance(parent.experts, LoraGroupedExperts):
                parent.experts = LoraGroupedExperts(parent.experts)
            experts = parent.experts
            adapter = ExpertsLora(
                getattr(experts, attribute), lora_A_ERI=lora_A, alpha=config.alpha
            )
            setattr(experts, f"{attribute}{ADAPTER_SUFFIX}", adapter)
            continue
        lora = LoraLinear(getattr(parent, attribute), lora_A_RI=lora_A, alpha=config.alpha)
        setattr(parent, attribute, lora)


def lora_modules(model: nn.Module) -> dict[str, LoraModule]:
    """Every LoRA module of `model` by its qualified name (e.g. 'blocks.0.attention.wq',
    'blocks.1.feed_forward.experts.w_gate_adapter', 'output_adapter')."""
    return {
        name: module for name, module in model.named_modules() if isinstance(module, LoraModule)
    }


def adapted_key(name: str, module: LoraModule) -> str:
    """The state-dict key of the weight that adapter `name` (a `lora_modules` entry) changes
    in a merged model: a linear's '{name}.weight', 'output.weight' for the unembedding, and the
    stacked expert weight for expert adapters ('blocks.1.feed_forward.experts.w_gate')."""
    if isinstance(module, LoraUnembedding):
        return "output.weight"
    if isinstance(module, ExpertsLora):
        return name.removesuffix(ADAPTER_SUFFIX)
    return f"{name}.weight"


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the LoRA tensors, e.g. 'blocks.0.attention.wq.lora_A', 'output_adapter.lora_B'."""
    return {key: value for key, value in model.state_dict().items() if key.endswith(LORA_SUFFIXES)}


def _unembedding_adapter(model: Decoder) -> LoraUnembedding | None:
    adapter = getattr(model, "output_adapter", None)
    return adapter if isinstance(adapter, LoraUnembedding) else None


def merged_config(model: Decoder) -> DecoderConfig:
    """The Config of the plain model that `merged_state_dict(model)` loads into.

    Merging an unembedding adapter into a tied model unties it (the embedding is unchanged,
    the output projection is not), so that case returns `tie_embeddings=False`.
    """
    if model.config.tie_embeddings and _unembedding_adapter(model) is not None:
        return dataclasses.replace(model.config, tie_embeddings=False)
    return model.config


@torch.no_grad()
def merged_state_dict(model: Decoder) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter merged: W + scale * B @ A.

    Sums are formed in fp32 and cast to the weight's dtype; keys are those of a model built
    from `merged_config(model)` (with a tied model's adapted unembedding as 'output.weight').
    """
    merged = {
        key: value for key, value in model.state_dict().items() if not key.endswith(LORA_SUFFIXES)
    }
    for name, module in lora_modules(model).items():
        key = adapted_key(name, module)
        if isinstance(module, LoraUnembedding):
            weight = model.output_weight_VD
        else:
            weight = model.get_parameter(key)
        merged[key] = (weight.float() + module.delta_weight()).to(weight.dtype)
    return merged
