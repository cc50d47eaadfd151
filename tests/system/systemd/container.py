"""A Debian 12 container booting a real systemd 252 as PID 1, for the shipped unit and install.sh.

``systemd-nspawn -b`` boots a copy of a debootstrap tree (built once, cached outside the checkout, keyed by the
package list; each run boots a fresh copy). There is no systemd-machined here, so the container is driven
with ``nsenter`` into the namespaces of its PID 1 (the child of the systemd-nspawn process), not machinectl.
``--private-network`` leaves the container only its loopback: its Mosquitto is its own, and the box installs
offline from a wheelhouse built on the host, as a box without internet does.

The boot needs no capability the host may lack. What the box does not use is masked (:data:`MASKED`), and
:meth:`Container.boot` waits for what the units under test need (the manager's socket, the journal,
basic.target), not for the whole system: a unit elsewhere that cannot start cannot hold the lane up, and one
that fails says so at once, with the journal.
"""

import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, Dict, List, Optional

SUITE = "bookworm"
# systemd as PID 1, Python for the venv (python3-venv: ensurepip), the broker and its clients
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "mosquitto", "mosquitto-clients")
BOOT_LIMIT_S = 900  # the container is powered off by `timeout` even if the test run dies without cleaning up
WAIT_S = 60.0
# The box's tests use neither a system bus nor logins: systemctl, journalctl and systemd-analyze reach PID 1
# over its private socket as root. dbus-daemon asks for CAP_SYS_RESOURCE (its fd limit), which a host may lack.
MASKED = ("dbus.service", "dbus.socket", "systemd-logind.service")
# What the tests run on: a unit that starts waits for basic.target anyway; journalctl reads journald's files.
BOOTED = ("systemd-journald.service", "basic.target")


class ContainerError(RuntimeError):
    pass


def debian_mirror(sources_dir: str = "/etc/apt") -> str:
    """The Debian mirror this machine's own apt sources use (debootstrap fetches from it)."""
    candidates = []
    for folder, _dirs, names in os.walk(sources_dir):
        for name in names:
            if name.endswith((".sources", ".list")):
                candidates.append(os.path.join(folder, name))
    for path in sorted(candidates):
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                words = line.split()
                if path.endswith(".sources") and words[:1] == ["URIs:"]:
                    uris = [w for w in words[1:] if "security" not in w]
                elif path.endswith(".list") and words[:1] == ["deb"]:
                    uris = [w for w in words[1:] if w.startswith("http") and "security" not in w]
                else:
                    continue
                if uris:
                    return uris[0]
    return "http://deb.debian.org/debian"


def rootfs(cache_dir: str) -> str:
    """The cached debootstrap tree for :data:`PACKAGES` (built when missing: about a minute and 300 MB)."""
    mirror = debian_mirror()
    key = hashlib.sha256(" ".join((SUITE, mirror) + PACKAGES).encode()).hexdigest()[:12]
    tree = os.path.join(cache_dir, "rootfs-%s-%s" % (SUITE, key))
    if os.path.isfile(os.path.join(tree, ".complete")):
        return tree
    os.makedirs(cache_dir, exist_ok=True)
    building = tempfile.mkdtemp(prefix="rootfs-building-", dir=cache_dir)
    try:
        done = subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(PACKAGES), SUITE,
                               building, mirror], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise ContainerError("debootstrap failed (%d): %s" % (done.returncode, done.stdout[-3000:]
                                                                  + done.stderr[-3000:]))
        open(os.path.join(building, ".complete"), "w").close()
        shutil.rmtree(tree, ignore_errors=True)
        os.rename(building, tree)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return tree


