"""Who may talk to the server: loopback by default; anywhere else only with an API key.

The tinker SDK sends its key as `X-API-Key` on every request and refuses, client-side, keys
that do not start with 'tml-'. With `api_key` set, every route requires exactly that key
(compared in constant time) and answers 401 otherwise. Binding to a non-loopback address
without a key is refused at startup: the server runs arbitrary training on this machine.
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.requests import Request

from temper.server.errors import Unauthorized

KEY_PREFIX = "tml-"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def check_bind(host: str, api_key: str | None) -> None:
    if api_key is not None and not (api_key.startswith(KEY_PREFIX) and len(api_key) > 8):
        raise ValueError(
            f"--api-key must start with {KEY_PREFIX!r} (the tinker SDK rejects other keys) and "
            "be longer than 8 characters"
        )
    if api_key is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} is not a loopback address; serving there requires --api-key "
            "tml-... (clients send it as TINKER_API_KEY)"
        )


def key_checker(api_key: str | None):
    """A FastAPI dependency that rejects requests without the configured key."""

    async def check(request: Request) -> None:
        check_key(request, api_key)

    return check


def check_key(request: Request, api_key: str | None) -> None:
    """Raise Unauthorized unless `request` carries `api_key` (any request if it is None)."""
    if api_key is None:
        return
    given = request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise Unauthorized("missing or wrong X-API-Key")
