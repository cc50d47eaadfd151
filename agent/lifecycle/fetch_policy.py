"""Where a deploy may download from: the box's own fetch policy (``fetch:`` in its config file).

A deploy command names a URL, and whoever can publish on the broker would otherwise make the box a client of
anything it can reach: its own loopback services, the plant's internal network, ``ftp://`` through a redirect.
The policy is enforced where it cannot be dodged:

- the URL's scheme, host and port before anything is sent: a port must be the scheme's own (443, 80) or
  listed in ``fetch.ports``;
- every address the host name resolves to, at connect time, and the socket connects to the address that was
  checked (no second lookup a DNS server could answer differently): loopback, private, link-local and other
  non-global addresses are refused unless the name, the address or its network is listed in ``fetch.hosts``.
  An address that embeds an IPv4 address is judged by it: IPv4-mapped (``::ffff:127.0.0.1``), NAT64
  (``64:ff9b::7f00:1``, RFC 6052) and 6to4 (``2002:7f00:1::``, RFC 3056), as :mod:`agent._util.netaddr`
  classifies every address;
- every redirect: never to another scheme, to another host only if that host is listed, and to a port only if
  the policy allows it (a redirect on the same host to another port included).

Only this module's HTTP and HTTPS handlers are installed (no ``ftp:``, ``file:`` or ``data:``, no proxy from
the environment). A refusal names the rule, never what a server said.
"""

import errno
import fnmatch
import http.client
import ipaddress
import os
import select
import socket
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

from agent._util import netaddr
from agent._util.compat import Protocol
from agent.config.daemon_config import FetchConfig

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
MAX_REDIRECTS = 5
SCHEME_PORTS = {"http": 80, "https": 443}


CONNECT_POLL_S = 0.2  # a connect in progress looks at the download's watch this often (cancel within 2 s)


class Refused(Exception):
    """The fetch policy forbids this URL, address or redirect; the message names the rule."""


class Watch(Protocol):
    """What a download lends the connections it opens (:class:`agent.lifecycle.fetch.SocketWatch`)."""

    def register(self, sock: socket.socket) -> None:
        """Take note of a connected socket, to shut it down when the download must end."""

    def stopped(self) -> bool:
        """Whether the download must end now (deadline passed, or cancelled)."""


class _NoWatch:
    def register(self, sock: socket.socket) -> None:
        pass

    def stopped(self) -> bool:
        return False


