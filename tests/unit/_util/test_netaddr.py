"""The one address classification (agent/_util/netaddr.py) that both policies on outgoing connections use:
lifecycle/fetch_policy.py refuses what is not global, config/remote_policy.py what is loopback, link-local,
unspecified, multicast or reserved (their own tests: tests/unit/lifecycle/test_fetch*.py,
tests/unit/config/test_remote_policy.py)."""

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent._util import netaddr
from agent._util.netaddr import GLOBAL, LINK_LOCAL, LOOPBACK, MULTICAST, PRIVATE, RESERVED, UNSPECIFIED


@pytest.mark.parametrize("text, expected", [
    ("8.8.8.8", {GLOBAL}),
    ("127.0.0.1", {LOOPBACK, PRIVATE}),
    ("10.0.0.7", {PRIVATE}),
    ("169.254.169.254", {LINK_LOCAL, PRIVATE}),  # the cloud metadata address
    ("0.0.0.0", {UNSPECIFIED, PRIVATE}),
    ("224.0.0.1", {MULTICAST, GLOBAL}),
    ("240.0.0.1", {RESERVED, PRIVATE}),
    ("::1", {LOOPBACK, PRIVATE, RESERVED}),
    ("fe80::1", {LINK_LOCAL, PRIVATE}),
    ("fe80::1%eth0", {LINK_LOCAL, PRIVATE}),  # a getaddrinfo sockaddr's host carries the zone
    ("2001:4860:4860::8888", {GLOBAL}),
    ("::ffff:127.0.0.1", {LOOPBACK, PRIVATE}),  # IPv4-mapped
    ("64:ff9b::7f00:1", {LOOPBACK, PRIVATE}),  # NAT64 of 127.0.0.1
    ("64:ff9b::a9fe:a9fe", {LINK_LOCAL, PRIVATE}),  # NAT64 of 169.254.169.254
    ("2002:7f00:1::1", {LOOPBACK, PRIVATE}),  # 6to4 of 127.0.0.1
    ("2002:c0a8:101::1", {PRIVATE}),  # 6to4 of 192.168.1.1
    ("64:ff9b::808:808", {GLOBAL}),  # NAT64 of 8.8.8.8
    ("2002:808:808::1", {GLOBAL}),  # 6to4 of 8.8.8.8
])
def test_each_address_has_the_classes_of_the_address_a_connection_reaches(text, expected):
    assert netaddr.classes(netaddr.parse(text)) == expected
    assert netaddr.classes(ipaddress.ip_address(text.split("%")[0])) == expected  # unparsed: judged the same


@given(st.integers(min_value=0, max_value=2 ** 32 - 1))
def test_an_ipv6_address_that_embeds_an_ipv4_one_is_judged_as_that_one(value):
    ipv4 = ipaddress.IPv4Address(value)
    embeddings = (ipaddress.IPv6Address((0xFFFF << 32) | value),  # ::ffff:a.b.c.d (RFC 4291)
                  ipaddress.IPv6Address((0x64FF9B << 96) | value),  # 64:ff9b::a.b.c.d (RFC 6052)
                  ipaddress.IPv6Address((0x2002 << 112) | (value << 80)))  # 2002:aabb:ccdd:: (RFC 3056)
    for ip in embeddings:
        assert netaddr.embedded_ipv4(ip) == ipv4
        assert netaddr.parse(str(ip).upper()) == ipv4
        assert netaddr.classes(ip) == netaddr.classes(ipv4)


@pytest.mark.parametrize("text", ["64:ff9b:1::7f00:1",  # outside 64:ff9b::/96 (local-use NAT64 is not judged)
                                  "2003:7f00:1::1", "::fffe:7f00:1", "2001:db8::1", "::1"])
def test_an_address_outside_those_prefixes_is_judged_as_itself(text):
    ip = ipaddress.ip_address(text)
    assert netaddr.embedded_ipv4(ip) is ip
    assert netaddr.parse(text) == ip and netaddr.parse(text).version == 6
    assert netaddr.embedded_ipv4(ipaddress.ip_address("10.0.0.7")) == ipaddress.ip_address("10.0.0.7")


@pytest.mark.parametrize("text", ["", "models.example", "[::1]", "127.0.0.256", "::ffff:127.0.0.1/8"])
def test_what_is_not_an_address_is_a_value_error(text):
    with pytest.raises(ValueError):
        netaddr.parse(text)
