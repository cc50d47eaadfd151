"""Bring a bundle named in a deploy command into the store's staging area, and nothing else.

A deploy names its bundle by a path or a URL. A path must resolve (symlinks followed) to a directory or a
``.tar``/``.tar.gz`` *inside the bundle store*: a command arriving over MQTT must not be able to make the daemon
read arbitrary files on the box. A URL must pass the box's fetch policy (:mod:`agent.lifecycle.fetch_policy`) and is
downloaded with a size cap, a per-read timeout and a deadline, hashed while it streams. The deadlines are enforced
on the socket, not checked between reads: a :class:`SocketWatch` shuts the connection down when the response headers
have not arrived within ``fetch.timeout_s``, when the whole download passes ``fetch.deadline_s`` or when the deploy
is cancelled, so a server that sends its headers or chunk-size lines a byte at a time cannot hold a deploy past
them. When the command names ``archive_sha256`` a mismatch is refused before the archive is even opened. Archives
are unpacked by :func:`agent.lifecycle.unpack.unpack_archive`, which reads them twice, authenticating what it saw
(the deploy's :class:`~agent.lifecycle.unpack.Pin`) before writing anything. The result is always a fresh copy under
a staging directory the caller owns, so the operator's source can change afterwards without touching what was
verified.

A deploy must not fill the box's disk (a full disk breaks the outbox, the slot table and the journal): every
way in (download, copy, unpack) is bounded by the cap *and* by the free space of the staging filesystem less
:data:`agent._util.disk.RESERVE_BYTES`, checked before writing (declared sizes) and while writing (actual bytes).
A ``.tar.gz`` of zeros compresses about 1000:1, so an archive's own size says nothing about what it unpacks to.

A failed download says *why* coarsely (the policy's rule, "could not connect or read", the class of an HTTP
status), never the server's own text or which socket error it was: acks must not make the box a port scanner.
The full reason goes to the box's log.
"""

import hashlib
import http.client
import logging
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
from typing import Callable, List, Optional

from agent._util.redact import redact
from agent.bundle.manifest import MANIFEST, BundleError
from agent.bundle.verify import sha256_file
from agent.config.schema import FieldError
from agent.errors import CommandError
from agent.lifecycle.fetch_policy import FetchPolicy, Refused
from agent.lifecycle.unpack import DEFAULT_MAX_BYTES, DEFAULT_UNPACK_DEADLINE_S, Budget, Check, unpack_archive

log = logging.getLogger(__name__)

DOWNLOAD_CHUNK = 1 << 16
COULD_NOT_READ = "download of %s failed: could not connect to the server or read from it"
WATCH_POLL_S = 0.1  # how often a download's watch looks at its deadlines and cancel (cancel within 2 s)
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MAX_TREE_FILES = 10000  # a bundle directory in the store: the same member cap as an archive
FIELD = "bundle"


class FetchError(BundleError):
    """The bundle could not be brought in: bad source, outside the store, too big, download failed."""

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__([FieldError(FIELD, message)], source)
        self.reason = message


def is_url(source: str) -> bool:
    return "://" in source


def resolve_in_store(source: str, store: str) -> str:
    """The real path of ``source`` (relative to the store, or absolute) if it lies inside the store.

    Symlinks are resolved *before* the check, so a link inside the store pointing elsewhere is refused too.
    """
    if "\x00" in source:
        raise FetchError("%r holds a NUL byte: not a path" % source[:80], source[:80])
    store_real = os.path.realpath(store)
    candidate = source if os.path.isabs(source) else os.path.join(store_real, source)
    real = os.path.realpath(candidate)
    if os.path.commonpath([store_real, real]) != store_real or real == store_real:
        raise FetchError("%s is outside the bundle store %s (deploy reads only from there)" % (
            source, store_real), source)
    if not os.path.exists(real):
        raise FetchError("%s does not exist in the bundle store" % source, source)
    return real


def fetch_bundle(source: str, store: str, staging: str, policy: Optional[FetchPolicy] = None,
                 check: Optional[Check] = None, archive_sha256: Optional[str] = None,
                 cancelled: Optional[Callable[[], bool]] = None) -> str:
    """Copy, unpack or download ``source`` into the empty directory ``staging``; returns the bundle root.

    ``check`` authenticates an archive between its two passes (nothing is written before it returns);
    ``archive_sha256`` pins the archive file itself; ``cancelled`` is polled between chunks (a ``cancel``
    command). ``staging`` belongs to the caller, who deletes it on failure.
    """
    policy = policy or FetchPolicy()
    if is_url(source):
        archive = os.path.join(staging, "download.tar")
        download(source, archive, policy, archive_sha256, cancelled)
        try:
            return _unpack(archive, os.path.join(staging, "bundle"), source, policy.max_bytes, check, cancelled,
                           policy.unpack_deadline_s)
        finally:
            os.remove(archive)
    real = resolve_in_store(source, store)
    if archive_sha256 is not None and os.path.isfile(real):
        _check_digest(sha256_file(real), archive_sha256, source)
    return copy_local(real, staging, policy.max_bytes, source, check, cancelled, policy.unpack_deadline_s)


