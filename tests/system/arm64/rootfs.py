"""The arm64 box of the aarch64 lane: a Debian root run through qemu-user, built once and cached.

``debootstrap --arch=arm64`` builds the tree on this x86_64 machine once ``qemu-aarch64`` is registered with
``binfmt_misc`` (:func:`ensure_binfmt` mounts and registers it, as root). The tree is cached under the cache
folder the systemd lane uses (keyed by suite, architecture, mirror and package list; the mirror is this
machine's own, :func:`tests.system.systemd.container.debian_mirror`); each run works on a throwaway overlay
(:class:`Scratch`) so the cache stays as built.

``python -m tests.system.arm64.rootfs`` prints the cached root's path, building it when missing.
"""

import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional

from tests.system.systemd.container import debian_mirror

SUITE = "bullseye"  # CPython 3.9, glibc 2.31: the Atlas 200I DK A2's openEuler 22.03 Python
ARCH = "arm64"
PACKAGES = ("python3", "python3-venv", "python3-pip", "mosquitto", "ca-certificates")
CACHE_DIR = os.environ.get("ATLAS_EDGE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "atlas-edge"))
BINFMT_DIR = "/proc/sys/fs/binfmt_misc"
# Debian's qemu-user-static registration (binfmt.d): the F flag opens the interpreter at registration, so it
# runs inside any chroot without a copy of qemu in the tree.
BINFMT_CONF = "/usr/lib/binfmt.d/qemu-aarch64.conf"
# qemu 7.2's default model (max) advertises SVE/SME: onnxruntime then picks kernels that run ~8x slower
# emulated. Every command in the root runs under a named model.
DEFAULT_CPU = "cortex-a53"


class Unavailable(RuntimeError):
    """The lane cannot run on this machine (the message says why); it is skipped, saying so."""


def ensure_binfmt() -> str:
    """Mount binfmt_misc and register qemu-aarch64 where they are not; the registration's path."""
    if os.geteuid() != 0:
        raise Unavailable("not root (binfmt_misc registration and debootstrap need root)")
    for tool in ("debootstrap", "qemu-aarch64-static"):
        if shutil.which(tool) is None:
            raise Unavailable("no %s (apt-get install debootstrap qemu-user-static)" % tool)
    entry = os.path.join(BINFMT_DIR, "qemu-aarch64")
    if not os.path.exists(os.path.join(BINFMT_DIR, "register")):
        done = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT_DIR], capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            raise Unavailable("binfmt_misc cannot be mounted: %s" % done.stderr.strip())
    if not os.path.exists(entry):
        if not os.path.isfile(BINFMT_CONF):
            raise Unavailable("no %s (qemu-user-static's binfmt entry)" % BINFMT_CONF)
        with open(BINFMT_CONF) as handle:
            line = [w for w in handle.read().splitlines() if w.startswith(":")][0]
        try:
            with open(os.path.join(BINFMT_DIR, "register"), "w") as register:
                register.write(line)
        except OSError as exc:
            raise Unavailable("qemu-aarch64 cannot be registered with binfmt_misc: %s" % exc) from exc
    with open(entry) as handle:
        if handle.readline().strip() != "enabled":
            raise Unavailable("binfmt_misc's qemu-aarch64 entry is disabled")
    return entry


def root_path(cache_dir: str = CACHE_DIR) -> str:
    mirror = debian_mirror()
    key = hashlib.sha256(" ".join((SUITE, ARCH, mirror) + PACKAGES).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, "arm64", "%s-%s" % (SUITE, key))


def rootfs(cache_dir: str = CACHE_DIR, log=None) -> str:
    """The cached arm64 tree (built when missing: about 6 minutes on 2 cores, 450 MB)."""
    ensure_binfmt()
    tree = root_path(cache_dir)
    if os.path.isfile(os.path.join(tree, ".complete")):
        return tree
    os.makedirs(os.path.dirname(tree), exist_ok=True)
    building = tempfile.mkdtemp(prefix="building-", dir=os.path.dirname(tree))
    try:
        if log:
            log("building the arm64 %s root with debootstrap (once; cached at %s)" % (SUITE, tree))
        done = subprocess.run(["debootstrap", "--arch=" + ARCH, "--variant=minbase",
                               "--include=" + ",".join(PACKAGES), SUITE, building, debian_mirror()],
                              capture_output=True, text=True, timeout=1500)
        if done.returncode != 0:
            raise RuntimeError("debootstrap failed (%d): %s" % (done.returncode, done.stdout[-3000:]
                                                                + done.stderr[-3000:]))
        os.chmod(building, 0o755)
        # minbase leaves no /etc/hosts: "localhost" (the box's broker) would not resolve
        with open(os.path.join(building, "etc", "hosts"), "w") as hosts:
            hosts.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
        subprocess.run(["chroot", building, "apt-get", "clean"], env=chroot_env(), check=True, timeout=300,
                       capture_output=True)
        machine = run_in(building, ["/usr/bin/python3", "-c", "import platform; print(platform.machine())"])
        if machine.strip() != "aarch64":
            raise RuntimeError("the built root's python3 says it runs on %r, not aarch64" % machine)
        open(os.path.join(building, ".complete"), "w").close()
        shutil.rmtree(tree, ignore_errors=True)
        os.rename(building, tree)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return tree


