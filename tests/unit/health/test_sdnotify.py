"""sd_notify against real AF_UNIX datagram sockets the test owns (path and abstract); no systemd needed."""

import logging
import os
import re
import shutil
import socket
import tempfile
import uuid

import pytest

from agent.health.sdnotify import STATUS_MAX_CHARS, SystemdNotifier

RECV_TIMEOUT_S = 5.0


@pytest.fixture
def notify_socket():
    """A bound datagram socket at a short path (AF_UNIX paths are limited to 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(RECV_TIMEOUT_S)
    yield sock, path
    sock.close()
    shutil.rmtree(directory)


def receive(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_disabled_without_notify_socket_every_call_is_a_no_op():
    notifier = SystemdNotifier(environ={"WATCHDOG_USEC": "30000000"})
    assert notifier.enabled is False
    assert notifier.watchdog_interval_s() is None
    for call in (notifier.ready, notifier.watchdog, notifier.stopping, notifier.reloading):
        assert call() is False
    assert notifier.status("x") is False


def test_messages_arrive_in_order_on_a_path_socket(notify_socket):
    sock, path = notify_socket
    notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready(status="serving demo")
    assert receive(sock) == "READY=1\nSTATUS=serving demo"
    assert notifier.status("line one\nline two")
    assert receive(sock) == "STATUS=line one line two"  # one line for `systemctl status`
    assert notifier.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    assert notifier.reloading()
    assert re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=\d+", receive(sock))
    assert notifier.extend_timeout(90)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    assert notifier.extend_timeout(1.5, status="starting: load")
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=1500000\nSTATUS=starting: load"
    assert notifier.stopping()
    assert receive(sock) == "STOPPING=1"
    notifier.close()


def test_abstract_socket_written_with_at_sign():
    name = "atlas-edge-test-%s" % uuid.uuid4().hex
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(RECV_TIMEOUT_S)
    try:
        notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": "@" + name})
        assert notifier.watchdog()
        assert receive(sock) == "WATCHDOG=1"
    finally:
        sock.close()


def test_long_status_is_cut_to_one_short_line(notify_socket):
    sock, path = notify_socket
    SystemdNotifier(environ={"NOTIFY_SOCKET": path}).status("x" * 1000)
    text = receive(sock)
    assert len(text) == len("STATUS=") + STATUS_MAX_CHARS and text.endswith("...")


@pytest.mark.parametrize("env, expected", [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),                       # WatchdogSec=30 -> ping every 15 s
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "OURS"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),   # meant for another process
    ({"WATCHDOG_USEC": "thirty"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "nope"}, None),
    ({}, None),
])
def test_watchdog_interval_is_half_of_watchdog_sec(notify_socket, env, expected):
    _, path = notify_socket
    pid = 4242
    environ = {k: (str(pid) if v == "OURS" else v) for k, v in env.items()}
    environ["NOTIFY_SOCKET"] = path
    notifier = SystemdNotifier(environ=environ, pid=pid)
    assert notifier.watchdog_interval_s() == expected
    if expected is not None:
        assert notifier.watchdog_timeout_s() == 2 * expected


def test_watchdog_pid_defaults_to_this_process(notify_socket):
    _, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(environ=env).watchdog_interval_s() == 1.0


def test_a_gone_socket_fails_quietly_and_is_logged_once(caplog):
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
    try:
        notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": os.path.join(directory, "missing")})
        with caplog.at_level(logging.WARNING, logger="agent.health.sdnotify"):
            results = [notifier.watchdog() for _ in range(25)]
        assert results == [False] * 25
        assert len([r for r in caplog.records if "sd_notify" in r.getMessage()]) == 1
    finally:
        shutil.rmtree(directory)


def test_unsupported_socket_address_disables_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="agent.health.sdnotify"):
        notifier = SystemdNotifier(environ={"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert any("vsock:2:1234" in r.getMessage() for r in caplog.records)


def test_daemon_start_up_extends_the_start_timeout_per_step(notify_socket, tmp_path, monkeypatch, mosquitto):
    """Bundle verify, model load, warm-up and golden check each ask for time before READY=1; nothing after."""
    from agent.cli.demo import DEMO_BUNDLE
    from agent.config.daemon_config import parse_daemon_config
    from agent.daemon import STARTUP_STEP_TIMEOUT_S, Daemon

    if not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")):
        pytest.skip("examples/demo-bundle is missing (make demo-bundle)")
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    config = parse_daemon_config({
        "device_id": "notify", "state_dir": str(tmp_path / "state"),
        "model": {"bundle": DEMO_BUNDLE, "backend": "opencv"},
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port}})
    steps = ["verify", "load", "warm-up", "golden check"]
    for start in ("first start", "restart from the slot table"):
        daemon = Daemon(config)
        daemon.start()
        messages = []
        while not messages or not messages[-1].startswith("READY=1"):
            messages.append(receive(sock))
        extended = [m for m in messages if m.startswith("EXTEND_TIMEOUT_USEC=")]
        usec = int(STARTUP_STEP_TIMEOUT_S * 1e6)
        assert extended == ["EXTEND_TIMEOUT_USEC=%d\nSTATUS=starting: %s" % (usec, step) for step in steps], start
        daemon.models.on_phase("load")  # what a deploy's load reports once serving: not start-up any more
        daemon.request_stop("test over")
        daemon.shutdown()
        after = []
        sock.settimeout(0.5)
        try:
            while True:
                after.append(receive(sock))
        except socket.timeout:
            pass
        sock.settimeout(RECV_TIMEOUT_S)
        assert not [m for m in after if "EXTEND_TIMEOUT_USEC" in m] and any("STOPPING=1" in m for m in after)