def copy_local(real: str, staging: str, max_bytes: int = DEFAULT_MAX_BYTES, source: str = "",
               check: Optional[Check] = None, cancelled: Optional[Callable[[], bool]] = None,
               deadline_s: float = DEFAULT_UNPACK_DEADLINE_S) -> str:
    """A bundle directory or archive already on this box into ``staging``; returns the bundle root.

    Used for store paths (after :func:`resolve_in_store`) and for the configured first-start bundle.
    """
    source = source or real
    dest = os.path.join(staging, "bundle")
    if os.path.isdir(real):
        _check_plain_tree(real, Budget(staging, max_bytes), source)
        shutil.copytree(real, dest, symlinks=False)
        return dest
    if os.path.isfile(real):
        if not real.endswith(ARCHIVE_SUFFIXES):
            raise FetchError("%s is neither a bundle directory nor a %s archive" % (
                source, "/".join(ARCHIVE_SUFFIXES)), source)
        if os.path.getsize(real) > max_bytes:
            raise FetchError("%s is %d bytes, over the limit of %d" % (
                source, os.path.getsize(real), max_bytes), source)
        return _unpack(real, dest, source, max_bytes, check, cancelled, deadline_s)
    raise FetchError("%s is not a directory or a file" % source, source)


def _check_plain_tree(root: str, budget: "Budget", source: str) -> None:
    """Refuse links (they could pull in files from outside) and trees bigger than the budget."""
    if not os.path.exists(os.path.join(root, MANIFEST)):
        raise FetchError("%s has no %s at its root" % (source, MANIFEST), source)
    total = count = 0
    for dirpath, dirs, names in os.walk(root):
        count += len(dirs) + len(names)
        if count > MAX_TREE_FILES:
            raise FetchError("%s holds more than %d files and directories" % (source, MAX_TREE_FILES), source)
        for name in dirs + names:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                raise FetchError("%s contains a symbolic link: %s" % (
                    source, os.path.relpath(path, root)), source)
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
    if total > budget.limit:
        raise FetchError("%s holds %d bytes, more than %s" % (source, total, budget.reason), source)


def _unpack(archive: str, dest: str, source: str, max_bytes: int, check: Optional[Check],
            cancelled: Optional[Callable[[], bool]] = None, deadline_s: float = DEFAULT_UNPACK_DEADLINE_S) -> str:
    try:
        return unpack_archive(archive, dest, max_bytes, deadline_s, check=check, cancelled=cancelled)
    except OSError as exc:
        raise FetchError("%s could not be unpacked: %s" % (source, exc), source) from None
    except BundleError as exc:
        # Keep the archive's own reason (e.g. "member escapes the bundle: ../x") and name the source.
        raise BundleError(exc.errors, source) from None


