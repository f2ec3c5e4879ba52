"""Fuzzing every route of one live `temper serve` with random and adversarial requests.

The routes are read off the app itself (`create_app` on a TemperServer without a backend), so
a new route is fuzzed without a change here. Each gets a fixed catalogue (an empty body, JSON
nested past the limit in bodies under and over 64 KiB, 1e400, a 1,000-digit integer, NaN,
garbage bytes; each leaf of its request template replaced by those; truncated and damaged
protobuf for forward_backward) and then hypothesis' random requests (derandomized, a fixed
number per route, no shrinking: the run time is bounded): random JSON with adversarial
leaves, templates with a leaf replaced, random bytes, deep nesting, any content type; GET
routes get random query strings and path ids.

The templates carry the ids of a real session, training model, sampling session and
checkpoint, so a body that passes validation up to the id lookups still reaches the model.
What the model must survive is a *rejected* request, so nothing here gives the target model
gradients: forward_backward bodies name a decoy model (a truncated protobuf may still be a
valid request), and an optim_step that slips through (say with seq_id 10**1000) applies
zero gradients with weight decay 0. A load_weights that slips through reloads the state the
model already has. Path ids on routes other than GET and PUT are never real (a bare
`sessions/{id}/finish` or DELETE is a valid request).

Asserted: no answer is a 5xx and the server never logs an internal error; the future of a
request that was accepted never fails as the server's fault; no request breaks its
keep-alive connection; a client polling healthz, get_info and a real sample on its own
keep-alive connection throughout never fails; the target model's logprobs of a fixed
sequence are bitwise what they were before.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.routing import Route
from tinker import types as tinker_types
from tinker.proto import tinker_public_pb2 as pb

from tests.server.conftest import API_KEY
from tests.server.test_bad_input import fwdbwd, post, raw_sampling_session, sample_body
from tests.server.test_sdk import datum

EXAMPLES_PER_ROUTE = 25
"""Hypothesis' random requests per route (after the fixed catalogue)."""
JSON = "application/json"
CONTENT_TYPES = [
    JSON,
    None,
    "text/plain",
    "application/x-protobuf",
    "application/json; charset=latin-1",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=fuzz",
    "application/vnd.fuzz+json",
]
HUGE = ["1e400", "-1e400", "1" + "0" * 1000, "-1" + "0" * 1000, "NaN", "Infinity", "-Infinity"]
"""Numbers past float range (1e400 parses as inf), a 1,001-digit integer, NaN, infinities."""
ADVERSARIAL_LEAVES = [
    *HUGE,
    "1" * 5000,  # past the 4,300 digits Python converts
    "9223372036854775808",  # 2**63: one past int64
    "-9223372036854775809",
    "1e-400",
    "-0.0",
    '"\\ud800"',  # a lone surrogate
    '"\\u0000"',
    json.dumps("x" * 3000),
    json.dumps("../" * 50),
    "[" * 300 + "]" * 300,  # over the nesting limit
    '{"a":' * 300 + "1" + "}" * 300,
    "[]",
    "{}",
    "null",
    "true",
    '"x"',
]
PATH_IDS = ["x", "..", "%2e%2e", "a" * 3000, "%00", "%ff%fe", "tinker:", "-1", "1e400", "%2F"]


@dataclass(frozen=True)
class RouteSpec:
    method: str
    path: str
    """The route's template, e.g. `/api/v1/sessions/{session_id}`."""
    query: tuple[str, ...] = ()
    """Query parameters the route reads."""
    body_model: type | None = None
    """The pydantic model of its JSON body, where FastAPI parses it."""


