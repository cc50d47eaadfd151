"""The one credential redaction: every URI the box prints, publishes or stores passes through :func:`redact`.

Two kinds of URI carry secrets. Camera URLs carry passwords (``rtsp://user:pass@host/...``), and so do the error
texts that name them (FFmpeg and OpenCV repeat the URL). A bundle's pre-signed download URL carries its token
in the query (``https://host/b.tar?X-Amz-Signature=...``, ``?sig=``, ``?token=``), and a deploy's acks and
progress lines name that URL. :func:`redact` masks both with ``***`` in every URI of a text: the password of
``scheme://user:password@`` (the user name stays: operators need it to tell cameras apart), and the value of
every query parameter whose name says it is a credential. Other parameters stay (``?channel=2&subtype=0``
tells an NVR's cameras apart).

Where a password ends (:func:`split_userinfo`, also the sources' parser, so the two never disagree): a password
written raw may hold ``/``, ``@``, ``?``, ``#`` or a space (``rtsp://viewer:Pa/ss@w0rd@10.0.0.5/cam``), which
a URL parser reads as the start of the path or the end of the userinfo. The userinfo is therefore everything
between ``scheme://`` and the **last** ``@`` after which the rest reads as ``host[:port]`` followed by the end,
``/``, ``?``, ``#``, a space or punctuation. In a text, a URI is followed up to the end of its line or the next
``scheme://``, so a password with a space is masked whole; a later ``@host`` on the same line can only make the
mask longer, never shorter.
"""

import re
from typing import Any, List, NamedTuple, Optional

MASK = "***"
# A URI inside a text: scheme://, then up to whitespace or a quote/bracket that ends it in prose.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# What follows a userinfo's '@': a name or IPv4 address, or [IPv6], then an optional port.
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%-]+)(?::[0-9]*)?")
_HOST_CHARS = re.compile(r"[A-Za-z0-9._~%@:\[\]-]")  # a host[:port] followed by one of these is not a whole one
# Query parameter names that hold a credential: AWS/GCS X-*-Signature, -Credential, -Security-Token; Azure's
# sig; OSS/OBS AccessKeyId; token, access_token, api_key, password, pwd, secret, auth, session.
_SECRET_PARAM = re.compile(r"sig|token|key|pass|pwd|secret|cred|auth|session", re.IGNORECASE)
_PROSE_END = ").,:;"
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#]+)=(?P<value>[^&;#]*)")


class Userinfo(NamedTuple):
    """A URI cut at its userinfo: ``head`` (``rtsp://``), ``userinfo`` (None: none), ``rest`` (host onwards).

    ``ambiguous``: the URI also reads another way that keeps a password elsewhere (``rtsp://u:p@h/a@b`` is
    user ``u`` at ``h``, or password ``p@h/a`` at ``b``); configs refuse such a URI, :func:`redact` masks the
    longer reading.
    """

    head: str
    userinfo: Optional[str]
    rest: str
    ambiguous: bool = False

    @property
    def user(self) -> Optional[str]:
        return None if self.userinfo is None else self.userinfo.partition(":")[0]

    @property
    def password(self) -> Optional[str]:
        """After the userinfo's first ':' (None without one: a user name alone)."""
        if self.userinfo is None or ":" not in self.userinfo:
            return None
        return self.userinfo.partition(":")[2]


def _ends_userinfo(text: str, at: int) -> bool:
    """Whether ``text[at]`` is an '@' after which ``text`` reads as host[:port], then its end or a non-host char."""
    match = _HOST_PORT.match(text, at + 1)
    return match is not None and (match.end() == len(text) or not _HOST_CHARS.match(text, match.end()))


def _userinfo_ends(text: str) -> List[int]:
    """Every '@' in ``text`` (what follows ``scheme://``) that could end a userinfo."""
    return [i for i, c in enumerate(text) if c == "@" and _ends_userinfo(text, i)]


def split_userinfo(uri: str) -> Userinfo:
    """``uri`` cut at its userinfo by the rule above (a URI without ``://`` has none)."""
    head, sep, tail = uri.partition("://")
    if not sep:
        return Userinfo("", None, uri)
    head += sep
    authority = re.split(r"[/?#]", tail, maxsplit=1)[0]
    plain_info, plain_at, plain_host = authority.rpartition("@")  # how FFmpeg and RFC 3986 read it
    plain = Userinfo(head, plain_info if plain_at else None, tail[len(plain_info) + 1:] if plain_at else tail)
    plain_valid = _HOST_PORT.fullmatch(plain_host) is not None
    ends = _userinfo_ends(tail)
    if not ends:
        return plain
    last = Userinfo(head, tail[:ends[-1]], tail[ends[-1] + 1:])
    if last.password is None or (plain_valid and last.userinfo == plain.userinfo):
        return plain if plain_valid else last
    ambiguous = len(ends) > 1 or (plain_valid and plain.userinfo != last.userinfo)
    return last._replace(ambiguous=ambiguous)


def _mask_userinfo(text: str) -> str:
    """Each ``scheme://user:password@`` of ``text`` with the password masked (the user name stays)."""
    out, done = [], 0
    heads = list(_SCHEME.finditer(text))
    for index, head in enumerate(heads):
        line_end = text.find("\n", head.end())
        stops = [len(text), line_end if line_end >= 0 else len(text)]
        if index + 1 < len(heads):
            stops.append(heads[index + 1].start())
        span = text[head.end():min(stops)]
        ends = _userinfo_ends(span)
        if not ends:
            continue
        colon = span.find(":", 0, ends[-1])
        if colon < 0:
            continue
        out.append(text[done:head.end() + colon + 1] + MASK)
        done = head.end() + ends[-1]
    return "".join(out) + text[done:]


def _redact_query(match: "re.Match[str]") -> str:
    found = match.group(0)
    uri = found.rstrip(_PROSE_END)  # "fetching URL: refused", "(see URL)": the punctuation is the text's
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
    if "://" not in text:
        return text
    return _URI.sub(_redact_query, _mask_userinfo(text))


def redact_all(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string redacted, for payloads and reports."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_all(v) for v in value]
    return value