# Run inside a new mount and network namespace (unshare -m -n): the loopback up and nothing else (no registry, no
# host service is reachable), the root an overlay of the cached tree and the layers above it, /proc, /sys and /dev
# inside, the lane's folder bound at /srv/lane. Everything mounted here ends with the namespace.
ENTER = r"""
set -e
ip link set lo up
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$UPPER/data,workdir=$UPPER/work" "$UPPER/root"
R="$UPPER/root"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
mount -t tmpfs tmpfs "$R/tmp"
mkdir -p "$R/srv/lane"
mount --bind "$SHARE" "$R/srv/lane"
exec chroot "$R" "$@"
"""


class BoxRoot:
    """The cached tree with layers on top: ``install`` (the box installed from the wheelhouse, kept for the
    session), then a fresh writable layer for each run, so runs under different CPU models can go side by side."""

    def __init__(self, tree: str, work: str, share: str) -> None:
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise Unavailable("no ip (iproute2) or unshare (util-linux) to isolate the root's network")
        self.tree, self.work, self.share = tree, work, share
        self.layers: List[str] = []
        self.numbers = itertools.count(1)  # next() is atomic: runs start from several threads

    def add_layer(self, layer: str) -> None:
        """A layer made before (its files under ``layer/data``) under the next runs, as a kept run's would be."""
        self.layers.append(layer)

    def run(self, argv: List[str], cpu: str = DEFAULT_CPU, keep: Optional[str] = None, timeout: float = 900,
            env: Optional[dict] = None) -> "subprocess.CompletedProcess[str]":
        """``argv`` in the root; with ``keep`` its writable layer is kept (named so) under the next runs."""
        upper = os.path.join(self.work, keep or "run-%d" % next(self.numbers))
        for sub in ("data", "work", "root"):
            os.makedirs(os.path.join(upper, sub), exist_ok=True)
        lower = ":".join([os.path.join(layer, "data") for layer in reversed(self.layers)] + [self.tree])
        done = subprocess.run(["unshare", "-m", "-n", "sh", "-c", ENTER, "-"] + list(argv),
                              env=dict(chroot_env(cpu, env), LOWER=lower, UPPER=upper, SHARE=self.share),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if keep:
            self.layers.append(upper)
        else:
            shutil.rmtree(upper, ignore_errors=True)
        return done


def chroot_env(cpu: str = DEFAULT_CPU, extra: Optional[dict] = None) -> dict:
    """A clean environment for the root: nothing of the host's (PIP_FIND_LINKS, proxies, venvs) leaks in."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "LANG": "C.UTF-8", "QEMU_CPU": cpu, "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(extra or {})
    return env


def run_in(root: str, argv: List[str], cpu: str = DEFAULT_CPU, offline: bool = False, timeout: float = 600,
           extra_env: Optional[dict] = None, check: bool = True) -> str:
    """``argv`` inside ``root`` under ``QEMU_CPU=cpu``; with ``offline`` in a network namespace of its own
    (loopback only): nothing outside the root is reachable."""
    command = ["chroot", root] + list(argv)
    if offline:
        command = ["unshare", "-n", "sh", "-c", 'ip link set lo up 2>/dev/null || true; exec "$@"', "-"] + command
    done = subprocess.run(command, env=chroot_env(cpu, extra_env), capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done.stdout


if __name__ == "__main__":
    try:
        print(rootfs(log=lambda line: print(line, file=sys.stderr)))
    except Unavailable as exc:
        print("arm64 root unavailable: %s" % exc, file=sys.stderr)
        sys.exit(3)
