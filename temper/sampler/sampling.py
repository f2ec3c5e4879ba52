"""Per-row sampling for a decode step: temperature, top-k, top-p, seeded draws and logprobs.

Shapes: B rows (each may belong to a different request with its own parameters), V vocab,
K top-k alternatives, W the most likely tokens per row that truncation looks at.

Everything here is a pure tensor function with no Python loop over rows or vocab, and no
device-to-host sync when the caller passes the host-side hints kept in `RowParams`, so it runs
on every decode step. A row's result depends only on that row's inputs, bitwise, whatever
shares the batch: the only reductions are row-wise kernels (softmax, log_softmax, argmax,
sort/topk, searchsorted) and prefix sums over fixed-point int64 probabilities, where addition
is exact, so no summation order (e.g. a different scan kernel for a single row on CUDA) can
move a top-p boundary or a sampled token. Ties are resolved by token id through exact value
comparisons, never by a sort's tie order. Randomness is a counter-based hash of
(seed, counter), so a row's draw does not depend on the batch, its position, or the device.

Greedy rows (temperature 0) take the argmax of the raw logits, and their reported logprobs are
log_softmax(logits): the untempered, untruncated model distribution, whatever top-k/top-p say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from temper.api.types import SamplingParams

# Probabilities become int64 in units of 2**-62: a row's total stays below 2**63 while its
# fp32 probabilities sum to < 2, and a token needs p >= 2**-62 to be drawable (float64 prefix
# sums would absorb far larger ones).
_FIXED_POINT_ONE = 2.0**62
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# splitmix64 constants, written as the signed int64 values of their bits.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_MULTIPLIER_2 = 0x94D049BB133111EB - 2**64

DrawMode = Literal["greedy", "sampled", "mixed"]
"""Which rows of a batch are greedy: all, none, or either ("mixed" is right for any batch)."""


@dataclass(frozen=True, kw_only=True)
class RowParams:
    """The sampling parameters of a batch of rows, as tensors on the decode device.

    Build it with `from_sampling_params`, which also sets the host-side hints that let the
    sampling functions skip work no row needs without reading tensors back from the device.
    """

    temperature_B: torch.Tensor
    """float32; 0 marks a greedy row."""
    top_k_B: torch.Tensor
    """int64; <= 0 means no top-k limit."""
    top_p_B: torch.Tensor
    """float64 (the user's value exactly); 1 means no top-p limit."""
    greedy_B: torch.Tensor
    """bool; temperature == 0."""
    seeds_B: torch.Tensor
    """int64; the seed each row's uniforms are derived from."""
    sort_width: int
    """See `sampling_logprobs`: 0 no row truncates, -1 the whole vocabulary, else the most
    likely tokens per row that top-k/top-p must see (the largest top_k)."""
    draw_mode: DrawMode
    """Whether all, none or some rows are greedy, so `draw_tokens` skips what no row needs."""

    @classmethod
    def from_sampling_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        seeds: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> RowParams:
        if len(seeds) != len(params):
            raise ValueError(f"seeds has {len(seeds)} entries but params has {len(params)} rows")
        for seed in seeds:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seeds must be ints, got {seed!r}")
            if not _INT64_MIN <= seed <= _INT64_MAX:
                raise ValueError(f"seeds must be in int64 range [-2**63, 2**63 - 1], got {seed}")
        widths = [row_sort_width(p) for p in params]
        return cls(
            temperature_B=torch.tensor(
                [p.temperature for p in params], dtype=torch.float32, device=device
            ),
            top_k_B=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p_B=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
            greedy_B=torch.tensor([p.temperature == 0 for p in params], device=device),
            seeds_B=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            sort_width=batch_sort_width(widths),
            draw_mode=draw_mode([p.temperature == 0 for p in params]),
        )

    @property
    def needs_truncation(self) -> bool:
        return self.sort_width != 0

    def logprobs(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """`sampling_logprobs` for these rows."""
        return sampling_logprobs(
            logits_BV,
            temperature_B=self.temperature_B,
            top_k_B=self.top_k_B,
            top_p_B=self.top_p_B,
            sort_width=self.sort_width,
        )

    def draw(
        self, logits_BV: torch.Tensor, logprobs_BV: torch.Tensor, *, counters_B: torch.Tensor
    ) -> torch.Tensor:
        """`draw_tokens` for these rows, with the uniforms of (seed, counter)."""
        return draw_tokens(
            logits_BV,
            logprobs_BV,
            uniforms_B=seeded_uniforms(self.seeds_B, counters_B),
            greedy_B=self.greedy_B,
            draw_mode=self.draw_mode,
        )


def row_sort_width(params: SamplingParams) -> int:
    """`sampling_logprobs`' sort_width for one row with these parameters."""
    if params.temperature == 0 or (params.top_k <= 0 and params.top_p >= 1):
        return 0
    return params.top_k if params.top_k > 0 else -1


def batch_sort_width(row_widths: Sequence[int]) -> int:
    """The sort_width that covers every row's (`row_sort_width` of each)."""
    return -1 if -1 in row_widths else max(row_widths, default=0)


def draw_mode(greedy: Sequence[bool]) -> DrawMode:
    """The `DrawMode` of rows with these greedy flags."""
    if all(greedy):
        return "greedy"
    return "mixed" if any(greedy) else "sampled"


def sampling_logprobs(
    logits_BV: torch.Tensor,
    *,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    sort_width: int | None = None,
) -> torch.Tensor:
    """fp32 log-probabilities of the distribution each row is drawn from; -inf where excluded.

    softmax(logits / temperature), then keep the top_k largest (ties: lower token id first),
    then keep the smallest most-likely prefix whose mass reaches top_p on the top-k
    distribution (the top token always stays), renormalized. Greedy rows (temperature 0) get
    log_softmax(logits). `sort_width` is a promise that saves a device sync and the full sort:
    0 no non-greedy row truncates, w > 0 every truncating row has 0 < top_k <= w, -1 some row
    needs the whole vocabulary sorted; None finds it on the device.
    """
    num_rows, vocab_size = logits_BV.shape
    assert temperature_B.shape == top_k_B.shape == top_p_B.shape == (num_rows,)
    greedy_B = temperature_B == 0
    # Division is exact-rounded everywhere, so the scaled logits match logits.float() / t.
    scaled_BV = logits_BV.float() / torch.where(greedy_B, 1.0, temperature_B.float())[:, None]
    if sort_width == 0:
        return torch.log_softmax(scaled_BV, dim=-1)
    top_k_B = torch.where(greedy_B | (top_k_B <= 0), vocab_size, top_k_B.clamp(max=vocab_size))
    top_p_B = torch.where(greedy_B, 1.0, top_p_B.double())
    if sort_width is None:
        widths_B = torch.where(top_p_B < 1, top_k_B, torch.where(top_k_B < vocab_size, top_k_B, 0))
        sort_width = int(widths_B.max()) if num_rows else 0
    width = vocab_size if sort_width < 0 else min(sort_width, vocab_size)
    if width == 0:
        return torch.log_softmax(scaled_BV, dim=-1)
    keep_BV = _truncation_mask(
        scaled_BV, top_k_B1=top_k_B[:, None], top_p_B1=top_p_B[:, None], width=width
    )
    return torch.log_softmax(scaled_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)


def _truncation_mask(
    scaled_BV: torch.Tensor, *, top_k_B1: torch.Tensor, top_p_B1: torch.Tensor, width: int
) -> torch.Tensor:
    """Which tokens survive top-k then top-p; rows with neither keep everything."""
    vocab_size = scaled_BV.shape[-1]
    if width < vocab_size:
        sorted_BW, order_BW = torch.topk(scaled_BV, width, dim=-1, sorted=True)
    else:
        sorted_BW, order_BW = torch.sort(scaled_BV, dim=-1, descending=True)
    in_top_k_BW = torch.arange(width, device=scaled_BV.device)[None, :] < top_k_B1
    # Probabilities come from the full-vocabulary softmax (a row-wise kernel, the same for any
    # width); the top-k renormalization is implicit in comparing against the top-k total.
    probs_BW = torch.softmax(scaled_BV, dim=-1).gather(-1, order_BW)
    fixed_probs_BW = (probs_BW * _FIXED_POINT_ONE).long().masked_fill_(~in_top_k_BW, 0)
    mass_BW = fixed_probs_BW.cumsum(dim=-1)
    mass_before_BW = (mass_BW - fixed_probs_BW).double()
    # A token stays while the mass before it is short of top_p. Rows with top_p 1 keep all
    # of their top k, including tokens too unlikely to register in fixed point.
    in_top_p_BW = (mass_before_BW < top_p_B1 * mass_BW[:, -1:].double()) | (top_p_B1 >= 1)
    # Both conditions hold on a prefix of the sorted order; its length says how many to keep.
    num_kept_B1 = (in_top_k_BW & in_top_p_BW).sum(dim=-1, keepdim=True)
    lowest_kept_B1 = sorted_BW.gather(-1, num_kept_B1 - 1)
    num_above_B1 = (sorted_BW > lowest_kept_B1).sum(dim=-1, keepdim=True)
    tied_BV = scaled_BV == lowest_kept_B1
    tie_rank_BV = tied_BV.cumsum(dim=-1, dtype=torch.int32)
    keep_tied_BV = tied_BV & (tie_rank_BV <= (num_kept_B1 - num_above_B1).int())
    truncating_B1 = (top_k_B1 < vocab_size) | (top_p_B1 < 1)
    return (scaled_BV > lowest_kept_B1) | keep_tied_BV | ~truncating_B1


def _mix64(z_B: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (products wrap; shifts are made logical)."""
    z_B = (z_B ^ ((z_B >> 30) & ((1 << 34) - 1))) * _MIX_MULTIPLIER_1
    z_B = (z_B ^ ((z_B >> 27) & ((1 << 37) - 1))) * _MIX_MULTIPLIER_2
    return z_B ^ ((z_B >> 31) & ((1 << 33) - 1))


def seeded_uniforms(seeds_B: torch.Tensor, counters_B: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1) that depend only on each row's (seed, counter).

    Output `counter` of a splitmix64 stream whose state starts at mix64(seed); integer ops
    only, so the bits are the same on every device and in every batch.
    """
    return stream_uniforms(stream_starts(seeds_B), counters_B)


def stream_starts(seeds_B: torch.Tensor) -> torch.Tensor:
    """Each seed's splitmix64 starting state, mix64(seed): what `stream_uniforms` takes, so
    that a sequence drawing many tokens mixes its seed once."""
    _check_int64(seeds_B=seeds_B)
    return _mix64(seeds_B)


def stream_uniforms(starts_B: torch.Tensor, counters_B: torch.Tensor) -> torch.Tensor:
    """`seeded_uniforms` from the streams' starting states (`stream_starts`): bitwise the
    same uniforms."""
    _check_int64(starts_B=starts_B, counters_B=counters_B)
    state_B = starts_B + (counters_B + 1) * _GOLDEN_GAMMA
    top_53_bits_B = (_mix64(state_B) >> 11) & ((1 << 53) - 1)
    return top_53_bits_B.double() * 2.0**-53


def _check_int64(**tensors: torch.Tensor) -> None:
    wrong = {name: t.dtype for name, t in tensors.items() if t.dtype != torch.int64}
    if wrong:
        names = " and ".join(tensors)
        got = ", ".join(f"{name} {dtype}" for name, dtype in wrong.items())
        raise TypeError(f"{names} must be int64, got {got}")


def draw_tokens(
    logits_BV: torch.Tensor,
    logprobs_BV: torch.Tensor,
    *,
    uniforms_B: torch.Tensor,
    greedy_B: torch.Tensor,
    draw_mode: DrawMode = "mixed",
) -> torch.Tensor:
    """int64 token per row: argmax of the raw logits for greedy rows, else an inverse-CDF draw.

    The draw walks the CDF of the logprobs' distribution in token-id order and takes the first
    token whose cumulative mass exceeds u * total; a token with zero probability is never drawn.
    `draw_mode` "greedy" or "sampled" promises that all or no rows are greedy, which skips
    the CDF or the argmax.
    """
    if draw_mode == "greedy":
        return logits_BV.argmax(dim=-1)
    # softmax (a row-wise kernel) re-derives the probabilities from the logprobs.
    probs_BV = torch.softmax(logprobs_BV.float(), dim=-1)
    drawn_B = _walk_cdf((probs_BV * _FIXED_POINT_ONE).long(), uniforms_B)
    if draw_mode == "sampled":
        return drawn_B
    return torch.where(greedy_B, logits_BV.argmax(dim=-1), drawn_B)


ONE_LEVEL_MAX_VOCAB = 4096
"""`_walk_cdf` takes one cumsum over the vocabulary up to this size: on CPU (64 rows) it is
faster than the two levels at every size up to here (18 against 80 us at 29 tokens, 110
against 124 us at 4096)."""


def _walk_cdf(fixed_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """First token whose cumulative fixed-point mass exceeds u * total, per row.

    Two levels (N blocks of about sqrt(V) tokens, then one block) instead of a cumsum over the
    whole vocabulary: integer sums are exact, so the token is the one a full cumsum finds, but
    the int64 prefix sums (a scalar loop on CPU) cover N + sqrt(V) entries per row, not V. A
    vocabulary of up to `ONE_LEVEL_MAX_VOCAB` tokens takes the full cumsum (three ops instead
    of about fifteen; the same token, the sums being exact).
    """
    num_rows, vocab_size = fixed_BV.shape
    if vocab_size <= ONE_LEVEL_MAX_VOCAB:
        cdf_BV = fixed_BV.cumsum(dim=-1)
        threshold_B1 = _threshold(uniforms_B, total_B1=cdf_BV[:, -1:])
        return torch.searchsorted(cdf_BV, threshold_B1, right=True)[:, 0]
    block = 1 << max(0, math.isqrt(vocab_size - 1).bit_length())  # power of two >= sqrt(V)
    # Block sums without a padded copy of the vocabulary (a large fresh tensor every step):
    # the whole blocks as a view, and the last, partial block on its own.
    whole = vocab_size // block * block
    block_sums_BN = fixed_BV[:, :whole].view(num_rows, -1, block).sum(dim=-1)
    if whole < vocab_size:
        block_sums_BN = torch.cat((block_sums_BN, fixed_BV[:, whole:].sum(-1, keepdim=True)), -1)
    block_cdf_BN = block_sums_BN.cumsum(dim=-1)
    threshold_B1 = _threshold(uniforms_B, total_B1=block_cdf_BN[:, -1:])
    block_B1 = torch.searchsorted(block_cdf_BN, threshold_B1, right=True)
    mass_before_B1 = torch.where(
        block_B1 > 0, block_cdf_BN.gather(-1, (block_B1 - 1).clamp(min=0)), 0
    )
    # The chosen block's tokens; positions past the vocabulary (last block) count as zero.
    tokens_BK = block_B1 * block + torch.arange(block, device=fixed_BV.device)
    past_end_BK = tokens_BK >= vocab_size
    within_BK = fixed_BV.gather(-1, tokens_BK.clamp(max=vocab_size - 1)).masked_fill_(
        past_end_BK, 0
    )
    offset_B1 = torch.searchsorted(
        within_BK.cumsum(dim=-1) + mass_before_B1, threshold_B1, right=True
    )
    return (block_B1 * block + offset_B1)[:, 0]


def _threshold(uniforms_B: torch.Tensor, *, total_B1: torch.Tensor) -> torch.Tensor:
    """floor(u * total) per row, as int64.

    u < 1, but u * total can round up to total in float64; the clamp keeps the threshold
    below the last increase of the CDF, so the token found always has mass.
    """
    threshold_B1 = (uniforms_B[:, None].double() * total_B1.double()).long()
    return torch.minimum(threshold_B1, total_B1 - 1)


def gather_logprobs(logprobs_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """Each row's logprob of its token."""
    return logprobs_BV.gather(-1, tokens_B[:, None].long())[:, 0]


def topk_logprobs(logprobs_BV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 token ids, fp32 logprobs), both [B, K], most likely first.

    Tokens excluded from the distribution appear with -inf when fewer than k remain. The order
    among exactly equal logprobs is torch.topk's (unspecified).
    """
    vocab_size = logprobs_BV.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"k must be an int in [1, {vocab_size}] (the vocab size), got {k!r}")
    values_BK, token_ids_BK = torch.topk(logprobs_BV, k, dim=-1, sorted=True)
    return token_ids_BK, values_BK.float()
