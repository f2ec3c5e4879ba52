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

from temper.server import wire
from temper.server.data_bodies import OFF_LOOP_BYTES, read_forward_backward
from temper.server.errors import BadRequest


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
