"""Bad requests to `temper serve` (raw HTTP and the tinker SDK): a 4xx with a JSON body that
names the field and what is valid (never a 5xx for the user's mistake), and nothing changes:
a model that took the bad requests trains on bitwise like its twin that did not, its
checkpoints are byte for byte as they were, and the server keeps serving."""

from __future__ import annotations

import hashlib

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from temper.job.memory_plan import model_config
from temper.sampler.engine import SamplerEngine
from temper.server.http.errors import BadRequest
from temper.server.wire import codec as wire
from tests.server.conftest import API_KEY
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=1e-2)


def post(server, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": API_KEY, **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def assert_user_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["category"] == "user", body
    assert message in body["detail"], body["detail"]


def tensor(values, dtype=pb.DTYPE_FLOAT32, shape=None) -> pb.Tensor:
    array = np.asarray(values, dtype=np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64)
    message = pb.Tensor(dtype=dtype, dense=array.tobytes())
    message.shape.extend(array.shape if shape is None else shape)
    return message


def sparse(shape, *, crow, col, values) -> pb.Tensor:
    message = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
    message.shape.extend(shape)
    message.sparse_csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
    message.sparse_csr.col_indices = np.asarray(col, dtype=np.int64).tobytes()
    message.sparse_csr.values = np.asarray(values, dtype=np.float32).tobytes()
    return message


def fwdbwd(model_id, tokens, inputs=None, *, loss_fn="cross_entropy", config=None) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=10_000, loss_fn=loss_fn)
    for key, value in (config or {}).items():
        message.loss_fn_config[key] = value
    item = message.data.add()
    item.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    n = len(tokens)
    if inputs is None:
        inputs = {"target_tokens": tensor([1] * n, pb.DTYPE_INT64), "weights": tensor([1.0] * n)}
    for name, value in inputs.items():
        item.loss_fn_inputs[name].CopyFrom(value)
    return message.SerializeToString()


PROTOBUF = {"Content-Type": "application/x-protobuf"}


def with_image(model_id: str, *, forward_only: bool) -> bytes:
    """A forward(_backward) body whose datum holds text, an image, text."""
    message = pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=10_000, loss_fn="cross_entropy", forward_only=forward_only
    )
    item = message.data.add()
    item.model_input.add().encoded_text.tokens = np.asarray([1, 2], dtype=np.int32).tobytes()
    item.model_input.add().image.data = b"\x89PNG"
    item.model_input.add().encoded_text.tokens = np.asarray([3], dtype=np.int32).tobytes()
    item.loss_fn_inputs["target_tokens"].CopyFrom(tensor([1] * 3, pb.DTYPE_INT64))
    return message.SerializeToString()


IMAGE_REFUSED = (
    "datum 0: model_input.chunks[1] is an image chunk (type 'image'): image and audio inputs "
    "are not supported"
)


