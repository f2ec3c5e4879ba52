"""The SDK routes Temper does not serve, each answering 404 with a message naming the feature.

Without these, a request the SDK can send would meet a bare 404 or, where its path looks like a
served route's, a 405 or another route's 400. docs/server.md's "What is served" lists each with
its reason; tests/server/test_route_walk.py checks the two agree with the installed SDK.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter

from temper.server.http.errors import NotFound
from temper.server.routes.common import api_router


@dataclass(frozen=True)
class Refused:
    method: str
    path: str
    """Under /api/v1."""
    feature: str
    why: str


REFUSED = (
    Refused(
        "POST",
        "/create_custom_loss",
        "server-side custom losses",
        "they run uploaded torch.fx code in the server process; the client config leaves "
        "custom_loss_server_side off, so the SDK computes custom losses client-side",
    ),
    Refused(
        "POST",
        "/auth/token",
        "JWT exchange",
        "the API key is checked on every request; the client config leaves pjwt_auth_enabled off",
    ),
    Refused(
        "GET", "/auth/apikey/me", "API key self-service", "keys come from --api-key or --key-file"
    ),
    Refused(
        "DELETE",
        "/auth/apikey/me",
        "API key self-service",
        "keys come from --api-key or --key-file (edit it and send SIGHUP)",
    ),
    Refused("PUT", "/sessions/{session_id}/project", "session projects", "there are no projects"),
    Refused(
        "GET",
        "/sessions/{session_id}/trace_export",
        "trace export",
        "requests are logged in the server's request log instead",
    ),
    Refused("GET", "/audit", "the audit log", "the server's request log records requests"),
    Refused("GET", "/billing/usage/events", "billing", "nothing is billed"),
    Refused("GET", "/billing/usage/checkpoints/current", "billing", "nothing is billed"),
)


def _refuser(refused: Refused) -> Callable[[], Coroutine[Any, Any, None]]:
    async def refuse() -> None:
        raise NotFound(f"{refused.feature} is not served by Temper: {refused.why}")

    return refuse


def refused_router() -> APIRouter:
    router = api_router()
    for refused in REFUSED:
        router.add_api_route(
            refused.path,
            _refuser(refused),
            methods=[refused.method],
            name=f"refused:{refused.feature}",
        )
    return router


router = refused_router()
