"""A real RabbitMQ cluster (MQTT plugin) on 127.0.0.1, started from Debian's own scripts: for the cluster lane.

No systemd and no system service: each node is ``/usr/lib/rabbitmq/bin/rabbitmq-server`` run with its own
``RABBITMQ_NODENAME``, ports, Mnesia directory, config file and enabled-plugins file, all in a private temporary
directory, sharing one Erlang cookie (a private ``HOME``). The cluster starts its own ``epmd`` on a free port
bound to 127.0.0.1 (``ERL_EPMD_ADDRESS``/``ERL_EPMD_PORT``), so it neither uses nor leaves behind a system one.
Node 1 boots first; the others join it at boot (``classic_config`` peer discovery), in parallel. Every process
started here carries a marker in its environment (:data:`MARK`), inherited by all it starts; a stop waits for
the marked processes to end (and kills them past a deadline), so nothing is left running.

Facts measured here (RabbitMQ 3.10.8, Erlang 25): a node boots in 7.5-10 s, the 3-node cluster in 17-28 s on 2
shared cores, 124-150 MiB per node. A clustered node started alone after the whole cluster stopped waits up to
10 x 30 s for its peers: restart a stopped node only while the others run (as the tests do).
"""

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import List, Optional

from agent._util.process import terminate
from agent.devtools.broker import LOCALHOST, BrokerError, free_port, port_accepts

logger = logging.getLogger(__name__)

RABBITMQ_BIN = "/usr/lib/rabbitmq/bin"
EPMD = "/usr/bin/epmd"
INSTALL_HINT = "install it with `make rabbitmq` (Debian's rabbitmq-server package)"
BOOT_TIMEOUT_S = 90.0  # 7.5-10 s measured alone; three at once on two loaded cores take longer
STOP_TIMEOUT_S = 15.0  # a clean stop closes every connection and flushes Mnesia: about 1-2 s here
POLL_S = 0.1
MARK = "ATLAS_EDGE_RABBITMQ"  # in the environment of every process started here: "<directory>:<node>"
COOKIE = "ATLASEDGECLUSTERLANECOOKIE"  # any value: only these nodes (on loopback) share it
# Schedulers sleep instead of spinning while idle: the nodes share a small machine with the test itself.
ERL_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"


def find_rabbitmq() -> str:
    """The rabbitmq-server script; BrokerError with the install hint when it or epmd is missing."""
    server = os.path.join(RABBITMQ_BIN, "rabbitmq-server")
    for path in (server, EPMD):
        if not os.access(path, os.X_OK):
            raise BrokerError("%s not found: %s" % (path, INSTALL_HINT))
    return server


def _marked(marker: str) -> List[int]:
    """Pids of live processes whose environment holds ``MARK=<marker>...``: everything started here inherits it
    (a node's beam.smp, and erl_child_setup and inet_gethost, which leave the node's process group and session,
    and what rabbitmqctl's own VM leaves behind for a moment)."""
    needle = ("%s=%s" % (MARK, marker)).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as handle:
                variables = handle.read().split(b"\0")
            with open("/proc/%s/stat" % entry, encoding="ascii", errors="replace") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if not zombie and any(v.startswith(needle) for v in variables):
            found.append(int(entry))
    return found


def _stop_marked(process: "Optional[subprocess.Popen[bytes]]", marker: str, timeout: float, name: str) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL), then wait for every process marked ``marker``; kill stragglers
    and wait for them to be gone too (each wait bounded by ``timeout``)."""
    if process is not None:
        terminate(process, timeout, name)
    deadline, killed = time.monotonic() + timeout, False
    while True:
        left = _marked(marker)
        if not left:
            return
        if time.monotonic() > deadline:
            if killed:
                logger.error("%s: still running after SIGKILL: %s", name, ", ".join(describe(p) for p in left))
                return
            for pid in left:
                logger.warning("%s: killing leftover process %s", name, describe(pid))
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            deadline, killed = time.monotonic() + timeout, True
        time.sleep(POLL_S)


def _is_vm(pid: int) -> bool:
    """Whether ``pid`` is an Erlang VM (``beam.smp``; ``beam`` on non-SMP builds)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            program = handle.read().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(program).startswith(b"beam")


