"""Router metrics and the load-balancing loss in the trainer engine (MoE models): the reported
`moe/aux_loss` equals transformers' on the same batch whatever the split (micro-batches,
thread shards, shared-prefix packing); 'add' makes the gradient transformers' gradient of
loss + coef * aux (coef from the model config or the trainer's), weighing micro-batches by
their tokens; 'report' leaves it the loss's own; forward records nothing; dense models report
nothing."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.checkpoint.hf import load_pretrained
from temper.models import materialize, qwen3_size
from temper.models.common.moe_stats import moe_layers
from temper.models.registry import family
from temper.trainer import LoraConfig, TrainerEngine
from tests.models.hf_reference import save_hf, tiny_hf_qwen3_moe

pytest.importorskip("transformers")

VOCAB = 97
COEF = 0.3
"""Large enough that the load-balancing term moves the router's gradient visibly."""


@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    hf_model = tiny_hf_qwen3_moe(seed=4)
    hf_model.config.router_aux_loss_coef = COEF
    return save_hf(hf_model, tmp_path_factory.mktemp("hf") / "model")


def _hf_model(directory):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(directory).float()


def _engine(directory, **config) -> TrainerEngine:
    return TrainerEngine.Config(**config).build(model=load_pretrained(directory), lora=None)


def _data(*, shared_prompt: bool = False, seed: int = 0) -> list[Datum]:
    """Six datums of 5..15 tokens (GRPO-like groups of three sharing a prompt, if asked),
    each token weighing 1 / (all targets): the summed loss is a per-token mean."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (6,), generator=generator).tolist() for _ in range(2)]
    token_lists = []
    for index in range(6):
        length = 5 + (index * 4) % 11
        tokens = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        token_lists.append(prompts[index // 3] + tokens if shared_prompt else tokens)
    num_targets = sum(len(tokens) - 1 for tokens in token_lists)
    return [
        Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "weights": [1.0 / num_targets] * (len(tokens) - 1),
            },
        )
        for tokens in token_lists
    ]


def _hf_loss_and_aux(hf_model, data: list[Datum]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers on the same right-padded batch (pad id 0, masked): the summed weighted
    cross-entropy, and its own load-balancing loss."""
    inputs = [d.model_input.to_ints() for d in data]
    width = max(len(tokens) for tokens in inputs)
    tokens_BT = torch.zeros(len(data), width, dtype=torch.long)
    mask_BT = torch.zeros(len(data), width, dtype=torch.long)
    for row, tokens in enumerate(inputs):
        tokens_BT[row, : len(tokens)] = torch.tensor(tokens)
        mask_BT[row, : len(tokens)] = 1
    output = hf_model(input_ids=tokens_BT, attention_mask=mask_BT, output_router_logits=True)
    logprobs_BTV = output.logits.float().log_softmax(-1)
    loss = 0.0
    for row, datum in enumerate(data):
        targets = datum.loss_fn_inputs["target_tokens"].to_torch().long()
        weights = datum.loss_fn_inputs["weights"].to_torch()
        picked = logprobs_BTV[row, : len(targets)].gather(-1, targets[:, None])[:, 0]
        loss = loss - (picked * weights).sum()
    return loss, output.aux_loss


def _aux(output) -> float:
    return output.metrics["moe/aux_loss:mean"]


@pytest.mark.parametrize(
    ("config", "shared_prompt"),
    [
        ({}, False),
        ({"max_tokens_per_microbatch": 24}, False),
        ({"shard_threads": 2}, False),
        ({"share_prefixes": True}, True),
        ({"share_prefixes": False}, True),
    ],
    ids=["one-batch", "micro-batches", "thread-shards", "packed-prefixes", "padded-prefixes"],
)
def test_reported_aux_loss_equals_transformers_however_the_call_is_split(
    hf_model_dir, config, shared_prompt
):
    data = _data(shared_prompt=shared_prompt)
    with torch.no_grad():
        _, expected = _hf_loss_and_aux(_hf_model(hf_model_dir), data)
    engine = _engine(hf_model_dir, **config)
    output = engine.forward_backward(data, "cross_entropy")
    assert _aux(output) == pytest.approx(expected.item(), rel=1e-5)
    # The other metrics do not depend on the split either (one micro-batch, padded).
    reference = _engine(hf_model_dir, share_prefixes=False).forward_backward(data, "cross_entropy")
    assert output.metrics.keys() == reference.metrics.keys()
    for key, value in reference.metrics.items():
        assert output.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert sorted(k for k in output.metrics if "layer" in k) == [
        "moe/layer_0/entropy:mean",
        "moe/layer_0/max_load:mean",
        "moe/layer_2/entropy:mean",
        "moe/layer_2/max_load:mean",
    ]  # layer 1 is dense
    assert all(
        not block.routings and not block.keep_routing for _, block in moe_layers(engine.model)
    )


def test_add_mode_gradient_is_transformers_gradient_of_loss_plus_coef_times_aux(hf_model_dir):
    data = _data()
    hf_model = _hf_model(hf_model_dir)
    loss, aux = _hf_loss_and_aux(hf_model, data)
    (loss + COEF * aux).backward()
    expected = {name: p.grad for name, p in hf_model.named_parameters()}

    engine = _engine(hf_model_dir, router_aux_loss="add")
    output = engine.forward_backward(data, "cross_entropy")
    assert output.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)  # the loss's own
    compared = 0
    for name, parameter in engine.model.named_parameters():
        layer, _, kind = name.removeprefix("blocks.").partition(".feed_forward.experts.")
        if kind in ("w_gate", "w_up"):  # HF keeps each expert's gate and up stacked
            gate, up = expected[f"model.layers.{layer}.mlp.experts.gate_up_proj"].chunk(2, dim=1)
            wanted = gate if kind == "w_gate" else up
        elif kind == "w_down":
            wanted = expected[f"model.layers.{layer}.mlp.experts.down_proj"]
        else:
            wanted = expected[family("qwen3_moe").key_to_hf(name)]
        scale = wanted.abs().max().item()
        assert (parameter.grad - wanted).abs().max().item() <= 1e-4 * scale, name
        compared += 1 if kind != "w_up" else 0  # gate and up are one HF tensor
    assert compared == len(expected)


