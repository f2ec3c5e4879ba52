"""Checkpoints survive a restart; bad requests are 4xx with a JSON body and change nothing."""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.server.conftest import API_KEY, start_server
from tests.server.test_sdk import datum


@pytest.fixture(scope="module")
def client(server, model_dir):
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    yield service, training
    service.close("success").result()


def post(server, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": API_KEY, **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def assert_user_error(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["category"] == "user"
    return body["detail"]


def fwdbwd_body(model_id: str, tokens: list[int], targets: list[int]) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1000, loss_fn="cross_entropy")
    item = message.data.add()
    item.model_input.add().encoded_text.tokens = bytes(
        b"".join(t.to_bytes(4, "little", signed=True) for t in tokens)
    )
    target = item.loss_fn_inputs["target_tokens"]
    target.dtype = pb.DTYPE_INT64
    target.shape.append(len(targets))
    target.dense = b"".join(t.to_bytes(8, "little", signed=True) for t in targets)
    weights = item.loss_fn_inputs["weights"]  # complete, so the tokens are what is wrong
    weights.dtype = pb.DTYPE_FLOAT32
    weights.shape.append(len(targets))
    weights.dense = np.ones(len(targets), dtype=np.float32).tobytes()
    return message.SerializeToString()


def test_bad_requests_are_4xx_and_change_nothing(server, client):
    _, training = client
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer, "12=3")]
    before = training.forward(data, "cross_entropy").result()

    protobuf = {"Content-Type": "application/x-protobuf"}
    assert "protobuf" in assert_user_error(
        post(server, "forward_backward", content=b"\xff\x00garbage", headers=protobuf)
    )
    assert "malformed" in assert_user_error(
        post(server, "optim_step", content=b"{not json", headers={"Content-Type": "x/json"})
    )
    assert "unknown model" in assert_user_error(
        post(server, "get_info", json={"model_id": "nope:train:0"}), status=404
    )
    vocab = len(tokenizer.get_vocab())
    out_of_vocab = fwdbwd_body(training.model_id, [1, vocab + 5], [1, 2])
    assert "outside the vocabulary" in assert_user_error(
        post(server, "forward_backward", content=out_of_vocab, headers=protobuf)
    )
    assert "unknown or expired request" in assert_user_error(
        post(server, "retrieve_future", json={"request_id": "req-missing"}), status=404
    )
    # The plain routes (asample, retrieve_future) reject malformed bodies the same way.
    assert "malformed" in assert_user_error(post(server, "asample", content=b"{not json"))
    assert "request_id" in assert_user_error(post(server, "retrieve_future", json={}))

    # Through the SDK: bad loss inputs and unknown losses raise at once.
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError, match="shape"):
        training.forward_backward([short], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        training.forward_backward(data, "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn"):
        training.forward_backward(data, "not_a_loss").result()
    with pytest.raises(tinker.BadRequestError, match="not a valid name"):
        training.save_state("../../escape").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="vocabulary"):
        sampler.sample(
            types.ModelInput.from_ints([vocab + 1]), 1, types.SamplingParams(max_tokens=2)
        ).result()

    after = training.forward(data, "cross_entropy").result()
    assert after.metrics == before.metrics
    # No rejected call left a gradient behind: the next step has nothing to apply.
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm:mean"] == 0.0
    assert training.forward(data, "cross_entropy").result().metrics == before.metrics


def test_paths_cannot_escape_storage(server):
    headers = {"X-API-Key": API_KEY}
    # Encoded, so the client sends the dots as they are (a bare `..` is resolved by httpx
    # itself: `training_runs/../checkpoints` is the listing of every checkpoint).
    for run_id in ("%2E%2E", "a%2F..%2F..", "a%2F%2E%2E"):
        response = httpx.get(
            f"{server.base_url}/api/v1/training_runs/{run_id}/checkpoints", headers=headers
        )
        assert response.status_code in (400, 404), response.text
        assert response.json()["category"] == "user"
    response = httpx.request(
        "DELETE",
        f"{server.base_url}/api/v1/training_runs/run/checkpoints/weights/..%2F..%2Fx",
        headers=headers,
    )
    assert response.status_code in (400, 404)
    weights_info = post(server, "weights_info", json={"tinker_path": "tinker://../weights/x"})
    assert_user_error(weights_info)
    assert not list(server.storage.parent.rglob("x"))