def describe(pid: int) -> str:
    """``pid (command line)`` for messages about a process."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as handle:
            return "%d (%s)" % (pid, handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120])
    except OSError:
        return str(pid)


class RabbitNode:
    """One node: MQTT on 127.0.0.1:``mqtt_port``; AMQP and Erlang distribution on loopback ports of its own."""

    def __init__(self, index: int, root: str, env: dict, seed: Optional[str] = None) -> None:
        self.name = "atlas%d@localhost" % index
        self.host = LOCALHOST
        self.port = free_port()
        self.amqp_port = free_port()
        self.dist_port = free_port()
        self.workdir = os.path.join(root, "node%d" % index)
        os.makedirs(self.workdir)
        self._process: "Optional[subprocess.Popen[bytes]]" = None
        config = os.path.join(self.workdir, "rabbitmq.conf")
        lines = ["listeners.tcp.default = %s:%d" % (LOCALHOST, self.amqp_port),
                 "mqtt.listeners.tcp.default = %s:%d" % (LOCALHOST, self.port),
                 "mqtt.allow_anonymous = true",  # as the guest user, which loopback_users = none lets in
                 "loopback_users = none",
                 "disk_free_limit.absolute = 50MB"]
        if seed:  # join the seed node at first boot
            lines += ["cluster_formation.peer_discovery_backend = classic_config",
                      "cluster_formation.classic_config.nodes.1 = %s" % seed]
        with open(config, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        plugins = os.path.join(self.workdir, "enabled_plugins")
        with open(plugins, "w", encoding="utf-8") as handle:
            handle.write("[rabbitmq_mqtt].\n")
        self.marker = "%s:%s" % (root, self.name)
        self.env = dict(env, RABBITMQ_NODENAME=self.name, RABBITMQ_NODE_PORT=str(self.amqp_port),
                        RABBITMQ_DIST_PORT=str(self.dist_port),
                        RABBITMQ_MNESIA_BASE=os.path.join(self.workdir, "mnesia"),
                        RABBITMQ_LOG_BASE=os.path.join(self.workdir, "log"),
                        RABBITMQ_CONFIG_FILE=config, RABBITMQ_ENABLED_PLUGINS_FILE=plugins,
                        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=ERL_ARGS, **{MARK: self.marker})

    @property
    def address(self) -> str:
        """``host:port`` of the MQTT listener, as ``mqtt.hosts`` takes it."""
        return "%s:%d" % (self.host, self.port)

    @property
    def url(self) -> str:
        return "mqtt://%s" % self.address

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def launch(self) -> "RabbitNode":
        """Start the node's process; :meth:`wait_ready` waits for its MQTT listener."""
        if self.running:
            return self
        with open(os.path.join(self.workdir, "console.log"), "ab") as log:
            self._process = subprocess.Popen(  # argument list, no shell; a session of its own
                [os.path.join(RABBITMQ_BIN, "rabbitmq-server")], env=self.env, cwd=self.workdir,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = BOOT_TIMEOUT_S) -> "RabbitNode":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise BrokerError("RabbitMQ node %s exited on start:\n%s" % (self.name, self.log_tail()))
            if port_accepts(self.host, self.port):
                return self
            time.sleep(POLL_S)
        raise BrokerError("RabbitMQ node %s: no MQTT listener on %s within %.0f s:\n%s"
                          % (self.name, self.address, timeout, self.log_tail()))

    def start(self) -> "RabbitNode":
        return self.launch().wait_ready()

    def stop(self) -> None:
        """A clean stop (SIGTERM to the node's script, which stops the VM); MQTT clients see their TCP close."""
        process, self._process = self._process, None
        _stop_marked(process, self.marker, STOP_TIMEOUT_S, self.name)

    def kill(self) -> None:
        """A crash: SIGKILL to the node's Erlang VM (``beam.smp``), so nothing is flushed and no connection is
        closed by the node (its peers see the distribution link drop; its MQTT clients see their TCP reset).
        Then the script and the VM's helpers, which end with it, are waited for like a stop's."""
        vms = [pid for pid in _marked(self.marker) if _is_vm(pid)]
        if not vms:
            raise BrokerError("RabbitMQ node %s: no running VM to kill" % self.name)
        for pid in vms:
            os.kill(pid, signal.SIGKILL)
        process, self._process = self._process, None
        _stop_marked(process, self.marker, STOP_TIMEOUT_S, self.name)

    def log_tail(self, chars: int = 3000) -> str:
        text = ""
        for name in ("console.log", os.path.join("log", "%s.log" % self.name)):
            try:
                with open(os.path.join(self.workdir, name), encoding="utf-8", errors="replace") as handle:
                    text += "--- %s\n%s\n" % (name, handle.read()[-chars:])
            except OSError:
                pass
        return text or "(no log)"

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n NODE ARGS``: its stdout; BrokerError with its output when it fails."""
        done = subprocess.run([os.path.join(RABBITMQ_BIN, "rabbitmqctl"), "-n", self.name] + list(args),
                              env=self.env, cwd=self.workdir, capture_output=True, timeout=timeout)
        if done.returncode != 0:
            raise BrokerError("rabbitmqctl %s on %s failed (%d): %s" % (
                " ".join(args), self.name, done.returncode, (done.stdout + done.stderr).decode()[-2000:]))
        return done.stdout.decode()


class RabbitCluster:
    """``size`` nodes clustered on loopback with their own epmd; see the module docstring."""

    def __init__(self, size: int = 3) -> None:
        find_rabbitmq()
        self._root = tempfile.mkdtemp(prefix="atlas-edge-rabbitmq-")
        home = os.path.join(self._root, "home")
        os.makedirs(home)
        cookie = os.path.join(home, ".erlang.cookie")
        with open(cookie, "w", encoding="ascii") as handle:
            handle.write(COOKIE)
        os.chmod(cookie, 0o400)
        self.epmd_port = free_port()
        env = {key: value for key, value in os.environ.items() if not key.startswith(("RABBITMQ_", "ERL_"))}
        env.update(HOME=home, ERL_EPMD_ADDRESS=LOCALHOST, ERL_EPMD_PORT=str(self.epmd_port))
        self._env = dict(env, **{MARK: "%s:epmd" % self._root})
        self.nodes = [RabbitNode(1, self._root, env)]
        self.nodes += [RabbitNode(i, self._root, env, seed=self.nodes[0].name) for i in range(2, size + 1)]
        self._epmd: "Optional[subprocess.Popen[bytes]]" = None

    def start(self) -> "RabbitCluster":
        """epmd, node 1, then the others at once (they join node 1 as they boot); checks that all are members."""
        try:
            self._epmd = subprocess.Popen(
                [EPMD, "-address", LOCALHOST, "-port", str(self.epmd_port)], env=self._env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.nodes[0].start()
            for node in self.nodes[1:]:
                node.launch()
            for node in self.nodes[1:]:
                node.wait_ready()
            running = self.running_nodes()
            if sorted(running) != sorted(n.name for n in self.nodes):
                raise BrokerError("RabbitMQ cluster formed with %s, expected %s" % (
                    running, [n.name for n in self.nodes]))
        except BaseException:
            self.close()
            raise
        return self

    def running_nodes(self) -> List[str]:
        """The cluster's running members as node 1 (or the first running node) sees them."""
        import json

        node = next(n for n in self.nodes if n.running)
        return list(json.loads(node.ctl("cluster_status", "--formatter", "json")).get("running_nodes", []))

    def close(self) -> None:
        """Stop every node and epmd (the processes started here and theirs); remove the directory."""
        for node in self.nodes:
            node.stop()
        epmd, self._epmd = self._epmd, None
        _stop_marked(epmd, self._root + ":", STOP_TIMEOUT_S, "epmd and what is left")  # every process marked here
        shutil.rmtree(self._root, ignore_errors=True)

    def leftovers(self) -> List[int]:
        """Processes started here that still run (none after :meth:`close`)."""
        return _marked(self._root + ":")

    def __enter__(self) -> "RabbitCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