class SocketWatch:
    """Ends a download from outside: a thread that shuts its connections down when it must stop.

    Reads block in the socket (http.client reads headers and chunk-size lines a line at a time), so a check
    between reads cannot bound them: a server that sends a byte every second never trips a per-read timeout.
    This watch shuts every socket the download connected down (``SHUT_RDWR`` on a duplicate of it, which ends
    the connection under any TLS wrapper) once the headers are late, the deadline has passed or the deploy is
    cancelled; the blocked read then returns, and :meth:`raise_if_stopped` says why in the project's words.
    """

    def __init__(self, url: str, policy: FetchPolicy, cancelled: Optional[Callable[[], bool]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.shown = url
        self.clock = clock
        self.started = clock()
        self.headers_by = self.started + min(policy.timeout_s, policy.deadline_s)
        self.deadline = self.started + policy.deadline_s
        self.policy = policy
        self.cancelled = cancelled or (lambda: False)
        self.headers_in = False
        self.why: Optional[str] = None
        self._lock = threading.Lock()
        self._sockets: List[socket.socket] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-watch", daemon=True)

    def __enter__(self) -> "SocketWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets = []

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock.dup())
            stop = self.why is not None
        if stop:
            self._shutdown()

    def stopped(self) -> bool:
        return self._reason() is not None

    def _reason(self) -> Optional[str]:
        if self.why is not None:
            return self.why
        now = self.clock()
        if self.cancelled():
            return "cancelled"
        if now > self.deadline:
            return "deadline"
        if not self.headers_in and now > self.headers_by:
            return "headers"
        return None

    def _run(self) -> None:
        while not self._done.wait(WATCH_POLL_S):
            why = self._reason()
            if why is not None:
                self.why = why
                self._shutdown()
                return

    def _shutdown(self) -> None:
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed by the server
                    pass

    def raise_if_stopped(self) -> None:
        """The download's end in the project's words, if the watch (or a check now) ended it."""
        why = self.why or self._reason()
        self.why = why
        if why == "cancelled":
            raise CommandError("cancelled", "the deploy was cancelled while downloading %s; nothing changed"
                               % self.shown)
        if why == "headers":  # in the ack, a silent server reads as a closed port does: no port scanner
            log.warning("download of %s failed: no response headers within %g s (fetch.timeout_s)", self.shown,
                        self.policy.timeout_s)
            raise FetchError(COULD_NOT_READ % self.shown, self.shown)
        if why == "deadline":
            raise FetchError("download of %s took longer than %g s (fetch.deadline_s)" % (
                self.shown, self.policy.deadline_s), self.shown)


def download(url: str, dest: str, policy: FetchPolicy, sha256: Optional[str] = None,
             cancelled: Optional[Callable[[], bool]] = None) -> int:
    """Stream ``url`` to ``dest`` under ``policy``; returns the byte count.

    Refused: a URL, address or redirect outside the policy; more than the cap (or than the disk can spare),
    by Content-Length before any byte is written and by count while streaming, since a server may send no
    length or a wrong one; a body shorter than its Content-Length; headers later than ``timeout_s``; a download
    slower than the deadline; a body whose sha256 is not ``sha256``. A cancel ends it within a poll.
    """
    shown = redact(url)
    budget = Budget(os.path.dirname(os.path.abspath(dest)), policy.max_bytes)
    digest = hashlib.sha256()
    total = 0
    watch = SocketWatch(shown, policy, cancelled)
    try:
        policy.check_url(url)
        with watch, policy.opener(watch).open(url, timeout=policy.timeout_s) as response:
            watch.headers_in = True
            declared = _content_length(response.headers.get("Content-Length"))
            if declared is not None and declared > budget.limit:
                raise FetchError("%s is %s bytes, more than %s" % (shown, declared, budget.reason), shown)
            with open(dest, "wb") as handle:
                while True:
                    watch.raise_if_stopped()
                    # read1: what has arrived, up to a chunk. read() would wait for a whole chunk.
                    chunk = response.read1(DOWNLOAD_CHUNK)
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > budget.limit:
                        raise FetchError("%s sent more than %s" % (shown, budget.reason), shown)
                    digest.update(chunk)
                    handle.write(chunk)
            watch.raise_if_stopped()  # a socket shut down by the watch reads as a clean end
            if declared is not None and total != declared:
                raise FetchError("download of %s failed: the server sent %d of the %d bytes it announced" % (
                    shown, total, declared), shown)
    except Refused as exc:
        raise FetchError("download of %s refused by the fetch policy: %s" % (shown, exc), shown) from None
    except urllib.error.HTTPError as exc:
        log.warning("download of %s failed: HTTP %d %s", shown, exc.code, str(exc.reason)[:200])
        raise FetchError("download of %s failed: the server answered HTTP %dxx" % (
            shown, exc.code // 100), shown) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        watch.raise_if_stopped()
        log.warning("download of %s failed: %s", shown, getattr(exc, "reason", exc))
        raise FetchError(COULD_NOT_READ % shown, shown) from None
    if sha256 is not None:
        _check_digest(digest.hexdigest(), sha256, shown)
    log.info("downloaded %s (%d bytes) in %.1f s", shown, total, time.monotonic() - watch.started)
    return total


def _content_length(value: Optional[str]) -> Optional[int]:
    """A Content-Length of ASCII digits (at most 20: any 64-bit size), else None: not trusted, counted instead."""
    if value is None or not re.fullmatch(r"[0-9]{1,20}", value.strip()):
        return None
    return int(value.strip())


def _check_digest(actual: str, pinned: str, shown: str) -> None:
    if actual != pinned.lower():
        raise CommandError("sha256_mismatch", "%s has sha256 %s, the command pinned archive_sha256 %s; nothing "
                           "was unpacked" % (shown, actual, pinned.lower()), field="archive_sha256")
