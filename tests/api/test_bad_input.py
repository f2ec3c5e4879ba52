"""Bad input to the in-process clients: a clear error naming the field and what is valid, and
nothing the user had changes: weights, accumulated gradients, optimizer moments, the policy
version and checkpoints stay bitwise as they were, and the clients keep serving."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from temper.api import EncodedTextChunk, ImageAssetPointerChunk, ImageChunk

VOCAB = 29  # the built-in digits vocabulary of "tiny"
MAX_SEQ_LEN = 2048
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _datum(tokens, **inputs):
    inputs.setdefault("target_tokens", [*tokens[1:], 1])
    inputs.setdefault("weights", [1.0] * len(tokens))
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _rl_datum(tokens, *, logprobs=None, advantages=None):
    n = len(tokens)
    inputs = {
        "target_tokens": [*tokens[1:], 1],
        "logprobs": logprobs or [-1.0] * n,
        "advantages": advantages or [0.5] * n,
    }
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


GOOD = [_datum([1, 2, 3]), _datum([4, 5, 6, 7])]
IMAGE = ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)
WITH_IMAGE = ModelInput(
    chunks=(EncodedTextChunk(tokens=(1, 2)), IMAGE, EncodedTextChunk(tokens=(3,)))
)
POINTER = ImageAssetPointerChunk(format="jpeg", location="/images/cat.jpeg")
IMAGE_DATUM = Datum(
    model_input=WITH_IMAGE,
    loss_fn_inputs={"target_tokens": [1] * 5, "weights": [1.0] * 5},
)
IMAGE_REFUSED = (
    r"model_input\.chunks\[1\] is an image chunk \(type 'image'\): image and audio inputs "
    "are not supported"
)


def _outcome(call):
    """Run a client call; a returned future is waited on (errors surface either way)."""
    result = call()
    return result.result() if hasattr(result, "result") else result


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    return ServiceClient(storage_dir=tmp_path_factory.mktemp("bad-input") / "storage")


@pytest.fixture(scope="module")
def client(service):
    """A LoRA client with optimizer moments, a saved checkpoint and accumulated gradients."""
    client = service.create_lora_training_client("tiny", rank=4, seed=1)
    client.forward_backward(GOOD, "cross_entropy")
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    client.save_state("kept").result()
    client.forward_backward(GOOD, "cross_entropy").result()  # left pending on purpose
    return client


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _state(client) -> dict:
    engine = client.engine
    optimizer = engine.optimizer.torch_optimizer
    return {
        "weights": {k: v.clone() for k, v in engine.model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in engine.trainable],
        "moments": [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for state in optimizer.state.values()
        ],
        "groups": json.dumps(
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            default=str,
        ),
        "policy_version": engine.policy_version,
        "storage": _tree_digest(client.service.storage.root),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["weights"].keys() == after["weights"].keys()
    for name, tensor in before["weights"].items():
        assert torch.equal(tensor, after["weights"][name]), name
    for a, b in zip(before["grads"], after["grads"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert len(before["moments"]) == len(after["moments"])
    for a, b in zip(before["moments"], after["moments"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert before["groups"] == after["groups"]
    assert before["policy_version"] == after["policy_version"]
    assert before["storage"] == after["storage"]


def _custom(fn):
    return lambda c: c.forward_backward_custom(GOOD, fn)


def _lp_sum(logprobs):
    return sum(lp.sum() for lp in logprobs)


TRAINING_CASES = {
    "empty data": (lambda c: c.forward_backward([], "cross_entropy"), ValueError, "data is empty"),
    "data not a list": (
        lambda c: c.forward_backward(None, "cross_entropy"),
        TypeError,
        "data must be a list of Datum, got NoneType",
    ),
    "a bare Datum": (
        lambda c: c.forward(GOOD[0], "cross_entropy"),
        TypeError,
        "data must be a list of Datum",
    ),
    "missing target_tokens": (
        lambda c: c.forward_backward(
            [
                GOOD[0],
                Datum(
                    model_input=ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"weights": [1.0, 1.0]},
                ),
            ],
            "cross_entropy",
        ),
        ValueError,
        r"datum 1: loss_fn_inputs is missing \['target_tokens'\]",
    ),
    "a misspelled input": (
        lambda c: c.forward_backward(
            [
                Datum(
                    model_input=ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 3], "weight": [1.0, 1.0]},
                )
            ],
            "cross_entropy",
        ),
        ValueError,
        r"datum 0: loss_fn_inputs\['weight'\] is not an input of this loss; did you mean "
        r"'weights'\? \(its inputs: target_tokens, weights; other names are ignored\)",
    ),
    "weights too short": (
        lambda c: c.forward_backward([_datum([1, 2, 3], weights=[1.0])], "cross_entropy"),
        ValueError,
        r"loss_fn_inputs\['weights'\] has shape \[1\], but model_input has 3 tokens",
    ),
    "fractional target ids": (
        lambda c: c.forward_backward(
            [_datum([1, 2, 3], target_tokens=[1.5, 2.0, 3.0])], "cross_entropy"
        ),
        ValueError,
        r"loss_fn_inputs\['target_tokens'\] must be integers",
    ),
    "bool targets": (
        lambda c: c.forward_backward(
            [_datum([1, 2, 3], target_tokens=torch.tensor([True, False, True]))], "cross_entropy"
        ),
        TypeError,
        "int64 or float32",
    ),
    "unknown loss": (
        lambda c: c.forward_backward(GOOD, "sft"),
        ValueError,
        "unknown loss_fn 'sft'; built-in losses: cross_entropy, importance_sampling, ppo",
    ),
    "target outside the vocabulary": (
        lambda c: c.forward_backward(
            [_datum([1, 2, 3], target_tokens=[1, 2, VOCAB])], "cross_entropy"
        ),
        ValueError,
        rf"token {VOCAB} at position 2 is outside the vocabulary; valid ids are 0..{VOCAB - 1}",
    ),
    "input token negative": (
        lambda c: c.forward_backward([_datum([1, -1, 3])], "cross_entropy"),
        ValueError,
        r"datum 0: model_input: token -1 at position 1 is outside the vocabulary",
    ),
    "nan advantages": (
        lambda c: c.forward_backward(
            [_rl_datum([1, 2, 3], advantages=[1.0, float("nan"), 0.0])], "ppo"
        ),
        ValueError,
        r"loss_fn_inputs\['advantages'\] has a non-finite value \(nan\) at position 1",
    ),
    "inf sampler logprobs": (
        lambda c: c.forward_backward(
            [_rl_datum([1, 2, 3], logprobs=[0.0, float("-inf"), 0.0])], "importance_sampling"
        ),
        ValueError,
        r"loss_fn_inputs\['logprobs'\] has a non-finite value \(-inf\)",
    ),
    "config key the loss does not take": (
        lambda c: c.forward_backward(GOOD, "cross_entropy", {"clip_low_threshold": 0.5}),
        ValueError,
        "'clip_low_threshold' is not accepted by loss 'cross_entropy'; valid keys: none",
    ),
    "crossed clip bounds": (
        lambda c: c.forward_backward(
            [_rl_datum([1, 2, 3])], "ppo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}
        ),
        ValueError,
        r"clip_low_threshold \(1.5\) must be <= clip_high_threshold \(1.2\)",
    ),
    "longer than the context": (
        lambda c: c.forward([_datum([1] * (MAX_SEQ_LEN + 1))], "cross_entropy"),
        ValueError,
        f"model_input has {MAX_SEQ_LEN + 1} tokens, more than the model's max_seq_len",
    ),
    "custom loss raises": (
        _custom(lambda data, lps: (_ for _ in ()).throw(RuntimeError("loss bug"))),
        RuntimeError,
        "loss bug",
    ),
    "custom loss not callable": (
        _custom("cross_entropy"),
        TypeError,
        "loss_fn must be a function",
    ),
    "custom loss not a tuple": (
        _custom(lambda data, lps: _lp_sum(lps)),
        TypeError,
        r"must return \(loss, metrics\), got Tensor",
    ),
    "custom loss not a scalar": (
        _custom(lambda data, lps: (torch.cat(lps), {})),
        TypeError,
        r"must return a 0-d tensor as its loss, got \[7\]",
    ),
    "custom loss detached": (
        _custom(lambda data, lps: (_lp_sum(lps).detach(), {})),
        ValueError,
        "does not depend on the logprobs",
    ),
    "custom loss nan": (
        _custom(lambda data, lps: (_lp_sum(lps) * float("nan"), {})),
        ValueError,
        r"non-finite loss \(nan\)",
    ),
    "custom loss with infinite gradient": (
        # sqrt at 0: a finite loss (0) whose gradient is infinite
        _custom(lambda data, lps: ((lps[0] - lps[0].detach()).sqrt().sum(), {})),
        ValueError,
        "gradient with respect to datum 0's logprobs is not finite",
    ),
    "custom metrics not a dict": (
        _custom(lambda data, lps: (_lp_sum(lps), [1.0])),
        TypeError,
        "metrics as a dict, got list",
    ),
    "custom metric not a number": (
        _custom(lambda data, lps: (_lp_sum(lps), {"kl": "high"})),
        TypeError,
        r"metrics\['kl'\] must be a number, got 'high'",
    ),
    "forward_backward of an image": (
        lambda c: c.forward_backward([GOOD[0], IMAGE_DATUM], "cross_entropy"),
        ValueError,
        f"datum 1: {IMAGE_REFUSED}",
    ),
    "forward of an image": (
        lambda c: c.forward([IMAGE_DATUM], "cross_entropy"),
        ValueError,
        f"datum 0: {IMAGE_REFUSED}",
    ),
    "forward_backward_custom of an image": (
        lambda c: c.forward_backward_custom([IMAGE_DATUM], lambda data, lps: (_lp_sum(lps), {})),
        ValueError,
        f"datum 0: {IMAGE_REFUSED}",
    ),
    "optim_step without AdamParams": (
        lambda c: c.optim_step({"learning_rate": 1e-3}),
        TypeError,
        "optim_step takes AdamParams, got dict",
    ),
}


@pytest.mark.parametrize("case", list(TRAINING_CASES))
def test_bad_training_calls_name_the_problem_and_change_nothing(client, case):
    call, error, message = TRAINING_CASES[case]
    before = _state(client)
    with pytest.raises(error, match=message):
        _outcome(lambda: call(client))
    _assert_same(before, _state(client))


def test_failed_calls_leave_the_client_serving(client):
    """After every rejected call above, the same forward gives the same result and the
    pending gradients are applied by the next step as usual."""
    before = client.forward(GOOD, "cross_entropy").result().metrics
    with pytest.raises(ValueError):
        client.forward_backward([], "cross_entropy").result()
    assert client.forward(GOOD, "cross_entropy").result().metrics == before


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"learning_rate": -1.0}, ValueError, r"AdamParams.learning_rate must be >= 0, got -1.0"),
        ({"learning_rate": float("nan")}, ValueError, "AdamParams.learning_rate must be >= 0"),
        ({"learning_rate": "1e-3"}, TypeError, "AdamParams.learning_rate must be a number"),
        (
            {"learning_rate": True},
            TypeError,
            r"AdamParams.learning_rate must be a number, got True",
        ),
        ({"beta1": 1.0}, ValueError, r"AdamParams.beta1 must be in \[0, 1\), got 1.0"),
        ({"beta2": -0.1}, ValueError, r"AdamParams.beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, ValueError, "AdamParams.eps must be > 0, got 0.0"),
        ({"eps": None}, TypeError, "AdamParams.eps must be a number, got None"),
        ({"weight_decay": -0.1}, ValueError, "AdamParams.weight_decay must be >= 0"),
        ({"grad_clip_norm": float("inf")}, ValueError, "AdamParams.grad_clip_norm must be >= 0"),
    ],
)
def test_bad_adam_params_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        AdamParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens": 0}, ValueError, r"max_tokens must be > 0 \(or None\), got 0"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens must be an int or None, got 2.0"),
        ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, ValueError, "temperature must be a finite number >= 0"),
        ({"temperature": "1"}, TypeError, "temperature must be a number, got '1'"),
        ({"top_k": -2}, ValueError, "top_k must be an int >= 1, or -1/0 for no limit, got -2"),
        ({"top_k": 2.5}, ValueError, "top_k must be an int"),
        ({"top_k": 2**63}, ValueError, r"top_k must be at most 2\*\*63 - 1 \(any top_k of the"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": float("nan")}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": None}, TypeError, "top_p must be a number, got None"),
        ({"stop": ""}, ValueError, "stop must not be the empty string"),
        ({"stop": ["a", ""]}, ValueError, "stop strings must not be empty"),
        ({"stop": [1, "a"]}, TypeError, "stop must be all strings or all ints"),
        ({"stop": [-1]}, ValueError, "stop token ids must be >= 0"),
        ({"stop": 5}, TypeError, "stop must be None, a string, or a list of strings or ints"),
        ({"seed": 1.5}, TypeError, "seed must be an int or None, got 1.5"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


SAMPLING_CASES = {
    "prompt token outside the vocabulary": (
        lambda s: s.sample(ModelInput.from_ints([1, VOCAB]), 1, GREEDY),
        ValueError,
        rf"prompt token {VOCAB} at position 1 is outside the vocabulary; valid ids are 0..",
    ),
    "empty prompt": (
        lambda s: s.sample(ModelInput.empty(), 1, GREEDY),
        ValueError,
        "prompt is empty",
    ),
    "prompt fills the context": (
        lambda s: s.sample(ModelInput.from_ints([1] * MAX_SEQ_LEN), 1, GREEDY),
        ValueError,
        rf"request 0: prompt has {MAX_SEQ_LEN} tokens; the sampler \(max_seq_len\) holds at "
        rf"most {MAX_SEQ_LEN} tokens \(prompt \+ completion\), so a prompt may have at most "
        rf"{MAX_SEQ_LEN - 1}",
    ),
    "prompt not a ModelInput": (
        lambda s: s.sample([1, 2], 1, GREEDY),
        TypeError,
        "prompt must be a ModelInput, got list",
    ),
    "num_samples 0": (
        lambda s: s.sample(ModelInput.from_ints([1, 2]), 0, GREEDY),
        ValueError,
        "num_samples must be >= 1, got 0",
    ),
    "num_samples not an int": (
        lambda s: s.sample(ModelInput.from_ints([1, 2]), 1.5, GREEDY),
        TypeError,
        "num_samples must be an int, got 1.5",
    ),
    "negative top-k logprobs": (
        lambda s: s.sample(ModelInput.from_ints([1, 2]), 1, GREEDY, topk_sample_logprobs=-1),
        ValueError,
        f"topk_sample_logprobs must be in 0..{VOCAB}, got -1",
    ),
    "stop token outside the vocabulary": (
        lambda s: s.sample(
            ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2, stop=[VOCAB + 3])
        ),
        ValueError,
        f"stop token id {VOCAB + 3} is outside the vocabulary",
    ),
    "params not SamplingParams": (
        lambda s: s.sample(ModelInput.from_ints([1, 2]), 1, {"max_tokens": 2}),
        TypeError,
        "params must be SamplingParams",
    ),
    "sample of an image": (
        lambda s: s.sample(WITH_IMAGE, 1, GREEDY),
        ValueError,
        r"sample: prompt\.chunks\[1\] is an image chunk",
    ),
    "logprobs of an image": (
        lambda s: s.compute_logprobs(WITH_IMAGE),
        ValueError,
        r"compute_logprobs: prompt\.chunks\[1\] is an image chunk",
    ),
    "logprobs of an image pointer": (
        lambda s: s.compute_logprobs_batch(
            [ModelInput.from_ints([1, 2]), ModelInput(chunks=(POINTER,))]
        ),
        ValueError,
        r"prompts\[1\]\.chunks\[0\] is an image chunk \(type 'image_asset_pointer'\)",
    ),
    "logprobs of an empty prompt": (
        lambda s: s.compute_logprobs(ModelInput.empty()),
        ValueError,
        "compute_logprobs: prompt is empty",
    ),
    "logprobs of one token outside the vocabulary": (
        lambda s: s.compute_logprobs(ModelInput.from_ints([VOCAB + 3])),
        ValueError,
        f"prompt token {VOCAB + 3} at position 0 is outside the vocabulary",
    ),
    "logprobs of a token outside the vocabulary": (
        lambda s: s.compute_logprobs(ModelInput.from_ints([1, VOCAB])),
        ValueError,
        f"token {VOCAB} at position 1 is outside the vocabulary",
    ),
    "logprobs longer than the context": (
        lambda s: s.compute_logprobs(ModelInput.from_ints([1] * (MAX_SEQ_LEN + 1))),
        ValueError,
        rf"has {MAX_SEQ_LEN + 1} tokens; the model \(max_seq_len\) holds at most {MAX_SEQ_LEN}",
    ),
}


@pytest.fixture(scope="module")
def sampler(client):
    return client.save_weights_and_get_sampling_client()


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_bad_sampling_calls_name_the_problem_and_keep_serving(client, sampler, case):
    call, error, message = SAMPLING_CASES[case]
    prompt = ModelInput.from_ints([1, 2, 3])
    expected = sampler.sample(prompt, 2, GREEDY).result().sequences
    before = _state(client)
    with pytest.raises(error, match=message):
        _outcome(lambda: call(sampler))
    assert sampler.sample(prompt, 2, GREEDY).result().sequences == expected
    _assert_same(before, _state(client))


def test_logprobs_of_one_token_is_none(sampler):
    assert sampler.compute_logprobs(ModelInput.from_ints([3])).result() == [None]


@pytest.mark.parametrize("name", ["", "a/b", "..", "../escape", ".hidden", "with space", None])
@pytest.mark.parametrize("verb", ["save_state", "save_weights_for_sampler"])
def test_bad_checkpoint_names_are_refused(client, verb, name):
    before = _state(client)
    with pytest.raises(ValueError, match=r"name .* is not a valid name: use 1-128 letters"):
        _outcome(lambda: getattr(client, verb)(name))
    _assert_same(before, _state(client))


def test_saving_over_a_checkpoint_needs_overwrite(client):
    before = _state(client)
    with pytest.raises(FileExistsError, match="overwrite"):
        client.save_state("kept").result()
    _assert_same(before, _state(client))


@pytest.fixture(scope="module")
def foreign(service):
    """Checkpoints of other configurations: LoRA rank 8, full fine-tuning, another vocabulary."""
    clients = {
        "rank 8": service.create_lora_training_client("tiny", rank=8, seed=1),
        "full": service.create_training_client("tiny"),
        "letters": service.create_lora_training_client("tiny:letters", rank=4, seed=1),
    }
    return {name: c.save_state("foreign").result().path for name, c in clients.items()}


@pytest.mark.parametrize(
    ("path", "error", "message"),
    [
        ("/etc/passwd", ValueError, "must look like tinker://<run>/<kind>/<name>"),
        ("tinker://{run}/weights/missing", FileNotFoundError, "no checkpoint at tinker://"),
        ("tinker://../weights/x", ValueError, "run id '..' is not a valid name"),
        ("{rank 8}", ValueError, r"saved from base model 'tiny' with LoRA \{'rank': 8"),
        ("{full}", ValueError, "saved from base model 'tiny' with full fine-tuning, but"),
        ("{letters}", ValueError, "saved from base model 'tiny:letters'"),
        (
            "tinker://{run}/sampler_weights/snap",
            ValueError,
            "is a sampler_weights checkpoint; load_state takes tinker://",
        ),
    ],
)
@pytest.mark.parametrize("with_optimizer", [False, True], ids=["weights", "with-optimizer"])
def test_loading_a_wrong_checkpoint_changes_nothing(
    client, foreign, path, error, message, with_optimizer
):
    if (
        "sampler_weights" in path
        and not (
            client.service.storage.root / client.model_id / "sampler_weights" / "snap"
        ).exists()
    ):
        client.save_weights_for_sampler("snap").result()
    path = path.format(run=client.model_id, **foreign)
    load = client.load_state_with_optimizer if with_optimizer else client.load_state
    before = _state(client)
    with pytest.raises(error, match=message):
        _outcome(lambda: load(path))
    _assert_same(before, _state(client))


def test_a_load_that_fails_midway_keeps_gradients_and_moments(client):
    """A checkpoint whose tensor files are gone passes every check before the read itself."""
    path = client.save_state("damaged").result().path
    directory = client.service.storage.directory(client.service.storage.existing(path)[0])
    for data_file in directory.glob("*.distcp"):
        data_file.unlink()
    before = _state(client)
    for load in (client.load_state, client.load_state_with_optimizer):
        with pytest.raises(FileNotFoundError, match="distcp"):
            load(path).result()
        _assert_same(before, _state(client))


def test_a_run_id_of_another_configuration_is_refused(service, client):
    run_file = service.storage.root / client.model_id / "run.json"
    saved = run_file.read_text()
    message = rf"run_id '{client.model_id}' exists already.* with full fine-tuning; choose"
    with pytest.raises(ValueError, match=message):
        service.create_training_client("tiny", run_id=client.model_id)
    assert run_file.read_text() == saved
    # The same configuration may continue the run (e.g. a new process resuming it).
    again = service.create_lora_training_client("tiny", rank=4, seed=1, run_id=client.model_id)
    assert again.model_id == client.model_id and run_file.read_text() == saved


def test_checkpoints_of_the_wrong_kind_are_named(service, client):
    weights = f"tinker://{client.model_id}/weights/kept"
    with pytest.raises(ValueError, match="is a training-state checkpoint; sampling clients load"):
        service.create_sampling_client(model_path=weights)
    sampler_path = client.save_weights_for_sampler("kind-check").result().path
    with pytest.raises(ValueError, match="is a sampler_weights checkpoint"):
        service.create_training_client_from_state(sampler_path)
    with pytest.raises(ValueError, match=r"LoraConfig.rank must be an int >= 1, got 0"):
        service.create_lora_training_client("tiny", rank=0)


def test_token_ids_must_be_ints():
    assert ModelInput.from_ints([1, torch.tensor(2)]).to_ints() == [1, 2]
    with pytest.raises(TypeError, match=r"token ids must be ints, got 1\.5"):
        ModelInput.from_ints([1, 1.5])
    with pytest.raises(TypeError, match=r"token ids must be ints, got True"):
        ModelInput.from_ints([1, True])


def test_model_input_chunks_are_chunks():
    with pytest.raises(TypeError, match=r"ModelInput.chunks\[0\] must be an EncodedTextChunk, "):
        ModelInput(chunks=([1, 2],))
    assert WITH_IMAGE.length == 5  # an image counts its expected tokens, as Tinker's does
