"""JSON bodies: one parser with one nesting limit (MAX_JSON_DEPTH) on every route, and every
body it cannot parse is a 400 naming the problem, never a 500 (json.loads raised
RecursionError past about 1,000 levels) nor a broken keep-alive connection."""

from __future__ import annotations

import json

import httpx
import pytest

from temper.server.http.body_limits import _crowded
from temper.server.http.errors import BadRequest
from temper.server.http.json_bodies import MAX_JSON_DEPTH, parse_json
from tests.server.conftest import API_KEY

JSON = {"Content-Type": "application/json", "X-API-Key": API_KEY}


def nested(depth: int, *, opener: str = "[", closed: bool = True) -> bytes:
    """`depth` levels of lists (or objects, `opener='{"a":'`) around a 1."""
    closer = "]" if opener == "[" else "}"
    return (opener * depth + "1" + (closer * depth if closed else "")).encode()


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_the_nesting_limit_is_max_json_depth(opener):
    assert MAX_JSON_DEPTH == 200
    parse_json(nested(MAX_JSON_DEPTH, opener=opener))
    with pytest.raises(BadRequest, match=f"nested more than {MAX_JSON_DEPTH} deep"):
        parse_json(nested(MAX_JSON_DEPTH + 1, opener=opener))
    with pytest.raises(BadRequest, match=f"nested more than {MAX_JSON_DEPTH} deep"):
        parse_json(nested(100_000, opener=opener, closed=False))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "EOF while parsing a value"),
        (b"{not json", "key must be a string"),
        (b'{"a": 1', "EOF while parsing an object"),
        (b"\xff\xfe", "expected value"),
        (b'"\\ud800"', "hex escape"),
        (b"1" * 5000, "number out of range"),
        (b"[1] trailing", "trailing characters"),
    ],
)
def test_every_parser_failure_is_a_bad_request(raw, message):
    with pytest.raises(BadRequest, match=message) as caught:
        parse_json(raw)
    assert caught.value.message.startswith("malformed request: the body is not JSON")


def test_it_reads_what_json_loads_reads():
    text = '{"a": [1, -2.5, 1e400, NaN, "x\\u00e9", null, true], "b": {"a": 1, "a": 2}}'
    parsed, expected = parse_json(text.encode()), json.loads(text)
    assert repr(parsed) == repr(expected)  # repr: nan != nan
    assert parse_json(b"1" + b"0" * 1000) == 10**1000


def test_a_body_too_deep_to_count_is_left_to_its_route():
    assert _crowded(nested(100_000, closed=False)) is None
    assert _crowded(nested(MAX_JSON_DEPTH + 1)) is None
    assert "more than 10000 items" in _crowded(json.dumps([[0, 0]] * 6000).encode())


def small_and_big(depth: int) -> list[bytes]:
    """A body of `depth` open lists, and one over 64 KiB (where plain routes parse first)."""
    return [b"[" * depth, b"[" * 100_000]


@pytest.mark.parametrize(
    "path",
    [
        "asample",
        "retrieve_future",
        "create_session",
        "create_model",
        "forward_backward",
        "session_heartbeat",
    ],
)
def test_deep_bodies_are_400_on_plain_and_fastapi_routes(server, path):
    # One keep-alive connection: a refused body must leave it usable for the next request.
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers=JSON, timeout=30) as client:
        for body in [*small_and_big(MAX_JSON_DEPTH + 1), nested(5000)]:
            answer = client.post(f"/{path}", content=body)
            assert 400 <= answer.status_code < 500, (path, len(body), answer.text[:300])
            assert answer.json()["category"] == "user"
            if path != "forward_backward":  # a protobuf route: its own message
                assert "malformed request" in answer.json()["detail"], answer.text[:300]
            assert client.get("/healthz").is_success
        if path in ("asample", "retrieve_future", "create_session"):
            answer = client.post(f"/{path}", content=b"[" * 100_000)
            assert f"nested more than {MAX_JSON_DEPTH} deep" in answer.json()["detail"]
    assert "Exception in ASGI application" not in server.log.read_text()
