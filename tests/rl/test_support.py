"""Sampler support into the trainer (rl/rollout.py `support_inputs`, losses/support.py):
with top-p 0.9, Temper's engine's sampled logprobs against the trainer's on the same
weights, plain and renormalised over the returned support; and the engine's gradient of a
policy loss over a support against a reference computed on the logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.rl.rollout import Trajectory, policy_datum, support_inputs
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.trainer import TrainerEngine

VOCAB = 31
PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 4, 8, 1, 6, 2]]


def _model():
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=5, dtype="float32")


def _trajectories(model, params):
    engine = SamplerEngine.Config(max_batch=16, max_seq_len=64).build(model=model.eval())
    requests = [SampleRequest(prompt=p, params=params, num_samples=4) for p in PROMPTS]
    return [
        Trajectory(
            prompt=prompt,
            completion=sequence.tokens,
            sampler_logprobs=sequence.logprobs,
            reward=0.0,
            stop_reason=sequence.stop_reason,
            metrics={},
            sampler_support=sequence.support,
        )
        for prompt, response in zip(PROMPTS, engine.generate(requests), strict=True)
        for sequence in response.sequences
    ]


def _max_gap(trajectories, output):
    gaps = []
    for trajectory, record in zip(trajectories, output.loss_fn_outputs, strict=True):
        trainer_lp = record["logprobs"].to_torch()[len(trajectory.prompt) - 1 :]
        gaps.append((trainer_lp - torch.tensor(trajectory.sampler_logprobs)).abs().max())
    return float(max(gaps))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_renormalised_trainer_logprob_is_the_samplers(temperature):
    model = _model()
    params = SamplingParams(
        max_tokens=8, temperature=temperature, top_p=0.9, seed=3, stop=[], return_support=True
    )
    trajectories = _trajectories(model, params)
    trainer = TrainerEngine.Config().build(model=model, lora=None)
    plain = [
        policy_datum(dataclasses.replace(t, sampler_support=None), advantage=1.0)
        for t in trajectories
    ]
    renormalised = [
        policy_datum(t, advantage=1.0, sampler_temperature=temperature) for t in trajectories
    ]
    gap_plain = _max_gap(trajectories, trainer.forward(plain, "importance_sampling"))
    gap_support = _max_gap(trajectories, trainer.forward(renormalised, "importance_sampling"))
    assert gap_support < 1e-5  # KV-cache decode against a full forward, fp32
    assert gap_plain > 1e-2  # the truncation (and temperature) the plain logprob ignores


def test_policy_loss_gradient_over_a_support_equals_the_formula_on_the_logits():
    model = _model()
    trainer = TrainerEngine.Config().build(model=model, lora=None)
    prompt, completion = [3, 1, 4], [1, 5, 9, 2]
    supports = [[1, 7], [5, 2, 6, 1], [9], [0, 2, 30, 11, 4]]
    temperature = 0.8
    tokens = prompt + completion
    generator = torch.Generator().manual_seed(0)
    sampler_lp = (-torch.rand(len(completion), generator=generator)).tolist()
    trajectory = Trajectory(
        prompt=prompt,
        completion=completion,
        sampler_logprobs=sampler_lp,
        reward=0.0,
        stop_reason="length",
        metrics={},
        sampler_support=supports,
    )
    advantages = torch.randn(len(completion), generator=generator).tolist()
    datum = policy_datum(trajectory, advantage=advantages, sampler_temperature=temperature)
    output = trainer.forward_backward([datum], "ppo")
    grads = [p.grad.clone() for p in trainer.trainable]
    trainer.zero_grad()
    # Reference: log q_S(x) = z_x / t - logsumexp_S(z / t) straight from the logits.
    logits_TV = model(torch.tensor([tokens[:-1]]))[0, len(prompt) - 1 :].float() / temperature
    lp = torch.stack(
        [
            row[x] - torch.logsumexp(row[s], 0)
            for row, x, s in zip(logits_TV, completion, supports, strict=True)
        ]
    )
    ratio = torch.exp(lp - torch.tensor(sampler_lp))
    a = torch.tensor(advantages)
    loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum()
    reference = torch.autograd.grad(loss, trainer.trainable)
    assert abs(output.metrics["loss:sum"] - float(loss.detach())) < 1e-5
    trained_lp = output.loss_fn_outputs[0]["logprobs"].to_torch()[len(prompt) - 1 :]
    assert torch.allclose(trained_lp, lp.detach(), atol=1e-5)
    for ours, theirs in zip(grads, reference, strict=True):
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= 1e-5 * max(scale, 1e-6)


def test_support_inputs_layout_and_errors():
    inputs = support_inputs([4, 2], [[1, 4], [2]], temperature=0.5)
    assert inputs["target_tokens"] == [[4, 1], [2, 2]]
    assert inputs["support_mask"] == [[1.0, 1.0], [1.0, 0.0]]
    assert inputs["sampler_temperature"] == [0.5, 0.5]
    with pytest.raises(ValueError, match="target token 3 is not in its support"):
        support_inputs([3], [[1, 4]], temperature=1.0)
