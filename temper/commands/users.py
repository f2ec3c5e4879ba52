"""`temper users`: add, remove and list the users of a `temper serve --key-file`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

import tyro


def users(
    action: Annotated[Literal["add", "remove", "list"], tyro.conf.Positional],
    name: Annotated[str | None, tyro.conf.Positional] = None,
    /,
    *,
    key_file: Path,
    admin: bool = False,
) -> int:
    """Add, remove or list the users of a server's key file (temper serve --key-file).

    `add NAME` prints the new user's API key once (only its SHA-256 is stored); give it to
    the user as TINKER_API_KEY. A running server picks up changes on SIGHUP (or POST
    /api/v1/admin/reload_keys with an admin's key).

    Args:
        action: add, remove or list.
        name: The user's name (add, remove): lowercase letters, digits, '_', '.', '-'.
        key_file: The key file (created by the first add).
        admin: With add: the user sees and may use every user's sessions and checkpoints.
    """
    from temper.server.http import users as key_file_users

    if action == "list":
        for user, _ in key_file_users.read_key_file(key_file.expanduser()):
            print(f"{user.name}{' (admin)' if user.admin else ''}")
        return 0
    if name is None:
        raise ValueError(f"temper users {action} needs a user NAME")
    if action == "add":
        key = key_file_users.add_user(key_file, name, admin=admin)
        print(key)
        print(
            f"added {name!r}{' (admin)' if admin else ''} to {key_file}; the key above is shown "
            "once. A running server reloads on SIGHUP.",
            file=sys.stderr,
        )
        return 0
    key_file_users.remove_user(key_file, name)
    print(f"removed {name!r} from {key_file}; a running server reloads on SIGHUP.")
    return 0
