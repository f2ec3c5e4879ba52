"""forward_backward bodies read chunk by chunk and decoded (off the event loop when big)
give the call a whole-body decode gives, with or without Content-Length or compression."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from temper.api.types import TensorData
from temper.server.http.errors import BadRequest
from temper.server.wire import codec as wire
from temper.server.wire.data_bodies import OFF_LOOP_BYTES, read_forward_backward


async def decoded(request: Request) -> PlainTextResponse:
    call = await read_forward_backward(request)
    tokens = sum(len(datum.model_input.to_ints()) for datum in call.data)
    return PlainTextResponse(f"{call.model_id} {len(call.data)} {tokens}")


def body(num_datums: int, tokens_per_datum: int) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m:train:0", loss_fn="cross_entropy")
    tokens = np.arange(tokens_per_datum, dtype=np.int32).tobytes()
    for _ in range(num_datums):
        message.data.add().model_input.add().encoded_text.tokens = tokens
    return message.SerializeToString()


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = Starlette(routes=[Route("/api/v1/forward_backward", decoded, methods=["POST"])])
    return TestClient(app)


@pytest.mark.parametrize("num_datums", [3, 400])  # 400 x 4 KB: decoded on a worker thread
def test_read_bodies_decode_like_whole_ones(client, num_datums):
    content = body(num_datums, 1000)
    assert (len(content) > OFF_LOOP_BYTES) == (num_datums == 400)
    call = wire.decode_forward_backward(content, content_encoding=None)
    expected = f"m:train:0 {len(call.data)} {1000 * num_datums}"
    url = "/api/v1/forward_backward"
    assert client.post(url, content=content).text == expected
    chunks = [content[start : start + 70_000] for start in range(0, len(content), 70_000)]
    assert client.post(url, content=iter(chunks)).text == expected  # no Content-Length
    compressed = zstandard.ZstdCompressor().compress(content)
    assert client.post(url, content=compressed, headers={"Content-Encoding": "zstd"}).text == (
        expected
    )


def test_a_bad_big_body_is_a_bad_request(client):
    with pytest.raises(BadRequest, match=r"not a tinker_public\.ForwardBackwardRequest"):
        client.post("/api/v1/forward_backward", content=body(400, 1000) + b"\xff\xff")
    with pytest.raises(BadRequest, match=f"more than {wire.MAX_DATUMS} datums"):
        client.post("/api/v1/forward_backward", content=body(wire.MAX_DATUMS + 1, 1))


def datum_body(*, tokens: bytes, dtype: int, dense: bytes, shape: list[int]) -> bytes:
    message = pb.ForwardBackwardRequest(model_id="m:train:0", loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = tokens
    tensor = datum.loss_fn_inputs["weights"]
    tensor.dtype, tensor.dense = dtype, dense
    tensor.shape.extend(shape)
    return message.SerializeToString()


def test_loss_inputs_decode_to_their_exact_values():
    tokens = np.array([3, 1, 2], dtype=np.int32)
    weights = np.array([0.1, -2.5e-8, 3.0], dtype=np.float32)
    content = datum_body(
        tokens=tokens.tobytes(), dtype=pb.DTYPE_FLOAT32, dense=weights.tobytes(), shape=[3]
    )
    (datum,) = wire.decode_forward_backward(content, content_encoding=None).data
    assert datum.model_input.to_ints() == [3, 1, 2]
    decoded = datum.loss_fn_inputs["weights"]
    assert (decoded.dtype, decoded.shape) == ("float32", (3,))
    assert np.array_equal(np.asarray(decoded.data, dtype=np.float32), weights)
    no_shape = datum_body(tokens=tokens.tobytes(), dtype=pb.DTYPE_INT32, dense=b"\0" * 12, shape=[])
    (datum,) = wire.decode_forward_backward(no_shape, content_encoding=None).data
    assert datum.loss_fn_inputs["weights"] == TensorData(data=[0, 0, 0], dtype="int64", shape=(3,))


@pytest.mark.parametrize(
    ("tokens", "dense", "shape", "message"),
    [
        (b"\0" * 5, b"\0" * 12, [3], r"datum 0 tokens: 5 bytes is not a whole number of"),
        (b"\0" * 12, b"\0" * 10, [3], r"datum 0: loss_fn_inputs\['weights'\]: 10 bytes is not"),
        (b"\0" * 12, b"\0" * 12, [2], r"datum 0: loss_fn_inputs\['weights'\]: 3 values do not"),
    ],
)
def test_bad_loss_inputs_name_the_datum_and_field(tokens, dense, shape, message):
    content = datum_body(tokens=tokens, dtype=pb.DTYPE_FLOAT32, dense=dense, shape=shape)
    with pytest.raises(BadRequest, match=message):
        wire.decode_forward_backward(content, content_encoding=None)
