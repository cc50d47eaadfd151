"""Atomic, durable file replacement: a reader (or a box after a power cut) sees the old file or the new one.

Order matters: write a temporary file in the same directory, fsync it, ``os.replace`` it over the target,
then fsync the directory so the rename itself survives a power cut (without that, the old file can reappear).
"""

import os
import tempfile
from typing import Union


def atomic_write(path: str, data: Union[str, bytes], durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; ``durable`` adds the two fsyncs (skip them for scratch files)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as handle:
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