@dataclass(frozen=True)
class FetchPolicy:
    schemes: Tuple[str, ...] = ("https",)
    hosts: Tuple[str, ...] = ()
    max_bytes: int = FetchConfig.max_bytes
    timeout_s: float = FetchConfig.timeout_s
    deadline_s: float = FetchConfig.deadline_s
    ports: Tuple[int, ...] = ()  # empty: each scheme's own port only
    unpack_deadline_s: float = FetchConfig.unpack_deadline_s

    @classmethod
    def from_config(cls, config: FetchConfig) -> "FetchPolicy":
        return cls(tuple(config.schemes), tuple(config.hosts), config.max_bytes, config.timeout_s,
                   config.deadline_s, tuple(config.ports), config.unpack_deadline_s)

    def check_url(self, url: str) -> None:
        """Scheme and host of ``url`` against the policy; raises :class:`Refused`."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in self.schemes:
            raise Refused("scheme %s is not allowed (fetch.schemes: %s)" % (parts.scheme or "(none)",
                                                                             ", ".join(self.schemes)))
        host = (parts.hostname or "").lower()
        if not host:
            raise Refused("the URL names no host")
        if self.hosts and not self.listed(host):
            raise Refused("host %s is not in fetch.hosts" % host)
        try:
            port = parts.port if parts.port is not None else SCHEME_PORTS[parts.scheme]
        except ValueError:
            raise Refused("the URL's port is not a number from 0 to 65535") from None
        if port not in (self.ports or (SCHEME_PORTS[parts.scheme],)):
            raise Refused("port %d is not allowed (fetch.ports: %s)" % (
                port, ", ".join(str(p) for p in self.ports) or "only the scheme's own, %d" % SCHEME_PORTS[
                    parts.scheme]))

    def listed(self, host: str, address: Optional[netaddr.IPAddress] = None) -> bool:
        """Whether ``host`` (or the address it resolved to) is named in ``fetch.hosts``."""
        for entry in self.hosts:
            network = _network(entry)
            if network is not None:
                ip = address or _address(host)
                if ip is not None and ip.version == network.version and ip in network:
                    return True
            elif fnmatch.fnmatchcase(host, entry.lower()):
                return True
        return False

    def resolve(self, host: str, port: int) -> List[Tuple[Any, ...]]:
        """The getaddrinfo entries of ``host`` this policy lets the box connect to; raises Refused if none."""
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        allowed = []
        for info in infos:
            ip = netaddr.parse(info[4][0])
            if netaddr.GLOBAL in netaddr.classes(ip) or self.listed(host.lower(), ip):
                allowed.append(info)
        if not allowed:
            raise Refused("%s resolves to a loopback, private or link-local address (list it in fetch.hosts to "
                          "allow it)" % host)
        return allowed

    def opener(self, watch: Optional[Watch] = None) -> urllib.request.OpenerDirector:
        """An opener with only this policy's HTTP(S) handlers and redirect rule; every socket it connects is
        registered with ``watch``, which can end a connect in progress."""
        opener = urllib.request.OpenerDirector()
        watch = watch or _NoWatch()
        for handler in (_HttpHandler(self, watch), _HttpsHandler(self, watch), _Redirects(self),
                        urllib.request.HTTPErrorProcessor(), urllib.request.HTTPDefaultErrorHandler()):
            opener.add_handler(handler)
        return opener


def _network(entry: str) -> Optional[IPNetwork]:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def _address(host: str) -> Optional[netaddr.IPAddress]:
    """The address a literal ``host`` names, judged by the IPv4 address it embeds; None for a name."""
    try:
        return netaddr.parse(host)
    except ValueError:
        return None


def _connect(policy: FetchPolicy, watch: Watch, address: Tuple[str, int],
             timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT, source_address: Any = None) -> socket.socket:
    """``socket.create_connection`` that connects only to the addresses the policy allowed, and that ``watch``
    can end while the connect is in progress (a blocking connect would hold a cancel for the whole timeout)."""
    host, port = address
    last: Optional[OSError] = None
    for family, socktype, proto, _name, sockaddr in policy.resolve(host, port):
        sock = socket.socket(family, socktype, proto)
        try:
            _connect_watched(sock, sockaddr, timeout if isinstance(timeout, (int, float)) else None, watch)
            watch.register(sock)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    assert last is not None
    raise last


def _connect_watched(sock: socket.socket, sockaddr: Any, timeout: Optional[float], watch: Watch) -> None:
    """A non-blocking connect, waited for in short steps that look at ``watch``; the socket then blocks with
    ``timeout`` per operation."""
    sock.setblocking(False)
    code = sock.connect_ex(sockaddr)
    end = None if timeout is None else time.monotonic() + timeout
    while code in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
        if watch.stopped():
            raise OSError(errno.ECANCELED, "the download was ended while connecting")
        left = CONNECT_POLL_S if end is None else min(CONNECT_POLL_S, end - time.monotonic())
        if left <= 0:
            raise socket.timeout("connect timed out")
        _, writable, _ = select.select([], [sock], [], left)
        if writable:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, os.strerror(code))
    sock.settimeout(timeout)


def _with_policy(connection: Any, policy: FetchPolicy, watch: Watch) -> Any:
    connection._create_connection = lambda address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source=None: \
        _connect(policy, watch, address, timeout, source)
    return connection


class _HttpHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: FetchPolicy, watch: Watch) -> None:
        super().__init__()
        self.policy = policy
        self.watch = watch

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kw: _with_policy(http.client.HTTPConnection(host, **kw), self.policy,
                                                            self.watch), req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: FetchPolicy, watch: Watch) -> None:
        super().__init__()
        self.policy = policy
        self.watch = watch
        self.context = ssl.create_default_context()

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kw: _with_policy(
            http.client.HTTPSConnection(host, context=self.context, timeout=kw.get("timeout")), self.policy,
            self.watch), req)


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, policy: FetchPolicy) -> None:
        self.policy = policy

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Optional[urllib.request.Request]:
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if new.scheme != old.scheme:
            raise Refused("a redirect to another scheme (redirects never change the scheme)")
        new_host = (new.hostname or "").lower()
        if new_host != (old.hostname or "").lower() and not self.policy.listed(new_host):
            raise Refused("a redirect to another host not in fetch.hosts")
        try:
            self.policy.check_url(newurl)
        except Refused:
            raise Refused("a redirect outside the fetch policy") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)