def bad_training_requests(model_id: str, vocab: int, max_seq_len: int):
    """(name, route, request kwargs, status, message) for one training model."""
    targets = tensor([2, 3, 4], pb.DTYPE_INT64)

    def body(tokens, inputs=None, **kwargs):
        return {"content": fwdbwd(model_id, tokens, inputs, **kwargs), "headers": PROTOBUF}

    def adam(**params):
        return {"json": {"model_id": model_id, "adam_params": params, "type": "optim_step"}}

    return [
        ("an image chunk", "forward_backward",
         {"content": with_image(model_id, forward_only=False), "headers": PROTOBUF}, 400,
         IMAGE_REFUSED),
        ("an image chunk to forward", "forward_backward",
         {"content": with_image(model_id, forward_only=True), "headers": PROTOBUF}, 400,
         IMAGE_REFUSED),
        ("JSON to a protobuf route", "forward_backward", {"json": {"model_id": model_id}}, 400,
         "is not a tinker_public.ForwardBackwardRequest protobuf"),
        ("zstd that is not zstd", "forward_backward",
         {"content": b"\x28\xb5\x2f\xfdgarbage", "headers": {"Content-Encoding": "zstd"}}, 400,
         "not valid zstd"),
        ("sparse tensor of a huge shape", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets,
                          "weights": sparse([3, 10**12], crow=[0, 0, 0, 1], col=[5], values=[1])}),
         400, "sparse CSR tensor of shape [3, 1000000000000]"),
        ("target outside the vocabulary", "forward_backward",
         body([1, 2, 3], {"target_tokens": tensor([2, 3, vocab], pb.DTYPE_INT64),
                          "weights": tensor([1.0] * 3)}),
         400, f"token {vocab} at position 2 is outside the vocabulary; valid ids are 0.."),
        ("nan weight", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "weights": tensor([1.0, np.nan, 1.0])}), 400,
         "loss_fn_inputs['weights'] has a non-finite value (nan) at position 1"),
        ("unsupported dtype", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "weights": pb.Tensor(dtype=99)}), 400,
         "unsupported dtype 99; use float32 or int64"),
        ("weights of the wrong length", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "weights": tensor([1.0, 1.0])}), 400,
         "loss_fn_inputs['weights'] has shape [2], but model_input has 3 tokens"),
        ("longer than the context", "forward_backward", body([1] * (max_seq_len + 1)), 400,
         f"more than the model's max_seq_len {max_seq_len}"),
        ("top-K weights of another shape than the targets", "forward_backward",
         body([1, 2, 3], {"target_tokens": tensor([[2, 5], [3, 6], [4, 7]], pb.DTYPE_INT64),
                          "weights": tensor([[1.0, 0.0, 0.0]] * 3)}),
         400, "datum 0: loss_fn_inputs['weights'] has shape [3, 3] but "
              "loss_fn_inputs['target_tokens'] has shape [3, 2]"),
        ("sparse top-K weights of another shape", "forward_backward",
         body([1, 2, 3], {"target_tokens": tensor([[2, 5], [3, 6], [4, 7]], pb.DTYPE_INT64),
                          "weights": sparse([3, 4], crow=[0, 1, 1, 1], col=[3], values=[1])}),
         400, "loss_fn_inputs['weights'] has shape [3, 4] but"),
        ("top-K target outside the vocabulary", "forward_backward",
         body([1, 2, 3], {"target_tokens": tensor([[2, 5], [3, vocab], [4, 7]], pb.DTYPE_INT64)}),
         400, f"token {vocab} at position [1, 1] is outside the vocabulary"),
        ("top-K targets for a loss that scores one per token", "forward_backward",
         body([1, 2, 3], {"target_tokens": tensor([[2, 5], [3, 6], [4, 7]], pb.DTYPE_INT64),
                          "logprobs": tensor([0.0] * 3), "advantages": tensor([1.0] * 3)},
              loss_fn="gspo"),
         400, "loss_fn_inputs['target_tokens'] has shape [3, 2], but model_input has 3 tokens; "
              "expected [3]"),
        ("config key gspo does not take", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "logprobs": tensor([0.0] * 3),
                          "advantages": tensor([1.0] * 3)}, loss_fn="gspo", config={"beta": 0.1}),
         400, "loss_fn_config key 'beta' is not accepted by loss 'gspo'; valid keys: "
              "clip_low_threshold, clip_high_threshold"),
        ("gspo without advantages", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "logprobs": tensor([0.0] * 3)},
              loss_fn="gspo"),
         400, "datum 0: loss_fn_inputs is missing ['advantages']"),
        ("misspelled required input", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "logprobs": tensor([0.0] * 3),
                          "advantage": tensor([1.0] * 3)}, loss_fn="importance_sampling"),
         400, "datum 0: loss_fn_inputs is missing ['advantages'] (did you write 'advantage' "
              "for 'advantages'?)"),
        ("misspelled input name", "forward_backward",
         body([1, 2, 3], {"target_tokens": targets, "weight": tensor([1.0] * 3)}), 400,
         "datum 0: loss_fn_inputs['weight'] is not an input of this loss; did you mean "
         "'weights'?"),
        ("unknown loss", "forward_backward", body([1, 2, 3], loss_fn="sft"), 400,
         "unknown loss_fn 'sft'"),
        ("config key the loss does not take", "forward_backward",
         body([1, 2, 3], config={"beta": 0.1}), 400,
         "loss_fn_config key 'beta' is not accepted by loss 'cross_entropy'"),
        ("no datums", "forward_backward",
         {"content": pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
          .SerializeToString(), "headers": PROTOBUF}, 400, "data is empty"),
        ("negative learning rate", "optim_step", adam(learning_rate=-1.0), 400,
         "AdamParams.learning_rate must be >= 0, got -1.0"),
        ("beta1 of 1", "optim_step", adam(learning_rate=1e-3, beta1=1.0), 400,
         "AdamParams.beta1 must be in [0, 1), got 1.0"),
        ("eps of 0", "optim_step", adam(learning_rate=1e-3, eps=0.0), 400,
         "AdamParams.eps must be > 0"),
        ("learning rate not a number", "optim_step", adam(learning_rate="fast"), 400,
         "learning_rate: Input should be a valid number"),
        ("nan learning rate", "optim_step",
         {"content": b'{"model_id": "%s", "adam_params": {"learning_rate": NaN}}'
          % model_id.encode(), "headers": {"Content-Type": "application/json"}}, 400,
         "AdamParams.learning_rate must be >= 0, got nan"),
        ("no optimizer params", "optim_step", {"json": {"model_id": model_id}}, 400,
         "optim_params: Field required"),
        ("a JSON array", "optim_step", {"json": [1, 2]}, 400, "malformed request"),
        ("not UTF-8", "optim_step",
         {"content": b"\xff\xfe", "headers": {"Content-Type": "application/json"}}, 400,
         "malformed request"),
        ("checkpoint name with '..'", "save_weights",
         {"json": {"model_id": model_id, "path": "../escape"}}, 400,
         "checkpoint name '../escape' is not a valid name"),
        ("empty checkpoint name", "save_weights", {"json": {"model_id": model_id, "path": ""}},
         400, "checkpoint name '' is not a valid name"),
        ("existing checkpoint", "save_weights", {"json": {"model_id": model_id, "path": "kept"}},
         400, "exists already; pass overwrite=True"),
        ("ttl under an hour", "save_weights",
         {"json": {"model_id": model_id, "path": "ttl", "ttl_seconds": 60}}, 400,
         "ttl_seconds must be in 3600..315360000 (1 hour to 10 years) or null"),
        ("ttl over ten years", "save_weights_for_sampler",
         {"json": {"model_id": model_id, "path": "ttl", "ttl_seconds": 10**10}}, 400,
         "ttl_seconds must be in 3600..315360000"),
        ("ttl not a number", "save_weights",
         {"json": {"model_id": model_id, "path": "ttl", "ttl_seconds": "soon"}}, 400,
         "ttl_seconds: Input should be a valid integer"),
        ("sampler checkpoint name with '/'", "save_weights_for_sampler",
         {"json": {"model_id": model_id, "path": "a/b"}}, 400,
         "checkpoint name 'a/b' is not a valid name"),
        ("load of a missing checkpoint", "load_weights",
         {"json": {"model_id": model_id, "path": f"tinker://{model_id}/weights/missing",
                   "optimizer": True}}, 404, "no checkpoint at"),
        ("load of a local path", "load_weights",
         {"json": {"model_id": model_id, "path": "/etc/passwd", "optimizer": False}}, 400,
         "must look like tinker://<run>/<kind>/<name>"),
        ("unknown model", "optim_step",
         {"json": {"model_id": "sess-nope:train:0", "adam_params": {"learning_rate": 1e-3}}},
         404, "unknown model id 'sess-nope:train:0'"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def twins(server, model_dir):
    """Two models created alike; only the first gets the bad requests."""
    service = server.service()
    pair = [
        service.create_lora_training_client(str(model_dir), rank=4, seed=7).result()
        for _ in range(2)
    ]
    yield service, pair
    service.close("success").result()


def checkpoint_digest(server, model_id: str) -> dict[str, str]:
    root = server.storage / model_id
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != "run.json"
    }


