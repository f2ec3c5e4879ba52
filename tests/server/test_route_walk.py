"""Route parity with the installed tinker SDK, which cannot drift: every route the SDK's source
can send (its resources, clients and CLI, found by reading their code) must reach a handler of
its own in the app's route table, served or refused (404 naming the feature), and be listed
with the same status in docs/server.md's "What is served"; every request type the SDK exports
must be named there too. A newer SDK that adds a route or type fails here until both say what
Temper does with it. No server starts: the app's route table is matched as Starlette would.
"""

from __future__ import annotations

import ast
import re
import types as std_types
from pathlib import Path

import pydantic
import pytest

tinker = pytest.importorskip("tinker")

from starlette.routing import Match  # noqa: E402

from temper.server.http.app import create_app  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
HTTP_VERBS = {"_post": "POST", "post": "POST", "_get": "GET", "get": "GET"}
HTTP_VERBS |= {"delete": "DELETE", "_delete": "DELETE", "put": "PUT", "_put": "PUT"}
SAMPLE_VALUES = {"checkpoint_id": "weights/x"}
"""Placeholders that hold a '/' (a checkpoint id is `<kind>/<name>`); the others become `x`."""


def _template(node: ast.expr) -> str | None:
    """The path a string or f-string argument spells, placeholders as `{name}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                assert isinstance(value, ast.FormattedValue)
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    return None


def sdk_routes() -> set[tuple[str, str]]:
    """(method, path template) of every request to /api/v1 in the SDK's source."""
    root = Path(tinker.__file__).parent
    found = set()
    for file in root.rglob("*.py"):
        if file.name.endswith("_test.py"):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, args = node.func.attr, node.args
            if name == "_request" and len(args) >= 2 and isinstance(args[0], ast.Constant):
                method, path = str(args[0].value), _template(args[1])
            elif name in HTTP_VERBS and args:
                method, path = HTTP_VERBS[name], _template(args[0])
            else:
                continue
            if path is not None and path.startswith("/api/v1/"):
                found.add((method, path))
    return found


def shape(template: str) -> str:
    """A template with its placeholders unnamed (the SDK names one route's two ways)."""
    return re.sub(r"\{\w+\}", "{}", template)


def concrete(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: SAMPLE_VALUES.get(m.group(1), "x"), template)


@pytest.fixture(scope="module")
def app():
    # The route table needs no served model: only the body limit reads the config.
    return create_app(std_types.SimpleNamespace(config=std_types.SimpleNamespace(max_body_mb=1)))


def handler_of(app, method: str, path: str) -> str | None:
    """The name of the route Starlette picks for the request, or None if none takes it."""
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.name
    return None


def documented() -> dict[tuple[str, str], str]:
    """(method, path) -> 'served' | 'refused' from the routes table of "What is served"."""
    section = DOCS.read_text().split("## What is served", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `(GET|POST|PUT|DELETE) (/api/v1/\S+)` \| (served|refused) \|", section, re.M
    )
    return {(method, shape(path)): status for method, path, status in rows}


def test_the_sdk_sends_the_routes_this_test_knows_to_look_for():
    routes = sdk_routes()
    assert ("POST", "/api/v1/asample") in routes
    assert (
        "DELETE",
        "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish",
    ) in routes
    assert ("POST", "/api/v1/cancel_future") in routes
    assert len(routes) >= 40


@pytest.mark.parametrize("route", sorted(sdk_routes()), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_sdk_route_is_served_or_refused_and_documented_so(app, route):
    method, template = route
    name = handler_of(app, method, concrete(template))
    assert name is not None, f"{method} {template} reaches no route (a 404 or 405 by collision)"
    status = "refused" if name.startswith("refused:") else "served"
    listed = documented().get((method, shape(template)))
    assert listed == status, (
        f"{method} {template} is {status} (handler {name!r}) but docs/server.md's 'What is "
        f"served' lists it as {listed!r}: add or fix its row"
    )


def test_every_sdk_request_type_is_named_in_what_is_served():
    section = DOCS.read_text().split("## What is served", 1)[1].split("\n## ", 1)[0]
    request_types = [
        name
        for name in dir(tinker.types)
        if name.endswith("Request")
        and isinstance(getattr(tinker.types, name), type)
        and issubclass(getattr(tinker.types, name), pydantic.BaseModel)
    ]
    assert request_types
    missing = [name for name in request_types if f"`{name}`" not in section]
    assert not missing, f"request types not named in docs/server.md 'What is served': {missing}"