class Container:
    """One booted copy of the tree; every command runs inside it as root through nsenter."""

    def __init__(self, tree: str, work_dir: str, name: str = "atlas-edge-test") -> None:
        self.root = os.path.join(work_dir, "root")
        subprocess.run(["cp", "-a", "--reflink=auto", tree, self.root], check=True, timeout=600)
        # The copy's top folder is / inside. The cached tree's is 0700 (debootstrap filled a mkdtemp), and with
        # / at 0700 every daemon that drops root is refused every path: dbus-daemon's inotify ("Permission
        # denied", so it never became ready and held the boot), Mosquitto's pid file and password file.
        os.chmod(self.root, 0o755)
        for unit in MASKED:
            self.mask(unit)
        self.name = name
        self.nspawn: Optional[subprocess.Popen] = None
        self.pid1: Optional[int] = None
        self.console = os.path.join(work_dir, "console.log")

    def boot(self) -> None:
        env = dict(os.environ, SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1")
        with open(self.console, "wb") as console:
            # timeout: the bound if nobody powers it off; nspawn is the child, so the PID is found by parent
            self.nspawn = subprocess.Popen(
                ["timeout", str(BOOT_LIMIT_S), "systemd-nspawn", "-D", self.root, "-M", self.name, "-b",
                 "--register=no", "--keep-unit", "--private-network"],
                stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        self.pid1 = self._wait_for_pid1()
        private = "/proc/%d/root/run/systemd/private" % self.pid1  # until it exists, systemctl answers nothing
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(private) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.wait_active(*BOOTED, timeout=max(1.0, deadline - time.monotonic()))

    def mask(self, unit: str) -> None:
        """Mask ``unit`` in the tree before the boot (as ``systemctl mask`` would)."""
        os.symlink("/dev/null", os.path.join(self.root, "etc/systemd/system", unit))

    def wait_active(self, *units: str, timeout: float = WAIT_S) -> None:
        """Wait until every one of ``units`` is active; ContainerError, with their journal, once one failed or
        the time is up."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.run_status("systemctl is-active %s" % " ".join(map(shlex.quote, units)), timeout=30)
            states = dict(zip(units, done.stdout.split()))
            if done.returncode == 0:
                return
            if "failed" in states.values() or time.monotonic() > deadline:
                journal = self.run_status("journalctl -q -b --no-pager -n 60", timeout=30).stdout
                raise ContainerError("inside the container, not active: %s (%s)\n%s\n%s" % (
                    ", ".join(units), states or done.stderr.strip(), journal, self.console_tail()))
            time.sleep(0.2)

    def _wait_for_pid1(self) -> int:
        assert self.nspawn is not None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError("systemd-nspawn exited %s:\n%s" % (self.nspawn.returncode, self.console_tail()))
            nspawn = _children(self.nspawn.pid)
            inner = _children(nspawn[0]) if nspawn else []
            if inner and os.path.exists("/proc/%d/root/run/systemd/system" % inner[0]):
                return inner[0]
            time.sleep(0.1)
        raise ContainerError("no systemd inside the container after %.0f s:\n%s" % (WAIT_S, self.console_tail()))

    def console_tail(self, limit: int = 3000) -> str:
        with open(self.console, "rb") as handle:
            return handle.read()[-limit:].decode("utf-8", "replace")

    def run(self, command: str, check: bool = True, timeout: float = 120, input: Optional[str] = None) -> str:
        """``command`` (a shell line) inside the container as root; its stdout, or ContainerError on failure."""
        done = self.run_status(command, timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise ContainerError("inside the container, %r exited %d:\n%s\n%s" % (
                command, done.returncode, done.stdout[-3000:], done.stderr[-3000:]))
        return done.stdout

    def run_status(self, command: str, timeout: float = 120,
                   input: Optional[str] = None) -> "subprocess.CompletedProcess[str]":
        assert self.pid1 is not None, "boot() first"
        return subprocess.run(["nsenter", "-t", str(self.pid1), "-a", "/bin/sh", "-c", command], input=input,
                              capture_output=True, text=True, timeout=timeout)

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """A file inside the container (written through its root from the host; owned by root)."""
        target = self.root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(target, mode)

    def show(self, unit: str, *properties: str) -> Dict[str, str]:
        """``systemctl show``'s answer for ``properties`` of ``unit``."""
        out = self.run("systemctl show %s -p %s" % (shlex.quote(unit), ",".join(properties)))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str, since_cursor: Optional[str] = None) -> str:
        after = " --after-cursor=%s" % shlex.quote(since_cursor) if since_cursor else ""
        return self.run("journalctl -q -o cat --no-pager -u %s%s" % (shlex.quote(unit), after))

    def cursor(self, unit: str) -> Optional[str]:
        """The end of ``unit``'s journal (None before its first entry), so a later :meth:`journal` of it reads
        only what came after. Its own last entry, not the journal's: systemd 252's ``journalctl -u U
        --after-cursor=C`` drops the first entry of U after C as if it were C's, so a cursor on another unit's
        entry lost a line (the "Watchdog timeout" the watchdog test looks for)."""
        out = self.run("journalctl -q -u %s -n 1 -o cat --show-cursor --no-pager" % shlex.quote(unit),
                       check=False)  # exit 1 when the unit has no entry yet
        return out.strip().rsplit("-- cursor: ", 1)[-1] if "-- cursor: " in out else None

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        if not predicate():
            raise AssertionError("inside the container: %s did not happen within %.0f s" % (what, timeout))

    def poweroff(self) -> None:
        """Shut the container down and wait for systemd-nspawn to end; kill it if it does not."""
        if self.nspawn is None:
            return
        if self.nspawn.poll() is None and self.pid1 is not None:
            subprocess.run(["nsenter", "-t", str(self.pid1), "-a", "systemctl", "poweroff"], capture_output=True,
                           timeout=60)
            try:
                self.nspawn.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, signal.SIGKILL)
                self.nspawn.wait(timeout=30)


def _children(pid: int) -> List[int]:
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid), encoding="ascii") as handle:
            return [int(p) for p in handle.read().split()]
    except OSError:
        return []
