"""Shared fixtures: a real Mosquitto on a free 127.0.0.1 port, and helpers to talk MQTT in tests.

``mosquitto`` is one broker for the whole session; ``fresh_broker`` is a broker of the test's own, for tests
that stop, restart or kill it (persistence on, so a subscriber's session survives ``restart()`` the way it
would on a production broker). Both skip, naming mosquitto, when it is not installed.
"""

import importlib.util
import json
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
from hypothesis import Phase, settings

from agent.devtools.broker import BrokerError, EmbeddedBroker, find_mosquitto, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# No test steers generation with hypothesis.target(), so its target phase only costs time: on the box's 3.7
# (hypothesis 6.79, the last release for it) it spent 70 s optimising the leak properties' 300-float lists.
settings.register_profile("atlas-edge", phases=[p for p in Phase if p is not Phase.target])
settings.load_profile("atlas-edge")
WAIT_S = 20.0  # bound on every wait for a broker round trip; generous for a loaded CI box

# Tests of the workstation's QAT package (quant/ trains with MindSpore): not collected where MindSpore is
# absent (the Lite lane on Python 3.7, a box-only install); the run's header says so.
HOST_ONLY_TESTS = ["unit/quant/test_*.py"]
HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None
collect_ignore_glob = [] if HAS_MINDSPORE else list(HOST_ONLY_TESTS)
# Lanes with a make target of their own (they boot a container, or need the package installed from its wheel):
# collected only when a path inside them is named on the command line, not by a plain `pytest`.
OWN_LANES = ("system/systemd", "system/installed", "system/arm64")
# The box's own tests: every module under these folders (the box-side groups of agent/) is marked `box`, and the
# aarch64 lane (`make test-arm64`) runs `-m box` on the box's CPU and Python; a new module there joins it unlisted.
BOX_TEST_FOLDERS = ("unit/_util", "unit/bundle", "unit/commands", "unit/config", "unit/devtools", "unit/health",
                    "unit/lifecycle", "unit/ops", "unit/pipeline", "unit/protocol")


def is_box_test(path: "os.PathLike[str]", tests_dir: str = os.path.dirname(os.path.abspath(__file__))) -> bool:
    """Whether the test module at ``path`` is one of the box's own tests (under :data:`BOX_TEST_FOLDERS`)."""
    relative = os.path.relpath(os.path.abspath(str(path)), tests_dir).replace(os.sep, "/")
    return any(relative.startswith(folder + "/") for folder in BOX_TEST_FOLDERS)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "box: the box's own tests (tests/conftest.py BOX_TEST_FOLDERS); the aarch64 "
                            "lane runs them on the box's CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        if is_box_test(item.path):
            item.add_marker(pytest.mark.box)


def pytest_ignore_collect(collection_path: "os.PathLike[str]", config: pytest.Config) -> Optional[bool]:
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.abspath(str(collection_path))
    lane = next((os.path.join(here, name) for name in OWN_LANES if path == os.path.join(here, name)), None)
    if lane is None:
        return None
    named = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    return not any(arg == lane or arg.startswith(lane + os.sep) for arg in named)


@pytest.fixture(autouse=True)
def _ieee_floats() -> Iterator[None]:
    """The Lite lane loads mindspore_lite, which switches on flush-to-zero; each test starts with IEEE floats."""
    from tests.support.lite_support import restore_ieee_floats

    restore_ieee_floats()
    yield


