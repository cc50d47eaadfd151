"""Issue 31: the daemon's log stays quiet under the faults the suite simulates. A real daemon process (the demo
bundle, a looping image folder) runs through each fault; every line it writes in a measured window is counted.

The acceptance figure is at most 400 lines in 60 s with the outbox on a full 3 MB file system and the broker away
(1 375 before: "source ... up" at every wrap of a looping folder, disk pressure starting and ending every few
seconds). Each fault is measured over :data:`WINDOW_S` and held to the same rate (:data:`LINES_PER_MINUTE`
scaled to the window); the log is counted from the moment the fault holds, so start-up lines do not count.
The flapping camera is in tests/system/cameras/test_camera_changes.py (it needs the rig).
"""

import os
import socket
import subprocess
import threading
import time

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.broker import free_port
from tests.conftest import wait_for
from tests.support.daemon_rig import SIZES, start_daemon, write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

LINES_PER_MINUTE = 400  # the acceptance figure, full disk and broker away
WINDOW_S = 20.0  # each fault measured this long; the bound is scaled to it
BOUND = int(LINES_PER_MINUTE * WINDOW_S / 60.0)


class LogTap:
    """The daemon's merged stdout and stderr, line by line, with the time each line came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def since(self, start: float):
        with self.lock:
            return [text for at, text in self.lines if at >= start]

    def has(self, needle: str) -> bool:
        with self.lock:
            return any(needle in text for _at, text in self.lines)


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        pytest.skip("needs a 3 MB tmpfs: `mount -t tmpfs` was refused (%s); run as root or with CAP_SYS_ADMIN"
                    % done.stdout.decode(errors="replace").strip())
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


class _NoBroker:
    """Where the broker would be: a port nobody listens on (the broker away for the whole run)."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.port = free_port("127.0.0.1")


def measure(tmp_path, broker, *ready: str, **extra):
    """Start the daemon, wait until each of ``ready`` is in its log (the fault holds), count one window's lines."""
    frames_dir = tmp_path / "frames"
    write_sample_frames(str(frames_dir), sizes_hw=SIZES[:3], seed=11)
    proc = start_daemon(write_config(tmp_path, broker, frames_dir, loop=True, **extra))
    tap = LogTap(proc)
    try:
        for needle in ready:
            assert wait_for(lambda needle=needle: tap.has(needle), timeout=120), "\n".join(tap.since(0.0))[-3000:]
        start = time.monotonic()
        time.sleep(WINDOW_S)  # the window measured, not synchronisation
        assert proc.poll() is None, "\n".join(tap.since(0.0))[-3000:]
        lines = tap.since(start)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("\n%d log lines in %.0f s (bound %d)" % (len(lines), WINDOW_S, BOUND))
    return lines


def test_full_disk_with_the_broker_away_stays_under_400_lines_a_minute(tmp_path, small_disk):
    with open(str(small_disk / "filler"), "wb") as handle:  # the rest of the small disk is taken
        handle.write(b"\0" * (2 * 1024 * 1024))
    lines = measure(tmp_path, _NoBroker(), "disk pressure", "source cam up",
                    outbox={"path": str(small_disk / "outbox.sqlite")})
    assert len(lines) <= BOUND, "\n".join(lines[:60])
    assert not any("source cam up" in line for line in lines), "a looping folder announced 'up' at a wrap"
    assert sum("disk pressure" in line for line in lines) <= 2, "\n".join(lines[:60])


def test_broker_away_stays_quiet(tmp_path):
    lines = measure(tmp_path, _NoBroker(), "source cam up")
    assert len(lines) <= BOUND, "\n".join(lines[:60])


@pytest.fixture
def refusing_port():
    """A port this test holds bound and never listens on: every connection to it is refused, forced. A port
    :func:`free_port` gave back is free for anyone: the other lane's brokers and cameras bind such ports, and
    the kernel may pick it as a connection's own source port (a self-connect), so "refused" was likely, not
    certain (issue 37: a clean-clone run's daemon never logged [refused] for it in 120 s)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_refusing_port_refuses(refusing_port):
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", refusing_port), timeout=5).close()


def test_camera_down_stays_quiet(tmp_path, mosquitto, refusing_port):
    nobody = "rtsp://127.0.0.1:%d/cam" % refusing_port
    lines = measure(tmp_path, mosquitto, "[refused]", sources=[
        {"name": "cam", "uri": nobody, "reopen_min_s": 0.1, "reopen_max_s": 1.0}])
    assert len(lines) <= BOUND, "\n".join(lines[:60])