@dataclass
class Target:
    """The ids the templates carry, and the model whose weights must not change."""

    session_id: str
    model_id: str
    decoy_id: str
    sampler_id: str
    checkpoint: str
    model_dir: str

    def templates(self) -> dict[tuple[str, str], dict]:
        """A valid body for each JSON route (mutated before it is sent)."""
        model, v1 = self.model_id, "/api/v1"
        return {
            ("POST", f"{v1}/asample"): sample_body(self.sampler_id, seq_id=5),
            ("POST", f"{v1}/retrieve_future"): {"request_id": "req-fuzz"},
            ("POST", f"{v1}/create_session"): {
                "tags": ["t"],
                "user_metadata": {"k": "v"},
                "sdk_version": "fuzz",
                "type": "create_session",
            },
            ("POST", f"{v1}/session_heartbeat"): {"session_id": self.session_id},
            ("POST", f"{v1}/create_model"): {
                "session_id": self.session_id,
                "model_seq_id": 1000,
                "base_model": self.model_dir,
                "user_metadata": None,
                "lora_config": {"rank": 4, "seed": 0},
                "type": "create_model",
            },
            ("POST", f"{v1}/get_info"): {"model_id": model},
            ("POST", f"{v1}/optim_step"): {
                "model_id": model,
                "adam_params": {"learning_rate": 1e-3, "weight_decay": 0.0},
                "seq_id": 100,
            },
            ("POST", f"{v1}/save_weights"): {"model_id": model, "path": "fuzz-saved"},
            ("POST", f"{v1}/load_weights"): {
                "model_id": model,
                "path": self.checkpoint,
                "optimizer": False,
            },
            ("POST", f"{v1}/save_weights_for_sampler"): {"model_id": model, "path": "fuzz-s"},
            ("POST", f"{v1}/create_sampling_session"): {
                "session_id": self.session_id,
                "sampling_session_seq_id": 1000,
                "base_model": self.model_dir,
            },
            ("POST", f"{v1}/weights_info"): {"tinker_path": self.checkpoint},
            ("PUT", f"{v1}/training_runs/{{training_run_id}}/checkpoints/{{checkpoint_id}}/ttl"): {
                "ttl_seconds": 7200
            },
        }

    def path_ids(self) -> dict[str, str]:
        """Real values for the path parameters, by name."""
        run_id, checkpoint_id = self.checkpoint.removeprefix("tinker://").split("/", 1)
        return {
            "session_id": self.session_id,
            "sampling_session_id": self.sampler_id,
            "training_run_id": run_id,
            "checkpoint_id": checkpoint_id,
        }


def app_routes(model_dir, storage) -> list[RouteSpec]:
    """Every route of the app `temper serve` runs, and the query parameters each reads."""
    from temper.server import TemperServer
    from temper.server.http.app import create_app

    config = TemperServer.Config(model=[str(model_dir)], storage=str(storage))
    app = create_app(TemperServer(config, backend=object()))  # no model runs here
    specs = []
    for prefix, route in _flat_routes(app.routes):
        assert isinstance(route, Route), route
        dependant = getattr(route, "dependant", None)
        query = () if dependant is None else tuple(p.name for p in dependant.query_params)
        body = getattr(route, "body_field", None)
        body_model = None if body is None else body.field_info.annotation
        path = prefix + route.path.replace(":path}", "}")
        for method in sorted(route.methods - {"HEAD"}):
            specs.append(RouteSpec(method, path, query, body_model))
    return specs


