"""A test-owned systemd notify socket (a helper module, not a test module): the watchdog and clock-step tests
read the daemon's READY/WATCHDOG datagrams from it."""

import os
import shutil
import socket
import tempfile
import threading
import time
from typing import List, Tuple

from tests.conftest import WAIT_S, wait_for


class NotifyListener:
    """A test-owned notify socket and a thread that records every datagram with its arrival time."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="wd-", dir="/tmp")
        self.path = os.path.join(self.directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: List[Tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            with self._lock:
                self.messages.append((time.monotonic(), data.decode()))

    def received(self, text: str, after: float = 0.0) -> List[float]:
        with self._lock:
            return [t for t, m in self.messages if m == text and t > after]

    def wait_for(self, text: str, count: int, after: float = 0.0) -> bool:
        return wait_for(lambda: len(self.received(text, after)) >= count, timeout=WAIT_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.sock.close()
        shutil.rmtree(self.directory)
