"""The daemon's MQTT settings (``mqtt:`` in its config): brokers, account, TLS, reconnect policy.

Part of the one daemon schema (:mod:`agent.config.daemon_config`); ``ctl`` and ``fleet`` read the same
``MqttConfig`` so that a box and its operator agree on brokers, prefix and TLS.
"""

import ipaddress
from dataclasses import dataclass
from typing import List, Optional, Tuple

from agent.config.names import name_problem
from agent.config.schema import setting

DEFAULT_PREFIX = "atlas-edge"


@dataclass(frozen=True)
class TlsConfig:
    ca_file: Optional[str] = setting(None, doc="CA bundle that signed the broker's certificate")
    cert_file: Optional[str] = setting(None, doc="client certificate (mutual TLS)")
    key_file: Optional[str] = setting(None, doc="client key; may be a systemd credential name 'cred:NAME'")
    insecure: bool = setting(False, doc="skip hostname verification (test brokers only)")


def parse_host_port(text: str, default_port: int) -> Tuple[str, int]:
    """``host:port`` (or ``[v6]:port``, or a bare host on ``default_port``); ValueError says what is wrong."""
    host, sep, port = text.rpartition(":") if not text.endswith("]") else ("", "", "")
    if not sep or (":" in host and not host.startswith("[")):  # a bare host, or a bare IPv6 address
        host, port = text, str(default_port)
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or any(c.isspace() for c in host):
        raise ValueError("expected HOST:PORT, got %r" % text)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("port must be 1-65535 in %r" % text)
    return host, int(port)


@dataclass(frozen=True)
class MqttConfig:
    host: str = setting("localhost", doc="broker host (when hosts is empty)")
    port: int = setting(1883, ge=1, le=65535, doc="broker port (when hosts is empty)")
    hosts: List[str] = setting(factory=list, doc="brokers as HOST:PORT, tried in turn (a cluster's nodes); "
                               "when set, host and port are not used")
    connect_timeout_s: float = setting(5.0, gt=0, le=60, doc="bound on one connect attempt (TCP, TLS, CONNACK) "
                                       "before the next broker is tried")
    prefix: str = setting(DEFAULT_PREFIX, doc="topic prefix: <prefix>/<device>/...")
    client_id: Optional[str] = setting(None, doc="MQTT client id; default atlas-edge-<device_id>")
    username: Optional[str] = setting(None, doc="MQTT username")
    password: Optional[str] = setting(
        None, doc="password, or 'env:VAR' / 'cred:NAME' (systemd LoadCredential) to keep it out of the file"
    )
    tls: Optional[TlsConfig] = setting(None, doc="enable TLS with these files")
    qos: int = setting(1, choices=(0, 1, 2), doc="QoS of result messages")
    keepalive_s: int = setting(30, ge=5, le=3600, doc="MQTT keepalive")
    reconnect_min_s: float = setting(0.5, gt=0, le=3600, doc="first reconnect delay; doubles up to reconnect_max_s")
    reconnect_max_s: float = setting(30.0, gt=0, le=86400, doc="longest reconnect delay")
    groups: List[str] = setting(factory=list, doc="groups whose commands this device obeys")
    allow_plain_password: bool = setting(False, doc="send the password to a broker that is not on loopback "
                                         "without TLS (anyone on the path reads it): trusted networks only")
    homeassistant_discovery: bool = setting(False, doc="publish Home Assistant MQTT discovery configs")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if self.reconnect_max_s < self.reconnect_min_s:
            problems.append(("reconnect_max_s", "must be >= reconnect_min_s"))
        problem = name_problem(self.prefix, levels=True)
        if problem:
            problems.append(("prefix", problem))
        for index, group in enumerate(self.groups):
            problem = name_problem(group)
            if problem:
                problems.append(("groups[%d]" % index, problem))
        for index, address in enumerate(self.hosts):
            try:
                parse_host_port(address, self.port)
            except ValueError as exc:
                problems.append(("hosts[%d]" % index, str(exc)))
        if self.password is not None and self.tls is None and not self.allow_plain_password:
            remote = [host for host, _port in _parsed_brokers(self) if not is_loopback(host)]
            if remote:
                problems.append(("password", "would be sent in clear over plain TCP to %s: set mqtt.tls, or "
                                 "mqtt.allow_plain_password: true on a network you trust" % ", ".join(remote)))
        return problems

    def brokers(self) -> List[Tuple[str, int]]:
        """The brokers to try, in order: ``hosts`` when given, else ``host``:``port``."""
        if not self.hosts:
            return [(self.host, self.port)]
        return [parse_host_port(address, self.port) for address in self.hosts]


def _parsed_brokers(config: "MqttConfig") -> List[Tuple[str, int]]:
    try:
        return config.brokers()
    except ValueError:  # reported as hosts[i] by check()
        return []


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
