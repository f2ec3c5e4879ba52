"""Several adapters in one batch (models/multi_lora.py) against each adapter's merged model:
logprobs within fp32 rounding (1e-5 absolute + 1e-5 relative: a merged weight and the
low-rank path round differently, as a single adapter's LoRA model does against its merge),
greedy tokens equal to the merged-weights sampler's. On Qwen3-MoE (one dense layer, the
others routed) the adapters also hold every expert's pairs; on Qwen3.5 the Gated DeltaNet's
projections, and on Qwen3.5-MoE the shared expert's too."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import llama_size, materialize, qwen3_moe_size, qwen3_size
from temper.models.lora import (
    LoraConfig,
    apply_lora,
    lora_modules,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.models.multi_lora import apply_multi_lora, set_rows
from temper.models.qwen3_5 import qwen3_5_size
from temper.models.qwen3_5_moe import qwen3_5_moe_size
from temper.sampler.engine import SamplerEngine, SampleRequest

CONFIGS = [
    LoraConfig(rank=2, seed=1),
    LoraConfig(rank=4, seed=2, train_unembed=False),
    LoraConfig(rank=8, seed=3, train_mlp=False, alpha=8.0),
]


def trained_adapters(configs, *, size=qwen3_size):
    """(a frozen tiny base, [(config, adapter tensors)] with B away from zero, [each
    adapter's merged plain model]); also used by tests/generator/test_multi_lora.py."""
    # Logits of order 2 (as tests/sampler/test_engine.py), so greedy outputs vary.
    config = dataclasses.replace(size("tiny", vocab_size=31), init_std=0.1)
    base = materialize(config, seed=5, dtype="float32").eval().requires_grad_(False)
    adapters, merged = [], []
    generator = torch.Generator().manual_seed(0)
    for lora in configs:
        trained = copy.deepcopy(base)
        apply_lora(trained, lora)
        with torch.no_grad():  # a trained adapter: B away from zero
            for module in lora_modules(trained).values():
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=generator) * 0.05)
        adapters.append((lora, lora_state_dict(trained)))
        plain = materialize(merged_config(trained), dtype="float32", init="empty").eval()
        plain.load_state_dict(merged_state_dict(trained))
        merged.append(plain)
    return base, adapters, merged


def qwen3_moe_with_a_dense_layer(name: str, *, vocab_size: int):
    """A Qwen3-MoE size whose layer 1 is dense (the other layers route over experts)."""
    return dataclasses.replace(qwen3_moe_size(name, vocab_size=vocab_size), mlp_only_layers=(1,))


@pytest.fixture(
    scope="module",
    params=[qwen3_size, llama_size, qwen3_moe_with_a_dense_layer, qwen3_5_size, qwen3_5_moe_size],
    ids=["qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe"],
)
def models(request):
    return trained_adapters(CONFIGS, size=request.param)


def _multi(base, adapters):
    multi = copy.deepcopy(base)
    apply_multi_lora(multi, adapters)
    return multi


def test_a_mixed_batch_equals_each_adapter_merged(models):
    base, adapters, merged = models
    multi = _multi(base, adapters)
    tokens_BT = torch.randint(0, 31, (6, 9), generator=torch.Generator().manual_seed(1))
    index_B = torch.tensor([0, 1, 2, 1, 0, 2])
    set_rows(multi, index_B)
    with torch.no_grad():
        logprobs_BTV = multi(tokens_BT).log_softmax(-1)
        for row, adapter in enumerate(index_B.tolist()):
            expected_TV = merged[adapter](tokens_BT[row : row + 1])[0].log_softmax(-1)
            torch.testing.assert_close(logprobs_BTV[row], expected_TV, atol=1e-5, rtol=1e-5)
    # The adapters matter: another row's adapter gives other logprobs.
    set_rows(multi, torch.tensor([1, 0, 0, 2, 2, 1]))
    with torch.no_grad():
        assert not torch.allclose(multi(tokens_BT).log_softmax(-1), logprobs_BTV, atol=1e-3)


