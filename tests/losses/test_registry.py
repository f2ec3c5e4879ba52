"""The registry in temper/losses/__init__.py: names, specs and the shape of every loss."""

from __future__ import annotations

import pytest
import torch

from temper.losses import LOSSES, LossSpec, get_loss, resolve_config

BUILT_INS = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)
CONFIGS = {"dro": {"beta": 0.5}}


def test_built_ins_are_registered_read_only():
    assert tuple(LOSSES) == BUILT_INS
    assert all(isinstance(spec, LossSpec) and spec.name == name for name, spec in LOSSES.items())
    with pytest.raises(TypeError):
        LOSSES["mine"] = LOSSES["ppo"]  # type: ignore[index]


def test_unknown_loss_lists_valid_names_and_points_to_custom():
    with pytest.raises(ValueError) as error:
        get_loss("dimuon")
    message = str(error.value)
    assert "'dimuon'" in message and "forward_backward_custom" in message
    assert all(name in message for name in BUILT_INS)


def test_inputs_declared():
    for spec in LOSSES.values():
        assert spec.required_inputs[0] == "target_tokens"
    assert get_loss("cross_entropy").required_inputs == ("target_tokens",)
    assert get_loss("cross_entropy").optional_inputs == ("weights",)
    assert get_loss("cross_entropy").topk_inputs == ("target_tokens", "weights")
    support = ("support_mask", "sampler_temperature")  # every policy loss (losses/support.py)
    for name in ("ppo", "cispo"):
        assert get_loss(name).optional_inputs == (
            "clip_low_threshold",
            "clip_high_threshold",
            *support,
        )
    assert get_loss("gspo").optional_inputs == (
        "sequence_ratio_mask",
        "clip_low_threshold",
        "clip_high_threshold",
        *support,
    )
    # Every default fills an input the loss accepts but does not require.
    for spec in LOSSES.values():
        assert set(spec.input_defaults) <= set(spec.optional_inputs)
    assert [spec.name for spec in LOSSES.values() if spec.segmented] == ["gspo"]


@pytest.mark.parametrize("name", BUILT_INS)
def test_every_loss_is_elementwise_fp32_and_differentiable(name):
    spec = get_loss(name)
    generator = torch.Generator().manual_seed(0)
    num_tokens = 6
    logprobs_N = (-torch.rand(num_tokens, generator=generator) * 3).requires_grad_()
    inputs = {
        "target_tokens": torch.arange(num_tokens),
        "weights": torch.rand(num_tokens, generator=generator),
        "logprobs": -torch.rand(num_tokens, generator=generator) * 3,
        "advantages": torch.randn(num_tokens, generator=generator),
    }
    inputs = {key: inputs[key] for key in spec.required_inputs}
    inputs |= {key: default(inputs) for key, default in spec.input_defaults.items()}
    config = resolve_config(spec, CONFIGS.get(name))
    # A segmented loss sees one datum here: a datum's positions in any order are one sequence.
    segments = {"segments_N": torch.zeros(num_tokens, dtype=torch.int64)} if spec.segmented else {}
    loss_N = spec.fn(logprobs_N=logprobs_N, inputs=inputs, config=config, **segments)
    assert loss_N.shape == (num_tokens,) and loss_N.dtype == torch.float32
    assert loss_N.requires_grad
    # Elementwise: a permutation of the tokens permutes the loss (datums can be concatenated).
    order = torch.randperm(num_tokens, generator=generator)
    permuted = spec.fn(
        logprobs_N=logprobs_N[order],
        inputs={key: value[order] for key, value in inputs.items()},
        config=config,
        **segments,
    )
    torch.testing.assert_close(permuted, loss_N[order])
