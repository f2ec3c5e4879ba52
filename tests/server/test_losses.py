"""gspo and top-K cross_entropy through `temper serve`, driven by the tinker SDK, against the
in-process client on the same model directory (the server is a translation: same numbers)."""

from __future__ import annotations

import pytest
import torch
from tinker import types

import temper
from temper.api import types as temper_types
from tests.server.test_sdk import datum, rl_datum

ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def service(server):
    client = server.service()
    yield client
    client.close("success").result()


@pytest.fixture
def pair(service, model_dir, tmp_path):
    """A model on the server and its in-process twin (same base, LoRA rank and seed)."""
    remote = service.create_lora_training_client(str(model_dir), rank=8, seed=3).result()
    local = temper.ServiceClient(storage_dir=tmp_path).create_lora_training_client(
        str(model_dir.resolve()), rank=8, seed=3
    )
    return remote, local


def assert_same_outputs(remote_out, local_out):
    assert remote_out.metrics["loss:sum"] == pytest.approx(local_out.metrics["loss:sum"], abs=1e-5)
    for remote, ours in zip(remote_out.loss_fn_outputs, local_out.loss_fn_outputs, strict=True):
        assert list(remote["logprobs"].shape) == list(ours["logprobs"].shape)
        assert remote["logprobs"].to_torch().reshape(-1).tolist() == pytest.approx(
            ours["logprobs"].to_torch().reshape(-1).tolist(), abs=1e-5
        )


def assert_same_weights_after_a_step(remote, local, tokenizer):
    """One AdamW step on the gradients each side holds, then the same forward."""
    remote.optim_step(ADAM).result()
    local.optim_step(temper_types.AdamParams(learning_rate=1e-2)).result()
    probe = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    local_probe = [datum(tokenizer, t, module=temper_types) for t in ("12=3", "45=9")]
    assert_same_outputs(
        remote.forward(probe, "cross_entropy").result(),
        local.forward(local_probe, "cross_entropy").result(),
    )


def gspo_inputs(tokenizer, text, *, with_mask, module):
    base = rl_datum(tokenizer, text)
    inputs = {name: value.tolist() for name, value in base.loss_fn_inputs.items()}
    if with_mask:
        n = len(inputs["target_tokens"])
        inputs["sequence_ratio_mask"] = [0.0] + [1.0] * (n - 1)
    return module.Datum(
        model_input=module.ModelInput.from_ints(base.model_input.to_ints()), loss_fn_inputs=inputs
    )


@pytest.mark.parametrize("with_mask", [True, False], ids=["sequence_ratio_mask", "default-mask"])
def test_gspo_matches_the_in_process_client(pair, with_mask):
    remote, local = pair
    tokenizer = remote.get_tokenizer()
    texts = ("12=3", "7=7", "45=9")
    data, local_data = (
        [gspo_inputs(tokenizer, t, with_mask=with_mask, module=m) for t in texts]
        for m in (types, temper_types)
    )
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    remote_out = remote.forward_backward(data, "gspo", config).result()
    local_out = local.forward_backward(local_data, "gspo", config).result()
    assert_same_outputs(remote_out, local_out)
    assert [o["logprobs"].shape for o in remote_out.loss_fn_outputs] == [[4], [3], [4]]
    assert_same_weights_after_a_step(remote, local, tokenizer)


