"""The engine with losses beyond one value per token: gspo's one ratio per datum and top-K
cross-entropy's [T, K] targets, against direct computations on the same model."""

from __future__ import annotations

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.models.common.logprobs import forward_logprobs
from tests.trainer.test_engine import VOCAB, _assert_close_to_scale, _engine, _grads

PROMPT = [3, 1, 4, 1, 5]


def _gspo_datum(completion, *, seed, mask=True):
    """A GRPO-style datum: prompt positions have advantage 0 and placeholder logprobs 0."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [*PROMPT, *completion]
    num_prompt, n = len(PROMPT) - 1, len(tokens) - 1
    sampled = (-torch.rand(n - num_prompt, generator=generator) * 3).tolist()
    advantage = float(torch.randn((), generator=generator))
    inputs = {
        "target_tokens": tokens[1:],
        "logprobs": [0.0] * num_prompt + sampled,
        "advantages": [0.0] * num_prompt + [advantage] * (n - num_prompt),
    }
    if mask:
        inputs["sequence_ratio_mask"] = [0.0] * num_prompt + [1.0] * (n - num_prompt)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _gspo_reference(engine, data, *, low=0.8, high=1.2):
    """Each datum alone, straight from the formula; returns (loss, gradients)."""
    total = torch.zeros(())
    for datum in data:
        inputs = {k: v.to_torch() for k, v in datum.loss_fn_inputs.items()}
        tokens = torch.tensor([datum.model_input.to_ints()])
        lp = forward_logprobs(engine.model, tokens, inputs["target_tokens"][None])[0]
        in_ratio = inputs["advantages"] != 0
        log_ratio = (lp.detach() - inputs["logprobs"])[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        a = inputs["advantages"]
        total = total - torch.minimum(ratio * a, ratio.clamp(low, high) * a).sum()
    grads = torch.autograd.grad(total, engine.trainable)
    return float(total.detach()), grads


@pytest.mark.parametrize(
    ("max_tokens", "share_prefixes"), [(8192, False), (8192, True), (20, False)],
    ids=["padded", "packed", "micro-batches"],
)  # fmt: skip
def test_gspo_matches_a_per_datum_computation(max_tokens, share_prefixes):
    data = [
        _gspo_datum([9, 2, 6], seed=0),
        _gspo_datum([5, 3], seed=1, mask=False),  # the default mask: nonzero advantages
        _gspo_datum([5, 8, 9, 7], seed=2),
        _gspo_datum([2], seed=3),
    ]
    engine = _engine(max_tokens=max_tokens)
    engine.config.share_prefixes = share_prefixes
    output = engine.forward_backward(data, "gspo")
    reference = _engine(max_tokens=max_tokens)
    loss, grads = _gspo_reference(reference, data)
    assert output.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    for got, expected in zip(_grads(engine), grads, strict=True):
        _assert_close_to_scale(got, expected)
    lengths = [len(d.model_input.to_ints()) for d in data]
    assert [o["logprobs"].shape for o in output.loss_fn_outputs] == [(n,) for n in lengths]


def _topk_datum(tokens, *, k, seed, weights=True):
    generator = torch.Generator().manual_seed(seed)
    n = len(tokens) - 1
    targets_TK = torch.randint(0, VOCAB, (n, k), generator=generator)
    targets_TK[:, 0] = torch.tensor(tokens[1:])
    inputs = {"target_tokens": targets_TK}
    if weights:
        weights_TK = torch.rand(n, k, generator=generator)
        inputs["weights"] = weights_TK / weights_TK.sum(-1, keepdim=True)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _topk_reference(engine, data):
    """-sum w * log_softmax(logits).gather(targets), datum by datum: (loss, logprobs, grads)."""
    total, logprobs = torch.zeros(()), []
    for datum in data:
        targets = datum.loss_fn_inputs["target_tokens"].to_torch()
        weights = datum.loss_fn_inputs["weights"].to_torch()
        tokens = torch.tensor([datum.model_input.to_ints()])
        hidden, weight = engine.model.logit_inputs(engine.model.hidden_states(tokens))
        lp = torch.log_softmax((hidden[0] @ weight.T).float(), -1).gather(
            -1, targets.view(len(targets), -1)
        )
        lp = lp.view(targets.shape)
        logprobs.append(lp.detach())
        total = total - (weights * lp).sum()
    return float(total.detach()), logprobs, torch.autograd.grad(total, engine.trainable)


@pytest.mark.parametrize("share_prefixes", [False, True], ids=["padded", "packed"])
def test_top_k_cross_entropy_matches_gather_of_log_softmax(share_prefixes):
    data = [
        _topk_datum([*PROMPT, 7, 2], k=4, seed=0),
        _topk_datum([*PROMPT, 8, 8, 1], k=4, seed=1),
        _topk_datum([*PROMPT, 6], k=2, seed=2),  # another K: a batch of its own
        _topk_datum([*PROMPT, 6], k=1, seed=3),
    ]
    one_d = {"target_tokens": [2, 3, 4], "weights": [1.0, 0.5, 0.0]}
    data.append(Datum(model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=one_d))
    if share_prefixes:  # datums of one K sharing a prompt pack; a mixed call runs padded
        data = data[:2]
    engine = _engine()
    engine.config.share_prefixes = share_prefixes
    output = engine.forward_backward(data, "cross_entropy")
    loss, logprobs, grads = _topk_reference(_engine(), data)
    assert output.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)
    for record, expected in zip(output.loss_fn_outputs, logprobs, strict=True):
        assert record["logprobs"].shape == tuple(expected.shape)
        torch.testing.assert_close(record["logprobs"].to_torch(), expected, rtol=0, atol=1e-5)
    for got, expected in zip(_grads(engine), grads, strict=True):
        _assert_close_to_scale(got, expected)


def test_cross_entropy_without_weights_weighs_every_target_one():
    without = [_topk_datum([*PROMPT, 7, 2], k=3, seed=0, weights=False)]
    targets = without[0].loss_fn_inputs["target_tokens"]
    with_ones = [
        Datum(
            model_input=without[0].model_input,
            loss_fn_inputs={"target_tokens": targets, "weights": torch.ones(6, 3)},
        )
    ]
    one_d = [
        Datum(
            model_input=ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]}
        )
    ]
    engine = _engine()
    for data in (without, one_d):
        forward = engine.forward(data, "cross_entropy")
        logprobs = forward.loss_fn_outputs[0]["logprobs"].to_torch()
        assert forward.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-6)
    engine.forward_backward(without, "cross_entropy")
    twin = _engine()
    twin.forward_backward(with_ones, "cross_entropy")
    assert all(torch.equal(a, b) for a, b in zip(_grads(engine), _grads(twin), strict=True))


def test_custom_loss_over_top_k_logprobs_equals_cross_entropy_with_its_gradient():
    # A reverse KL on [T, K] logprobs, as the cookbook's sdft.reverse_kl_custom_loss.
    data = [_topk_datum([*PROMPT, 7, 2], k=4, seed=0), _topk_datum([*PROMPT, 9], k=4, seed=1)]

    def reverse_kl(datums, logprobs):
        loss = torch.zeros(())
        for datum, lp_TK in zip(datums, logprobs, strict=True):
            teacher_TK = datum.loss_fn_inputs["weights"].to_torch()
            student_TK = torch.softmax(lp_TK, -1)
            loss = loss + (student_TK * (torch.log_softmax(lp_TK, -1) - teacher_TK.log())).sum()
        return loss, {}

    custom = _engine()
    output = custom.forward_backward_custom(data, reverse_kl)
    assert [o["logprobs"].shape for o in output.loss_fn_outputs] == [(6, 4), (5, 4)]
    leaves = [o["logprobs"].to_torch().requires_grad_() for o in output.loss_fn_outputs]
    loss, _ = reverse_kl(data, leaves)
    grads = torch.autograd.grad(loss, leaves)
    assert output.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-5)
    built_in = _engine()
    linear = [
        Datum(model_input=d.model_input,
              loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": -g})
        for d, g in zip(data, grads, strict=True)
    ]  # fmt: skip
    built_in.forward_backward(linear, "cross_entropy")
    for a, b in zip(_grads(custom), _grads(built_in), strict=True):
        _assert_close_to_scale(a, b)


@pytest.mark.parametrize(
    ("inputs", "loss_fn", "message"),
    [
        ({"target_tokens": torch.zeros(2, 3, dtype=torch.long), "weights": torch.ones(2, 4)},
         "cross_entropy",
         r"datum 0: loss_fn_inputs\['weights'\] has shape \[2, 4\] but "
         r"loss_fn_inputs\['target_tokens'\] has shape \[2, 3\]"),
        ({"target_tokens": torch.zeros(2, 3, dtype=torch.long), "weights": torch.ones(2)},
         "cross_entropy", r"loss_fn_inputs\['weights'\] has shape \[2\] but"),
        ({"target_tokens": torch.zeros(2, 3, dtype=torch.long), "logprobs": torch.zeros(2),
          "advantages": torch.zeros(2)},
         "ppo", r"loss_fn_inputs\['target_tokens'\] has shape \[2, 3\], but model_input has "
                r"2 tokens; expected \[2\] \(or \[2, K\] with 'support_mask'"),
        ({"target_tokens": torch.full((2, 3), VOCAB)},
         "cross_entropy", rf"token {VOCAB} at position \[0, 0\] is outside the vocabulary"),
    ],
    ids=["k-mismatch", "1d-weights", "topk-for-ppo", "topk-vocab"],
)  # fmt: skip
def test_bad_top_k_inputs_are_named(inputs, loss_fn, message):
    engine = _engine()
    datum = Datum(model_input=ModelInput.from_ints([1, 2]), loss_fn_inputs=inputs)
    with pytest.raises(ValueError, match=message):
        engine.forward_backward([datum], loss_fn)
    assert all(p.grad is None for p in engine.trainable)
