"""The key file behind `temper serve --key-file` and `temper users`: digests only, atomic
edits, clear errors naming the entry, and keys mapped to users (401 for any other)."""

from __future__ import annotations

import json
import stat

import pytest

from temper.cli import main
from temper.server.http.errors import Unauthorized
from temper.server.http.security import check_bind
from temper.server.http.users import (
    KEY_FILE_FORMAT,
    Users,
    add_user,
    digest,
    read_key_file,
    remove_user,
)


def test_keys_map_to_their_users_and_only_digests_are_stored(tmp_path):
    key_file = tmp_path / "keys.json"
    alice = add_user(key_file, "alice")
    root = add_user(key_file, "root", admin=True)
    assert alice.startswith("tml-") and alice not in key_file.read_text()
    assert digest(alice) in key_file.read_text()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    users = Users(key_file=key_file, api_key="tml-the-old-single-key")
    assert users.authenticate(alice).name == "alice" and not users.authenticate(alice).admin
    assert users.authenticate(root).admin
    # With a key file, the --api-key user is an ordinary user.
    assert users.authenticate("tml-the-old-single-key").name == "default"
    assert not users.authenticate("tml-the-old-single-key").admin
    for wrong in (None, "", "tml-nobody-has-this-key-000"):
        with pytest.raises(Unauthorized):
            users.authenticate(wrong)
    remove_user(key_file, "alice")
    users.reload()
    with pytest.raises(Unauthorized):
        users.authenticate(alice)


def test_without_a_key_file_the_one_user_sees_all(tmp_path):
    assert Users().authenticate(None).admin  # loopback, no key
    single = Users(api_key="tml-the-single-key-0123")
    assert single.authenticate("tml-the-single-key-0123").admin
    with pytest.raises(Unauthorized):
        single.authenticate("tml-the-single-key-0124")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "keys.json"),
        ('{"people": []}', 'expected {"users": [...]}'),
        ('{"users": [{"name": "Al Ice", "key_sha256": "' + "0" * 64 + '"}]}', "not valid"),
        ('{"users": [{"name": "al", "key_sha256": "abc"}]}', "users[0].key_sha256 must be 64"),
        ('{"users": [{"name": "al", "key_sha256": "' + "0" * 64 + '", "admin": 1}]}', "admin"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_entry(tmp_path, content, message):
    key_file = tmp_path / "keys.json"
    key_file.write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        read_key_file(key_file)


def test_a_reload_that_fails_keeps_the_users(tmp_path):
    key_file = tmp_path / "keys.json"
    alice = add_user(key_file, "alice")
    users = Users(key_file=key_file)
    key_file.write_text(json.dumps({"users": "nope"}))
    with pytest.raises(ValueError):
        users.reload()
    assert users.authenticate(alice).name == "alice"


def test_a_reload_of_an_emptied_key_file_keeps_the_users(tmp_path):
    key_file = tmp_path / "keys.json"
    alice = add_user(key_file, "alice")
    users = Users(key_file=key_file)
    key_file.write_text('{"users": []}')
    with pytest.raises(ValueError, match=r"holds no users; the server keeps its 1 \(add one"):
        users.reload()
    assert users.authenticate(alice).name == "alice"


def test_the_users_command_adds_lists_and_removes(tmp_path, capsys):
    key_file = str(tmp_path / "team.json")
    assert main(["users", "add", "alice", "--key-file", key_file]) == 0
    key = capsys.readouterr().out.strip()
    assert Users(key_file=key_file).authenticate(key).name == "alice"
    assert main(["users", "add", "alice", "--key-file", key_file]) == 2
    assert "is in" in capsys.readouterr().err
    assert main(["users", "list", "--key-file", key_file]) == 0
    assert capsys.readouterr().out.strip() == "alice"
    assert main(["users", "remove", "alice", "--key-file", key_file]) == 0
    assert main(["users", "remove", "alice", "--key-file", key_file]) == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"users": []}', "holds no users, so no key opens the server on --host 0.0.0.0"),
        ("", "is empty; it must contain " + KEY_FILE_FORMAT),
        ("  \n", "is empty; it must contain " + KEY_FILE_FORMAT),
        (None, "does not exist; create it with `temper users add`"),
        ("[]", 'expected {"users": [...]}, as in ' + KEY_FILE_FORMAT),
    ],
)
def test_a_non_loopback_host_needs_a_key_file_with_users(tmp_path, content, message):
    key_file = tmp_path / "keys.json"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(ValueError, match=r"^--key-file") as caught:
        check_bind("0.0.0.0", None, key_file=str(key_file))
    assert message in str(caught.value)


def test_a_key_file_without_users_is_refused_only_where_it_would_guard(tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text('{"users": []}')
    with pytest.raises(ValueError, match=r"must contain .* with at least one user: add one with"):
        check_bind("0.0.0.0", None, key_file=str(key_file))
    check_bind("127.0.0.1", None, key_file=str(key_file))  # loopback needs no key
    check_bind("0.0.0.0", "tml-the-single-key-0123", key_file=str(key_file))  # --api-key's user
    add_user(key_file, "alice")
    check_bind("0.0.0.0", None, key_file=str(key_file))
