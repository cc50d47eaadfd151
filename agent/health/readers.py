"""Memory readers: a process's resident memory (this one's, or a camera worker's by pid) and the memory limit
systemd put on its cgroup.

Plain file readers over ``/proc`` and ``/sys/fs/cgroup`` (both roots are parameters, so tests use fake trees).
All figures are MiB (what systemd's ``M`` suffix means).
"""

import os
from typing import List, Optional, Tuple

MIB = 1024 * 1024
# cgroup v1 writes "unlimited" as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages): no box
# has 1 EiB, so anything at or above it means no limit.
V1_UNLIMITED_BYTES = 1 << 60


def read_rss_mb(proc_root: str = "/proc", pid: str = "self") -> Optional[float]:
    """Resident memory of a process in MiB, from ``statm`` (cheap), else ``status`` VmRSS; None off Linux."""
    base = os.path.join(proc_root, str(pid))
    try:
        with open(os.path.join(base, "statm")) as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(base, "status")) as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_paths(proc_root: str, pid: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 memory-controller path) of a process, from ``/proc/<pid>/cgroup``."""
    v2 = v1 = None
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _read_limit_file(path: str, unlimited_word: str) -> Optional[int]:
    """Bytes in a cgroup limit file; None when absent, unreadable or unlimited."""
    try:
        with open(path) as handle:
            raw = handle.read().strip()
    except OSError:
        return None
    if raw == unlimited_word:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if value < V1_UNLIMITED_BYTES else None


def _walk_limits(mount: str, cgroup_path: str, filename: str, unlimited_word: str) -> List[int]:
    """Limits from our cgroup up to the mount's root: the tightest one is what the kernel enforces."""
    relative = cgroup_path.strip("/")
    directory = os.path.join(mount, relative) if relative else mount
    if not os.path.isdir(directory):
        # In a cgroup namespace (a container) /proc shows "/" or a path the mount does not have: the mount's
        # root is then our own cgroup.
        directory = mount
    limits = []
    while True:
        value = _read_limit_file(os.path.join(directory, filename), unlimited_word)
        if value is not None:
            limits.append(value)
        if os.path.normpath(directory) == os.path.normpath(mount):
            return limits
        directory = os.path.dirname(directory)


def read_cgroup_limit_mb(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                         pid: str = "self") -> Optional[float]:
    """This process's cgroup memory limit in MiB (v2 ``memory.max``, v1 ``memory.limit_in_bytes``).

    None when there is no limit or no cgroup filesystem. On a hybrid host the v2 tree is mounted at
    ``<cgroup_root>/unified`` and usually has no memory controller, so the v1 tree answers.
    """
    v2_path, v1_path = _cgroup_paths(proc_root, pid)
    limits: List[int] = []
    if v2_path is not None:
        for mount in (cgroup_root, os.path.join(cgroup_root, "unified")):
            if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                limits += _walk_limits(mount, v2_path, "memory.max", "max")
                break
    if v1_path is not None:
        mount = os.path.join(cgroup_root, "memory")
        if os.path.isdir(mount):
            limits += _walk_limits(mount, v1_path, "memory.limit_in_bytes", "")
    return min(limits) / MIB if limits else None
