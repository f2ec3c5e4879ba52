"""Several LoRA adapters on one frozen base in one batch: each row picks its adapter.

Shapes: B rows, T tokens, D model dim, V vocab, K adapters, R rank (the largest of the
adapters'; a smaller adapter is zero-padded, and an adapter without a target has zeros there:
both add exact zeros), I/O a linear's in/out features.

`apply_multi_lora(model, adapters)` swaps each adapted linear of a plain decoder (whose
weights may be shared, frozen, with other clients) for a `MultiLoraLinear` holding the K
adapters stacked, and sets a `MultiLoraUnembedding` as its output adapter; `set_rows(model,
index_B)` says which adapter each row of the next forwards uses. A linear adds, per row b,
scale_b * (x_b @ A_b.T) @ B_b.T (a batched gather of the row's A and B), so the base matmul
runs once for all rows; the unembedding extends both factors of the logit product as
`LoraUnembedding` does, with every adapter's B side by side and each row's low-rank part in
its own adapter's columns (zeros elsewhere).

This is the first piece of issue 19's multi-adapter sampling: a correctness building block
(tests/models/test_multi_lora.py: a mixed batch equals each adapter's merged model within
fp32 rounding). The sampler engine does not use it yet; LoRA snapshots still sample on
merged weights (client/weight_sync.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.decoder import Decoder
from temper.models.lora import ATTENTION_TARGETS, MLP_TARGETS, LoraConfig


class _Rows:
    """The adapter index of each row, shared by every adapted module of one model."""

    def __init__(self) -> None:
        self.index_B: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.index_B is None:
            raise RuntimeError("multi-LoRA model: call set_rows(model, index_B) before a forward")
        return self.index_B


def _stack(
    adapters: Sequence[tuple[LoraConfig, Mapping[str, torch.Tensor]]],
    name: str,
    *,
    in_features: int,
    out_features: int,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A [K, R, I], B [K, O, R], scale [K]) of target `name`, zero-padded to the largest rank."""
    rank = max(config.rank for config, _ in adapters)
    lora_A_KRI = like.new_zeros(len(adapters), rank, in_features)
    lora_B_KOR = like.new_zeros(len(adapters), out_features, rank)
    scale_K = torch.zeros(len(adapters), dtype=like.dtype, device=like.device)
    for k, (config, tensors) in enumerate(adapters):
        if f"{name}.lora_A" not in tensors:
            continue  # this adapter leaves the target alone: zeros
        lora_A_KRI[k, : config.rank] = tensors[f"{name}.lora_A"]
        lora_B_KOR[k, :, : config.rank] = tensors[f"{name}.lora_B"]
        scale_K[k] = config.alpha / config.rank
    return lora_A_KRI, lora_B_KOR, scale_K


class MultiLoraLinear(nn.Module):
    """A frozen linear plus, per row, its adapter's scale * B @ A."""

    def __init__(
        self,
        base: nn.Linear,
        *,
        lora_A_KRI: torch.Tensor,
        lora_B_KOR: torch.Tensor,
        scale_K: torch.Tensor,
        rows: _Rows,
    ) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.register_buffer("lora_A_KRI", lora_A_KRI, persistent=False)
        self.register_buffer("lora_B_KOR", lora_B_KOR, persistent=False)
        self.register_buffer("scale_K", scale_K, persistent=False)
        self.rows = rows

    def forward(self, x_BxI: torch.Tensor) -> torch.Tensor:
        index_B = self.rows.get()
        low_BxR = torch.einsum("b...i,bri->b...r", x_BxI, self.lora_A_KRI[index_B])
        low_BxR = low_BxR * self.scale_K[index_B].view(-1, *[1] * (x_BxI.ndim - 1))
        delta_BxO = torch.einsum("b...r,bor->b...o", low_BxR, self.lora_B_KOR[index_B])
        return F.linear(x_BxI, self.weight, self.bias) + delta_BxO


class MultiLoraUnembedding(nn.Module):
    """Per-row LoRA on the unembedding, by extending both factors of the logit product."""

    def __init__(
        self,
        *,
        lora_A_KRD: torch.Tensor,
        lora_B_KVR: torch.Tensor,
        scale_K: torch.Tensor,
        rows: _Rows,
    ) -> None:
        super().__init__()
        self.register_buffer("lora_A_KRD", lora_A_KRD, persistent=False)
        self.register_buffer("lora_B_KVR", lora_B_KVR, persistent=False)
        self.register_buffer("scale_K", scale_K, persistent=False)
        self.rows = rows

    def augment(
        self, hidden_BxD: torch.Tensor, weight_VD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden' = [hidden, per adapter k: scale_k * hidden @ A_k.T if the row uses k else
        0] and weight' = [weight, B_1, ..., B_K]."""
        index_B = self.rows.get()
        num_adapters = self.lora_A_KRD.shape[0]
        low_BxKR = torch.einsum("b...d,krd->b...kr", hidden_BxD, self.lora_A_KRD)
        pick_BK = F.one_hot(index_B, num_adapters).to(hidden_BxD.dtype) * self.scale_K
        pick_BxK1 = pick_BK.view(-1, *[1] * (hidden_BxD.ndim - 2), num_adapters, 1)
        low_BxKR = (low_BxKR * pick_BxK1).flatten(-2)
        lora_B_VKR = self.lora_B_KVR.permute(1, 0, 2).reshape(weight_VD.shape[0], -1)
        return torch.cat([hidden_BxD, low_BxKR], -1), torch.cat([weight_VD, lora_B_VKR], -1)


def apply_multi_lora(
    model: Decoder, adapters: Sequence[tuple[LoraConfig, Mapping[str, torch.Tensor]]]
) -> None:
    """Give plain `model` the K `adapters` ((config, `lora_state_dict` tensors) each) in
    place; its own weights are only read."""
    if not adapters:
        raise ValueError("apply_multi_lora: give at least one adapter")
    rows = _Rows()
    model.multi_lora_rows = rows
    any_attn = any(config.train_attn for config, _ in adapters)
    any_mlp = any(config.train_mlp for config, _ in adapters)
    for index, block in enumerate(model.blocks):
        targets = [(block.attention, name) for name in ATTENTION_TARGETS if any_attn]
        targets += [(block.feed_forward, name) for name in MLP_TARGETS if any_mlp]
        for parent, name in targets:
            base = getattr(parent, name)
            prefix = "attention" if parent is block.attention else "feed_forward"
            lora_A_KRI, lora_B_KOR, scale_K = _stack(
                adapters,
                f"blocks.{index}.{prefix}.{name}",
                in_features=base.in_features,
                out_features=base.out_features,
                like=base.weight,
            )
            multi = MultiLoraLinear(
                base, lora_A_KRI=lora_A_KRI, lora_B_KOR=lora_B_KOR, scale_K=scale_K, rows=rows
            )
            setattr(parent, name, multi)
    if any(config.train_unembed for config, _ in adapters):
        vocab_size, dim = model.output_weight_VD.shape
        lora_A_KRD, lora_B_KVR, scale_K = _stack(
            adapters,
            "output_adapter",
            in_features=dim,
            out_features=vocab_size,
            like=model.output_weight_VD,
        )
        model.output_adapter = MultiLoraUnembedding(
            lora_A_KRD=lora_A_KRD, lora_B_KVR=lora_B_KVR, scale_K=scale_K, rows=rows
        )


def set_rows(model: Decoder, index_B: torch.Tensor) -> None:
    """Row b of the next forwards uses adapter index_B[b]."""
    model.multi_lora_rows.index_B = index_B
