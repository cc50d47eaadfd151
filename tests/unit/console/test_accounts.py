"""The console's users file (agent/console/accounts.py): Argon2 hashes only, roles and groups, a bad file refused
whole with the user and field named, and ``console adduser`` reading the password from stdin."""

import io
import json
import os
import stat
import subprocess
import sys

import pytest

pytest.importorskip("argon2", reason="needs the [console] extra (argon2-cffi): the operator's side, not the box's")

from agent.console.accounts import Accounts, AccountsError, Role  # noqa: E402

PASSWORD = "correct horse battery"


def test_an_added_account_is_stored_hashed_0600_and_checks_only_its_password(tmp_path):
    path = str(tmp_path / "users.json")
    accounts = Accounts.load(path, missing_ok=True)
    accounts.add("ana", "operator", PASSWORD, ["site-a"])
    accounts.save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = open(path).read()
    assert PASSWORD not in text and "$argon2id$" in text
    again = Accounts.load(path)
    assert again.check("ana", PASSWORD).role == Role.OPERATOR
    assert again.check("ana", PASSWORD + "x") is None
    assert again.check("nobody", PASSWORD) is None
    assert again.accounts["ana"].may_change(["site-a"]) and not again.accounts["ana"].may_change(["site-b"])


def test_a_viewer_changes_nothing_and_an_unlimited_operator_everything(tmp_path):
    accounts = Accounts(str(tmp_path / "u.json"), {})
    viewer = accounts.add("vic", "viewer", PASSWORD)
    operator = accounts.add("olga", "operator", PASSWORD)
    assert not viewer.may_change(["site-a"]) and not viewer.may_change([])
    assert operator.may_change(["any"]) and operator.may_change([])


@pytest.mark.parametrize("body, named", [
    ({"users": {"ana": {"role": "admin", "password_hash": "$argon2id$x"}}}, "role 'admin'"),
    ({"users": {"ana": {"role": "viewer", "password_hash": "plain"}}}, "user ana: password_hash"),
    ({"users": {"bad/name": {"role": "viewer", "password_hash": "$argon2id$x"}}}, "'bad/name'"),
    ({"users": {"ana": {"role": "operator", "password_hash": "$argon2id$x", "groups": ["a.b"]}}}, "group 'a.b'"),
    ([], "a 'users' object"),
])
def test_a_bad_users_file_is_refused_whole_naming_the_user_and_field(tmp_path, body, named):
    path = tmp_path / "users.json"
    path.write_text(json.dumps(body))
    with pytest.raises(AccountsError) as caught:
        Accounts.load(str(path))
    assert named in str(caught.value) and str(path) in str(caught.value)


def test_short_passwords_and_bad_names_are_refused(tmp_path):
    accounts = Accounts(str(tmp_path / "u.json"), {})
    with pytest.raises(AccountsError, match="at least 10"):
        accounts.add("ana", "viewer", "short")
    with pytest.raises(AccountsError, match="user name"):
        accounts.add("../ana", "viewer", PASSWORD)


def test_adduser_reads_the_password_from_stdin_and_never_prints_it(tmp_path):
    path = str(tmp_path / "users.json")
    done = subprocess.run([sys.executable, "-m", "agent", "console", "adduser", "--users", path, "vic", "--role",
                           "viewer"], input=PASSWORD + "\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "vic is viewer" in done.stdout and PASSWORD not in done.stdout + done.stderr
    assert Accounts.load(path).check("vic", PASSWORD).role == Role.VIEWER
    short = subprocess.run([sys.executable, "-m", "agent", "console", "adduser", "--users", path, "olga", "--role",
                            "operator"], input="short\n", capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "at least 10" in short.stderr
    assert set(Accounts.load(path).accounts) == {"vic"}  # nothing written


def test_the_console_refuses_to_start_without_a_users_file_or_with_no_account(tmp_path):
    from agent.cli import console

    err = io.StringIO()
    assert console.run(_args(users=str(tmp_path / "missing.json")), err=err) == 2
    assert "no such users file" in err.getvalue()
    empty = tmp_path / "empty.json"
    empty.write_text('{"users": {}}')
    err = io.StringIO()
    assert console.run(_args(users=str(empty)), err=err) == 2
    assert "has no account" in err.getvalue()


def _args(**values):
    import argparse

    from agent.cli.console import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    for name, value in values.items():
        setattr(args, name, value)
    return args
