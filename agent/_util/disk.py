"""Free space on the filesystem that holds the daemon's state, less the reserve nothing may eat into.

An edge box keeps its state on a small SD card or eMMC. Whatever fills it (a deploy, a growing outbox) must
leave ``RESERVE_BYTES`` free, so that SQLite can still commit the deletes that make room again, the slot table
can still be replaced atomically and the journal can still log why.
"""

import shutil

# SQLite needs room for its WAL/journal to commit a delete; an atomic replace needs a second copy of the file.
# 32 MiB covers both with margin on a box whose state is a few MB (outbox budget aside).
RESERVE_BYTES = 32 << 20


def free_bytes(path: str) -> int:
    """Free bytes (for unprivileged writers) on the filesystem holding ``path``."""
    return shutil.disk_usage(path).free


def usable_bytes(path: str, reserve: int = RESERVE_BYTES) -> int:
    """Bytes that may still be written on ``path``'s filesystem: free space less ``reserve``, never negative."""
    return max(0, free_bytes(path) - reserve)