def test_gspo_in_an_rl_loop_style_step(service, model_dir):
    # As tinker_cookbook/recipes/rl_loop.py builds gspo datums: placeholder zeros on the
    # prompt, the sampler's logprobs on sampled tokens, a sequence_ratio_mask over them.
    training = service.create_lora_training_client(str(model_dir), rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("12=")
    for step in range(3):
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=step)
        response = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
        rewards = [float(s.tokens[:1] == tokenizer.encode("3")) for s in response.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for sequence, reward in zip(response.sequences, rewards, strict=True):
            ob_len, n = len(prompt) - 1, len(sequence.tokens)
            item = types.Datum(
                model_input=types.ModelInput.from_ints(prompt + sequence.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [0] * ob_len + sequence.tokens,
                    "logprobs": [0.0] * ob_len + sequence.logprobs,
                    "advantages": [0.0] * ob_len + [reward - mean] * n,
                    "sequence_ratio_mask": [0.0] * ob_len + [1.0] * n,
                },
            )
            # rl_loop attaches provenance (with_sampled_provenance); gspo does not read it.
            sid = sequence.sequence_id
            data.append(
                item.with_provenance(
                    model_input=[
                        types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n - 1),
                    ],
                    loss_fn_inputs=[
                        types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob_len),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n),
                    ],
                )
            )
        output = training.forward_backward(data, loss_fn="gspo").result()
        for record, sequence in zip(output.loss_fn_outputs, response.sequences, strict=True):
            # The trainer scores the sampled tokens as the sampler did: sequence ratio 1.
            sampled = record["logprobs"].tolist()[len(prompt) - 1 :]
            assert sampled == pytest.approx(sequence.logprobs, abs=1e-4)
        # With ratio 1 and no clipping, the loss is -sum of the advantages: 0 for a group.
        assert output.metrics["loss:sum"] == pytest.approx(0.0, abs=1e-4)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def topk_data(module, tokenizer, *, k):
    """Datums of top-K targets ([N, K], the first column the text's own next tokens) with
    renormalized weights, 0 in padding slots (target 0), as sdft.py builds them."""
    data = []
    for text, width in (("12=3", k), ("45=9", k), ("7=7", k - 1)):
        tokens = [*tokenizer.encode(text), tokenizer.eos_token_id]
        n = len(tokens) - 1
        generator = torch.Generator().manual_seed(n)
        targets_NK = torch.randint(1, 10, (n, width), generator=generator)
        targets_NK[:, 0] = torch.tensor(tokens[1:])
        weights_NK = torch.rand(n, width, generator=generator)
        targets_NK[0, -1], weights_NK[0, -1] = 0, 0.0  # a padding slot
        weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        if module is types and width == k:
            # Raw 2-D tensors: the SDK sends them as sparse CSR (pad 0).
            inputs = {"target_tokens": targets_NK, "weights": weights_NK}
        else:
            inputs = {
                "target_tokens": module.TensorData.from_torch(targets_NK),
                "weights": module.TensorData.from_torch(weights_NK),
            }
        model_input = module.ModelInput.from_ints(tokens[:-1])
        data.append(module.Datum(model_input=model_input, loss_fn_inputs=inputs))
    # As recipes/decisions/train.py: only the last row is a distribution, the rest padding;
    # the SDK sends such raw tensors as sparse CSR.
    tokens = tokenizer.encode("12=3")
    targets_NK = torch.zeros(len(tokens), k, dtype=torch.int64)
    weights_NK = torch.zeros(len(tokens), k)
    targets_NK[-1] = torch.arange(1, k + 1)
    weights_NK[-1] = torch.full((k,), 1.0 / k)
    inputs = {"target_tokens": targets_NK, "weights": weights_NK}
    model_input = module.ModelInput.from_ints(tokens)
    data.append(module.Datum(model_input=model_input, loss_fn_inputs=inputs))
    if module is types:
        sent = data[-1].loss_fn_inputs.values()
        assert all(value.sparse_crow_indices is not None for value in sent)
    return data


def test_top_k_cross_entropy_forward_and_backward(pair):
    remote, local = pair
    tokenizer = remote.get_tokenizer()
    data, local_data = (topk_data(m, tokenizer, k=4) for m in (types, temper_types))
    remote_out = remote.forward(data, "cross_entropy").result()
    shapes = [[4, 4], [4, 4], [3, 3], [4, 4]]
    assert [o["logprobs"].shape for o in remote_out.loss_fn_outputs] == shapes
    assert_same_outputs(remote_out, local.forward(local_data, "cross_entropy").result())
    # Column 0 holds the text's own next tokens: the plain cross_entropy logprobs.
    plain = remote.forward([datum(tokenizer, "12=3")], "cross_entropy").result()
    column = remote_out.loss_fn_outputs[0]["logprobs"].to_torch()[:, 0].tolist()
    assert column == pytest.approx(plain.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-6)

    remote_out = remote.forward_backward(data, "cross_entropy").result()
    assert_same_outputs(remote_out, local.forward_backward(local_data, "cross_entropy").result())
    assert_same_weights_after_a_step(remote, local, tokenizer)


def test_forward_backward_custom_reverse_kl_on_top_k_logprobs(pair):
    sdft = pytest.importorskip("tinker_cookbook.distillation.sdft")
    remote, local = pair
    tokenizer = remote.get_tokenizer()
    data, local_data = (topk_data(m, tokenizer, k=3) for m in (types, temper_types))
    remote_out = remote.forward_backward_custom(data, sdft.reverse_kl_custom_loss).result()
    local_out = local.forward_backward_custom(local_data, sdft.reverse_kl_custom_loss).result()
    shapes = [[4, 3], [4, 3], [3, 2], [4, 3]]
    assert [o["logprobs"].shape for o in remote_out.loss_fn_outputs] == shapes
    assert_same_outputs(remote_out, local_out)
    assert_same_weights_after_a_step(remote, local, tokenizer)


def test_cross_entropy_without_weights_weighs_every_target_one(pair):
    remote, _ = pair
    tokenizer = remote.get_tokenizer()
    tokens = [*tokenizer.encode("12=3"), tokenizer.eos_token_id]
    targets_NK = torch.tensor([[t, 1] for t in tokens[1:]])
    for targets in (tokens[1:], targets_NK):
        bare = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": targets},
        )
        forward = remote.forward([bare], "cross_entropy").result()
        logprobs = forward.loss_fn_outputs[0]["logprobs"].to_torch()
        assert forward.metrics["loss:sum"] == pytest.approx(-float(logprobs.sum()), rel=1e-5)
        backward = remote.forward_backward([bare], "cross_entropy").result()
        assert backward.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-6)
