"""Bring a bundle named in a deploy command into the store's staging area, and nothing else.

A deploy names its bundle by a path or an http(s) URL. A path must resolve (symlinks followed) to a directory
or a ``.tar``/``.tar.gz`` *inside the bundle store*: a command arriving over MQTT must not be able to make the
daemon read arbitrary files on the box. A URL is downloaded with a size cap and a timeout. Archives are
unpacked by :func:`unpack_archive`, which refuses absolute, ``..``, link and device members.
The result is always a fresh copy under a staging directory the caller owns, so the operator's source can
change afterwards without touching what was verified.

A deploy must not fill the box's disk (a full disk breaks the outbox, the slot table and the journal): every
way in (download, copy, unpack) is bounded by the cap *and* by the free space of the staging filesystem less
:data:`agent._util.disk.RESERVE_BYTES`, checked before writing (declared sizes) and while writing (actual bytes).
A ``.tar.gz`` of zeros compresses about 1000:1, so an archive's own size says nothing about what it unpacks to.
"""

import logging
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, Optional

from agent._util.disk import RESERVE_BYTES, free_bytes
from agent.config.schema import FieldError
from agent.lifecycle.bundle import MANIFEST, BundleError

log = logging.getLogger(__name__)

# A bundle is a few MB to a few hundred MB (several tiers of .om/.ms plus golden files); 1 GiB stops a wrong
# URL from filling the box's disk while leaving room for big multi-tier detectors.
DEFAULT_MAX_BYTES = 1 << 30
# Per-read socket timeout and whole-download deadline: a stalled server must fail the deploy, not hang it.
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_DEADLINE_S = 600.0
DOWNLOAD_CHUNK = 1 << 16
COPY_CHUNK = 1 << 20
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FIELD = "bundle"


class FetchError(BundleError):
    """The bundle could not be brought in: bad source, outside the store, too big, download failed."""

    def __init__(self, message: str, source: str = "") -> None:
        super().__init__([FieldError(FIELD, message)], source)
        self.reason = message


def is_url(source: str) -> bool:
    return urllib.parse.urlsplit(source).scheme in ("http", "https")


def resolve_in_store(source: str, store: str) -> str:
    """The real path of ``source`` (relative to the store, or absolute) if it lies inside the store.

    Symlinks are resolved *before* the check, so a link inside the store pointing elsewhere is refused too.
    """
    store_real = os.path.realpath(store)
    candidate = source if os.path.isabs(source) else os.path.join(store_real, source)
    real = os.path.realpath(candidate)
    if os.path.commonpath([store_real, real]) != store_real or real == store_real:
        raise FetchError("%s is outside the bundle store %s (deploy reads only from there)" % (
            source, store_real), source)
    if not os.path.exists(real):
        raise FetchError("%s does not exist in the bundle store" % source, source)
    return real


def fetch_bundle(source: str, store: str, staging: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float = DEFAULT_DEADLINE_S) -> str:
    """Copy, unpack or download ``source`` into the empty directory ``staging``; returns the bundle root.

    ``staging`` belongs to the caller, who deletes it on failure.
    """
    if is_url(source):
        archive = os.path.join(staging, "download.tar")
        download(source, archive, max_bytes, timeout_s, deadline_s)
        try:
            return _unpack(archive, os.path.join(staging, "bundle"), source, max_bytes)
        finally:
            os.remove(archive)
    if "://" in source:
        raise FetchError("unsupported scheme in %s (use a store path or an http(s) URL)" % source, source)
    return copy_local(resolve_in_store(source, store), staging, max_bytes, source)


def copy_local(real: str, staging: str, max_bytes: int = DEFAULT_MAX_BYTES, source: str = "") -> str:
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
        return _unpack(real, dest, source, max_bytes)
    raise FetchError("%s is not a directory or a file" % source, source)


def _check_plain_tree(root: str, budget: "Budget", source: str) -> None:
    """Refuse links (they could pull in files from outside) and trees bigger than the budget."""
    if not os.path.exists(os.path.join(root, MANIFEST)):
        raise FetchError("%s has no %s at its root" % (source, MANIFEST), source)
    total = 0
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                raise FetchError("%s contains a symbolic link: %s" % (
                    source, os.path.relpath(path, root)), source)
        for name in names:
            total += os.path.getsize(os.path.join(dirpath, name))
    if total > budget.limit:
        raise FetchError("%s holds %d bytes, more than %s" % (source, total, budget.reason), source)


