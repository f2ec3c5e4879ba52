"""Who is asking: API keys mapped to users, from `--api-key` and a key file.

The key file is JSON; `temper users add NAME --key-file F` writes it (and prints the new key
once), an admin may edit it by hand:

    {"users": [{"name": "alice", "key_sha256": "<64 hex digits>", "admin": false}, ...]}

Only SHA-256 digests of keys are stored. The keys `temper users add` makes are 32 random
bytes, so a plain digest is as strong as a slow password hash would be; a key chosen by hand
must be at least `MIN_KEY_LENGTH` characters. The server re-reads the file on SIGHUP and on
`POST /api/v1/admin/reload_keys`; a file that fails to parse leaves the previous users in
place.

Without a key file there is one user, `default`: every request without a key (loopback
only), or with `--api-key`, is that user, and sees everything (as a single-user server
always has). With a key file, `--api-key` (if given) is the key of `default`, then an
ordinary user; a run whose run.json records no owner belongs to `default`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from temper.server.http.errors import Unauthorized

KEY_FILE_FORMAT = '{"users": [{"name": ..., "key_sha256": ..., "admin": false}, ...]}'
"""What a key file holds, as its errors describe it."""
KEY_PREFIX = "tml-"
"""The tinker SDK refuses, client-side, keys that do not start with this."""
MIN_KEY_LENGTH = 24
DEFAULT_USER = "default"
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class User:
    name: str
    admin: bool = False

    def owns(self, owner: str) -> bool:
        """Whether this user may see and use what `owner` created."""
        return self.admin or owner == self.name


SERVER = User("(server)", admin=True)
"""The server acting on its own (deleting expired checkpoints)."""


def check_user_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"user name {name!r} is not valid: use 1-64 lowercase letters, digits, '_', '.' or "
            "'-', starting with a letter or digit"
        )
    return name


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class Users:
    """Maps each request's `X-API-Key` to a `User` (401 for a key nobody holds)."""

    def __init__(self, *, api_key: str | None = None, key_file: str | Path | None = None) -> None:
        self.api_key = api_key
        self.key_file = None if key_file is None else Path(key_file).expanduser()
        self._by_digest: dict[str, User] = {}
        if self.key_file is not None:
            self.reload()

    @property
    def open(self) -> bool:
        """No key is required (no --api-key and no key file): every request is `default`."""
        return self.api_key is None and self.key_file is None

    def reload(self) -> int:
        """Re-read the key file (ValueError naming the problem; the users stay as they were);
        returns the number of users it holds."""
        assert self.key_file is not None, "reload needs a key file"
        users = read_key_file(self.key_file)
        by_digest = {entry_digest: user for user, entry_digest in users}
        if self.api_key is not None:
            by_digest.setdefault(digest(self.api_key), User(DEFAULT_USER))
        if self._by_digest and not by_digest:
            # Every key, the admins' too, would be refused: nobody could reload again.
            raise ValueError(
                f"key file {self.key_file} holds no users; the server keeps its "
                f"{len(self._by_digest)} (add one with `temper users add`, or stop the server "
                "to revoke every key)"
            )
        self._by_digest = by_digest
        return len(users)

    def authenticate(self, key: str | None) -> User:
        if self.open:
            return User(DEFAULT_USER, admin=True)
        if self.key_file is None:  # --api-key alone: its holder is the only user
            if key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()):
                return User(DEFAULT_USER, admin=True)
            raise Unauthorized("missing or wrong X-API-Key")
        user = self._by_digest.get(digest(key)) if key else None
        if user is None:
            raise Unauthorized("missing or wrong X-API-Key")
        return user


def read_key_file(path: Path) -> list[tuple[User, str]]:
    """The (user, key digest) pairs of a key file (ValueError naming the problem)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(
            f"key file {path} does not exist; create it with `temper users add`"
        ) from None
    except OSError as error:
        raise ValueError(f"key file {path}: {error}") from None
    if not text.strip():
        raise ValueError(
            f"key file {path} is empty; it must contain {KEY_FILE_FORMAT} (temper users add)"
        )
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"key file {path}: {error}; it must contain {KEY_FILE_FORMAT}") from None
    entries = raw.get("users") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'key file {path}: expected {{"users": [...]}}, as in {KEY_FILE_FORMAT}')
    users, seen_names, seen_digests = [], set(), set()
    for index, entry in enumerate(entries):
        where = f"key file {path}: users[{index}]"
        if not isinstance(entry, dict) or set(entry) - {"name", "key_sha256", "admin"}:
            raise ValueError(f"{where}: expected {{'name', 'key_sha256', 'admin'}}, got {entry!r}")
        try:
            name = check_user_name(entry.get("name"))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        key_digest = entry.get("key_sha256")
        if not (isinstance(key_digest, str) and re.fullmatch(r"[0-9a-f]{64}", key_digest)):
            raise ValueError(f"{where}.key_sha256 must be 64 lowercase hex digits (a SHA-256)")
        if not isinstance(entry.get("admin", False), bool):
            raise ValueError(f"{where}.admin must be true or false")
        if name in seen_names or key_digest in seen_digests:
            raise ValueError(f"{where}: user {name!r} or its key appears twice")
        seen_names.add(name)
        seen_digests.add(key_digest)
        users.append((User(name, admin=entry.get("admin", False)), key_digest))
    return users


def add_user(path: str | Path, name: str, *, admin: bool = False, key: str | None = None) -> str:
    """Add `name` to the key file (created if missing) and return its key (made here unless
    given). The file is replaced atomically and readable by its owner only."""
    path = Path(path).expanduser()
    check_user_name(name)
    if key is None:
        key = new_key()
    elif not (key.startswith(KEY_PREFIX) and len(key) >= MIN_KEY_LENGTH):
        raise ValueError(
            f"key must start with {KEY_PREFIX!r} and be at least {MIN_KEY_LENGTH} characters"
        )
    users = read_key_file(path) if path.exists() else []
    if any(user.name == name for user, _ in users):
        raise ValueError(f"user {name!r} is in {path} already; remove it first")
    if any(entry_digest == digest(key) for _, entry_digest in users):
        raise ValueError("that key belongs to another user already")
    _write(path, [*users, (User(name, admin=admin), digest(key))])
    return key


def remove_user(path: str | Path, name: str) -> None:
    path = Path(path).expanduser()
    users = read_key_file(path)
    if not any(user.name == name for user, _ in users):
        raise ValueError(f"no user {name!r} in {path}")
    _write(path, [(user, key_digest) for user, key_digest in users if user.name != name])


def _write(path: Path, users: list[tuple[User, str]]) -> None:
    text = json.dumps(
        {
            "users": [
                {"name": user.name, "key_sha256": key_digest, "admin": user.admin}
                for user, key_digest in users
            ]
        },
        indent=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(handle, "w") as file:  # mkstemp makes it 0600
        file.write(text + "\n")
    os.replace(staging, path)
