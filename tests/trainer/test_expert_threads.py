"""A CPU trainer runs a MoE model's experts whole per thread ('auto'): where it applies (one
process, no thread shards, a MoE model), a forward_backward equals the one on torch's intra-op
threads ('off') to float rounding and is the same bits on every run."""

from __future__ import annotations

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.models.common.moe import GroupedExperts
from temper.trainer import TrainerEngine

VOCAB = 41


def _data() -> list[Datum]:
    generator = torch.Generator().manual_seed(0)
    token_lists = [torch.randint(1, VOCAB, (40,), generator=generator).tolist() for _ in range(4)]
    return [
        Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        for tokens in token_lists
    ]


def _step(mode: str, *, config=None, **engine) -> tuple[float, list[torch.Tensor], object]:
    model = materialize(config or qwen3_moe_size("tiny", vocab_size=VOCAB), seed=3)
    trainer = TrainerEngine.Config(expert_threads=mode, **engine).build(model=model, lora=None)
    loss = trainer.forward_backward(_data(), "cross_entropy").metrics["loss:sum"]
    grads = [p.grad.clone() for p in model.parameters()]
    return loss, grads, trainer


def _expert_threads(model) -> set:
    return {m.threads for m in model.modules() if isinstance(m, GroupedExperts)}


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_auto_equals_off_to_rounding_and_repeats_bitwise(two_threads):
    loss_off, grads_off, off = _step("off")
    loss, grads, auto = _step("auto")
    assert off.expert_threads is None and _expert_threads(off.model) == {None}
    assert auto.expert_threads is not None
    assert _expert_threads(auto.model) == {auto.expert_threads}
    assert loss == pytest.approx(loss_off, rel=1e-6)
    for grad, grad_off in zip(grads, grads_off, strict=True):
        torch.testing.assert_close(grad, grad_off, rtol=1e-4, atol=1e-6)
    again_loss, again_grads, _ = _step("auto")
    assert again_loss == loss
    assert all(torch.equal(a, b) for a, b in zip(again_grads, grads, strict=True))


def test_no_expert_threads_where_something_else_splits_the_work_or_no_experts(two_threads):
    assert _step("auto", shard_threads=2)[2].expert_threads is None
    dense = qwen3_size("tiny", vocab_size=VOCAB)
    assert _step("auto", config=dense)[2].expert_threads is None


def test_a_bad_mode_names_the_field():
    with pytest.raises(ValueError, match=r"TrainerEngine\.Config\.expert_threads"):
        TrainerEngine.Config(expert_threads="many")
