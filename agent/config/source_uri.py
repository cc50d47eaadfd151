"""What a source URI names, decided once: its kind by scheme, and its password resolved from a reference.

Kinds: ``stream`` (``rtsp://``, ``rtsps://``, ``http://``, ``https://``), ``camera`` (``camera:N``, a V4L2
device index), and, without a scheme, ``folder`` (an existing directory, or a path without a suffix) or
``file`` (a video file). Any other scheme is refused by ``validate``. The frame path registers one reader per
kind (:mod:`agent.pipeline.sources`).

A stream's password may be a reference instead of the secret, ``rtsp://admin:env:CAM1_PASSWORD@host/s`` or
``rtsp://admin:cred:cam1@host/s``, resolved by :func:`agent.config.secrets.resolve_secret` when the source
opens, so the config file, the overrides file and every report hold only the reference.
"""

import os
from typing import Optional, Tuple
from urllib.parse import quote

from agent.config.secrets import CRED_PREFIX, ENV_PREFIX, resolve_secret

SCHEMES = {"rtsp": "stream", "rtsps": "stream", "http": "stream", "https": "stream", "camera": "camera"}
KINDS = ("folder", "file", "stream", "camera")
LIVE_KINDS = ("stream", "camera")


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


def _split_userinfo(uri: str) -> Tuple[str, Optional[str], Optional[str], str]:
    """(scheme://, user, password, rest) of a stream URI; user and password None when absent."""
    head, _, tail = uri.partition("://")
    authority_end = len(tail)
    for stop in "/?#":
        index = tail.find(stop)
        if index >= 0:
            authority_end = min(authority_end, index)
    authority, rest = tail[:authority_end], tail[authority_end:]
    if "@" not in authority:
        return head + "://", None, None, tail
    userinfo, _, host = authority.rpartition("@")
    user, colon, password = userinfo.partition(":")
    return head + "://", user, password if colon else None, host + rest


def has_secret_reference(uri: str) -> bool:
    """Whether the URI's password is an ``env:``/``cred:`` reference rather than the secret itself."""
    _, _, password, _ = _split_userinfo(uri) if "://" in uri else ("", None, None, "")
    return password is not None and password.startswith((ENV_PREFIX, CRED_PREFIX))


def resolve_source_uri(uri: str, field: str = "sources.uri") -> str:
    """``uri`` with an ``env:``/``cred:`` password replaced by the secret (percent-encoded); others unchanged.

    Raises ConfigError naming ``field`` when the reference cannot be resolved.
    """
    if not has_secret_reference(uri):
        return uri
    head, user, password, rest = _split_userinfo(uri)
    secret = resolve_secret(password, field) or ""
    return "%s%s:%s@%s" % (head, user, quote(secret, safe=""), rest)
