"""Bounded requests: bodies over their route's limit are 413 (before they are read, where
Content-Length says so), no error echoes more than about 1 KB of what was sent, list limits
are 400s naming the field, and a huge bad request does not hold up other clients."""

from __future__ import annotations

import concurrent.futures
import functools
import http.client
import json
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from temper.server.http.body_limits import MAX_JSON_ITEMS, BodyLimits
from temper.server.http.errors import BadRequest, error_body
from temper.server.routes.validation import MAX_LABEL_CHARS, check_tags, check_user_metadata
from tests.server.conftest import API_KEY
from tests.server.test_bad_input import PROTOBUF, post, raw_sampling_session, sample_body

MAX_ANSWER_BYTES = 1200
JSON = {"Content-Type": "application/json"}


def compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def post_compact(server, path: str, body: dict) -> httpx.Response:
    """`body` as JSON without spaces: the most items for its bytes."""
    return post(server, path, content=compact(body), headers=JSON)


def session_body(**fields) -> dict:
    return {"tags": [], "user_metadata": None, "sdk_version": "test", **fields}


def small_datums(num_bytes: int, *, tail: bytes = b"") -> bytes:
    """A forward_backward body of about `num_bytes` of one-token datums, then `tail`."""
    head = pb.ForwardBackwardRequest(model_id="m:train:0", loss_fn="cross_entropy")
    one = pb.ForwardBackwardRequest()
    one.data.add().model_input.add().encoded_text.tokens = bytes(4)
    datum = one.SerializeToString()
    return head.SerializeToString() + datum * (num_bytes // len(datum)) + tail


def assert_small_user_error(response: httpx.Response, status: int, *messages: str) -> str:
    assert response.status_code == status, response.text[:2000]
    assert len(response.content) <= MAX_ANSWER_BYTES, len(response.content)
    body = response.json()
    assert body["category"] == "user", body
    for message in messages:
        assert message in body["detail"], body["detail"]
    return body["detail"]


def head_only(server, path: str, content_length: int) -> httpx.Response:
    """POST `path` declaring `content_length` bytes and sending none of them."""
    url = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        connection.putrequest("POST", f"/api/v1/{path}")
        connection.putheader("Content-Length", str(content_length))
        connection.putheader("X-API-Key", API_KEY)
        connection.endheaders()
        answer = connection.getresponse()
        return httpx.Response(answer.status, headers=answer.getheaders(), content=answer.read())
    finally:
        connection.close()


def test_declared_bodies_over_the_limit_are_413_before_any_is_sent(server):
    data = head_only(server, "forward_backward", 300 << 20)
    assert_small_user_error(
        data,
        413,
        "/api/v1/forward_backward: request body of 314572800 bytes",
        "limit of 256 MiB",
        "--max-body-mb",
    )
    assert data.headers["x-should-retry"] == "false"
    other = head_only(server, "create_session", 2 << 20)
    assert_small_user_error(other, 413, "limit of 1 MiB for routes other than asample")
    # A client that sends the whole body anyway reads the 413, and its connection stays usable.
    headers = {**JSON, "X-API-Key": API_KEY}
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=headers, timeout=30) as client:
        assert client.post("/create_session", content=b" " * (2 << 20)).status_code == 413
        assert client.post("/create_session", content=compact(session_body())).is_success


def test_chunked_bodies_over_the_limit_are_413(server):
    chunks = (b" " * (1 << 16) for _ in range(40))  # 2.5 MiB, no Content-Length
    response = post(server, "create_session", content=chunks)
    assert_small_user_error(response, 413, "/api/v1/create_session", "limit of 1 MiB")
    assert response.headers["x-should-retry"] == "false"


def test_huge_bad_json_gets_a_short_answer(server, model_dir):
    bad_tags = post_compact(server, "create_session", session_body(tags=[0] * 9000))
    detail = assert_small_user_error(bad_tags, 400, "body.tags.0: Input should be a valid")
    assert detail.endswith("and 8995 more")
    crowded = session_body(tags=[0] * 500_000)  # 1 MB: under the byte limit
    assert_small_user_error(
        post_compact(server, "create_session", crowded),
        413,
        "body.tags has 500000 items",
        f"at most {MAX_JSON_ITEMS} JSON items",
    )
    sampler = raw_sampling_session(server, model_dir)
    stops = sample_body(sampler, params={"stop": ["ab"] * 300_000})
    assert_small_user_error(
        post_compact(server, "asample", stops),
        400,
        "sampling_params.stop has 300000 entries; at most 64",
    )
    tokens = sample_body(sampler, tokens=["a"] * 1_000_000)  # refused before pydantic sees it
    assert_small_user_error(
        post_compact(server, "asample", tokens),
        400,
        "prompt.chunks[0].tokens must be a list of integer token ids",
    )
    few = sample_body(sampler, tokens=["a", "b"])
    assert "chunks.0.EncodedTextChunk.tokens.0" in assert_small_user_error(
        post_compact(server, "asample", few), 400, "malformed request"
    )


