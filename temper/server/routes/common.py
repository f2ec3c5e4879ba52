"""What every route module shares: its router's shape, and the server as a FastAPI dependency.

Handlers are module-level functions; the state they read and change is the app's server
(`request.app.state.server`, set by `create_app`), never a closure's.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.requests import Request

from temper.server.http.json_bodies import JsonBodyRoute
from temper.server.state.server import TemperServer


async def app_server(request: Request) -> TemperServer:
    """A FastAPI dependency: the server the app serves (async: no thread hop)."""
    return request.app.state.server


Server = Annotated[TemperServer, Depends(app_server)]


def api_router() -> APIRouter:
    """A router of `/api/v1` routes whose JSON bodies parse with `parse_json`."""
    return APIRouter(prefix="/api/v1", route_class=JsonBodyRoute)
