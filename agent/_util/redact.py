"""The one credential redaction: every URI the box prints, publishes or stores passes through :func:`redact`.

Two kinds of URI carry secrets. Camera URLs carry passwords (``rtsp://user:pass@host/...``), and so do the error
texts that name them (FFmpeg and OpenCV repeat the URL). A bundle's pre-signed download URL carries its token
in the query (``https://host/b.tar?X-Amz-Signature=...``, ``?sig=``, ``?token=``), and a deploy's acks and
progress lines name that URL. :func:`redact` masks both with ``***`` in every URI of a text: the password of
``scheme://user:password@`` (the user name stays: operators need it to tell cameras apart), and the value of
every query parameter whose name says it is a credential. Other parameters stay (``?channel=2&subtype=0``
tells an NVR's cameras apart).
"""

import re
from typing import Any

MASK = "***"
# A URI inside a text: scheme://, then up to whitespace or a quote/bracket that ends it in prose.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")
# scheme://user:password@ : the password runs up to the last '@' before the path (passwords may contain '@'
# only percent-encoded, but a careless one is still hidden up to the last '@' of the authority).
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<secret>[^/\s]*)@")
# Query parameter names that hold a credential: AWS/GCS X-*-Signature, -Credential, -Security-Token; Azure's
# sig; OSS/OBS AccessKeyId; token, access_token, api_key, password, pwd, secret, auth, session.
_SECRET_PARAM = re.compile(r"sig|token|key|pass|pwd|secret|cred|auth|session", re.IGNORECASE)
_PROSE_END = ").,:;"
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#]+)=(?P<value>[^&;#]*)")


def _redact_uri(match: "re.Match[str]") -> str:
    found = match.group(0)
    uri = found.rstrip(_PROSE_END)  # "fetching URL: refused", "(see URL)": the punctuation is the text's
    uri = _USERINFO.sub(lambda m: "%s:%s@" % (m.group("head"), MASK), uri)
    query_at = uri.find("?", uri.index("://") + 3)
    if query_at >= 0:
        uri = uri[:query_at] + _QUERY_PARAM.sub(_mask_param, uri[query_at:])
    return uri + found[len(found.rstrip(_PROSE_END)):]


def _mask_param(match: "re.Match[str]") -> str:
    if not _SECRET_PARAM.search(match.group("name")):
        return match.group(0)
    return "%s%s=%s" % (match.group("sep"), match.group("name"), MASK)


def redact(text: str) -> str:
    """``text`` with the password and the credential query values of each URI in it replaced by :data:`MASK`."""
    return _URI.sub(_redact_uri, text)


def redact_all(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string redacted, for payloads and reports."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_all(v) for v in value]
    return value