def _unpack(archive: str, dest: str, source: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    try:
        return unpack_archive(archive, dest, max_bytes)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise FetchError("%s is not a readable tar archive: %s" % (source, exc), source) from None
    except BundleError as exc:
        # Keep the archive's own reason (e.g. "member escapes the bundle: ../x") and name the source.
        raise BundleError(exc.errors, source) from None


def download(url: str, dest: str, max_bytes: int = DEFAULT_MAX_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
             deadline_s: float = DEFAULT_DEADLINE_S) -> int:
    """Stream ``url`` to ``dest``; refuse more than ``max_bytes`` (or than the disk can spare) and downloads
    slower than the deadline.

    The Content-Length is checked before any byte is written, and the count is checked while streaming, since
    a server may send no length or a wrong one. Returns the byte count.
    """
    started = time.monotonic()
    shown = redact(url)
    budget = Budget(os.path.dirname(os.path.abspath(dest)), max_bytes)
    try:
        response = urllib.request.urlopen(url, timeout=timeout_s)  # noqa: S310 - scheme checked by is_url
    except urllib.error.HTTPError as exc:
        raise FetchError("download of %s failed: HTTP %d %s" % (shown, exc.code, exc.reason), shown) from None
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError("download of %s failed: %s" % (shown, getattr(exc, "reason", exc)), shown) from None
    total = 0
    with response:
        declared: Optional[str] = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > budget.limit:
            raise FetchError("%s is %s bytes, more than %s" % (shown, declared, budget.reason), shown)
        try:
            with open(dest, "wb") as handle:
                while True:
                    if time.monotonic() - started > deadline_s:
                        raise FetchError("download of %s took longer than %.0f s" % (
                            shown, deadline_s), shown)
                    chunk = response.read(DOWNLOAD_CHUNK)
                    if not chunk:
                        break
                    total += len(chunk)
                    if total > budget.limit:
                        raise FetchError("%s sent more than %s" % (shown, budget.reason), shown)
                    handle.write(chunk)
        except OSError as exc:
            raise FetchError("download of %s failed: %s" % (shown, exc), shown) from None
    log.info("downloaded %s (%d bytes) in %.1f s", shown, total, time.monotonic() - started)
    return total


def redact(source: str) -> str:
    """A URL without user:password or query (a pre-signed URL's token must not reach acks or logs)."""
    if not is_url(source):
        return source
    parts = urllib.parse.urlsplit(source)
    host = parts.hostname or ""
    if parts.port:
        host = "%s:%d" % (host, parts.port)
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


# --- archives -----------------------------------------------------------------------------------------------

class Budget:
    """How many bytes a fetch may write under ``path``: the cap, or less when the disk cannot spare that much.

    ``reason`` names the binding number for error messages: the cap, or the free space and the reserve.
    """

    def __init__(self, path: str, cap: int, reserve: int = RESERVE_BYTES) -> None:
        free = free_bytes(path)
        spare = max(0, free - reserve)
        self.limit = min(cap, spare)
        if cap <= spare:
            self.reason = "the limit of %d bytes" % cap
        else:
            self.reason = "the %d bytes free on %s less the reserve of %d bytes" % (free, path, reserve)


def unpack_archive(archive: str, dest: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Extract a bundle tar into ``dest``; returns the bundle root (``dest`` or its single top directory).

    Refused before anything is written: absolute paths, ``..``, links, devices, and members whose declared
    sizes add up to more than the :class:`Budget` (the cap, or the free space less the reserve). While
    extracting, the bytes actually written are counted against the same budget.
    """
    os.makedirs(dest, exist_ok=True)
    budget = Budget(dest, max_bytes)
    with tarfile.open(archive, "r:*") as tar:
        members = []
        declared = 0
        for member in tar:  # headers only; refused at the first one that goes over, before any data is read
            name = member.name
            if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
                raise _archive_error(archive, "archive member escapes the bundle: %s" % name)
            if not (member.isfile() or member.isdir()):
                raise _archive_error(archive, "archive member is not a plain file: %s" % name)
            declared += member.size if member.isfile() else 0
            if declared > budget.limit:
                raise _archive_error(archive, "archive unpacks to at least %d bytes, more than %s" % (
                    declared, budget.reason))
            members.append(member)
        written = 0
        for member in members:
            target = os.path.join(dest, member.name)
            if member.isdir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target) or dest, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            with source, open(target, "wb") as out:
                written = _copy_counted(source, out, written, budget, archive)
    if os.path.exists(os.path.join(dest, MANIFEST)):
        return dest
    tops = [d for d in os.listdir(dest) if os.path.isdir(os.path.join(dest, d))]
    if len(tops) == 1 and os.path.exists(os.path.join(dest, tops[0], MANIFEST)):
        return os.path.join(dest, tops[0])
    raise BundleError([FieldError("manifest.json", "missing at the archive's root")], archive)


def _copy_counted(source: IO[bytes], out: IO[bytes], written: int, budget: Budget, archive: str) -> int:
    """Copy one member, counting every byte against the budget: declared sizes are a claim, not a bound."""
    while True:
        chunk = source.read(COPY_CHUNK)
        if not chunk:
            return written
        written += len(chunk)
        if written > budget.limit:
            raise _archive_error(archive, "archive unpacked past %s while extracting (%d bytes written)" % (
                budget.reason, written))
        out.write(chunk)


def _archive_error(archive: str, message: str) -> BundleError:
    return BundleError([FieldError(FIELD, message)], archive)