@pytest.fixture(autouse=True, scope="session")
def _operator_state_in_a_temporary_directory(tmp_path_factory: Any) -> Iterator[None]:
    """``fleet`` keeps its record of boxes and rollouts under $XDG_STATE_HOME: never the tester's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))
        yield


def pytest_report_header() -> List[str]:
    if HAS_MINDSPORE:
        return []
    return ["host-only tests not collected (no MindSpore here): %s" % ", ".join(HOST_ONLY_TESTS)]


def _require_mosquitto() -> None:
    try:
        find_mosquitto()
    except BrokerError as exc:
        pytest.skip("needs the mosquitto broker: %s" % exc)


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[EmbeddedBroker]:
    _require_mosquitto()
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture
def fresh_broker() -> Iterator[EmbeddedBroker]:
    _require_mosquitto()
    with EmbeddedBroker(persistence=True) as broker:
        yield broker


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT_S, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (a bound, never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class MqttProbe:
    """A plain paho client for tests: subscribes, records every message, publishes raw bytes."""

    def __init__(self, broker: EmbeddedBroker, topics: List[str], client_id: Optional[str] = None,
                 clean_session: bool = True, username: Optional[str] = None, password: Optional[str] = None,
                 tls_ca: Optional[str] = None) -> None:
        import paho.mqtt.client as mqtt

        self.messages: List[Tuple[str, bytes, bool, bool]] = []  # (topic, payload, retain, dup)
        self.arrived: List[float] = []  # time.monotonic() of each message's arrival: rates are judged on it
        self._decoded: Dict[int, Any] = {}  # index in messages -> its JSON, decoded once when first asked for
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._topics = topics
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                  client_id=client_id or "probe-%s" % os.urandom(4).hex(),
                                  clean_session=clean_session)
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls_ca:
            self.client.tls_set(ca_certs=tls_ca)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda c, u, mid, codes, props: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.05, 0.2)
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()
        if topics:
            assert self._subscribed.wait(WAIT_S), "probe could not subscribe to %s" % topics

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if not reason_code.is_failure and self._topics:
            client.subscribe([(t, 1) for t in self._topics])

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.messages.append((message.topic, bytes(message.payload), bool(message.retain),
                                  bool(message.dup)))
            self.arrived.append(time.monotonic())

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        info = self.client.publish(topic, payload, qos)
        info.wait_for_publish(WAIT_S)

    def on(self, topic: str) -> List[Dict[str, Any]]:
        """JSON payloads received on ``topic`` so far, in order."""
        return [payload for _t, payload in self._decode(lambda t: t == topic)]

    def json(self, topic_prefix: str = "", since: float = float("-inf")) -> List[Tuple[str, Any]]:
        """(topic, JSON payload) of each message so far whose topic starts with ``topic_prefix`` and that arrived
        at or after ``since`` (``time.monotonic()``), in order."""
        return self._decode(lambda t: t.startswith(topic_prefix), since)

    def _decode(self, wanted: Callable[[str], bool], since: float = float("-inf")) -> List[Tuple[str, Any]]:
        """Each payload is decoded once, when first asked for, and shared between calls (a poll over thousands
        of results stays cheap): callers read them, never change them."""
        with self._lock:
            picked = [i for i, ((t, _, _, _), at) in enumerate(zip(self.messages, self.arrived))
                      if at >= since and wanted(t)]
            for i in picked:
                if i not in self._decoded:
                    self._decoded[i] = json.loads(self.messages[i][1])
            return [(self.messages[i][0], self._decoded[i]) for i in picked]

    def wait(self, predicate: Callable[[List[Tuple[str, Any]]], bool], timeout: float = WAIT_S) -> bool:
        """Poll (bounded by ``timeout``) until ``predicate`` holds for :meth:`json`; False when it never did."""
        return wait_for(lambda: predicate(self.json()), timeout, interval=0.05)

    def count(self, topic_prefix: str = "") -> int:
        with self._lock:
            return sum(1 for t, _, _, _ in self.messages if t.startswith(topic_prefix))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def probe_factory() -> Iterator[Callable[..., MqttProbe]]:
    probes: List[MqttProbe] = []

    def make(*args: Any, **kwargs: Any) -> MqttProbe:
        probe = MqttProbe(*args, **kwargs)
        probes.append(probe)
        return probe

    yield make
    for probe in probes:
        probe.close()


class TcpProxy:
    """A real TCP relay between one client and the broker, that a test can hold in one direction or cut.

    Not an MQTT stand-in: bytes pass through unchanged. It lets a test create exactly the situations of a
    bad network: messages written but not acknowledged (``hold('up')`` keeps the client's bytes from the
    broker; ``hold('down')`` keeps the broker's PUBACKs from the client), then a dropped connection (``cut``)
    while the broker and other clients stay up. While cut, new connections are closed at once.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.host = "127.0.0.1"
        self.port = free_port(self.host)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, self.port))
        self._listener.listen(8)
        self._accepting = True
        self._held = {"up": False, "down": False}
        self._pairs: List[Tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0
        threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            ready, _, _ = select.select([self._listener], [], [], 0.1)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._accepting:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
                self.connections += 1
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if self._held[direction]:
                    continue  # swallowed: as if stuck in a dead network until the cut
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def hold(self, direction: str) -> None:
        self._held[direction] = True

    def cut(self) -> None:
        """Drop every relayed connection and refuse new ones until :meth:`resume`."""
        self._accepting = False
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def resume(self) -> None:
        self._held = {"up": False, "down": False}
        self._accepting = True

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()


@pytest.fixture
def tcp_proxy_factory() -> Iterator[Callable[[EmbeddedBroker], TcpProxy]]:
    proxies: List[TcpProxy] = []

    def make(broker: EmbeddedBroker) -> TcpProxy:
        proxy = TcpProxy(broker.host, broker.port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