@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_rejected_requests_change_nothing(server, model_dir, twins):
    service, (hit, twin) = twins
    tokenizer = hit.get_tokenizer()
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    for model in (hit, twin):  # moments, a checkpoint, and gradients waiting for a step
        model.forward_backward(data, "cross_entropy")
        model.optim_step(ADAM).result()
        model.save_state("kept").result()
        model.forward_backward(data, "cross_entropy").result()
    saved = checkpoint_digest(server, hit.model_id)
    other_rank = service.create_lora_training_client(str(model_dir), rank=8, seed=7).result()
    other_rank_path = other_rank.save_state("rank8").result().path

    vocab = len(tokenizer.get_vocab())
    for name, route, kwargs, status, message in bad_training_requests(hit.model_id, vocab, 2048):
        response = post(server, route, **kwargs)
        assert response.status_code < 500, (name, response.text)
        assert_user_error(response, status, message)
    # Found once queued, by the backend: the future fails as the user's error.
    with pytest.raises(tinker.RequestFailedError, match="saved from base model") as failed:
        hit.load_state_with_optimizer(other_rank_path).result()
    assert failed.value.category.name == "User"

    assert checkpoint_digest(server, hit.model_id) == saved
    steps = [model.optim_step(ADAM).result().metrics for model in (hit, twin)]
    assert steps[0] == steps[1]  # the same pending gradients, the same moments
    outputs = [model.forward(data, "cross_entropy").result() for model in (hit, twin)]
    assert outputs[0].metrics == outputs[1].metrics
    for a, b in zip(outputs[0].loss_fn_outputs, outputs[1].loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == b["logprobs"].tolist()


IMAGE_POINTER = {"type": "image_asset_pointer", "format": "jpeg", "location": "/images/cat.jpeg"}


def sample_body(session_id, tokens=(1, 2), *, params=None, chunks=None, **fields) -> dict:
    text = [{"type": "encoded_text", "tokens": list(tokens)}]
    return {
        "sampling_session_id": session_id,
        "prompt": {"chunks": text if chunks is None else chunks},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 3, "temperature": 0.0, **(params or {})},
        "type": "sample",
        **fields,
    }


