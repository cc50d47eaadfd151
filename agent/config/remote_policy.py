"""What a remote ``set-config`` may do to sources: hand the box data, never a capability.

Whoever can publish ``set-config`` is trusted with the live fields, not with the box's secrets, its loopback or
its files. So, for every source a remote change adds or points at a new URI (``remote_config`` in the local
file is the policy; nothing here can be changed over MQTT):

* the URI is parsed (scheme, host, port, path, query) and matched part by part against
  ``remote_config.source_uris``: a ``*`` in a pattern's host matches within one label of the host (``*``
  alone: any host), never across ``.``, ``@``, ``:`` or ``/`` (``rtsp://10.1.2.*/stream1`` once matched ``rtsp://10.1.2.9:cred:mqtt-password@127.0.0.1/...``);
* it may carry no userinfo (``user:password@``), no ``@`` at all, and no ``cred:``/``env:`` reference: those
  would make the box resolve its own secrets and send them to the URI's host. A remotely set source gets a
  credential only from ``remote_config.credentials`` (pattern → ``USER:cred:NAME`` or ``USER:env:VAR``);
* its host must resolve, and to no loopback, link-local, unspecified, multicast or reserved address (an IPv6
  address that embeds an IPv4 one judged by it, as :mod:`agent._util.netaddr` classifies every address; a
  private address is allowed: cameras live there), nor one of the box's own (an address this box can bind):
  the box never becomes a client of itself;
* new or changed ``input_options`` keys must be in :data:`REMOTE_INPUT_OPTIONS` (timeouts, transport, buffer
  sizes, with decimal values): anything else can make FFmpeg connect elsewhere (``http_proxy``), listen
  (``rtsp_flags``, RTSP's ``timeout``), read files or other protocols (``protocol_whitelist``,
  ``input_format``), so it is local-only.

A source whose URI and options are those already in effect passes unchanged. Errors never repeat the URI.
A name is resolved again by FFmpeg when the source opens: a host name listed in a pattern trusts its DNS.
"""

import fnmatch
import re
import socket
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from agent._util import netaddr
from agent.config.schema import FieldError
from agent.config.secrets import CRED_PREFIX, ENV_PREFIX

_DIGITS = re.compile(r"[0-9]{1,12}")
# Input options a remote change may set, each with the values it takes; everything else is local-only.
REMOTE_INPUT_OPTIONS: Dict[str, Callable[[str], bool]] = {
    "stimeout": _DIGITS.fullmatch,  # RTSP socket I/O timeout, microseconds (FFmpeg < 5)
    "rw_timeout": _DIGITS.fullmatch,  # any protocol's read/write timeout, microseconds
    "rtsp_transport": lambda v: v in ("tcp", "udp"),  # not udp_multicast (joins groups) nor http (tunnels)
    "buffer_size": _DIGITS.fullmatch,  # UDP socket buffer, bytes
    "max_delay": _DIGITS.fullmatch,  # demuxer reordering delay, microseconds
    "reorder_queue_size": _DIGITS.fullmatch,  # RTP packets buffered for reordering
    "probesize": _DIGITS.fullmatch,
    "analyzeduration": _DIGITS.fullmatch,
    "fpsprobesize": _DIGITS.fullmatch,
}
# Address classes a remotely set source may never reach; private is not one of them (cameras live there).
NON_ROUTABLE = frozenset((netaddr.LOOPBACK, netaddr.LINK_LOCAL, netaddr.UNSPECIFIED, netaddr.MULTICAST,
                          netaddr.RESERVED))
DEFAULT_PORTS = {"rtsp": 554, "rtsps": 322, "http": 80, "https": 443}
_URI = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)"
                  r"(?::(?P<port>[0-9]{1,5}))?(?P<path>/[^?#@\s]*)?(?:\?(?P<query>[^#@\s]*))?")
_PATTERN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.*]+\]|[A-Za-z0-9.*?-]+)"
                      r"(?::(?P<port>[0-9]{1,5}|\*))?(?P<path>/[^?#@\s]*)?(?:\?(?P<query>[^#@\s]*))?")
_CREDENTIAL = re.compile(r"[^:@/\s]+:(?:%s|%s)[^@/\s]+" % (re.escape(CRED_PREFIX), re.escape(ENV_PREFIX)))


class UriParts(NamedTuple):
    scheme: str
    host: str
    port: Optional[str]
    path: str
    query: Optional[str]


def _parts(text: str, grammar: "re.Pattern[str]") -> Optional[UriParts]:
    match = grammar.fullmatch(text)
    if match is None:
        return None
    return UriParts(match.group("scheme").lower(), match.group("host").lower(), match.group("port"),
                    match.group("path") or "/", match.group("query"))


def pattern_problems(patterns: Sequence[str], credentials: Mapping[str, str]) -> List[Tuple[str, str]]:
    """``remote_config`` checked when the local file is read: each pattern parses; each credential is
    ``USER:cred:NAME`` or ``USER:env:VAR`` under a pattern of ``source_uris``."""
    problems = []
    for index, pattern in enumerate(patterns):
        parts = _parts(pattern, _PATTERN)
        if parts is None or parts.scheme not in DEFAULT_PORTS:
            problems.append(("source_uris[%d]" % index, "expected SCHEME://HOST[:PORT][/PATH][?QUERY] with scheme "
                             "%s, no user or password (got %r)" % (", ".join(DEFAULT_PORTS), pattern[:80])))
    for pattern, credential in credentials.items():
        if pattern not in patterns:
            problems.append(("credentials", "%r is not one of source_uris" % pattern[:80]))
        if not _CREDENTIAL.fullmatch(credential):
            problems.append(("credentials", "the credential of %r must be USER:cred:NAME or USER:env:VAR (a "
                             "reference, never the password)" % pattern[:80]))
    return problems


