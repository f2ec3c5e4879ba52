"""Who may talk to the server: loopback by default; anywhere else only with API keys.

The tinker SDK sends its key as `X-API-Key` on every request and refuses, client-side, keys
that do not start with 'tml-'. With `--api-key` or `--key-file` set, every route requires a
key some user holds (users.py) and answers 401 otherwise. Binding to a non-loopback address
without keys (no --api-key, and no key file or one that holds no users) is refused at
startup: the server runs arbitrary training on this machine.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from temper.server.http.users import KEY_FILE_FORMAT, KEY_PREFIX, User, Users, read_key_file


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def check_bind(host: str, api_key: str | None, *, key_file: str | None = None) -> None:
    """Refuse, before anything loads, an `--api-key` the SDK would not send, and a non-loopback
    `--host` that no key guards: no --api-key and no --key-file, or a key file that is
    missing, unreadable or holds no users (every request would be refused but healthz, and a
    key file meant to guard the server should say whom it lets in)."""
    if api_key is not None and not (api_key.startswith(KEY_PREFIX) and len(api_key) > 8):
        raise ValueError(
            f"--api-key must start with {KEY_PREFIX!r} (the tinker SDK rejects other keys) and "
            "be longer than 8 characters"
        )
    if api_key is not None or is_loopback(host):
        return
    if key_file is None:
        raise ValueError(
            f"--host {host} is not a loopback address; serving there requires --key-file FILE "
            "(temper users add) or --api-key tml-... (clients send it as TINKER_API_KEY)"
        )
    try:
        users = read_key_file(Path(key_file).expanduser())
    except ValueError as error:
        raise ValueError(f"--key-file: {error}") from None
    if not users:
        raise ValueError(
            f"--key-file {key_file} holds no users, so no key opens the server on --host "
            f"{host} (not a loopback address); the file must contain {KEY_FILE_FORMAT} with at "
            f"least one user: add one with `temper users add NAME --key-file {key_file}`"
        )


def check_port_free(host: str, port: int) -> None:
    """Refuse, before any model loads, a `--host`/`--port` that something already listens on
    (uvicorn would find out only after the models had loaded, and say so in a traceback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ValueError(
                f"cannot listen on --host {host} --port {port}: {error.strerror or error}; stop "
                "what holds that port or choose another --port"
            ) from None


async def current_user(request: Request) -> User:
    """A FastAPI dependency: the `User` whose key the request carries (401 otherwise), from
    the users of the app's server. Declared app-wide (every route needs a key) and, through
    `CurrentUser`, by the routes that use the user; FastAPI solves it once per request."""
    return user_of(request, request.app.state.server.users)


CurrentUser = Annotated[User, Depends(current_user)]


def user_of(request: Request, users: Users) -> User:
    """The user whose `X-API-Key` the request carries (Unauthorized if none holds it)."""
    return users.authenticate(request.headers.get("x-api-key"))
