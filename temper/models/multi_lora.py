"""Several LoRA adapters on one frozen base in one batch: each row picks its adapter slot.

Shapes: B rows, M positions per row, D model dim, V vocab, K adapter slots, R rank (the
largest loaded so far; a smaller adapter is zero-padded, and an adapter without a target has
zeros there: both add exact zeros), U slots used by a batch, N rows per used slot (padded),
I/O a linear's in/out features; in a MoE block, T tokens (rows and positions flattened), P
experts per token (top-k), E experts, A token-expert assignments sorted by expert (`combine`
keeps `MoE.combine`'s argument names, with N for T and K for P).

`install_slots(model)` swaps every adaptable linear of a plain decoder (whose weights may be
shared, frozen, with other clients) for a `MultiLoraLinear` and sets a `MultiLoraUnembedding`
as its output adapter; `load_adapter(model, slot, config, tensors)` writes one adapter's
`lora_state_dict` tensors into a slot (the slot tables grow as needed), and `set_rows(model,
index)` says which slot each row of the next forwards uses: one int for every row, or each
row's (ints, or a [B] tensor). The adapter scale is folded into the slot's B (B' = scale * B).

A per-row forward runs the base matmul once for all rows and the low-rank term grouped by
slot (multi_lora_groups.py, worked out once per `set_rows` on the host): the rows of each
used slot gathered into one padded group, two batched matmuls over the groups (each group
with its own A and B'), and the results gathered back; the cost grows with the rows and the
used slots' ranks, not with the slots loaded. The unembedding
adds its low-rank logits the same way (`logits`); `augment` (chunked logprobs, one adapter
for every row) extends both factors of the logit product as `LoraUnembedding` does.

A MoE block becomes a `MultiLoraMoE`: its experts hold K slots of per-expert factors for each
projection (`_ExpertSlots`, the adapters `apply_lora` puts on experts) and run as
`LoraGroupedExperts` do, with one slot's factors. The router runs once for all rows (the
plain block's forward, routing kept as it keeps it); with one slot for every row the experts
run once, else the tokens of each used slot are combined separately (a token's output does
not depend on the other tokens of its batch), each with its slot's factors.

Row indices are thread-local: the sampler's decode shards run row groups on threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.decoder import Decoder
from temper.models.common.moe import GroupedExperts, MoE
from temper.models.lora import MLP_TARGETS, LoraConfig, mixer, shared_expert
from temper.models.lora_experts import (
    ADAPTER_SUFFIX,
    EXPERT_TARGETS,
    grouped_low_rank,
    swiglu_with_low_rank,
)
from temper.models.multi_lora_groups import RowGroups


class AdapterRows:
    """The slot of each row, shared by every adapted module of one model (per thread)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.ranks: dict[int, int] = {}
        """The rank of the adapter in each loaded slot."""

    def set(
        self, index: int | Sequence[int] | torch.Tensor, *, device: torch.device | None = None
    ) -> None:
        """One slot for every row (an int), or each row's slot (ints, or a [B] tensor);
        `device`: the model's, where per-row index tensors go (default: a tensor index's)."""
        local = self._local
        if isinstance(index, int):
            local.index, local.groups = index, None
            return
        if isinstance(index, torch.Tensor):
            device = index.device if device is None else device
            slots_B = index.tolist()
        else:
            slots_B = list(index)
        local.groups = RowGroups.of(slots_B, ranks=self.ranks, device=device)
        local.index = None  # made when asked for (the MoE blocks)
        local.slots_B, local.device = slots_B, device

    def index(self) -> int | torch.Tensor:
        """The one slot of every row (an int), or each row's slot (a [B] tensor)."""
        local = self._local
        if getattr(local, "groups", None) is None and getattr(local, "index", None) is None:
            raise RuntimeError("multi-LoRA model: call set_rows(model, index) before a forward")
        if local.index is None:
            local.index = torch.tensor(local.slots_B, device=local.device)
        return local.index

    def uniform(self) -> int | None:
        """The one slot of every row, or None when rows differ."""
        index = self.index()
        return index if isinstance(index, int) else None

    @contextlib.contextmanager
    def one_slot(self, slot: int) -> Iterator[None]:
        """Every row uses `slot` inside the block (on this thread), then the rows' slots again."""
        local = self._local
        saved = local.index, local.groups
        local.index, local.groups = slot, None
        try:
            yield
        finally:
            local.index, local.groups = saved

    def groups(self) -> RowGroups:
        return self._local.groups


