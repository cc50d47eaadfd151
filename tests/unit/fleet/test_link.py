"""The operator's link (agent/fleet/link.py) connecting: a broker that takes the TCP connection but sends no CONNACK,
or drops the connection before it, is tried again within a bound, and the error says which of them happened; a
refusal is not retried. Each situation is forced (a relay that holds the real Mosquitto's CONNACK until the
second attempt, a listener that closes or refuses after reading the CONNECT), never waited for by chance."""

import socket
import threading
from typing import Any, List

import pytest
from conftest import WAIT_S

from agent.devtools.broker import free_port
from agent.fleet.link import LinkError, open_link
from agent.ops.mqtt_client import new_client

CONNACK_S = 0.5  # the link's bound per attempt in these tests (the field's is CONNACK_TIMEOUT_S, 10 s)
NOT_AUTHORIZED = b"\x20\x02\x00\x05"  # an MQTT 3.1.1 CONNACK, return code 5


class ConnectListener:
    """A TCP listener that reads each client's CONNECT and then closes the connection (``drop``) or answers a
    refusing CONNACK (``refuse``); ``connections`` counts what it accepted."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.connections = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self.port))
        self._sock.listen(8)
        self._open: List[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.recv(65536)  # the CONNECT: the client's connect() has written it
            if self.mode == "refuse":
                conn.sendall(NOT_AUTHORIZED)
                self._open.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        self._sock.close()
        for conn in self._open:
            conn.close()


def clients(made: List[Any], before=None):
    """``new_client`` for open_link that keeps each client it made and runs ``before(attempt)`` first."""

    def make(use_tls: bool) -> Any:
        if before is not None:
            before(len(made) + 1)
        client = new_client("test-link-%d" % (len(made) + 1))
        made.append(client)
        return client

    return make


def test_a_connack_held_past_the_bound_is_tried_again_and_the_second_attempt_connects(mosquitto, tcp_proxy_factory):
    proxy = tcp_proxy_factory(mosquitto)
    proxy.hold("down")  # the first attempt's CONNACK never reaches the link (a stalled broker or operator)
    made: List[Any] = []
    link = open_link([(proxy.host, proxy.port, False)],
                     clients(made, before=lambda attempt: proxy.resume() if attempt == 2 else None),
                     connack_timeout_s=CONNACK_S)
    try:
        assert len(made) == 2 and proxy.connections == 2
        link.subscribe(["test-link/#"])  # a working link
    finally:
        link.close()


def test_a_broker_that_never_sends_its_connack_fails_after_the_bounded_tries_saying_so(mosquitto, tcp_proxy_factory):
    proxy = tcp_proxy_factory(mosquitto)
    proxy.hold("down")
    with pytest.raises(LinkError) as failed:
        open_link([(proxy.host, proxy.port, False)], clients([]), tries=3, connack_timeout_s=CONNACK_S)
    where = "%s:%d" % (proxy.host, proxy.port)
    assert str(failed.value) == "broker %s took the connection but sent no CONNACK within 0.5 s (tried 3 times)" % where
    assert failed.value.transient and proxy.connections == 3


@pytest.fixture
def listener():
    """``listener(mode)``: a :class:`ConnectListener`, closed after the test."""
    made: List[ConnectListener] = []

    def make(mode: str) -> ConnectListener:
        made.append(ConnectListener(mode))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_connection_dropped_before_its_connack_is_tried_again_and_named(listener):
    dropping = listener("drop")
    with pytest.raises(LinkError) as failed:
        open_link([("127.0.0.1", dropping.port, False)], clients([]), tries=2, connack_timeout_s=WAIT_S)
    assert "127.0.0.1:%d dropped the connection before its CONNACK" % dropping.port in str(failed.value)
    assert "(tried 2 times)" in str(failed.value) and dropping.connections == 2


def test_a_refused_connection_is_not_tried_again(listener):
    refusing = listener("refuse")
    with pytest.raises(LinkError) as failed:
        open_link([("127.0.0.1", refusing.port, False)], clients([]), tries=3, connack_timeout_s=WAIT_S)
    assert "127.0.0.1:%d refused the connection: Not authorized" % refusing.port in str(failed.value)
    assert not failed.value.transient and refusing.connections == 1


def test_brokers_are_tried_in_turn_and_a_busy_one_again_after_the_others(mosquitto, tcp_proxy_factory):
    # round 1: the dead port refuses at once, the relay holds its CONNACK; round 2: the dead port again, then the
    # relay, released for that attempt
    dead = free_port()
    proxy = tcp_proxy_factory(mosquitto)
    proxy.hold("down")
    made: List[Any] = []
    link = open_link([("127.0.0.1", dead, False), (proxy.host, proxy.port, False)],
                     clients(made, before=lambda attempt: proxy.resume() if attempt == 4 else None),
                     connack_timeout_s=CONNACK_S)
    link.close()
    assert len(made) == 4 and proxy.connections == 2


def test_nothing_listening_fails_at_once_naming_each_broker():
    dead = [free_port(), free_port()]
    made: List[Any] = []
    with pytest.raises(LinkError) as failed:
        open_link([("127.0.0.1", port, False) for port in dead], clients(made), tries=3)
    assert len(made) == 2  # one round: nothing there was busy
    assert all("cannot connect to 127.0.0.1:%d" % port in str(failed.value) for port in dead)