def _flat_routes(routes: list, prefix: str = "") -> Iterator[tuple[str, Route]]:
    """(path prefix, route) of every route. FastAPI 0.16x keeps an included router whole in
    the app's routes (its `original_router`, with the include's own prefix); older versions
    copy its routes in."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is None:
            yield prefix, route
        else:
            yield from _flat_routes(included.routes, prefix + route.include_context.prefix)


# -- the well-behaved client that runs alongside -----------------------------------------------


@dataclass
class Bystander:
    """Polls healthz and get_info, and samples, on one keep-alive connection."""

    base_url: str
    model_id: str
    sampler_id: str
    failures: list[str] = field(default_factory=list)
    rounds: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        headers = {"X-API-Key": API_KEY}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=60) as client:
            while not self.stop.is_set():
                try:
                    self.round(client)
                except Exception as error:  # a reset connection, a timeout
                    self.failures.append(f"round {self.rounds}: {type(error).__name__}: {error}")
                self.rounds += 1
                time.sleep(0.02)

    def round(self, client: httpx.Client) -> None:
        expect_ok(client.get("/api/v1/healthz"), "healthz")
        expect_ok(client.post("/api/v1/get_info", json={"model_id": self.model_id}), "get_info")
        if self.rounds % 10:
            return
        body = sample_body(self.sampler_id, params={"max_tokens": 2})
        answer = expect_ok(client.post("/api/v1/asample", json=body), "asample")
        request_id = answer.json()["request_id"]
        for _ in range(100):
            result = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
            expect_ok(result, "retrieve_future")
            if "application/x-protobuf" in result.headers.get("content-type", ""):
                assert pb.SampleResponse.FromString(result.content).sequences
                return
        raise AssertionError(f"sample {request_id} did not finish")


def expect_ok(response: httpx.Response, what: str) -> httpx.Response:
    assert response.status_code == 200, f"{what}: {response.status_code} {response.text[:300]}"
    return response


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(server, model_dir) -> Iterator[tuple[Target, object]]:
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    decoy = service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    checkpoint = training.save_state("fuzz-kept").result().path
    session_id = training.model_id.split(":train:")[0]
    ids = Target(
        session_id=session_id,
        model_id=training.model_id,
        decoy_id=decoy.model_id,
        sampler_id=raw_sampling_session(server, model_dir, session_id=session_id),
        checkpoint=checkpoint,
        model_dir=str(model_dir),
    )
    yield ids, training
    service.close("success").result()


def fixed_logprobs(training) -> list[float]:
    data = [datum(training.get_tokenizer(), "12=3")]
    return training.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


# -- what is sent -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fuzzed:
    content: bytes | None = None
    content_type: str | None = JSON
    params: tuple[tuple[str, str], ...] = ()
    path_ids: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        body = None if self.content is None else self.content[:200]
        size = 0 if self.content is None else len(self.content)
        return (
            f"body {body!r} ({size} bytes), content type {self.content_type!r}, params "
            f"{self.params!r}, path ids {[(k, v[:40]) for k, v in self.path_ids]}, "
            f"headers {self.headers!r}"
        )


def with_leaf(template: object, path: tuple, fragment: str) -> bytes:
    """`template` as JSON text with the value at `path` replaced by the JSON text `fragment`."""
    marker = "\u0000fuzz-leaf\u0000"
    value = json.loads(json.dumps(template))
    if not path:
        return fragment.encode()
    holder = value
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = marker
    return json.dumps(value).replace(json.dumps(marker), fragment).encode()


def leaf_paths(value: object, path: tuple = ()) -> list[tuple]:
    """Every position in `value` a leaf can be put at: its values, lists and objects."""
    paths = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            paths += leaf_paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths += leaf_paths(child, (*path, index))
    return paths


def deep(depth: int, *, opener: str = "[", closed: bool = False) -> bytes:
    closer = "]" if opener == "[" else "}"
    return (opener * depth + "1" + (closer * depth if closed else "")).encode()


def catalogue(spec: RouteSpec, target: Target) -> Iterator[Fuzzed]:
    """The fixed requests every route gets."""
    for content in (
        b"",
        b"[" * 60_000,  # under 64 KiB: parsed straight by pydantic on the plain routes
        b"[" * 100_000,  # over 64 KiB: parsed first on the plain routes
        deep(201, closed=True),
        deep(5000, opener='{"a":', closed=True),
        b"\xff\xfe\x00garbage",
        b"1e400",
        b"1" + b"0" * 1000,
        b"NaN",
        b'{"a": NaN, "b": -Infinity, "c": 1e400, "d": ' + b"9" * 1001 + b"}",
    ):
        for content_type in (JSON, None, "text/plain"):
            yield Fuzzed(content, content_type)
    template = target.templates().get((spec.method, spec.path))
    if template is not None:
        for path in leaf_paths(template):
            for fragment in (*HUGE, "[" * 300 + "]" * 300, '"' + "x" * 70_000 + '"', "{}"):
                yield Fuzzed(with_leaf(template, path, fragment))
    if spec.path.endswith("/forward_backward"):
        yield from protobuf_catalogue(target)
    for name in spec.query:
        for value in ("1" + "0" * 1000, "-1", "nan", "1e400", "", "x", "%00"):
            yield Fuzzed(None, None, params=((name, value),))


def protobuf_catalogue(target: Target) -> Iterator[Fuzzed]:
    body = fwdbwd(target.decoy_id, [1, 2, 3, 4])
    protobuf = "application/x-protobuf"
    for cut in range(1, len(body), max(1, len(body) // 25)):
        yield Fuzzed(body[:cut], protobuf)
        flipped = bytearray(body)
        flipped[cut] ^= 0xFF
        yield Fuzzed(bytes(flipped), protobuf)
    for content in (
        b"\x0b" * 100_000,  # unknown groups nested 100,000 deep
        b"\x0a\xff\xff\xff\xff\x0f",  # a field of 4 GiB in 6 bytes
        b"\x0a" + b"\xff" * 11,  # a varint of 11 bytes
        b"\x28\xb5\x2f\xfd" + b"\x00" * 64,  # a zstd frame header, then nothing valid
    ):
        yield Fuzzed(content, protobuf)
    for encoding in ("zstd", "gzip", "br", "zstd, zstd"):
        yield Fuzzed(body, protobuf, headers=(("Content-Encoding", encoding),))


def json_texts() -> st.SearchStrategy[str]:
    """JSON text with adversarial leaves, nested a few levels."""
    leaves = st.one_of(
        st.sampled_from(ADVERSARIAL_LEAVES),
        st.text(max_size=20).map(json.dumps),
        st.integers().map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=5).map(lambda xs: "[" + ",".join(xs) + "]"),
            st.dictionaries(st.text(max_size=12), children, max_size=5).map(
                lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}"
            ),
        ),
        max_leaves=20,
    )


@st.composite
def fuzzed(draw, spec: RouteSpec, target: Target) -> Fuzzed:
    template = target.templates().get((spec.method, spec.path))
    kinds = ["json", "bytes", "deep"] + (["template"] * 3 if template is not None else [])
    if spec.path.endswith("/forward_backward"):
        kinds += ["protobuf"] * 3
    kind = draw(st.sampled_from(kinds))
    if kind == "json":
        content = draw(json_texts()).encode()
    elif kind == "bytes":
        content = draw(st.binary(max_size=512))
    elif kind == "deep":
        depth = draw(st.sampled_from([201, 1000, 30_000, 70_000, 200_000]))
        opener = draw(st.sampled_from(["[", '{"a":', '{"model_id":[']))
        content = deep(depth, opener=opener, closed=draw(st.booleans()))
    elif kind == "template":
        path = draw(st.sampled_from(leaf_paths(template)))
        content = with_leaf(template, path, draw(json_texts()))
    else:
        body = bytearray(fwdbwd(target.decoy_id, draw(st.lists(st.integers(0, 20), max_size=8))))
        for _ in range(draw(st.integers(0, 3))):
            body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
        content = bytes(body[: draw(st.integers(0, len(body)))])
    params = ()
    if spec.query:
        values = st.one_of(st.sampled_from(["1" + "0" * 1000, "-1", "nan", "1e400", ""]), st.text())
        params = tuple(
            draw(st.dictionaries(st.sampled_from(spec.query), values, max_size=3)).items()
        )
    return Fuzzed(
        content=None if spec.method == "GET" and draw(st.booleans()) else content,
        content_type=draw(st.sampled_from(CONTENT_TYPES)),
        params=params,
        path_ids=tuple((name, draw(st.sampled_from(PATH_IDS))) for name in path_names(spec.path)),
    )


def path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


# -- sending ------------------------------------------------------------------------------------


def url_of(spec: RouteSpec, request: Fuzzed, target: Target) -> str:
    """The route's path with its ids: the fuzzed ones, else real ones on GET and PUT (module
    doc: a real id elsewhere may be a valid finish or delete), else 'fuzz'."""
    given = dict(request.path_ids)
    real = target.path_ids() if spec.method in ("GET", "PUT") else {}
    path = spec.path
    for name in path_names(spec.path):
        path = path.replace("{" + name + "}", given.get(name) or real.get(name, "fuzz"))
    return path


def send(client: httpx.Client, spec: RouteSpec, request: Fuzzed, target: Target) -> None:
    headers = dict(request.headers)
    if request.content_type is not None:
        headers["Content-Type"] = request.content_type
    try:
        answer = client.request(
            spec.method,
            url_of(spec, request, target),
            content=request.content,
            params=request.params,
            headers=headers,
        )
    except httpx.TransportError as error:
        pytest.fail(f"{spec.method} {spec.path}: {error!r} for {request.describe()}")
    assert answer.status_code < 500, (
        f"{spec.method} {spec.path} answered {answer.status_code} {answer.text[:500]} to "
        f"{request.describe()}"
    )
    request_id = future_id(answer)
    if request_id is not None:  # accepted: its future must not fail as the server's fault
        failure = future_failure(client, request_id)
        assert failure is None or failure["category"] != "server", (
            f"{spec.method} {spec.path}: the future of {request.describe()} failed: {failure}"
        )


def future_id(answer: httpx.Response) -> str | None:
    if answer.status_code != 200 or "json" not in answer.headers.get("content-type", ""):
        return None
    body = answer.json()
    return body.get("request_id") if isinstance(body, dict) else None


def future_failure(client: httpx.Client, request_id: str) -> dict | None:
    """The error a future answers with once done, None if it succeeds."""
    for _ in range(30):
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert answer.status_code == 200, answer.text[:500]
        if "json" not in answer.headers.get("content-type", ""):
            return None  # a protobuf result
        body = answer.json()
        if body.get("type") != "try_again":
            return body if "error" in body else None
    raise AssertionError(f"future {request_id} did not finish")


def fuzz_route(client: httpx.Client, spec: RouteSpec, target: Target) -> None:
    for request in catalogue(spec, target):
        send(client, spec, request, target)

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(request=fuzzed(spec, target))
    def random_requests(request: Fuzzed) -> None:
        send(client, spec, request, target)

    random_requests()


# -- the test -------------------------------------------------------------------------------------


def test_fuzzed_requests_are_4xx_and_change_nothing(server, model_dir, target, tmp_path):
    ids, training = target
    routes = app_routes(model_dir, tmp_path / "storage")
    paths = {spec.path for spec in routes}
    assert {"/api/v1/asample", "/api/v1/forward_backward", "/api/v1/healthz"} <= paths
    # The templates are valid requests: what is wrong with a mutated one is the mutation.
    models = {(spec.method, spec.path): spec.body_model for spec in routes}
    models[("POST", "/api/v1/asample")] = tinker_types.SampleRequest
    models[("POST", "/api/v1/retrieve_future")] = tinker_types.FutureRetrieveRequest
    for key, template in ids.templates().items():
        models[key].model_validate(template)
    assert post(server, "get_info", json=ids.templates()[("POST", "/api/v1/get_info")]).is_success
    before = fixed_logprobs(training)

    bystander = Bystander(server.base_url, ids.model_id, ids.sampler_id)
    thread = threading.Thread(target=bystander.run, daemon=True)
    thread.start()
    headers = {"X-API-Key": API_KEY}
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
            for spec in routes:
                fuzz_route(client, spec, ids)
    finally:
        bystander.stop.set()
        thread.join(timeout=60)

    assert not bystander.failures, bystander.failures[:5]
    assert bystander.rounds > 10
    assert fixed_logprobs(training) == before
    log = server.log.read_text()
    assert "Exception in ASGI application" not in log
    assert "internal error" not in log