class _Slots(nn.Module):
    """K slots of one target's factors: A.T [K, I, R] and B'.T = (scale * B).T [K, R, O]
    (the layouts the grouped matmuls read fastest on CPU: `multi_lora_groups.py`)."""

    def __init__(self, *, in_features: int, out_features: int, like: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("lora_A_KIR", like.new_zeros(0, in_features, 0), persistent=False)
        self.register_buffer("lora_B_KRO", like.new_zeros(0, 0, out_features), persistent=False)

    def grow(self, *, num_slots: int, rank: int) -> None:
        """At least `num_slots` slots of rank `rank` (zeros added; loaded slots kept)."""
        old_K, old_R = self.lora_B_KRO.shape[:2]
        if num_slots <= old_K and rank <= old_R:
            return
        num_slots, rank = max(num_slots, old_K), max(rank, old_R)
        lora_A = self.lora_A_KIR.new_zeros(num_slots, self.in_features, rank)
        lora_B = self.lora_B_KRO.new_zeros(num_slots, rank, self.out_features)
        lora_A[:old_K, :, :old_R] = self.lora_A_KIR
        lora_B[:old_K, :old_R] = self.lora_B_KRO
        self.lora_A_KIR, self.lora_B_KRO = lora_A, lora_B

    @torch.no_grad()
    def load(self, slot: int, *, tensors: tuple[torch.Tensor, torch.Tensor] | None, scale: float):
        self.lora_A_KIR[slot].zero_()
        self.lora_B_KRO[slot].zero_()
        if tensors is None:
            return  # the adapter leaves this target alone
        lora_A_RI, lora_B_OR = tensors
        rank = lora_A_RI.shape[0]
        self.lora_A_KIR[slot, :, :rank] = lora_A_RI.T
        # B' = scale * B, formed in fp32 as merged weights are.
        self.lora_B_KRO[slot, :rank] = (lora_B_OR.float() * scale).T

    @property
    def loaded(self) -> bool:
        return self.lora_B_KRO.shape[1] > 0

    def low_rank(self, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor | None:
        """The low-rank term of `x` [B, ..., I] (None while no slot is loaded)."""
        if not self.loaded:
            return None
        slot = rows.uniform()
        if slot is not None:
            rank = rows.ranks.get(slot, 0)
            return (x @ self.lora_A_KIR[slot, :, :rank]) @ self.lora_B_KRO[slot, :rank]
        x_BMI = x.reshape(x.shape[0], -1, x.shape[-1])
        out_BMO = rows.groups().low_rank(x_BMI, self.lora_A_KIR, self.lora_B_KRO)
        return out_BMO.view(*x.shape[:-1], -1)


class MultiLoraLinear(nn.Module):
    """A frozen linear plus, per row, its slot's B' @ A."""

    def __init__(self, base: nn.Linear, *, rows: AdapterRows) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.slots = _Slots(
            in_features=base.in_features, out_features=base.out_features, like=base.weight
        )
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        delta = self.slots.low_rank(x, self.rows)
        return out if delta is None else out + delta


class MultiLoraUnembedding(nn.Module):
    """Per-row LoRA on the unembedding."""

    def __init__(self, *, dim: int, vocab_size: int, like: torch.Tensor, rows: AdapterRows):
        super().__init__()
        self.slots = _Slots(in_features=dim, out_features=vocab_size, like=like)
        self.rows = rows

    def logits(self, hidden_BxD: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_BxD, weight_VD)
        delta = self.slots.low_rank(hidden_BxD, self.rows)
        return logits if delta is None else logits + delta

    def augment(
        self, hidden_BxD: torch.Tensor, weight_VD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden' = [hidden, hidden @ A_k.T], weight' = [weight, B'_k] for the rows' one slot
        k (chunked logprobs score one adapter's sequences at a time)."""
        slot = self.rows.uniform()
        if slot is None:
            raise ValueError("multi-LoRA unembedding: augment needs one slot for every row")
        rank = self.rows.ranks.get(slot, 0)
        if not self.slots.loaded or rank == 0:
            return hidden_BxD, weight_VD
        low_BxR = hidden_BxD @ self.slots.lora_A_KIR[slot, :, :rank]
        return (
            torch.cat([hidden_BxD, low_BxR], -1),
            torch.cat([weight_VD, self.slots.lora_B_KRO[slot, :rank].T], -1),
        )


class _ExpertSlots(nn.Module):
    """K slots of one expert projection's factors, a pair per expert: A [K, E, R, I] and
    B' = scale * B [K, E, O, R]."""

    def __init__(self, weight_EOI: torch.Tensor) -> None:
        super().__init__()
        num_experts, out_features, in_features = weight_EOI.shape
        self.register_buffer(
            "lora_A_KERI", weight_EOI.new_zeros(0, num_experts, 0, in_features), persistent=False
        )
        self.register_buffer(
            "lora_B_KEOR", weight_EOI.new_zeros(0, num_experts, out_features, 0), persistent=False
        )

    def grow(self, *, num_slots: int, rank: int) -> None:
        """At least `num_slots` slots of rank `rank` (zeros added; loaded slots kept)."""
        old_K, num_experts, old_R, in_features = self.lora_A_KERI.shape
        if num_slots <= old_K and rank <= old_R:
            return
        num_slots, rank = max(num_slots, old_K), max(rank, old_R)
        out_features = self.lora_B_KEOR.shape[2]
        lora_A = self.lora_A_KERI.new_zeros(num_slots, num_experts, rank, in_features)
        lora_B = self.lora_B_KEOR.new_zeros(num_slots, num_experts, out_features, rank)
        lora_A[:old_K, :, :old_R] = self.lora_A_KERI
        lora_B[:old_K, ..., :old_R] = self.lora_B_KEOR
        self.lora_A_KERI, self.lora_B_KEOR = lora_A, lora_B

    @torch.no_grad()
    def load(self, slot: int, *, tensors: tuple[torch.Tensor, torch.Tensor] | None, scale: float):
        self.lora_A_KERI[slot].zero_()
        self.lora_B_KEOR[slot].zero_()
        if tensors is None:
            return  # the adapter leaves the experts alone
        lora_A_ERI, lora_B_EOR = tensors
        rank = lora_A_ERI.shape[1]
        self.lora_A_KERI[slot, :, :rank] = lora_A_ERI
        self.lora_B_KEOR[slot, ..., :rank] = lora_B_EOR.float() * scale  # as merged weights are

    def low_rank(
        self,
        x_AI: torch.Tensor,
        *,
        slot: int,
        rank: int,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
    ) -> torch.Tensor:
        """Slot `slot`'s B'[e] @ A[e] on each row of expert e: [A, O]."""
        lora_A_ERI = self.lora_A_KERI[slot, :, :rank]
        lora_B_EOR = self.lora_B_KEOR[slot, ..., :rank]
        return grouped_low_rank(
            x_AI, lora_A_ERI, lora_B_EOR, counts_E=counts_E, offsets_E=offsets_E
        )


class MultiLoraExperts(GroupedExperts):
    """Frozen stacked experts plus, for the slot every row uses, each expert's B' @ A."""

    def __init__(self, base: GroupedExperts, *, rows: AdapterRows) -> None:
        num_experts, hidden_dim, dim = base.w_gate.shape
        with torch.device("meta"):  # the weights it allocates are replaced by base's below
            super().__init__(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)
        self.w_gate, self.w_up, self.w_down = base.w_gate, base.w_up, base.w_down
        for name in EXPERT_TARGETS:
            setattr(self, f"{name}{ADAPTER_SUFFIX}", _ExpertSlots(getattr(base, name)))
        self.rows = rows

    def forward(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        slot = self.rows.uniform()
        assert slot is not None, "MultiLoraMoE runs its experts one slot at a time"
        rank = self.rows.ranks.get(slot, 0)
        groups = {"counts_E": counts_E, "offsets_E": offsets_E}

        def low_rank(name: str, x_AI: torch.Tensor) -> torch.Tensor | None:
            if rank == 0:  # nothing loaded in this slot
                return None
            slots = getattr(self, f"{name}{ADAPTER_SUFFIX}")
            return slots.low_rank(x_AI, slot=slot, rank=rank, **groups)

        return swiglu_with_low_rank(self, x_AD, low_rank=low_rank, weights_A=weights_A, **groups)


class MultiLoraMoE(MoE):
    """A frozen MoE block whose experts add the adapter of each token's row: routed as the
    plain block is (`MoE.forward`), then combined once for the rows' one slot, or once per
    used slot on that slot's tokens. A block with a shared expert (shared_expert_moe.py) keeps
    it and its sigmoid gate, added after the routed part as that block adds it (the shared
    expert's linears carry slots of their own)."""

    def __init__(self, base: MoE, *, rows: AdapterRows) -> None:
        num_experts, hidden_dim, dim = base.experts.w_gate.shape
        with torch.device("meta"):  # the weights it allocates are replaced by base's below
            super().__init__(
                dim=dim,
                hidden_dim=hidden_dim,
                num_experts=num_experts,
                top_k=base.top_k,
                norm_topk_prob=base.norm_topk_prob,
            )
        self.router = base.router
        self.experts = MultiLoraExperts(base.experts, rows=rows)
        self.keep_routing = base.keep_routing
        self.rows = rows
        self.shared_expert = getattr(base, "shared_expert", None)
        self.shared_expert_gate = getattr(base, "shared_expert_gate", None)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        routed_BTD = super().forward(x_BTD)
        if self.shared_expert is None:
            return routed_BTD
        gate_BT1 = torch.sigmoid(self.shared_expert_gate(x_BTD))
        return routed_BTD + gate_BT1 * self.shared_expert(x_BTD)

    def combine(
        self, x_ND: torch.Tensor, *, weights_NK: torch.Tensor, experts_NK: torch.Tensor
    ) -> torch.Tensor:
        index = self.rows.index()
        if isinstance(index, int):
            return super().combine(x_ND, weights_NK=weights_NK, experts_NK=experts_NK)
        x_TD, weights_TP, experts_TP = x_ND, weights_NK, experts_NK  # this file's letters
        # Rows come first in the block's input, so each row's tokens are consecutive in x_TD.
        slots_T = index.repeat_interleave(x_TD.shape[0] // index.shape[0])
        out_TD = torch.empty_like(x_TD)
        for slot in self.rows.groups().slots:
            tokens = torch.nonzero(slots_T == slot).squeeze(1)
            with self.rows.one_slot(slot):
                out_TD[tokens] = super().combine(
                    x_TD[tokens], weights_NK=weights_TP[tokens], experts_NK=experts_TP[tokens]
                )
        return out_TD


def _targets(model: Decoder) -> dict[str, _Slots | _ExpertSlots]:
    """Adapter name (as `lora_state_dict` names it) -> its slots."""
    targets = {}
    for name, module in model.named_modules():
        if isinstance(module, _Slots):
            targets[name.removesuffix(".slots")] = module
        elif isinstance(module, _ExpertSlots):
            targets[name] = module
    return targets


def install_slots(model: Decoder) -> None:
    """Make plain `model` a multi-LoRA model (no slot loaded: it computes the base model);
    its own weights are only read."""
    if hasattr(model, "multi_lora_rows"):
        raise ValueError("install_slots: the model has multi-LoRA slots already")
    rows = AdapterRows()
    model.multi_lora_rows = rows
    for block in model.blocks:
        _, module, names = mixer(block)
        targets = [(module, name) for name in names]
        if isinstance(block.feed_forward, MoE):
            shared = shared_expert(block.feed_forward)
            if shared is not None:
                targets += [(shared, name) for name in MLP_TARGETS]
            block.feed_forward = MultiLoraMoE(block.feed_forward, rows=rows)
        else:
            targets += [(block.feed_forward, name) for name in MLP_TARGETS]
        for parent, name in targets:
            setattr(parent, name, MultiLoraLinear(getattr(parent, name), rows=rows))
    vocab_size, dim = model.output_weight_VD.shape
    model.output_adapter = MultiLoraUnembedding(
        dim=dim, vocab_size=vocab_size, like=model.output_weight_VD, rows=rows
    )


def load_adapter(
    model: Decoder, slot: int, *, config: LoraConfig, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write an adapter (`lora_state_dict` tensors of a model with LoRA `config`) into `slot`."""
    targets = _targets(model)
    names = {key.rsplit(".", 1)[0] for key in tensors}
    unknown = sorted(names - targets.keys())
    if unknown:
        raise ValueError(f"load_adapter: the model has no adaptable target {unknown[0]!r}")
    scale = config.alpha / config.rank
    model.multi_lora_rows.ranks[slot] = config.rank
    for name, slots in targets.items():
        slots.grow(num_slots=slot + 1, rank=config.rank)
        pair = None
        if name in names:
            pair = (tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"])
        slots.load(slot, tensors=pair, scale=scale)


def apply_multi_lora(
    model: Decoder, adapters: Sequence[tuple[LoraConfig, Mapping[str, torch.Tensor]]]
) -> None:
    """Install slots in plain `model` and load `adapters` into slots 0..K-1."""
    if not adapters:
        raise ValueError("apply_multi_lora: give at least one adapter")
    install_slots(model)
    for slot, (config, tensors) in enumerate(adapters):
        load_adapter(model, slot, config=config, tensors=tensors)


def set_rows(model: Decoder, index: int | Sequence[int] | torch.Tensor) -> None:
    """Every row of the next forwards on this thread uses slot `index` (an int), or row b
    uses slot index[b] (ints, or a [B] tensor)."""
    device = model.output_weight_VD.device
    model.multi_lora_rows.set(index, device=device)
