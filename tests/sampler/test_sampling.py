"""Per-row sampling: exact distributions, seeded uniform draws, and batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from temper.api.types import SamplingParams
from temper.sampler.sampling import (
    RowParams,
    _walk_cdf,
    draw_tokens,
    gather_logprobs,
    sampling_logprobs,
    seeded_uniforms,
    stream_starts,
    stream_uniforms,
    topk_logprobs,
)

MASK64 = 2**64 - 1


def reference_logprobs(logits, *, temperature, top_k=-1, top_p=1.0):
    """Straightforward float64 version of the documented rule, one row at a time."""
    logits = [float(x) for x in logits]
    if temperature == 0:
        temperature, top_k, top_p = 1.0, -1, 1.0
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])  # stable: ties by token id
    kept = order[: top_k if top_k > 0 else len(order)]
    top = scaled[kept[0]]
    weights = [math.exp(scaled[i] - top) for i in kept]
    mass, nucleus = 0.0, []
    for i, weight in zip(kept, weights, strict=True):
        if top_p < 1 and mass >= top_p * sum(weights):
            break
        nucleus.append(i)
        mass += weight
    log_norm = top + math.log(sum(math.exp(scaled[i] - top) for i in nucleus))
    return [scaled[i] - log_norm if i in nucleus else -math.inf for i in range(len(scaled))]


def logprobs_of(logits, params):
    """With the host-side hint, after checking it agrees with the hint found on the device."""
    rows = RowParams.from_sampling_params(params, seeds=[0] * len(params))
    tensors = dict(temperature_B=rows.temperature_B, top_k_B=rows.top_k_B, top_p_B=rows.top_p_B)
    logprobs_BV = rows.logprobs(torch.as_tensor(logits))
    assert torch.equal(logprobs_BV, sampling_logprobs(torch.as_tensor(logits), **tensors))
    return logprobs_BV


def assert_matches_reference(logprobs_BV, logits_BV, params):
    for row, p in enumerate(params):
        expected = torch.tensor(
            reference_logprobs(
                logits_BV[row].float(), temperature=p.temperature, top_k=p.top_k, top_p=p.top_p
            ),
            dtype=torch.float64,
        )
        assert torch.equal(torch.isinf(logprobs_BV[row]), torch.isinf(expected)), (row, p)
        torch.testing.assert_close(logprobs_BV[row].double(), expected, atol=2e-6, rtol=0)


def test_temperature_by_hand():
    logprobs = logprobs_of([[1.0, 2.0, 3.0]], [SamplingParams(temperature=0.5)])[0]
    log_norm = math.log(math.exp(2) + math.exp(4) + math.exp(6))
    expected = torch.tensor([2 - log_norm, 4 - log_norm, 6 - log_norm])
    torch.testing.assert_close(logprobs, expected)


def test_top_k_by_hand_and_ties_keep_lower_token_ids():
    logprobs = logprobs_of([[1.0, 3.0, 2.0, 0.0]], [SamplingParams(top_k=2)])[0]
    log_norm = math.log(math.exp(3) + math.exp(2))
    expected = torch.tensor([-math.inf, 3 - log_norm, 2 - log_norm, -math.inf])
    torch.testing.assert_close(logprobs, expected)

    tied = logprobs_of([[1.0, 2.0, 2.0, 2.0]], [SamplingParams(top_k=2)])[0]
    torch.testing.assert_close(
        tied, torch.tensor([-math.inf, -math.log(2), -math.log(2), -math.inf])
    )


def test_top_p_by_hand():
    logits = [[math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]] * 2
    params = [SamplingParams(top_p=0.7), SamplingParams(top_p=0.85)]
    logprobs = logprobs_of(logits, params)
    # Mass before each token: 0, 0.5, 0.8, 0.95. 0.7 keeps two tokens, 0.85 keeps three.
    expected = torch.tensor(
        [
            [math.log(0.5 / 0.8), math.log(0.3 / 0.8), -math.inf, -math.inf],
            [math.log(0.5 / 0.95), math.log(0.3 / 0.95), math.log(0.15 / 0.95), -math.inf],
        ]
    )
    torch.testing.assert_close(logprobs, expected)
    tiny = logprobs_of(logits[:1], [SamplingParams(top_p=0.01)])[0]
    assert tiny.tolist() == [0.0, -math.inf, -math.inf, -math.inf]  # the top token always stays


def test_top_p_boundary_and_ties_are_exact():
    # Equal logits give probabilities of exactly 1/4: the mass before token 2 is exactly 0.5,
    # which reaches top_p 0.5, so tokens 0 and 1 (lower ids first among ties) are kept.
    logprobs = logprobs_of([[0.0] * 4], [SamplingParams(top_p=0.5)])[0]
    torch.testing.assert_close(logprobs, torch.tensor([-math.log(2)] * 2 + [-math.inf] * 2))
    many_ties = logprobs_of([[1.0] * 3000], [SamplingParams(top_k=10)])[0]
    assert torch.isfinite(many_ties).nonzero()[:, 0].tolist() == list(range(10))


def test_top_p_one_keeps_tokens_too_unlikely_for_fixed_point():
    logits = [[0.0, -50.0, -60.0]] * 2
    logprobs = logprobs_of(logits, [SamplingParams(top_k=2), SamplingParams()])
    assert torch.isfinite(logprobs).tolist() == [[True, True, False], [True, True, True]]


def test_temperature_top_k_top_p_combined_by_hand():
    # temperature 2 halves the logits to [0, 2, 1, 3, 0.5]; top-3 keeps tokens 3, 1, 2 with
    # probabilities 0.665, 0.245, 0.090; top_p 0.75 keeps tokens 3 and 1 (the mass before
    # token 2 is 0.91).
    logprobs = logprobs_of(
        [[0.0, 4.0, 2.0, 6.0, 1.0]], [SamplingParams(temperature=2.0, top_k=3, top_p=0.75)]
    )[0]
    log_norm = math.log(math.exp(3) + math.exp(2))
    expected = torch.tensor([-math.inf, 2 - log_norm, -math.inf, 3 - log_norm, -math.inf])
    torch.testing.assert_close(logprobs, expected)
    # top-p sees the top-k distribution: (0.4, 0.35, 0.25) -> top-2 is (0.53, 0.47), so top_p
    # 0.5 keeps one token (over the full distribution the mass before token 1 would be 0.4).
    # The second row needs the whole vocabulary sorted, so both ways of sorting are used.
    for params in ([SamplingParams(top_k=2, top_p=0.5)], [SamplingParams(top_p=0.9)]):
        renormalized = logprobs_of(
            [[math.log(p) for p in (0.4, 0.35, 0.25)]] * 2,
            [SamplingParams(top_k=2, top_p=0.5), *params],
        )[0]
        assert renormalized.tolist() == [0.0, -math.inf, -math.inf]


def test_greedy_rows_report_the_untempered_untruncated_distribution():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0]])
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1)]
    logprobs = logprobs_of(logits, params)
    assert torch.equal(logprobs, torch.log_softmax(logits, dim=-1))
    rows = RowParams.from_sampling_params(params, seeds=[3])
    assert rows.draw_mode == "greedy" and not rows.needs_truncation
    tokens = draw_tokens(logits, logprobs, uniforms_B=torch.tensor([0.99]), greedy_B=rows.greedy_B)
    assert tokens.tolist() == [1]  # argmax of the raw logits, first of the tied maxima


def random_batch(num_rows, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    logits_BV = torch.randn(num_rows, vocab_size, generator=generator) * 3
    choices = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.5),
        SamplingParams(top_k=vocab_size + 3),
        SamplingParams(temperature=0.3, top_p=0.999),
        SamplingParams(top_k=1),
    ]
    params = [choices[(row * 5 + seed) % len(choices)] for row in range(num_rows)]
    return logits_BV, params


def test_random_batches_match_the_reference_and_are_normalized():
    for seed in range(3):
        logits_BV, params = random_batch(16, 97, seed)
        logprobs_BV = logprobs_of(logits_BV, params)
        assert logprobs_BV.dtype == torch.float32
        assert_matches_reference(logprobs_BV, logits_BV, params)
        torch.testing.assert_close(
            logprobs_BV.double().exp().sum(-1), torch.ones(16, dtype=torch.float64)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_alone_equals_it_in_a_mixed_batch_bitwise(dtype):
    logits_BV, params = random_batch(8, 5000, seed=11)
    logits_BV = logits_BV.to(dtype)
    rows = RowParams.from_sampling_params(params, seeds=list(range(-4, 4)))
    uniforms_B = seeded_uniforms(rows.seeds_B, torch.full((8,), 7))
    batch_logprobs = logprobs_of(logits_BV, params)
    batch_tokens = draw_tokens(
        logits_BV, batch_logprobs, uniforms_B=uniforms_B, greedy_B=rows.greedy_B
    )
    for row in range(8):
        alone = RowParams.from_sampling_params(params[row : row + 1], seeds=[row - 4])
        logprobs = logprobs_of(logits_BV[row : row + 1], params[row : row + 1])
        uniforms = seeded_uniforms(alone.seeds_B, torch.tensor([7]))
        assert torch.equal(uniforms, uniforms_B[row : row + 1])
        assert torch.equal(logprobs, batch_logprobs[row : row + 1])
        token = draw_tokens(
            logits_BV[row : row + 1], logprobs, uniforms_B=uniforms, greedy_B=alone.greedy_B
        )
        assert token.item() == batch_tokens[row].item()


def test_bf16_logits_are_computed_in_fp32():
    logits_BV, params = random_batch(8, 50, seed=2)
    logits_BV = logits_BV.bfloat16()
    logprobs_BV = logprobs_of(logits_BV, params)
    assert logprobs_BV.dtype == torch.float32
    assert torch.equal(logprobs_BV, logprobs_of(logits_BV.float(), params))
    assert_matches_reference(logprobs_BV, logits_BV, params)


def reference_uniform(seed, counter):
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    state = (mix(seed & MASK64) + (counter + 1) * 0x9E3779B97F4A7C15) & MASK64
    return (mix(state) >> 11) / 2**53


def test_seeded_uniforms_equal_a_pure_python_splitmix64():
    seeds = [0, 1, -1, 42, -(2**63), 2**63 - 1, 123456789012345]
    counters = [0, 1, 5, 2**40, 3, 0, 999]
    uniforms = seeded_uniforms(torch.tensor(seeds), torch.tensor(counters))
    assert uniforms.dtype == torch.float64
    assert uniforms.tolist() == [
        reference_uniform(s, c) for s, c in zip(seeds, counters, strict=True)
    ]


def test_seeded_uniforms_are_uniform_and_differ_across_seeds_and_counters():
    counters = torch.arange(20000)
    for seed in (0, -7, 2**62):
        uniforms = seeded_uniforms(torch.full_like(counters, seed), counters)
        assert uniforms.min() >= 0 and uniforms.max() < 1
        empirical = torch.arange(1, 20001, dtype=torch.float64) / 20000
        ks_statistic = (uniforms.sort().values - empirical).abs().max().item()
        assert ks_statistic < 1.63 / math.sqrt(20000)  # the 1% critical value
        assert uniforms.unique().numel() == 20000
    across_seeds = seeded_uniforms(torch.arange(-5000, 5000), torch.zeros(10000, dtype=torch.long))
    assert across_seeds.unique().numel() == 10000
    buckets = torch.bincount((across_seeds * 10).long(), minlength=10)
    assert buckets.min() > 900 and buckets.max() < 1100
    with pytest.raises(TypeError, match="int64"):
        seeded_uniforms(torch.tensor([1], dtype=torch.int32), torch.tensor([0]))


def test_a_stream_mixed_once_gives_the_seeded_uniforms_bitwise():
    # The engine mixes each sequence's seed once when it starts (SlotTable.stream_starts_S).
    seeds_B = torch.tensor([0, -1, 7, 2**62, -(2**63), 2**63 - 1])
    starts_B = stream_starts(seeds_B)
    for counter in (0, 1, 5, 4095):
        counters_B = torch.full_like(seeds_B, counter)
        assert torch.equal(
            stream_uniforms(starts_B, counters_B), seeded_uniforms(seeds_B, counters_B)
        )
    with pytest.raises(TypeError, match=r"starts_B torch\.int32"):
        stream_uniforms(starts_B.int(), torch.zeros_like(seeds_B))


def test_draw_frequencies_match_probabilities_and_truncated_tokens_never_appear():
    num_draws = 40000
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 3.0, 0.0, 1.5]])
    params = [SamplingParams(temperature=0.9, top_k=5, top_p=0.95)]
    logprobs = logprobs_of(logits, params)
    probs = logprobs[0].double().exp()
    rows = RowParams.from_sampling_params(params * num_draws, seeds=[2024] * num_draws)
    uniforms = seeded_uniforms(rows.seeds_B, torch.arange(num_draws))
    tokens = draw_tokens(
        logits.expand(num_draws, -1),
        logprobs.expand(num_draws, -1),
        uniforms_B=uniforms,
        greedy_B=rows.greedy_B,
    )
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    expected = probs[kept] * num_draws
    chi_square = ((counts[kept] - expected) ** 2 / expected).sum().item()
    assert chi_square < 25  # p < 1e-4 at <= 5 degrees of freedom


def test_inverse_cdf_edges_never_draw_zero_probability_tokens():
    logprobs = torch.log(torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(4, -1))
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 1 - 2**-53])
    tokens = draw_tokens(
        torch.zeros(4, 5), logprobs, uniforms_B=uniforms, greedy_B=torch.zeros(4, dtype=torch.bool)
    )
    assert tokens.tolist() == [1, 1, 3, 3]


def test_same_seed_and_counter_reproduce_the_same_tokens():
    logits_BV, params = random_batch(6, 300, seed=4)
    rows = RowParams.from_sampling_params(params, seeds=[9, 9, 10, 10, 11, 11])
    logprobs_BV = logprobs_of(logits_BV, params)

    def draw(counter):
        uniforms_B = seeded_uniforms(rows.seeds_B, torch.full((6,), counter))
        return draw_tokens(logits_BV, logprobs_BV, uniforms_B=uniforms_B, greedy_B=rows.greedy_B)

    assert torch.equal(draw(3), draw(3))
    assert not all(torch.equal(draw(3), draw(c)) for c in range(4, 10))


def test_gather_and_topk_logprobs():
    logprobs_BV = torch.log_softmax(torch.tensor([[0.1, 2.0, -1.0, 1.0], [3.0, 0.0, 1.0, 2.0]]), -1)
    assert torch.equal(
        gather_logprobs(logprobs_BV, torch.tensor([1, 2])), logprobs_BV[[0, 1], [1, 2]]
    )
    token_ids_BK, values_BK = topk_logprobs(logprobs_BV, 3)
    assert token_ids_BK.dtype == torch.int64 and values_BK.dtype == torch.float32
    assert token_ids_BK.tolist() == [[1, 3, 0], [0, 3, 2]]
    assert torch.equal(values_BK, logprobs_BV.gather(-1, token_ids_BK))
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="k must be"):
            topk_logprobs(logprobs_BV, bad)


def test_row_params_hints_and_validation():
    def hints(*params):
        rows = RowParams.from_sampling_params(params, seeds=[0] * len(params))
        return rows.sort_width, rows.needs_truncation, rows.draw_mode

    assert hints(SamplingParams(), SamplingParams(temperature=0.5)) == (0, False, "sampled")
    assert hints(SamplingParams(temperature=0.0, top_k=4)) == (0, False, "greedy")
    greedy = SamplingParams(temperature=0.0)
    assert hints(SamplingParams(top_k=4), SamplingParams(top_k=9, top_p=0.5)) == (
        9,
        True,
        "sampled",
    )
    assert hints(SamplingParams(top_k=4), SamplingParams(top_p=0.5), greedy) == (-1, True, "mixed")
    rows = RowParams.from_sampling_params(
        [SamplingParams(top_p=0.3), SamplingParams(temperature=0.0)], seeds=[-1, 2**63 - 1]
    )
    assert rows.greedy_B.tolist() == [False, True]
    assert rows.top_p_B.dtype == torch.float64 and rows.top_p_B[0].item() == 0.3
    with pytest.raises(ValueError, match="seeds has 1 entries"):
        RowParams.from_sampling_params([SamplingParams()] * 2, seeds=[0])
    with pytest.raises(ValueError, match="int64 range"):
        RowParams.from_sampling_params([SamplingParams()], seeds=[2**63])
    with pytest.raises(TypeError, match="seeds must be ints"):
        RowParams.from_sampling_params([SamplingParams()], seeds=[1.5])


def test_draw_modes_agree_with_the_mixed_path():
    logits_BV = torch.randn(6, 40, generator=torch.Generator().manual_seed(8))
    counters_B = torch.arange(6)
    for params in ([SamplingParams(temperature=0.0)] * 6, [SamplingParams(top_k=7)] * 6):
        rows = RowParams.from_sampling_params(params, seeds=list(range(6)))
        logprobs_BV = rows.logprobs(logits_BV)
        mixed = draw_tokens(
            logits_BV,
            logprobs_BV,
            uniforms_B=seeded_uniforms(rows.seeds_B, counters_B),
            greedy_B=rows.greedy_B,
        )
        assert rows.draw_mode != "mixed"
        assert torch.equal(rows.draw(logits_BV, logprobs_BV, counters_B=counters_B), mixed)


@pytest.mark.parametrize("vocab_size", [29, 1024, 1025, 4096, 4097, 5000, 151_936])
def test_cdf_walk_finds_the_full_cumsum_token(vocab_size):
    # One level up to ONE_LEVEL_MAX_VOCAB (4096), two levels past it.
    generator = torch.Generator().manual_seed(vocab_size)
    logits_BV = torch.randn(16, vocab_size, generator=generator) * 3
    if vocab_size > 100:
        logits_BV[:, ::7] = float("-inf")  # zero-probability tokens inside blocks
    probs_BV = torch.softmax(logits_BV, dim=-1)
    fixed_BV = (probs_BV * 2.0**62).long()
    uniforms_B = seeded_uniforms(torch.arange(16), torch.arange(16))
    cdf_BV = fixed_BV.cumsum(dim=-1)
    total_B1 = cdf_BV[:, -1:]
    threshold_B1 = torch.minimum((uniforms_B[:, None] * total_B1.double()).long(), total_B1 - 1)
    expected_B = torch.searchsorted(cdf_BV, threshold_B1, right=True)[:, 0]
    drawn_B = _walk_cdf(fixed_BV, uniforms_B)
    assert torch.equal(drawn_B, expected_B)
    assert bool((probs_BV.gather(-1, drawn_B[:, None]) > 0).all())