def test_bad_sample_requests_are_4xx_and_the_sampler_keeps_serving(server, model_dir, twins):
    _, (_, twin) = twins
    sampler = twin.save_weights_and_get_sampling_client().result()
    session = raw_sampling_session(server, model_dir)
    vocab = len(twin.get_tokenizer().get_vocab())
    prompt = types.ModelInput.from_ints([1, 2])
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    expected = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    cases = [
        (sample_body(session, num_samples=0), 400, "num_samples must be in 1..4096, got 0"),
        (sample_body(session, num_samples=10**6), 400, "num_samples must be in 1..4096"),
        (sample_body(session, ()), 400, "prompt is empty"),
        (sample_body(session, (1, vocab)), 400, f"prompt token {vocab} at position 1 is outside"),
        (sample_body(session, (-1,)), 400, "prompt token -1 at position 0 is outside"),
        (sample_body(session, params={"max_tokens": 0}), 400, "max_tokens must be > 0"),
        (sample_body(session, params={"temperature": -1}), 400, "temperature must be a finite"),
        (sample_body(session, params={"top_p": 0}), 400, "top_p must be in (0, 1]"),
        (sample_body(session, params={"top_k": -5}), 400, "top_k must be an int >= 1, or -1/0"),
        (sample_body(session, params={"top_k": 2**63}), 400, "top_k must be at most 2**63 - 1"),
        (sample_body(session, params={"stop": ""}), 400, "stop must not be the empty string"),
        (
            sample_body(session, params={"stop": [vocab + 3]}),
            400,
            f"stop token ids [{vocab + 3}] are outside the vocabulary",
        ),
        (
            sample_body(session, topk_sample_logprobs=-1),
            400,
            f"topk_sample_logprobs must be in 0..{vocab}, got -1",
        ),
        (
            sample_body(session, prompt_logprobs=True, topk_prompt_logprobs=vocab + 1),
            400,
            f"topk_prompt_logprobs must be in 0..{vocab}, got {vocab + 1}",
        ),
        (
            sample_body(session, chunks=[{"type": "image", "data": "iVBO", "format": "png"}]),
            400,
            "prompt.chunks[0] is an image chunk (type 'image'): image and audio inputs are not",
        ),
        (
            sample_body(session, chunks=[IMAGE_POINTER], prompt_logprobs=True),
            400,
            "prompt.chunks[0] is an image chunk (type 'image_asset_pointer')",
        ),
        (sample_body("samp-unknown"), 404, "unknown sampling session 'samp-unknown'"),
        (sample_body(None), 400, "asample needs a sampling_session_id"),
    ]
    for body, status, message in cases:
        assert_user_error(post(server, "asample", json=body), status, message)
    assert post(server, "asample", json=sample_body(session)).status_code == 200
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, stop=[vocab])).result()
    # A prompt that fills the sampler: the error names the verb the SDK user called.
    limit = min(SamplerEngine.Config().max_seq_len, model_config(str(model_dir)).max_seq_len)
    too_long = types.ModelInput.from_ints([1] * limit)
    wording = (
        f"prompt has {limit} tokens; the sampler holds at most {limit} tokens (prompt + "
        f"completion), so a prompt may have at most {limit - 1}"
    )
    with pytest.raises(tinker.BadRequestError) as refused:
        sampler.compute_logprobs(too_long).result()
    assert f"compute_logprobs: {wording}" in str(refused.value)
    with pytest.raises(tinker.BadRequestError) as refused:
        sampler.sample(too_long, 1, greedy).result()
    assert f"sample: {wording}" in str(refused.value)
    assert sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == expected


