"""What kind of address an IP address is, judged as a connection to it would be: the one classification that
the box's policies on outgoing connections share (``lifecycle/fetch_policy.py`` for downloads,
``config/remote_policy.py`` for remotely set sources). Which classes each refuses stays with each policy.

An IPv6 address that carries an IPv4 address is judged as that IPv4 address, since that is where a packet to it
ends up: IPv4-mapped ``::ffff:127.0.0.1``, NAT64 ``64:ff9b::7f00:1`` (RFC 6052: a gateway connects to the last
32 bits) and 6to4 ``2002:7f00:1::`` (RFC 3056: bits 16-47) are all ``127.0.0.1``. Judged by the IPv6 address
itself, the NAT64 and 6to4 forms of loopback passed as public.
"""

import ipaddress
from typing import FrozenSet, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the IPv4 address is the last 32 bits

# The classes, each as Python's ipaddress defines it (its is_* property of the same name).
LOOPBACK = "loopback"
PRIVATE = "private"
LINK_LOCAL = "link_local"
UNSPECIFIED = "unspecified"
MULTICAST = "multicast"
RESERVED = "reserved"
GLOBAL = "global"
CLASSES = (LOOPBACK, PRIVATE, LINK_LOCAL, UNSPECIFIED, MULTICAST, RESERVED, GLOBAL)


def embedded_ipv4(ip: IPAddress) -> IPAddress:
    """The IPv4 address ``ip`` carries (IPv4-mapped, NAT64, 6to4); ``ip`` itself otherwise."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if ip.sixtofour is not None:
            return ip.sixtofour
    return ip


def parse(text: str) -> IPAddress:
    """The address ``text`` names (a literal, or a ``getaddrinfo`` sockaddr's host with its ``%zone``), as it is
    judged: the IPv4 address it embeds, if any. Raises ``ValueError`` when ``text`` is not an address."""
    return embedded_ipv4(ipaddress.ip_address(text.split("%", 1)[0]))


def classes(ip: IPAddress) -> FrozenSet[str]:
    """The classes of :data:`CLASSES` that ``ip`` (judged by the IPv4 address it embeds) belongs to."""
    judged = embedded_ipv4(ip)
    return frozenset(name for name in CLASSES if getattr(judged, "is_" + name))
