"""Secrets kept out of config files: ``env:VAR`` (the environment) and ``cred:NAME`` (a systemd credential).

The unit's ``LoadCredential=NAME:/etc/...`` gives the daemon a private copy of a root-only file under
``$CREDENTIALS_DIRECTORY``; older systemd (the Atlas 200 DK's Ubuntu 18.04) ignores it, so the environment
file is the fallback. Every config value that may hold a secret (the MQTT password, TLS files, ``ctl
--password``) is resolved here, so the two forms mean the same thing everywhere and a failure names its field.
"""

import os
from typing import Optional

from agent.config.schema import ConfigError, FieldError

ENV_PREFIX = "env:"
CRED_PREFIX = "cred:"
CREDENTIALS_DIRECTORY_ENV = "CREDENTIALS_DIRECTORY"


def _credential_file(name: str, field: str) -> str:
    directory = os.environ.get(CREDENTIALS_DIRECTORY_ENV)
    if not directory:
        raise ConfigError([FieldError(field, "cred: needs systemd LoadCredential ($%s is not set)"
                                      % CREDENTIALS_DIRECTORY_ENV)])
    if not name or os.sep in name or name in (".", ".."):
        raise ConfigError([FieldError(field, "bad credential name %r" % name)])
    return os.path.join(directory, name)


def resolve_secret(value: Optional[str], field: str = "mqtt.password") -> Optional[str]:
    """The secret a value stands for: ``env:VAR`` → $VAR, ``cred:NAME`` → that credential's text (stripped);
    any other value is the secret itself. Raises ConfigError naming ``field`` when it cannot be resolved."""
    if value is None:
        return None
    if value.startswith(ENV_PREFIX):
        var = value[len(ENV_PREFIX):]
        if var not in os.environ:
            raise ConfigError([FieldError(field, "environment variable %s is not set" % var)])
        return os.environ[var]
    if value.startswith(CRED_PREFIX):
        path = _credential_file(value[len(CRED_PREFIX):], field)
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read().strip()
        except OSError as exc:
            raise ConfigError([FieldError(field, "cannot read credential %s: %s" % (path, exc))]) from None
    return value


def credential_path(value: Optional[str], field: str) -> Optional[str]:
    """A file named in the config (a TLS key or certificate): a path, or ``cred:NAME`` for that credential's
    private copy. Raises ConfigError naming ``field`` when the file does not exist."""
    if value is None:
        return None
    path = _credential_file(value[len(CRED_PREFIX):], field) if value.startswith(CRED_PREFIX) else value
    if not os.path.isfile(path):
        raise ConfigError([FieldError(field, "file not found: %s" % path)])
    return path
