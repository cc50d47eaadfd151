"""A real Mosquitto broker started as a child process on 127.0.0.1: for ``atlas-edge demo`` and the tests.

``atlas-edge demo`` uses it when no ``--broker`` is given, so the demo publishes over real MQTT with nothing
to set up; the tests use it to run against the real thing, including broker restarts on the same port.
It listens on 127.0.0.1 only and never on another address.
"""

import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from typing import NamedTuple, Optional, Sequence

from agent._util.process import terminate

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
# Where Debian/Ubuntu put the broker (sbin is often not on a normal user's PATH).
SEARCH_DIRS = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin")
INSTALL_HINT = "install it with `apt-get install mosquitto` (package: mosquitto), or pass --broker mqtt://HOST:PORT"
START_TIMEOUT_S = 10.0  # a cold start on a loaded CI box takes well under a second; generous on purpose
STOP_TIMEOUT_S = 5.0  # SIGTERM lets it save persistence and close clients; then SIGKILL
PORT_POLL_S = 0.02
LOG_TAIL_CHARS = 2000


class BrokerError(RuntimeError):
    """The embedded broker is missing or failed to start; the message says what to do."""


class BrokerTls(NamedTuple):
    """Files for a TLS listener (PEM)."""

    ca_file: str
    cert_file: str
    key_file: str
    require_client_cert: bool = False


def find_mosquitto() -> str:
    """Path of the ``mosquitto`` executable: PATH first, then the sbin directories."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for directory in SEARCH_DIRS:
        candidate = os.path.join(directory, "mosquitto")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise BrokerError("mosquitto not found on PATH or in %s: %s" % (", ".join(SEARCH_DIRS), INSTALL_HINT))


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port that is free right now on ``host`` (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedBroker:
    """Mosquitto on 127.0.0.1 and a free port, with its config and log in a private temporary directory.

    Anonymous clients are allowed unless a password file or ACL file is given. Persistence is off unless
    asked for (tests that need a subscriber's session to survive :meth:`restart` turn it on).
    """

    def __init__(
        self,
        port: Optional[int] = None,
        password_file: Optional[str] = None,
        acl_file: Optional[str] = None,
        tls: Optional[BrokerTls] = None,
        persistence: bool = False,
        executable: Optional[str] = None,
        start_timeout_s: float = START_TIMEOUT_S,
        extra_config: Sequence[str] = (),
    ) -> None:
        for label, path in (("password file", password_file), ("ACL file", acl_file)):
            if path is not None and not os.path.isfile(path):
                raise BrokerError("embedded broker: %s %s does not exist" % (label, path))
        self.executable = executable or find_mosquitto()
        self.host = LOCALHOST
        self.port = port or free_port(self.host)
        self.password_file = password_file
        self.acl_file = acl_file
        self.tls = tls
        self.persistence = persistence
        self.start_timeout_s = start_timeout_s
        # appended lines, e.g. a bridge section (tests/system/fleet/test_fleet.py)
        self.extra_config = tuple(extra_config)
        self._workdir = tempfile.mkdtemp(prefix="atlas-edge-mosquitto-")
        self._conf_path = os.path.join(self._workdir, "mosquitto.conf")
        self._log_path = os.path.join(self._workdir, "mosquitto.log")
        self._process: "Optional[subprocess.Popen[bytes]]" = None
        self._write_config()

    @property
    def url(self) -> str:
        return "%s://%s:%d" % ("mqtts" if self.tls else "mqtt", self.host, self.port)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def _write_config(self) -> None:
        lines = [
            "# written by agent.devtools.broker.EmbeddedBroker",
            "listener %d %s" % (self.port, self.host),
            "allow_anonymous %s" % ("false" if (self.password_file or self.acl_file) else "true"),
            "persistence %s" % ("true" if self.persistence else "false"),
            "log_dest file %s" % self._log_path,
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
        ]
        if self.persistence:
            lines.append("persistence_location %s/" % self._workdir)
        if os.geteuid() == 0:
            # Started as root, mosquitto switches to the user "mosquitto", which cannot read our temp files.
            lines.append("user %s" % pwd.getpwuid(os.geteuid()).pw_name)
        if self.password_file:
            lines.append("password_file %s" % os.path.abspath(self.password_file))
        if self.acl_file:
            lines.append("acl_file %s" % os.path.abspath(self.acl_file))
        if self.tls:
            lines += ["cafile %s" % os.path.abspath(self.tls.ca_file),
                      "certfile %s" % os.path.abspath(self.tls.cert_file),
                      "keyfile %s" % os.path.abspath(self.tls.key_file),
                      "require_certificate %s" % ("true" if self.tls.require_client_cert else "false")]
        lines += self.extra_config  # last: a bridge's "connection" section must follow the listener settings
        with open(self._conf_path, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")

    def start(self) -> "EmbeddedBroker":
        """Start the broker and wait until its port accepts connections."""
        if self.running:
            return self
        with open(self._log_path, "ab") as log:
            self._process = subprocess.Popen(  # argument list, no shell
                [self.executable, "-c", self._conf_path],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self._workdir)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise BrokerError("mosquitto exited with code %s on start (port %d):\n%s"
                                  % (self._process.returncode, self.port, self.log_tail()))
            if port_accepts(self.host, self.port):
                logger.info("embedded mosquitto (pid %d) listening on %s", self._process.pid, self.url)
                return self
            time.sleep(PORT_POLL_S)
        self.stop()
        raise BrokerError("mosquitto did not accept connections on %s within %.0f s:\n%s"
                          % (self.url, self.start_timeout_s, self.log_tail()))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop it (SIGTERM, then SIGKILL after ``timeout``); the port and config stay for restart()."""
        process, self._process = self._process, None
        if process is not None:
            terminate(process, timeout, "mosquitto")

    def kill(self) -> None:
        """Kill the broker without letting it shut down cleanly (a crash, as far as clients can tell)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def restart(self) -> "EmbeddedBroker":
        """Stop and start again on the same port, with the same config."""
        self.stop()
        return self.start()

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            with open(self._log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()[-chars:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the broker and remove its temporary directory."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
