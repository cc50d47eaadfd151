"""Where a deploy may download from: the box's own fetch policy (``fetch:`` in its config file).

A deploy command names a URL, and whoever can publish on the broker would otherwise make the box a client of
anything it can reach: its own loopback services, the plant's internal network, ``ftp://`` through a redirect.
The policy is enforced where it cannot be dodged:

- the URL's scheme and host before anything is sent;
- every address the host name resolves to, at connect time, and the socket connects to the address that was
  checked (no second lookup a DNS server could answer differently): loopback, private, link-local and other
  non-global addresses are refused unless the name, the address or its network is listed in ``fetch.hosts``;
- every redirect: never to another scheme, and to another host only if that host is listed.

Only this module's HTTP and HTTPS handlers are installed (no ``ftp:``, ``file:`` or ``data:``, no proxy from
the environment). A refusal names the rule, never what a server said.
"""

import fnmatch
import http.client
import ipaddress
import socket
import ssl
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

from agent.config.daemon_config import FetchConfig

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
MAX_REDIRECTS = 5


class Refused(Exception):
    """The fetch policy forbids this URL, address or redirect; the message names the rule."""


@dataclass(frozen=True)
class FetchPolicy:
    schemes: Tuple[str, ...] = ("https",)
    hosts: Tuple[str, ...] = ()
    max_bytes: int = FetchConfig.max_bytes
    timeout_s: float = FetchConfig.timeout_s
    deadline_s: float = FetchConfig.deadline_s

    @classmethod
    def from_config(cls, config: FetchConfig) -> "FetchPolicy":
        return cls(tuple(config.schemes), tuple(config.hosts), config.max_bytes, config.timeout_s,
                   config.deadline_s)

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

    def listed(self, host: str, address: Optional[IPAddress] = None) -> bool:
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
            ip = _unmapped(ipaddress.ip_address(info[4][0].split("%", 1)[0]))
            if ip.is_global or self.listed(host.lower(), ip):
                allowed.append(info)
        if not allowed:
            raise Refused("%s resolves to a loopback, private or link-local address (list it in fetch.hosts to "
                          "allow it)" % host)
        return allowed

    def opener(self) -> urllib.request.OpenerDirector:
        """An opener with only this policy's HTTP(S) handlers and redirect rule."""
        opener = urllib.request.OpenerDirector()
        for handler in (_HttpHandler(self), _HttpsHandler(self), _Redirects(self),
                        urllib.request.HTTPErrorProcessor(), urllib.request.HTTPDefaultErrorHandler()):
            opener.add_handler(handler)
        return opener


def _network(entry: str) -> Optional[IPNetwork]:
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return None


def _address(host: str) -> Optional[IPAddress]:
    try:
        return _unmapped(ipaddress.ip_address(host))
    except ValueError:
        return None


def _unmapped(ip: IPAddress) -> IPAddress:
    """``::ffff:127.0.0.1`` is judged as ``127.0.0.1``."""
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _connect(policy: FetchPolicy, address: Tuple[str, int], timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,
             source_address: Any = None) -> socket.socket:
    """``socket.create_connection`` that connects only to the addresses the policy allowed."""
    host, port = address
    last: Optional[OSError] = None
    for family, socktype, proto, _name, sockaddr in policy.resolve(host, port):
        sock = socket.socket(family, socktype, proto)
        try:
            if timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    assert last is not None
    raise last


def _with_policy(connection: Any, policy: FetchPolicy) -> Any:
    connection._create_connection = lambda address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source=None: \
        _connect(policy, address, timeout, source)
    return connection


class _HttpHandler(urllib.request.HTTPHandler):
    def __init__(self, policy: FetchPolicy) -> None:
        super().__init__()
        self.policy = policy

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kw: _with_policy(http.client.HTTPConnection(host, **kw), self.policy),
                            req)


class _HttpsHandler(urllib.request.HTTPSHandler):
    def __init__(self, policy: FetchPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.context = ssl.create_default_context()

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(lambda host, **kw: _with_policy(
            http.client.HTTPSConnection(host, context=self.context, timeout=kw.get("timeout")), self.policy), req)


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
