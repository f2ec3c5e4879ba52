"""stable_reinforce: -sg[min(ratio, max_ratio)] * A * lp (+ kl_coeff * mask * k3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from temper.losses import get_loss, resolve_config
from tests.losses import loss_and_grad

RATIOS = [1.0, 1.5, 0.5, 3.0, 0.1, 2.5]
WEIGHTS = torch.tensor([1.0, 1.5, 0.5, 2.0, 0.1, 2.0])  # min(ratio, 2.0)
ADVANTAGES = [1.0, 1.0, 1.0, -1.0, -1.0, 2.0]
LOGPROBS = [-1.0, -2.0, -0.5, -1.0, -3.0, -0.25]
SAMPLER_LOGPROBS = [lp - math.log(r) for lp, r in zip(LOGPROBS, RATIOS, strict=True)]
INPUTS = {"logprobs": SAMPLER_LOGPROBS, "advantages": ADVANTAGES}


def test_loss_and_gradient_by_hand():
    loss, grad = loss_and_grad("stable_reinforce", logprobs=LOGPROBS, inputs=INPUTS)
    advantages = torch.tensor(ADVANTAGES)
    assert_close(loss, -WEIGHTS * advantages * torch.tensor(LOGPROBS))
    # No gradient through the weight, and no position dropped (unlike PPO's clip).
    assert_close(grad, -WEIGHTS * advantages)


def test_on_policy_it_is_reinforce():
    _, grad = loss_and_grad(
        "stable_reinforce", logprobs=LOGPROBS, inputs={**INPUTS, "logprobs": LOGPROBS}
    )
    assert_close(grad, -torch.tensor(ADVANTAGES))


def test_max_ratio_bounds_the_weight():
    _, grad = loss_and_grad(
        "stable_reinforce", logprobs=LOGPROBS, inputs=INPUTS, config={"max_ratio": 1.0}
    )
    assert_close(grad, -torch.tensor(RATIOS).clamp(max=1.0) * torch.tensor(ADVANTAGES))


def test_kl_term_is_k3_on_masked_positions_and_zero_on_policy():
    mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    inputs = {**INPUTS, "advantages": [0.0] * 6, "mask": mask}
    loss, grad = loss_and_grad(
        "stable_reinforce", logprobs=LOGPROBS, inputs=inputs, config={"kl_coeff": 0.5}
    )
    log_ratio = torch.tensor(SAMPLER_LOGPROBS) - torch.tensor(LOGPROBS)
    k3 = log_ratio.exp() - 1 - log_ratio
    assert_close(loss, 0.5 * k3 * torch.tensor(mask))
    assert (loss >= 0).all() and loss[0] == 0  # ratio 1: no divergence
    # d k3 / d lp = 1 - exp(q - lp): pulls lp toward q.
    assert_close(grad, 0.5 * (1 - log_ratio.exp()) * torch.tensor(mask))


@pytest.mark.parametrize(
    ("config", "message"),
    [({"max_ratio": 0.0}, "max_ratio of stable_reinforce must be > 0"),
     ({"kl_coeff": -0.1}, "kl_coeff of stable_reinforce must be >= 0")],
)  # fmt: skip
def test_bad_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        resolve_config(get_loss("stable_reinforce"), config)


def test_in_process_training_client_takes_it(tmp_path):
    import temper
    from temper.api.types import Datum, ModelInput
    from temper.checkpoint.model_source import init_model_dir

    init_model_dir(tmp_path / "m", size="tiny", tokenizer="digits", seed=0)
    service = temper.ServiceClient(storage_dir=tmp_path / "storage")
    training = service.create_lora_training_client(str(tmp_path / "m"), rank=4, seed=0)
    data = [
        Datum(
            model_input=ModelInput.from_ints([3, 4, 5]),
            loss_fn_inputs={
                "target_tokens": [4, 5, 6],
                "logprobs": [0.0, -2.0, -2.5],
                "advantages": [0.0, 1.0, 1.0],
                "mask": [0.0, 1.0, 1.0],
            },
        )
    ]
    output = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result()
    assert set(output.metrics) == {"loss:sum"}
    assert len(output.loss_fn_outputs[0]["logprobs"].data) == 3