def test_each_rows_bits_do_not_depend_on_row_order_or_padding(models, request):
    """The rows grouped by slot (multi_lora_groups.py): rows already in the grouped layout,
    the same rows shuffled, and a batch one row short (its slot's group padded) give each
    row the same bits (dense families: MoE routing and the Gated DeltaNet's kernels round
    differently in another row order even without adapters)."""
    if request.node.callspec.id not in ("qwen3", "llama"):
        pytest.skip("the base model itself is not bitwise across row orders")
    base, adapters, _ = models
    multi = _multi(base, adapters)
    tokens_BT = torch.randint(0, 31, (6, 5), generator=torch.Generator().manual_seed(3))
    slots = [0, 0, 1, 1, 2, 2]  # sorted, as many rows each: the layout itself
    order = [3, 0, 5, 1, 4, 2]
    with torch.no_grad():
        set_rows(multi, slots)
        logits_BTV = multi(tokens_BT)
        set_rows(multi, [slots[row] for row in order])
        assert torch.equal(multi(tokens_BT[order]), logits_BTV[order])
        set_rows(multi, slots[:5])
        assert torch.equal(multi(tokens_BT[:5]), logits_BTV[:5])


def test_one_slot_for_every_row_equals_that_adapter_merged(models):
    base, adapters, merged = models
    multi = _multi(base, adapters)
    tokens_BT = torch.randint(0, 31, (3, 9), generator=torch.Generator().manual_seed(2))
    set_rows(multi, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            multi(tokens_BT).log_softmax(-1),
            merged[2](tokens_BT).log_softmax(-1),
            atol=1e-5,
            rtol=1e-5,
        )


def test_a_mixed_moe_batch_routes_each_row_as_its_adapter_merged():
    base, adapters, merged = trained_adapters(CONFIGS, size=qwen3_moe_with_a_dense_layer)
    multi = _multi(base, adapters)
    tokens_BT = torch.randint(0, 31, (4, 7), generator=torch.Generator().manual_seed(3))
    index_B = torch.tensor([2, 0, 1, 2])
    for model in (multi, *merged):
        model.blocks[2].feed_forward.keep_routing = True
    set_rows(multi, index_B)
    with torch.no_grad():
        multi(tokens_BT)
        experts_BTK = multi.blocks[2].feed_forward.routing.experts_NK.view(4, 7, -1)
        for row, adapter in enumerate(index_B.tolist()):
            merged[adapter](tokens_BT[row : row + 1])
            expected_TK = merged[adapter].blocks[2].feed_forward.routing.experts_NK
            assert torch.equal(experts_BTK[row], expected_TK), row


def test_greedy_mixed_batch_equals_the_merged_sampler(models):
    base, adapters, merged = models
    multi = _multi(base, adapters)
    prompts = [[3, 4, 5], [7], [1, 2, 3, 4], [9, 9], [2, 2, 2], [5, 6]]
    index_B = torch.tensor([0, 1, 2, 2, 1, 0])
    steps = 8
    # The multi-adapter model, full forward per step, all rows in one batch.
    sequences = [list(prompt) for prompt in prompts]
    logprobs = [[] for _ in prompts]
    set_rows(multi, index_B)
    with torch.no_grad():
        for _ in range(steps):
            for row, sequence in enumerate(sequences):  # rows differ in length: one at a time
                set_rows(multi, index_B[row : row + 1])
                last_V = multi(torch.tensor([sequence]))[0, -1].log_softmax(-1)
                token = int(last_V.argmax())
                logprobs[row].append(float(last_V[token]))
                sequence.append(token)
    # Each adapter's merged sampler (KV cache, continuous batching) on its rows.
    params = SamplingParams(max_tokens=steps, temperature=0)
    # A hybrid model's sampler steps its Gated DeltaNet layers by the recurrent form, which
    # rounds otherwise than the full forward's chunked form.
    tolerance = 1e-4 if getattr(base.config, "linear_layers", ()) else 1e-5
    for adapter, model in enumerate(merged):
        rows = [row for row, k in enumerate(index_B.tolist()) if k == adapter]
        engine = SamplerEngine.Config(max_batch=4, max_seq_len=64).build(model=model)
        responses = engine.generate([SampleRequest(prompt=prompts[r], params=params) for r in rows])
        for row, response in zip(rows, responses, strict=True):
            (sequence,) = response.sequences
            assert sequence.tokens == sequences[row][len(prompts[row]) :], (adapter, row)
            torch.testing.assert_close(
                torch.tensor(sequence.logprobs),
                torch.tensor(logprobs[row]),
                atol=tolerance,
                rtol=tolerance,
            )


def test_the_base_weights_are_only_read(models):
    base, adapters, _ = models
    multi = _multi(base, adapters)
    key = next(k for k in base.state_dict() if k.endswith(("wq.weight", "in_proj_qkv.weight")))
    assert multi.get_parameter(key) is not None
    before = {name: t.clone() for name, t in base.state_dict().items()}
    set_rows(multi, torch.tensor([2]))
    with torch.no_grad():
        multi(torch.tensor([[1, 2, 3]]))
    after = base.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
