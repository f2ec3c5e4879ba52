"""Qwen3.5 (dense) against transformers: fp32 logits of a checkpoint transformers wrote, right
padding, export that transformers reloads, the recurrent form (prefill then token-by-token
decode through a RecurrentStates backend, and prefill in two pieces) against the full forward,
and configs Temper refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models.common.gated_attention import GatedAttention
from temper.models.common.gated_deltanet import GatedDeltaNet
from temper.models.qwen3_5 import Qwen3_5, qwen3_5_size
from tests.models.hf_reference import assert_export_reloads_exactly, save_hf, tiny_hf_qwen3_5
from tests.models.qwen3_5.reference_states import DictStates, right_padded

pytest.importorskip("transformers")


def _tokens(batch: int, length: int, *, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    hf_model = tiny_hf_qwen3_5()
    model = load_pretrained(save_hf(hf_model, tmp_path_factory.mktemp("hf")), dtype=torch.float32)
    return hf_model, model.eval()


def test_loaded_hf_checkpoint_has_the_hybrid_layout(hf_and_ours):
    _, model = hf_and_ours
    assert isinstance(model, Qwen3_5)
    assert model.config.linear_layers == (0, 1, 2)
    assert model.config.attention_layers == (3,)
    assert model.config.conv_state_shape == (2 * 2 * 16 + 4 * 24, 3)
    assert model.config.recurrent_state_shape == (4, 16, 24)
    assert [type(b.linear_attention) for b in model.blocks[:3]] == [GatedDeltaNet] * 3
    assert isinstance(model.blocks[3].attention, GatedAttention)


@pytest.mark.parametrize("length", [40, 150])  # one chunk; several chunks with a ragged tail
def test_loaded_hf_checkpoint_matches_hf_logits(hf_and_ours, length):
    hf_model, model = hf_and_ours
    tokens_BT = _tokens(3, length)
    with torch.no_grad():
        expected_BTV = hf_model(input_ids=tokens_BT).logits
        actual_BTV = model(tokens_BT)
    torch.testing.assert_close(actual_BTV, expected_BTV, rtol=0, atol=1e-5)


def test_untied_layer_pattern_from_config_matches_hf_logits(tmp_path):
    types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    hf_model = tiny_hf_qwen3_5(tie=False, layer_types=types, seed=1)
    model = load_pretrained(save_hf(hf_model, tmp_path)).eval()
    assert model.config.layer_types == tuple(types)
    tokens_BT = _tokens(2, 70, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens_BT), hf_model(input_ids=tokens_BT).logits, rtol=0, atol=1e-5
        )


def test_right_padded_rows_equal_their_unpadded_forward(hf_and_ours):
    _, model = hf_and_ours
    rows = [list(range(1, 90)), [5, 6, 7], list(range(20, 60))]
    tokens_BT, lengths_B = right_padded(rows)
    with torch.no_grad():
        padded_BTV = model(tokens_BT)
        for b, row in enumerate(rows):
            alone_1TV = model(torch.tensor([row]))
            torch.testing.assert_close(padded_BTV[b, : lengths_B[b]], alone_1TV[0])


def test_export_reloads_in_transformers_exactly(hf_and_ours, tmp_path):
    from transformers import Qwen3_5ForCausalLM

    hf_model, model = hf_and_ours
    save_pretrained(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text"
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert_export_reloads_exactly(
        hf_model,
        model,
        tmp_path / "export",
        tokens_BT=_tokens(2, 80, seed=3),
        hf_class=Qwen3_5ForCausalLM,
    )


def _prefill(model, states: DictStates, rows: list[list[int]], *, start_B: torch.Tensor):
    """Logits [B, T, V] of a right-padded prefill continuing each row at start_B."""
    tokens_BT, lengths_B = right_padded(rows)
    states.lengths_B = lengths_B
    positions_BT = start_B[:, None] + torch.arange(tokens_BT.shape[1])
    hidden = model.hidden_states(tokens_BT, positions_BT=positions_BT, attention=states)
    return model.logits(hidden), lengths_B


@torch.no_grad()
def test_prefill_then_recurrent_decode_matches_the_full_forward(hf_and_ours):
    _, model = hf_and_ours
    generator = torch.Generator().manual_seed(4)
    prompts = [list(range(1, 71)), [9, 8, 7, 6, 5], list(range(30, 60))]
    continuations = torch.randint(0, 97, (3, 12), generator=generator)
    states = DictStates()
    logits_BTV, lengths_B = _prefill(
        model, states, prompts, start_B=torch.zeros(3, dtype=torch.long)
    )
    steps = [logits_BTV[torch.arange(3), lengths_B - 1]]
    states.lengths_B = None
    for i in range(continuations.shape[1]):
        tokens_B1 = continuations[:, i : i + 1]
        hidden = model.hidden_states(
            tokens_B1, positions_BT=(lengths_B + i)[:, None], attention=states
        )
        steps.append(model.logits(hidden)[:, 0])
    max_diff = 0.0
    for b, prompt in enumerate(prompts):
        full_TV = model(torch.tensor([prompt + continuations[b].tolist()]))[0]
        expected_SV = full_TV[len(prompt) - 1 :]
        actual_SV = torch.stack([step[b] for step in steps])
        max_diff = max(max_diff, (actual_SV - expected_SV).abs().max().item())
        torch.testing.assert_close(actual_SV, expected_SV, rtol=0, atol=1e-4)
    print(f"recurrent decode vs full forward: max |logit diff| {max_diff:.2e}")


@torch.no_grad()
def test_prefill_in_two_pieces_matches_the_full_forward(hf_and_ours):
    _, model = hf_and_ours
    firsts = [list(range(1, 50)), [3, 4, 5], list(range(60, 90))]
    seconds = [list(range(10, 30)), list(range(20, 96)), [7]]
    states = DictStates()
    _, first_lengths_B = _prefill(model, states, firsts, start_B=torch.zeros(3, dtype=torch.long))
    logits_BTV, second_lengths_B = _prefill(model, states, seconds, start_B=first_lengths_B)
    for b in range(3):
        full_TV = model(torch.tensor([firsts[b] + seconds[b]]))[0]
        torch.testing.assert_close(
            logits_BTV[b, : second_lengths_B[b]], full_TV[len(firsts[b]) :], rtol=0, atol=1e-4
        )


def test_states_written_have_the_interface_shapes(hf_and_ours):
    _, model = hf_and_ours
    states = DictStates()
    with torch.no_grad():
        _prefill(model, states, [[1, 2, 3], [4] * 9], start_B=torch.zeros(2, dtype=torch.long))
    assert sorted(states.states) == list(model.config.linear_layers)
    conv_BCW, state_BNKV = states.states[0]
    assert tuple(conv_BCW.shape) == (2, *model.config.conv_state_shape)
    assert tuple(state_BNKV.shape) == (2, *model.config.recurrent_state_shape)


def test_unknown_layer_type_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"layer_types.*\['mamba'\].*linear_attention"):
        dataclasses.replace(qwen3_5_size("tiny"), layer_types=("mamba",) * 4)
    with pytest.raises(ValueError, match=r"layer_types has 3 entries.*num_layers=4"):
        dataclasses.replace(qwen3_5_size("tiny"), layer_types=("full_attention",) * 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["linear_attention"] * 3 + ["sliding"]}, r"layer_types.*'sliding'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"rope_type 'yarn' is not supported",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attn_output_gate": False}, "attn_output_gate=false is not supported"),
        (
            {"layer_types": ["linear_attention"] * 3},
            r"layer_types has 3 entries; it needs one per layer \(num_hidden_layers=4\)",
        ),
    ],
    ids=["layer-type", "rope-type", "activation", "output-gate", "layer-count"],
)
def test_unsupported_hf_config_fails_before_loading_naming_the_field(tmp_path, change, message):
    save_hf(tiny_hf_qwen3_5(), tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(change)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as raised:
        load_pretrained(tmp_path)
    assert str(raised.value).startswith(f"{config_path}: ")