def raw_session(server) -> str:
    body = {"tags": [], "user_metadata": None, "sdk_version": "test", "type": "create_session"}
    return post(server, "create_session", json=body).json()["session_id"]


def raw_sampling_session(server, model_dir, *, session_id: str | None = None) -> str:
    """A sampling session on the base model, made over raw HTTP (in a new session if none)."""
    body = {
        "session_id": session_id or raw_session(server),
        "sampling_session_seq_id": 0,
        "base_model": str(model_dir),
    }
    return post(server, "create_sampling_session", json=body).json()["sampling_session_id"]


def create_model_body(session_id: str, model_dir, seq_id: int, **lora) -> dict:
    return {
        "session_id": session_id,
        "model_seq_id": seq_id,
        "base_model": str(model_dir),
        "user_metadata": None,
        "lora_config": {"rank": 4, **lora},
        "type": "create_model",
    }


def test_bad_lora_configs_are_refused_before_anything_is_queued(server, model_dir):
    session = raw_session(server)
    cases = [
        ({"rank": 0}, "LoraConfig.rank must be an int >= 1, got 0"),
        ({"rank": -4}, "LoraConfig.rank must be an int >= 1, got -4"),
        ({"seed": 2**64}, "LoraConfig.seed must be in [-2**63, 2**64)"),
        (
            {"train_attn": False, "train_mlp": False, "train_unembed": False},
            "at least one of train_attn, train_mlp, train_unembed must be True",
        ),
    ]
    for seq_id, (lora, message) in enumerate(cases):
        body = create_model_body(session, model_dir, seq_id, **lora)
        assert_user_error(post(server, "create_model", json=body), 400, message)
        assert not (server.storage / f"{session}:train:{seq_id}").exists()
    post(server, f"sessions/{session}/finish")


def test_requests_after_the_session_closed_are_410_saying_so(server, model_dir):
    session = raw_session(server)
    created = post(server, "create_model", json=create_model_body(session, model_dir, 0))
    model_id = created.json()["model_id"]
    sampling = raw_sampling_session(server, model_dir, session_id=session)
    assert post(server, f"sessions/{session}/finish").status_code == 204

    adam = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
    finished = f"session {session} was finished by its client"
    assert_user_error(post(server, "optim_step", json=adam), 410, finished)
    assert_user_error(
        post(server, "forward_backward", content=fwdbwd(model_id, [1, 2, 3]), headers=PROTOBUF),
        410,
        f"model id {model_id!r} is gone: {finished}",
    )
    assert_user_error(post(server, "get_info", json={"model_id": model_id}), 410, finished)
    assert_user_error(
        post(server, "asample", json=sample_body(sampling)),
        410,
        f"sampling session {sampling!r} is gone: {finished}",
    )
    assert_user_error(
        post(server, "create_model", json=create_model_body(session, model_dir, 1)),
        410,
        f"session {session!r} is gone: {finished}",
    )
    heartbeat = post(server, "session_heartbeat", json={"session_id": session})
    assert heartbeat.status_code == 410 and heartbeat.json()["category"] == "user"
    assert post(server, f"sessions/{session}/finish").status_code == 204  # twice is fine
    never = "sess-0000000000000000"
    assert_user_error(post(server, f"sessions/{never}/finish"), 404, "unknown session")
    assert httpx.get(f"{server.base_url}/api/v1/healthz", headers={"X-API-Key": API_KEY}).is_success


def test_a_zstd_body_that_expands_past_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(wire, "MAX_BODY_BYTES", 1 << 20)
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (2 << 20))
    assert len(bomb) < 1000
    with pytest.raises(BadRequest, match=f"decompresses to more than {1 << 20} bytes"):
        wire.decode_forward_backward(bomb, content_encoding="zstd")
    small = fwdbwd("m:train:0", [1, 2, 3])
    compressed = zstandard.ZstdCompressor().compress(small)
    assert wire.decode_forward_backward(compressed, content_encoding="zstd").model_id == "m:train:0"
