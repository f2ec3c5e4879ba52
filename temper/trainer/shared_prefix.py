"""Shared-prefix packing: datums that start with the same tokens run that prefix once.

Shapes: G prefix rows (one per cluster), P longest prefix, R suffix rows (one per datum), S
longest suffix, M = G*P + R*S packed positions, N scored positions (all datums' tokens), D
model dim, heads as in attention.py (Q query heads, K key/value heads, H head dim).

GRPO trains on `group_size` completions of each prompt, so most of a batch's prompt tokens are
repeats. Here consecutive datums that share a prefix form a cluster; the forward runs each
cluster's prefix once as one row and each datum's remaining tokens (its suffix) as a row that
attends to its cluster's prefix keys and values, then causally to itself. The model sees one
packed sequence with explicit positions; only attention knows the layout (an
`AttentionBackend`), so every per-token op (norms, projections, MLP) runs on fewer tokens.
Autograd sums a shared prefix's gradient over the suffixes that read it. Each datum's
hidden states are gathered back from the packed rows, so logprobs, losses and outputs are per
datum as in the padded path, equal to it up to float rounding (a different batching of the
same matmuls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from temper.api.types import numbers_to_tensor
from temper.models.common.attention import masked_attention
from temper.models.common.logprobs import target_logprobs


def packing_is_exact(model_config: object) -> bool:
    """Whether a model computes the same function on the packed layout: only when attention is
    its only token mixer. The layout is known to attention alone (through its backend); a
    hybrid model's linear-attention layers (Gated DeltaNet, `linear_layers` in its config) run
    a convolution and a recurrence along each row of their input, which in the packed sequence
    would read across a prefix row's end and never carry the prefix's state into its suffix
    rows. Such models train on the padded layout."""
    return not getattr(model_config, "linear_layers", ())


MIN_SAVING = 0.15
"""Pack only when it saves at least this fraction of the padded layout's positions."""
KEY_MULTIPLE = 16
"""Suffix rows attend over a multiple of this many keys (padding keys, masked, fill the rest):
torch's CPU attention and softmax kernels take a scalar path for a row length that is not a
multiple of their 16-float vector (measured: 1.3 ms vs 0.84 ms forward+backward for 64 rows
of 14 vs 16 keys), and a few masked keys cost nothing elsewhere."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    members: list[int]
    """Indices (into the micro-batch's datums) of consecutive datums sharing the prefix."""
    prefix_len: int
    """Tokens every member starts with and runs once; each member keeps >= 1 suffix token."""


def cluster_prefixes(
    token_lists: Sequence[Sequence[int]], *, routes: Sequence[torch.Tensor] | None = None
) -> list[Cluster]:
    """Consecutive datums grouped by a shared prefix, greedily.

    A datum joins the current cluster while the tokens saved do not drop: with n members
    sharing p tokens, (n - 1) * p are saved; adding one whose common prefix with the first is
    l gives n * min(p, l). So a group's samples stay together even when a few of them also
    share their first completion tokens, and the next prompt starts a new cluster.

    With `routes` (each datum's [T, L, K] experts, replayed: routing_replay.py) a prefix is
    shared only as far as the datums' routes agree too, since it runs once for all of them.
    """
    clusters: list[Cluster] = []
    start, shared = 0, 0
    for index in range(1, len(token_lists) + 1):
        if index < len(token_lists):
            common = _common_prefix(token_lists[start], token_lists[index])
            common = min(common, len(token_lists[index]) - 1, len(token_lists[start]) - 1)
            if routes is not None and common > 0:
                common = _common_routes(routes[start], routes[index], length=common)
            size = index - start
            candidate = common if size == 1 else min(shared, common)
            if candidate > 0 and size * candidate >= (size - 1) * shared:
                shared = candidate
                continue
        members = list(range(start, index))
        clusters.append(Cluster(members=members, prefix_len=shared if len(members) > 1 else 0))
        start, shared = index, 0
    return clusters


def _common_routes(a_TLK: torch.Tensor, b_TLK: torch.Tensor, *, length: int) -> int:
    """Leading tokens, of the first `length`, whose routes are equal in a and b."""
    differ_T = (a_TLK[:length] != b_TLK[:length]).flatten(1).any(dim=1)
    return int(differ_T.nonzero()[0]) if bool(differ_T.any()) else length


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


@dataclass(frozen=True, kw_only=True)
class PackedLayout:
    """Where each datum's tokens live in the packed sequence, and what attention may see."""

    tokens_1M: torch.Tensor
    positions_1M: torch.Tensor
    """Each position's place in its datum (a suffix row continues after its prefix)."""
    num_prefix_rows: int
    prefix_width: int
    suffix_width: int
    suffix_keys_RX: torch.Tensor
    """int64: the packed position of each key a suffix row attends over: its prefix row's P,
    then its own S, then padding up to X (a multiple of KEY_MULTIPLE) that repeats its last
    position and is masked."""
    suffix_mask_R1SX: torch.Tensor
    """bool [R, 1, S, X]: which of those keys a query sees."""
    gather_N: torch.Tensor
    """int64: the packed position of every datum token, datums concatenated in order."""

    @property
    def num_positions(self) -> int:
        return self.tokens_1M.shape[1]


@dataclass(frozen=True)
class PackedSize:
    """The widths and row counts of a packed layout, grown one cluster at a time (a caller
    that adds clusters in turn pays for each cluster once, not for the whole list again)."""

    num_clusters: int = 0
    num_rows: int = 0
    prefix_width: int = 0
    """The longest prefix."""
    suffix_width: int = 0
    """The longest suffix."""

    def plus(self, cluster: Cluster, lengths: Sequence[int]) -> PackedSize:
        """With `cluster` too; `lengths` holds the token count of every datum it indexes."""
        longest = max(lengths[member] for member in cluster.members)
        return PackedSize(
            num_clusters=self.num_clusters + 1,
            num_rows=self.num_rows + len(cluster.members),
            prefix_width=max(self.prefix_width, cluster.prefix_len),
            suffix_width=max(self.suffix_width, longest - cluster.prefix_len),
        )

    @property
    def num_positions(self) -> int:
        return self.num_clusters * self.prefix_width + self.num_rows * self.suffix_width

    @classmethod
    def of(cls, clusters: Sequence[Cluster], lengths: Sequence[int]) -> PackedSize:
        size = cls()
        for cluster in clusters:
            size = size.plus(cluster, lengths)
        return size


def packed_size(clusters: Sequence[Cluster], lengths: Sequence[int]) -> int:
    """Positions of the packed layout of these clusters (prefix and suffix rows, padded);
    `lengths` holds the token count of every datum the clusters' members index."""
    return PackedSize.of(clusters, lengths).num_positions


def worth_packing(clusters: Sequence[Cluster], lengths: Sequence[int]) -> bool:
    """Whether packing all datums saves at least MIN_SAVING of the padded positions."""
    padded = len(lengths) * max(lengths)
    return packed_size(clusters, lengths) <= (1 - MIN_SAVING) * padded


def pack(
    token_lists: Sequence[Sequence[int]],
    clusters: Sequence[Cluster],
    *,
    pad_token_id: int = 0,
) -> PackedLayout:
    """The packed sequence for datums (their token ids) and their clusters."""
    lengths = [len(t) for t in token_lists]
    num_rows, num_clusters = len(token_lists), len(clusters)
    size = PackedSize.of(clusters, lengths)
    prefix_width, suffix_width = size.prefix_width, size.suffix_width
    tokens = [pad_token_id] * (num_clusters * prefix_width + num_rows * suffix_width)
    prefix_lens_R = [0] * num_rows
    cluster_R = [0] * num_rows
    gather: list[int] = []
    suffix_base = num_clusters * prefix_width
    for g, cluster in enumerate(clusters):
        p = cluster.prefix_len
        prefix_start = g * prefix_width
        tokens[prefix_start : prefix_start + p] = token_lists[cluster.members[0]][:p]
        for r in cluster.members:
            suffix_start = suffix_base + r * suffix_width
            suffix_len = lengths[r] - p
            tokens[suffix_start : suffix_start + suffix_len] = token_lists[r][p:]
            prefix_lens_R[r], cluster_R[r] = p, g
            gather.extend(range(prefix_start, prefix_start + p))
            gather.extend(range(suffix_start, suffix_start + suffix_len))
    prefix_lens_R1 = torch.tensor(prefix_lens_R)[:, None]
    positions_GP = torch.arange(prefix_width).expand(num_clusters, -1)
    positions_RS = prefix_lens_R1 + torch.arange(suffix_width)
    # A suffix query sees its prefix row's real tokens, then its own tokens causally.
    sees_prefix_RSP = (torch.arange(prefix_width) < prefix_lens_R1)[:, None, :].expand(
        -1, suffix_width, -1
    )
    causal_SS = torch.ones(suffix_width, suffix_width, dtype=torch.bool).tril()
    num_padding = -(prefix_width + suffix_width) % KEY_MULTIPLE
    padding_RSZ = torch.zeros(num_rows, suffix_width, num_padding, dtype=torch.bool)
    mask_RSX = torch.cat((sees_prefix_RSP, causal_SS.expand(num_rows, -1, -1), padding_RSZ), dim=-1)
    # The keys behind the mask's columns. Padding repeats the row's last key: masked keys get
    # zero weight whatever they hold, so any real position does (and gets a zero gradient).
    prefix_keys_RP = torch.tensor(cluster_R)[:, None] * prefix_width + torch.arange(prefix_width)
    own_keys_RS = suffix_base + torch.arange(num_rows)[:, None] * suffix_width
    own_keys_RS = own_keys_RS + torch.arange(suffix_width)
    padding_keys_RZ = own_keys_RS[:, -1:].expand(-1, num_padding)
    return PackedLayout(
        tokens_1M=numbers_to_tensor(tokens, dtype="int64")[None],
        positions_1M=torch.cat((positions_GP.reshape(-1), positions_RS.reshape(-1)))[None],
        num_prefix_rows=num_clusters,
        prefix_width=prefix_width,
        suffix_width=suffix_width,
        suffix_keys_RX=torch.cat((prefix_keys_RP, own_keys_RS, padding_keys_RZ), dim=1),
        suffix_mask_R1SX=mask_RSX[:, None],
        gather_N=numbers_to_tensor(gather, dtype="int64"),
    )


class SharedPrefixAttention:
    """An `AttentionBackend` for a `PackedLayout`: prefix rows attend causally to themselves;
    suffix rows attend to their prefix row, then causally to themselves."""

    def __init__(self, layout: PackedLayout, *, device: torch.device) -> None:
        self.layout = layout
        self.keys_N = layout.suffix_keys_RX.reshape(-1).to(device)
        self.mask_R1SX = layout.suffix_mask_R1SX.to(device)

    def attend(
        self, layer_index: int, q_1QMH: torch.Tensor, k_1KMH: torch.Tensor, v_1KMH: torch.Tensor
    ) -> torch.Tensor:
        del layer_index  # the same layout in every layer
        q_prefix, q_suffix = self._split(q_1QMH)
        k_prefix, _ = self._split(k_1KMH)
        v_prefix, _ = self._split(v_1KMH)
        gqa = q_1QMH.shape[1] != k_1KMH.shape[1]
        scale = q_1QMH.shape[-1] ** -0.5
        out_prefix_GQPH = F.scaled_dot_product_attention(
            q_prefix, k_prefix, v_prefix, is_causal=True, scale=scale, enable_gqa=gqa
        )
        # masked_attention: on CUDA with grouped heads, a layout SDPA's efficient kernel takes.
        out_suffix_RQSH = masked_attention(
            q_suffix,
            self._suffix_keys(k_1KMH),
            self._suffix_keys(v_1KMH),
            visible_B1TC=self.mask_R1SX,
        )
        return torch.cat((self._merge(out_prefix_GQPH), self._merge(out_suffix_RQSH)), dim=2)

    def _suffix_keys(self, x_1KMH: torch.Tensor) -> torch.Tensor:
        """Each suffix row's keys (or values) [R, K, X, H], in one gather: its prefix row's,
        its own, then padding (`PackedLayout.suffix_keys_RX`)."""
        heads, head_dim = x_1KMH.shape[1], x_1KMH.shape[-1]
        rows, width = self.mask_R1SX.shape[0], self.mask_R1SX.shape[-1]
        # [M, K, H] is the projections' own memory order: the gather copies whole rows.
        gathered_NKH = x_1KMH[0].transpose(0, 1).index_select(0, self.keys_N)
        return gathered_NKH.view(rows, width, heads, head_dim).transpose(1, 2)

    def _split(self, x_1HMD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, heads, M, H] -> prefix rows [G, heads, P, H] and suffix rows [R, heads, S, H]."""
        layout = self.layout
        heads, head_dim = x_1HMD.shape[1], x_1HMD.shape[-1]
        boundary = layout.num_prefix_rows * layout.prefix_width
        prefix, suffix = x_1HMD[0, :, :boundary], x_1HMD[0, :, boundary:]
        prefix = prefix.reshape(heads, layout.num_prefix_rows, layout.prefix_width, head_dim)
        suffix = suffix.reshape(heads, -1, layout.suffix_width, head_dim)
        return prefix.transpose(0, 1), suffix.transpose(0, 1)

    @staticmethod
    def _merge(x_BHTD: torch.Tensor) -> torch.Tensor:
        """[rows, heads, T, H] -> [1, heads, rows*T, H]."""
        rows, heads, width, head_dim = x_BHTD.shape
        return x_BHTD.transpose(0, 1).reshape(1, heads, rows * width, head_dim)


def packed_logprobs(
    model: torch.nn.Module, layout: PackedLayout, targets_N: torch.Tensor
) -> torch.Tensor:
    """Every datum's target logprobs, concatenated [N] (or [N, K] for [N, K] targets): one
    forward of the packed sequence, each datum's hidden states gathered back, then the
    trainer's one logprob function."""
    device = targets_N.device
    hidden_1MD = model.hidden_states(
        layout.tokens_1M.to(device),
        positions_BT=layout.positions_1M.to(device),
        attention=SharedPrefixAttention(layout, device=device),
    )
    hidden_NX, weight_VX = model.logit_inputs(hidden_1MD[0][layout.gather_N.to(device)])
    return target_logprobs(hidden_NX, weight_VX, targets_N)
