"""sd_notify(3) without libsystemd: one datagram per state change to ``$NOTIFY_SOCKET``.

systemd starts a ``Type=notify`` service with ``NOTIFY_SOCKET`` set to a unix datagram socket (a path, or an
abstract name written with a leading ``@``) and, when ``WatchdogSec=`` is set, ``WATCHDOG_USEC`` (and
usually ``WATCHDOG_PID``). Outside systemd none of these are set and every call here is a no-op, so the
daemon can call the notifier unconditionally. Sending never raises: a lost notification must not take the
pipeline down (a missing ``WATCHDOG=1`` is what systemd acts on, the right outcome if the socket is gone).
"""

import logging
import os
import socket
import threading
import time
from typing import Mapping, Optional

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"

# sd_watchdog_enabled(3) advises pinging at half of WatchdogSec, so one late ping is survivable.
PING_FRACTION = 0.5
# systemd truncates STATUS= at a line; keep it to one short line for `systemctl status`.
STATUS_MAX_CHARS = 200


class SystemdNotifier:
    """Talks to systemd's notify socket; every method is a no-op when ``NOTIFY_SOCKET`` is unset.

    ``environ`` and ``pid`` default to the real process; tests pass their own to point at a test-owned socket.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None, pid: Optional[int] = None) -> None:
        env = os.environ if environ is None else environ
        self._env = dict(env)
        self._pid = os.getpid() if pid is None else pid
        self._address = self._parse_address(self._env.get(NOTIFY_SOCKET_ENV, ""))
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._last_error = ""

    @staticmethod
    def _parse_address(raw: str) -> Optional[str]:
        if not raw:
            return None
        if raw.startswith("@"):
            return "\0" + raw[1:]  # abstract namespace: leading NUL, no file on disk
        if raw.startswith("/"):
            return raw
        # systemd >= 254 may also hand out vsock: addresses (VMs); we are never started that way on a box.
        log.warning("NOTIFY_SOCKET %r is neither a path nor an abstract socket; notifications disabled", raw)
        return None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def watchdog_timeout_s(self) -> Optional[float]:
        """The unit's ``WatchdogSec`` in seconds, or None when systemd does not watch this process."""
        raw = self._env.get(WATCHDOG_USEC_ENV)
        if not raw or not self.enabled:
            return None
        owner = self._env.get(WATCHDOG_PID_ENV)
        if owner:
            try:
                if int(owner) != self._pid:
                    return None  # the variable was inherited from a parent that systemd watches, not us
            except ValueError:
                log.warning("ignoring %s=%r: not a pid", WATCHDOG_PID_ENV, owner)
                return None
        try:
            usec = int(raw)
        except ValueError:
            log.warning("ignoring %s=%r: not an integer", WATCHDOG_USEC_ENV, raw)
            return None
        return usec / 1e6 if usec > 0 else None

    def watchdog_interval_s(self) -> Optional[float]:
        """How often to send ``WATCHDOG=1``: half of ``WatchdogSec``; None when there is no watchdog."""
        timeout = self.watchdog_timeout_s()
        return None if timeout is None else timeout * PING_FRACTION

    def notify(self, message: str) -> bool:
        """Send one raw notification (``KEY=value`` lines); True when the datagram left."""
        if self._address is None:
            return False
        data = message.encode("utf-8", "replace")
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)  # a full receive queue must not stall the caller
                self._sock.sendto(data, self._address)
            except OSError as exc:
                text = "%s: %s" % (type(exc).__name__, exc)
                if text != self._last_error:  # log each distinct failure once, not every ping
                    log.warning("sd_notify to %s failed: %s", self._env.get(NOTIFY_SOCKET_ENV), text)
                    self._last_error = text
                return False
        self._last_error = ""
        return True

    def ready(self, status: Optional[str] = None) -> bool:
        """Start-up (or a reload) is complete: systemd marks the unit active."""
        return self.notify("READY=1" + ("\nSTATUS=" + _one_line(status) if status else ""))

    def status(self, text: str) -> bool:
        """Free-form one-line status shown by ``systemctl status``."""
        return self.notify("STATUS=" + _one_line(text))

    def watchdog(self) -> bool:
        """Keep-alive. Call only from a place that has seen progress (see agent.health.progress.ProgressMonitor)."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: Optional[str] = None) -> bool:
        """Shutdown has begun (drain and flush follow); systemd now waits up to TimeoutStopSec."""
        return self.notify("STOPPING=1" + ("\nSTATUS=" + _one_line(status) if status else ""))

    def reloading(self) -> bool:
        """A reload has begun; send :meth:`ready` when it is done.

        MONOTONIC_USEC pairs the two for ``Type=notify-reload`` (systemd >= 253); older versions ignore it.
        """
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        return self.notify("RELOADING=1\nMONOTONIC_USEC=%d" % usec)

    def extend_timeout(self, seconds: float, status: Optional[str] = None) -> bool:
        """Ask for ``seconds`` more start/stop time from now (a slow model load or NPU init) instead of being
        killed mid-way; systemd never shortens the unit's own timeout this way, and a step that hangs sends no
        further extension, so the unit still fails it."""
        return self.notify("EXTEND_TIMEOUT_USEC=%d" % int(seconds * 1e6)
                           + ("\nSTATUS=" + _one_line(status) if status else ""))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _one_line(text: str) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= STATUS_MAX_CHARS else flat[: STATUS_MAX_CHARS - 3] + "..."