def test_report_mode_leaves_the_gradient_the_losses_own(hf_model_dir):
    data = _data()
    hf_model = _hf_model(hf_model_dir)
    loss, _ = _hf_loss_and_aux(hf_model, data)
    loss.backward()
    router = "model.layers.0.mlp.gate.weight"
    expected = dict(hf_model.named_parameters())[router].grad

    engine = _engine(hf_model_dir)
    engine.forward_backward(data, "cross_entropy")
    actual = _router_grad(engine)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-7)
    added = _engine(hf_model_dir, router_aux_loss="add")
    added.forward_backward(data, "cross_entropy")
    difference = _router_grad(added) - actual
    assert difference.abs().max() > 0.1 * actual.abs().max()


def test_the_trainer_coefficient_overrides_the_model_configs(hf_model_dir):
    data = _data()
    grads = {}
    for name, config in {
        "report": {},
        "config": {"router_aux_loss": "add"},
        "twice": {"router_aux_loss": "add", "router_aux_loss_coef": 2 * COEF},
    }.items():
        engine = _engine(hf_model_dir, **config)
        engine.forward_backward(data, "cross_entropy")
        grads[name] = _router_grad(engine)
    expected = grads["report"] + 2 * (grads["config"] - grads["report"])
    torch.testing.assert_close(grads["twice"], expected, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match=r"TrainerEngine\.Config\.router_aux_loss_coef"):
        TrainerEngine.Config(router_aux_loss_coef=-1.0)


def test_add_mode_over_micro_batches_weighs_each_by_its_tokens(hf_model_dir):
    """Split into micro-batches, 'add' back-propagates coef * sum_b (n_b / n) * aux_b: with
    each datum a micro-batch of its own, the loss's gradient plus each datum's own
    load-balancing gradient (that of a call of it alone) scaled by its share of the tokens."""
    data = _data()
    num_tokens = [len(d.model_input.to_ints()) for d in data]
    split = _engine(hf_model_dir, router_aux_loss="add", max_tokens_per_microbatch=1)
    split.forward_backward(data, "cross_entropy")
    report = _engine(hf_model_dir)
    report.forward_backward(data, "cross_entropy")
    expected = _router_grad(report).clone()
    for datum, count in zip(data, num_tokens, strict=True):
        added, plain = _engine(hf_model_dir, router_aux_loss="add"), _engine(hf_model_dir)
        added.forward_backward([datum], "cross_entropy")
        plain.forward_backward([datum], "cross_entropy")
        expected += (_router_grad(added) - _router_grad(plain)) * (count / sum(num_tokens))
    torch.testing.assert_close(_router_grad(split), expected, rtol=1e-4, atol=1e-7)


def _router_grad(engine: TrainerEngine) -> torch.Tensor:
    return engine.model.blocks[0].feed_forward.router.weight.grad


def test_lora_on_the_experts_reports_the_same_routing_and_trains_the_adapters(hf_model_dir):
    data = _data()
    full = _engine(hf_model_dir).forward_backward(data, "cross_entropy")
    engine = TrainerEngine.Config(router_aux_loss="add").build(
        model=load_pretrained(hf_model_dir), lora=LoraConfig(rank=4)
    )
    output = engine.forward_backward(data, "cross_entropy")  # B = 0: the base model's routing
    assert output.metrics.keys() == full.metrics.keys()
    for key, value in full.metrics.items():
        assert output.metrics[key] == pytest.approx(value, rel=1e-5), key
    adapters = {n: p for n, p in engine.model.named_parameters() if p.requires_grad}
    assert any("experts" in name for name in adapters)
    assert all(p.grad is not None for p in adapters.values())


def test_forward_records_and_reports_nothing(hf_model_dir):
    engine = _engine(hf_model_dir)
    output = engine.forward(_data(), "cross_entropy")
    assert list(output.metrics) == ["loss:sum"]
    assert all(not block.routings for _, block in moe_layers(engine.model))


def test_custom_loss_reports_router_metrics_too(hf_model_dir):
    data = _data()
    engine = _engine(hf_model_dir)

    def mean_logprob(data, logprobs):
        return -torch.cat(logprobs).mean(), {}

    output = engine.forward_backward_custom(data, mean_logprob)
    reference = _engine(hf_model_dir).forward_backward(data, "cross_entropy")
    assert _aux(output) == pytest.approx(_aux(reference), rel=1e-6)


def test_a_dense_model_reports_no_router_metrics_and_warns_that_add_is_ignored():
    model = materialize(dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB)))
    with pytest.warns(UserWarning, match=r"router_aux_loss='add' is ignored: .*no MoE layers"):
        engine = TrainerEngine.Config(router_aux_loss="add").build(model=model, lora=None)
    assert engine.router is None
    output = engine.forward_backward(_data(), "cross_entropy")
    assert list(output.metrics) == ["loss:sum"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainerEngine.Config().build(model=model, lora=None)


def test_an_unknown_aux_loss_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"TrainerEngine\.Config\.router_aux_loss.*report.*add"):
        TrainerEngine.Config(router_aux_loss="train")