def test_list_limits_are_400_naming_the_field(server, model_dir):
    sampler = raw_sampling_session(server, model_dir)
    long_stop = sample_body(sampler, params={"stop": ["x" * 2000]})
    assert_small_user_error(
        post(server, "asample", json=long_stop), 400, "sampling_params.stop[0] has 2000 char"
    )
    stop_ids = sample_body(sampler, params={"stop": list(range(65))})
    assert_small_user_error(post(server, "asample", json=stop_ids), 400, "at most 64")
    datums = post(server, "forward_backward", content=small_datums(2 << 20), headers=PROTOBUF)
    assert_small_user_error(datums, 400, "more than 65536 datums")

    with pytest.raises(BadRequest, match="create_session: tags has 65 entries; at most 64"):
        check_tags(["t"] * 65, route="create_session")
    with pytest.raises(BadRequest, match=r"tags\[1\] has 1025 characters; at most 1024"):
        check_tags(["t", "t" * 1025], route="create_session")
    check_tags(["t" * MAX_LABEL_CHARS] * 64, route="create_session")
    many = {f"k{index}": index for index in range(65)}
    with pytest.raises(BadRequest, match="create_model: user_metadata has 65 entries; at most"):
        check_user_metadata(many, route="create_model")
    with pytest.raises(BadRequest, match="user_metadata key 'kkkk"):
        check_user_metadata({"k" * 1025: 1}, route="create_model")
    with pytest.raises(BadRequest, match=r"user_metadata\['k'\] has 2000 characters as text"):
        check_user_metadata({"k": "v" * 2000}, route="create_model")
    check_user_metadata(None, route="create_session")
    check_user_metadata({"k": [1, 2]}, route="create_session")


def test_error_messages_are_cut_to_1000_characters():
    body = error_body("x" * 5000)
    assert body["detail"] == "x" * 1000 + "... (4000 more characters)"
    assert error_body("short")["detail"] == "short"


def healthz_statuses_during(server, send) -> tuple[httpx.Response, list[int]]:
    """`send()`'s response, and the status of each healthz polled while it ran (the first
    one sent right after `send` starts, the last after it returns). Each poll may take up to a
    minute: on a loaded machine a healthz can be slow, and what is checked is that it is
    answered, not how fast (bench/server_bounds.py measures the latency)."""
    statuses: list[int] = []
    headers = {"X-API-Key": API_KEY}
    with (
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
        httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client,
    ):
        sending = pool.submit(send)
        while True:
            statuses.append(client.get("/api/v1/healthz").status_code)
            if sending.done():
                break
            time.sleep(0.005)
        return sending.result(), statuses


def test_healthz_answers_during_huge_bad_requests(server, model_dir):
    sampler = raw_sampling_session(server, model_dir)
    bad_requests = {
        "create_session": compact(session_body(tags=[0] * 1_000_000)),
        "asample": compact(sample_body(sampler, params={"stop": ["ab"] * 300_000})),
        "forward_backward": small_datums(50 << 20, tail=b"\xff\xff"),
    }
    for path, content in bad_requests.items():
        headers = PROTOBUF if path == "forward_backward" else JSON
        send = functools.partial(post, server, path, content=content, headers=headers)
        response, statuses = healthz_statuses_during(server, send)
        assert 400 <= response.status_code < 500 and len(response.content) <= MAX_ANSWER_BYTES
        print(f"{path}: {len(statuses)} healthz answered while it ran")
        assert statuses and set(statuses) == {200}
    # ... and the server goes on serving.
    assert post(server, "asample", json=sample_body(sampler)).status_code == 200
    assert post(server, "create_session", json=session_body(tags=["a"])).status_code == 200


def limited_app() -> FastAPI:
    app = FastAPI()

    @app.post("/api/v1/forward_backward")
    async def data(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    @app.post("/api/v1/create_session")
    async def other(body: dict) -> PlainTextResponse:
        return PlainTextResponse(str(len(body)))

    app.add_middleware(BodyLimits, data_routes_bytes=3000, other_routes_bytes=1 << 20)
    return app


def test_chunked_data_bodies_are_counted_as_they_are_read():
    client = TestClient(limited_app())
    under = client.post("/api/v1/forward_backward", content=iter([b"x" * 1000] * 3))
    assert under.status_code == 200 and under.text == "3000"
    over = client.post("/api/v1/forward_backward", content=iter([b"x" * 1000] * 4))
    assert over.status_code == 413 and over.headers["x-should-retry"] == "false"
    assert "over the limit of 3000 bytes for data routes" in over.json()["detail"]
    declared = client.post("/api/v1/forward_backward", content=b"x" * 3001)
    assert declared.status_code == 413 and "3001 bytes" in declared.json()["detail"]
    # Non-data bodies are read and counted once, then handed on whole.
    items = {str(index): index for index in range(5000)}
    assert client.post("/api/v1/create_session", json=items).text == "5000"
    assert (
        client.post("/api/v1/create_session", content=iter([compact(items)]), headers=JSON).text
        == "5000"
    )
    crowded = client.post("/api/v1/create_session", json=dict.fromkeys(map(str, range(12_000))))
    assert crowded.status_code == 413 and "body has 12000 items" in crowded.json()["detail"]
    nested = {"a": [[0] * 100] * 200}
    assert "more than 10000 items" in client.post("/api/v1/create_session", json=nested).text
    # Not JSON: the route says so.
    assert client.post("/api/v1/create_session", content=b"[" * 30_000).status_code in (400, 422)


def test_limits_must_be_positive_ints():
    for value in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError, match=f"data_routes_bytes must be a positive int, got {value}"
        ):
            BodyLimits(limited_app(), data_routes_bytes=value)
