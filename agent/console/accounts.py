"""The console's users file: who may log in, with which role, over which groups.

One JSON file (``atlas-edge console adduser --users FILE NAME --role viewer|operator``), written 0600, holding
Argon2id hashes only (argon2-cffi's :class:`PasswordHasher`, its defaults: RFC 9106's second recommendation).
A ``viewer`` sees everything and changes nothing; an ``operator`` may run commands and rollouts, on every group or
only on the groups listed for it. The console reads the file at start; a bad file is refused whole, naming the
user and field.
"""

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional, Sequence

from agent.config.names import name_problem

USERNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MIN_PASSWORD = 10  # characters: the console is reachable over the network when told to listen beyond loopback
MAX_PASSWORD = 1024  # Argon2 hashes whatever it is given; a megabyte of "password" is a request to refuse


class Role(str, Enum):
    VIEWER = "viewer"
    OPERATOR = "operator"


class AccountsError(ValueError):
    """The users file or an account is not usable; the message names the file, user and field."""


@dataclass(frozen=True)
class Account:
    name: str
    role: Role
    password_hash: str
    groups: List[str] = field(default_factory=list)  # an operator limited to these groups; empty: every group

    def may_change(self, groups: Sequence[str]) -> bool:
        """Whether this account may send a command to a box (or roll out to a group) of ``groups``."""
        if self.role != Role.OPERATOR:
            return False
        return not self.groups or any(group in self.groups for group in groups)


def _hasher():
    from argon2 import PasswordHasher  # the [console] extra's: imported here so the box never needs it

    return PasswordHasher()


def hash_password(password: str) -> str:
    problem = password_problem(password)
    if problem:
        raise AccountsError(problem)
    return _hasher().hash(password)


def password_problem(password: str) -> Optional[str]:
    if len(password) < MIN_PASSWORD:
        return "the password has %d characters: at least %d" % (len(password), MIN_PASSWORD)
    if len(password) > MAX_PASSWORD:
        return "the password is longer than %d characters" % MAX_PASSWORD
    return None


class Accounts:
    """The accounts of one users file; :meth:`check` verifies a login in constant work whether or not the user
    exists (a missing user costs one Argon2 verification too, so timing does not tell who has an account)."""

    def __init__(self, path: str, accounts: Dict[str, Account]) -> None:
        self.path = path
        self.accounts = accounts
        self._decoy = None  # a hash to verify against for unknown users, made on first need

    @classmethod
    def load(cls, path: str, missing_ok: bool = False) -> "Accounts":
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            if missing_ok:
                return cls(path, {})
            raise AccountsError("%s: no such users file (make one: atlas-edge console adduser --users %s NAME "
                                "--role operator)" % (path, path)) from None
        except (OSError, ValueError) as exc:
            raise AccountsError("%s: cannot read the users file: %s" % (path, exc)) from None
        users = data.get("users") if isinstance(data, dict) else None
        if not isinstance(users, dict):
            raise AccountsError("%s: expected an object with a 'users' object" % path)
        return cls(path, {name: _account(path, name, entry) for name, entry in users.items()})

    def add(self, name: str, role: str, password: str, groups: Sequence[str] = ()) -> Account:
        if not USERNAME.match(name):
            raise AccountsError("user name %r: letters, digits, '.', '_' and '-', at most 64" % name)
        account = Account(name, _role(self.path, name, role), hash_password(password), _groups(self.path, name,
                                                                                                 list(groups)))
        self.accounts[name] = account
        return account

    def save(self) -> None:
        """Atomically, 0600: the file holds password hashes."""
        body = {"users": {a.name: {"role": a.role.value, "password_hash": a.password_hash, "groups": a.groups}
                          for a in sorted(self.accounts.values(), key=lambda a: a.name)}}
        folder = os.path.dirname(os.path.abspath(self.path))
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".users-")
        try:
            os.fchmod(handle, 0o600)
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(body, out, indent=2)
                out.write("\n")
            os.replace(temporary, self.path)
        except BaseException:
            os.unlink(temporary)
            raise

    def check(self, name: str, password: str) -> Optional[Account]:
        """The account when ``password`` is right, else None."""
        from argon2.exceptions import InvalidHashError, VerificationError

        account = self.accounts.get(name)
        if len(password) > MAX_PASSWORD:
            return None
        if account is None:
            if self._decoy is None:
                self._decoy = _hasher().hash("decoy password of no account")
            target = self._decoy
        else:
            target = account.password_hash
        try:
            _hasher().verify(target, password)
        except (VerificationError, InvalidHashError):
            return None
        return account


def _account(path: str, name: str, entry: object) -> Account:
    if not USERNAME.match(str(name)):
        raise AccountsError("%s: user name %r: letters, digits, '.', '_' and '-', at most 64" % (path, name))
    if not isinstance(entry, dict):
        raise AccountsError("%s: user %s: expected an object" % (path, name))
    password_hash = entry.get("password_hash")
    if not isinstance(password_hash, str) or not password_hash.startswith("$argon2"):
        raise AccountsError("%s: user %s: password_hash is not an Argon2 hash" % (path, name))
    groups = entry.get("groups", [])
    if not isinstance(groups, list):
        raise AccountsError("%s: user %s: groups must be a list" % (path, name))
    return Account(name, _role(path, name, entry.get("role")), password_hash, _groups(path, name, groups))


def _role(path: str, name: str, role: object) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise AccountsError("%s: user %s: role %r is not one of %s" % (
            path, name, role, ", ".join(r.value for r in Role))) from None


def _groups(path: str, name: str, groups: List[object]) -> List[str]:
    for group in groups:
        problem = name_problem(group) if isinstance(group, str) else "is not a string"
        if problem:
            raise AccountsError("%s: user %s: group %r %s" % (path, name, group, problem))
    return [str(group) for group in groups]
