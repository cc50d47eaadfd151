"""Atomic, durable file replacement: a reader (or a box after a power cut) sees the old file or the new one.

Order matters: write a temporary file in the same directory, fsync it, ``os.replace`` it over the target,
then fsync the directory so the rename itself survives a power cut (without that, the old file can reappear).
"""

import os
import tempfile
from typing import Optional, Union

_umask: Optional[int] = None


def default_mode() -> int:
    """What ``open(path, "w")`` gives: 0666 less the process umask (0644 under the usual 022; 0640 under the
    unit's UMask=0027, so an overrides file holding a stream's password is not world-readable). mkstemp makes
    0600 and the rename keeps it: a bundle's manifest would then be unreadable to the user that serves it.
    The umask is read from /proc (os.umask can only read it by changing it, which races other threads)."""
    global _umask
    if _umask is None:
        _umask = 0o022
        try:
            with open("/proc/self/status", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("Umask:"):
                        _umask = int(line.split()[1], 8)
        except (OSError, ValueError):
            pass
    return 0o666 & ~_umask


def private_mode() -> int:
    """:func:`default_mode` with no bits for others, whatever the umask: for a file that can hold a secret
    (``overrides.json`` keeps a stream URL with its password from a remote set-config). The unit's UMask
    already gives that; a daemon run by hand or under another supervisor (umask 022) would not."""
    return default_mode() & ~0o007


def atomic_write(path: str, data: Union[str, bytes], durable: bool = True, mode: Optional[int] = None) -> None:
    """Replace ``path`` with ``data`` atomically, as a file of ``mode`` (default: as ``open`` would make it);
    ``durable`` adds the two fsyncs (skip them for scratch files)."""
    if mode is None:
        mode = default_mode()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(payload)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if durable:
        fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