def _host_matches(host: str, pattern: str) -> bool:
    """``*`` alone is any host; otherwise ``*`` and ``?`` stay within one label, like a certificate's wildcard
    (``10.1.2.*`` is not ``10.1.2.9.evil.example``)."""
    if pattern == "*":
        return True
    grammar = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(grammar, host) is not None


def _matches(uri: UriParts, pattern: UriParts) -> bool:
    if uri.scheme != pattern.scheme or not _host_matches(uri.host, pattern.host):
        return False
    port = int(uri.port) if uri.port else DEFAULT_PORTS[uri.scheme]
    if pattern.port != "*" and port != (int(pattern.port) if pattern.port else DEFAULT_PORTS[uri.scheme]):
        return False
    if not fnmatch.fnmatchcase(uri.path, pattern.path):
        return False
    return uri.query is None if pattern.query is None else fnmatch.fnmatchcase(uri.query or "", pattern.query)


def _is_own(ip: netaddr.IPAddress) -> bool:
    """Whether ``ip`` is one of this box's addresses: only those can be bound."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((str(ip), 0))
        return True
    except OSError:
        return False


def address_problem(host: str, port: int) -> Optional[str]:
    """Why a remotely set source may not connect to ``host`` (None: it may): every address it resolves to."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "its host does not resolve"
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = netaddr.parse(str(sockaddr[0]))
        if netaddr.classes(ip) & NON_ROUTABLE:
            return "its host resolves to a loopback, link-local or other non-routable address"
        if _is_own(ip):
            return "its host resolves to one of this box's own addresses"
    return None


def _uri_problem(uri: str, patterns: Sequence[str]) -> Optional[str]:
    lowered = uri.lower()
    if "@" in uri or CRED_PREFIX in lowered or ENV_PREFIX in lowered:
        return ("a remote change may not carry a user, password or cred:/env: reference in a URI: credentials "
                "of remotely set sources come only from remote_config.credentials in the local config")
    parts = _parts(uri, _URI)
    patterns_parts = [p for p in (_parts(p, _PATTERN) for p in patterns) if p is not None]
    if parts is None or parts.scheme not in DEFAULT_PORTS or not any(_matches(parts, p) for p in patterns_parts):
        return ("a remote change may not point a source at a new URI unless remote_config.source_uris in the "
                "local config allows it (allowed: %s)" % (", ".join(patterns) or "none"))
    return address_problem(parts.host, int(parts.port) if parts.port else DEFAULT_PORTS[parts.scheme])


def _with_credential(uri: str, patterns: Sequence[str], credentials: Mapping[str, str]) -> str:
    """``uri`` with the local credential of the first pattern of ``credentials`` it matches (if any)."""
    parts = _parts(uri, _URI)
    for pattern, credential in credentials.items():
        pattern_parts = _parts(pattern, _PATTERN)
        if parts is not None and pattern_parts is not None and _matches(parts, pattern_parts):
            head, _, rest = uri.partition("://")
            return "%s://%s@%s" % (head, credential, rest)
    return uri


def _option_problems(field: str, before: Mapping[str, str], after: Mapping[str, str]) -> List[FieldError]:
    problems = []
    for key, value in sorted(after.items()):
        if before.get(key) == value:
            continue
        check = REMOTE_INPUT_OPTIONS.get(key)
        if check is None:
            problems.append(FieldError("%s.input_options.%s" % (field, key), "local-only: a remote change may set "
                                       "only %s" % ", ".join(sorted(REMOTE_INPUT_OPTIONS))))
        elif not check(str(value)):
            problems.append(FieldError("%s.input_options.%s" % (field, key), "a remote change may set it only to "
                                       "a decimal number (rtsp_transport: tcp or udp)"))
    return problems


def remote_sources(before: Sequence[Any], after: Sequence[Any], policy: Any) -> Tuple[List[Any], List[FieldError]]:
    """``after`` (the sources a remote change asks for) as the box will run them, with every refusal.

    ``before``: the sources in effect; ``policy``: the local ``remote_config``. Sources are the daemon config's
    :class:`SourceConfig`; a granted credential is written into the URI as a reference.
    """
    known = {s.name: s for s in before}
    sources, errors = [], []
    for index, source in enumerate(after):
        field = "sources[%d]" % index
        old = known.get(source.name)
        errors += _option_problems(field, old.input_options if old is not None else {}, source.input_options)
        if old is not None and old.uri == source.uri:
            sources.append(source)
            continue
        problem = _uri_problem(source.uri, policy.source_uris)
        if problem is not None:
            errors.append(FieldError(field + ".uri", problem))
            continue
        sources.append(replace(source, uri=_with_credential(source.uri, policy.source_uris, policy.credentials)))
    return sources, errors