def test_checkpoints_load_after_a_restart(model_dir, tmp_path):
    storage = tmp_path / "storage"
    first = start_server(model_dir, storage, tmp_path / "first.log")
    try:
        service = first.service()
        training = service.create_lora_training_client(str(model_dir), rank=4, seed=5).result()
        tokenizer = training.get_tokenizer()
        data = [datum(tokenizer, "12=3")]
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        expected = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        state = training.save_state("before-restart").result().path
        sampler_path = training.save_weights_for_sampler("before-restart").result().path
        prompt = types.ModelInput.from_ints(tokenizer.encode("12="))
        greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
        sampler = training.save_weights_and_get_sampling_client().result()
        expected_tokens = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
        service.close("success").result()
    finally:
        first.stop(signal.SIGINT)  # a Ctrl-C
    # uvicorn re-raises the signal after its clean shutdown: the command stops quietly.
    assert first.process.returncode == 0, first.log.read_text()
    assert "Traceback" not in first.log.read_text()

    second = start_server(model_dir, storage, tmp_path / "second.log")
    try:
        service = second.service()
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == expected
        sampler = service.create_sampling_client(model_path=sampler_path).result()
        assert sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == expected_tokens
        run = second.rest().get_training_run_by_tinker_path(state).result()
        assert run.last_checkpoint.tinker_path == state
        service.close("success").result()
    finally:
        second.stop()
    assert second.process.returncode == 0, second.log.read_text()


def test_non_loopback_needs_an_api_key_and_full_fine_tuning(model_dir, tmp_path):
    with pytest.raises(RuntimeError, match="requires --key-file FILE"):
        start_server(model_dir, tmp_path / "s", tmp_path / "nokey.log", host="0.0.0.0")
    empty = tmp_path / "keys.json"
    empty.write_text('{"users": []}')
    with pytest.raises(RuntimeError, match=f"--key-file {empty} holds no users"):
        start_server(
            model_dir,
            tmp_path / "s",
            tmp_path / "empty.log",
            "--key-file",
            str(empty),
            host="0.0.0.0",
        )
    guarded = start_server(
        model_dir,
        tmp_path / "s",
        tmp_path / "key.log",
        "--api-key",
        API_KEY,
        "--fine-tuning",
        "full",
        host="0.0.0.0",
    )
    try:
        wrong = httpx.post(
            f"{guarded.base_url}/api/v1/client/config", headers={"X-API-Key": "tml-wrong-key-99"}
        )
        assert wrong.status_code == 401 and wrong.json()["category"] == "user"
        missing = httpx.get(f"{guarded.base_url}/api/v1/training_runs")
        assert missing.status_code == 401
        assert httpx.get(f"{guarded.base_url}/api/v1/healthz").is_success  # probes need no key
        for page in ("openapi.json", "docs", "redoc"):  # FastAPI's schema pages are off
            assert httpx.get(f"{guarded.base_url}/{page}").status_code == 404
        for path in ("asample", "retrieve_future"):  # plain routes check the key themselves
            lean = httpx.post(f"{guarded.base_url}/api/v1/{path}", json={"request_id": "x"})
            assert lean.status_code == 401 and lean.json()["category"] == "user"
        with pytest.raises(tinker.AuthenticationError):
            guarded.service("tml-wrong-key-99").create_lora_training_client(
                str(model_dir), rank=4
            ).result()
        service = guarded.service()
        training = service.create_lora_training_client(str(model_dir), rank=4).result()
        assert training.get_info().is_lora is False
        data = [datum(training.get_tokenizer(), "12=3")]
        before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] < before
        service.close("success").result()
    finally:
        guarded.stop()
