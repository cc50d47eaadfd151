"""The one credential redaction: every URI the box prints, publishes or stores passes through :func:`redact`.

Camera URLs carry passwords (``rtsp://user:pass@host/...``), and so do the error texts that name them (FFmpeg
and OpenCV repeat the URL). :func:`redact` replaces the password of every ``scheme://user:password@`` in a
text with ``***`` and keeps the user name, which operators need to tell cameras apart.
"""

import re
from typing import Any

MASK = "***"
# scheme://user:password@ : the password runs up to the last '@' before the host (passwords may contain '@'
# only percent-encoded, but a careless one is still hidden up to the last '@' of the authority).
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<secret>[^/\s]*)@")


def redact(text: str) -> str:
    """``text`` with the password of each URI in it replaced by :data:`MASK`."""
    return _USERINFO.sub(lambda m: "%s:%s@" % (m.group("head"), MASK), text)


def redact_all(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string redacted, for payloads and reports."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_all(v) for v in value]
    return value
