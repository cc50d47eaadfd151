"""Atomic, durable file replacement: a reader (or a box after a power cut) sees the old file or the new one.

Order matters: write a temporary file in the same directory, fsync it, ``os.replace`` it over the target,
then fsync the directory so the rename itself survives a power cut (without that, the old file can reappear).
"""

import os
import tempfile
from typing import Union

# What open(path, "w") gives under the usual umask 022. mkstemp makes 0600, and the rename keeps it: a bundle's
# manifest would then be unreadable to the user that serves or copies the bundle, unlike its artifacts.
DEFAULT_MODE = 0o644


def atomic_write(path: str, data: Union[str, bytes], durable: bool = True, mode: int = DEFAULT_MODE) -> None:
    """Replace ``path`` with ``data`` atomically, as a file of ``mode``; ``durable`` adds the two fsyncs (skip
    them for scratch files)."""
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
