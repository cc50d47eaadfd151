"""What a source URI names, decided once: its kind by scheme, and its password resolved from a reference.

Kinds: ``stream`` (``rtsp://``, ``rtsps://``, ``http://``, ``https://``), ``camera`` (``camera:N``, a V4L2
device index), and, without a scheme, ``folder`` (an existing directory, or a path without a suffix) or
``file`` (a video file). Any other scheme is refused by ``validate``. The frame path registers one reader per
kind (:mod:`agent.pipeline.sources`).

A stream's password may be a reference instead of the secret, ``rtsp://admin:env:CAM1_PASSWORD@host/s`` or
``rtsp://admin:cred:cam1@host/s``, resolved by :func:`agent.config.secrets.resolve_secret` when the source
opens, so the config file, the overrides file and every report hold only the reference.

A password written raw may hold ``@``, ``/``, ``?``, ``#`` or a space: the userinfo runs to the last ``@``
after which the rest reads as ``host[:port]`` (:func:`agent._util.redact.split_userinfo`, the redaction's own
rule), and the password is percent-encoded before FFmpeg sees it. A URI that reads two ways with a password in
one of them (``rtsp://u:p@host/a@b``) is refused by ``validate``: percent-encode the password (``%40``,
``%2F``, ``%20``) or give it as ``cred:NAME`` / ``env:VAR``.
"""

import os
import re
from urllib.parse import quote

from agent._util.redact import split_userinfo
from agent.config.secrets import CRED_PREFIX, ENV_PREFIX, resolve_secret

SCHEMES = {"rtsp": "stream", "rtsps": "stream", "http": "stream", "https": "stream", "camera": "camera"}
KINDS = ("folder", "file", "stream", "camera")
LIVE_KINDS = ("stream", "camera")
AMBIGUOUS = ("the URL reads two ways (an '@', '/', '?', '#' or space in the password or path): percent-encode "
             "the password (@ as %40, / as %2F, space as %20) or give it as cred:NAME or env:VAR")
# Characters a userinfo may carry raw (RFC 3986 unreserved, sub-delims, ':' and percent-escapes).
_USERINFO_SAFE = "!$&'()*+,;=:~"
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")


def is_local_path(uri: str) -> bool:
    """A source URI naming a folder or a video file (not ``rtsp://...``, not ``camera:N``)."""
    return not ("://" in uri or uri.startswith("camera:"))


def source_kind(uri: str) -> str:
    """The kind of source ``uri`` names; ValueError (a message for ``validate``) when no reader takes it."""
    if not is_local_path(uri):
        scheme = uri.split(":", 1)[0].lower()
        kind = SCHEMES.get(scheme)
        if kind is None:
            raise ValueError("unknown scheme %r (known: %s, or a folder or video file path)" % (
                scheme, ", ".join(s + ("://" if k == "stream" else ":N") for s, k in SCHEMES.items())))
        if kind == "camera":
            camera_index(uri)
        elif split_userinfo(uri).ambiguous:
            raise ValueError(AMBIGUOUS)  # never the URI itself: it holds the password
        return kind
    if not uri:
        raise ValueError("must not be empty")
    return "folder" if os.path.isdir(uri) or not os.path.splitext(uri)[1] else "file"


def camera_index(uri: str) -> int:
    """N of ``camera:N``; ValueError unless N is a non-negative decimal integer."""
    text = uri.split(":", 1)[1]
    if not text.isdigit():
        raise ValueError("camera index must be a non-negative integer, as in camera:0 (got %r)" % text)
    return int(text)


def has_secret_reference(uri: str) -> bool:
    """Whether the URI's password is an ``env:``/``cred:`` reference rather than the secret itself."""
    password = split_userinfo(uri).password
    return password is not None and password.startswith((ENV_PREFIX, CRED_PREFIX))


def resolve_source_uri(uri: str, field: str = "sources.uri") -> str:
    """``uri`` as FFmpeg must get it: an ``env:``/``cred:`` password replaced by the secret, percent-encoded;
    a raw password with characters a URL cannot carry (``@ / ? #``, spaces) percent-encoded; others unchanged.

    Raises ConfigError naming ``field`` when the reference cannot be resolved.
    """
    parts = split_userinfo(uri)
    password = parts.password
    if password is None:
        return uri
    if password.startswith((ENV_PREFIX, CRED_PREFIX)):
        encoded = quote(resolve_secret(password, field) or "", safe="")
    else:
        encoded = _encode_raw(password)
    return "%s%s:%s@%s" % (parts.head, parts.user, encoded, parts.rest)


def _encode_raw(password: str) -> str:
    """A raw password percent-encoded where a URL cannot carry it; its own ``%XX`` escapes kept."""
    out, done = [], 0
    for escape in _ESCAPE.finditer(password):
        out += [quote(password[done:escape.start()], safe=_USERINFO_SAFE), escape.group(0)]
        done = escape.end()
    return "".join(out) + quote(password[done:], safe=_USERINFO_SAFE)
