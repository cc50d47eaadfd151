"""The bundle store on disk: staging for fetches in progress, installed slot bundles, and garbage collection.

Layout under ``<state_dir>/<model.store>``::

    slots/<slot>-<sha12>[-n]     the bundles the slot table refers to (and, briefly, one being installed)
    slots/<name>.corrupt-<time>  an entry that failed its hashes at start, kept as evidence (the newest only)
    .staging/<tmp>               fetches in progress; anything left there is from a crash
    incoming/ (or any other)     the operator's own files, which a deploy may name; never touched here

The store never decides what to keep: the model manager's slot table does. A directory being installed is
"in flight" until the table names it, so a garbage collection running meanwhile does not delete it.
"""

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Iterable, Iterator, List, Optional, Set

from agent._util.quarantine import move_aside
from agent.bundle.manifest import MANIFEST, BundleError
from agent.bundle.verify import Bundle, verify_bundle
from agent.config.schema import FieldError
from agent.lifecycle.slots import Slot

log = logging.getLogger(__name__)

SLOTS_DIR = "slots"
STAGING_DIR = ".staging"
SET_ASIDE_MARK = ".corrupt-"  # agent._util.quarantine.move_aside's suffix
# A damaged bundle can be hundreds of MB on a small eMMC: keep the newest one for a person to look at, not all.
KEEP_SET_ASIDE = 1


class BundleStore:
    """Staging, install, verification and garbage collection of bundle directories (see module doc)."""

    def __init__(self, root: str, public_key: Optional[bytes] = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.root = os.path.abspath(root)
        self.public_key = public_key
        self.wall_clock = wall_clock  # only names set-aside entries, for people
        self.slots_dir = os.path.join(self.root, SLOTS_DIR)
        self.staging_dir = os.path.join(self.root, STAGING_DIR)
        self._lock = threading.Lock()
        self._in_flight: Set[str] = set()  # store-relative dirs installed but not yet in the table

    def open(self) -> None:
        """At start: make the layout and drop what a crash left in staging."""
        os.makedirs(self.slots_dir, exist_ok=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    @contextlib.contextmanager
    def staging(self) -> Iterator[str]:
        """A fresh, empty staging directory, removed (with whatever is in it) when the block ends."""
        os.makedirs(self.staging_dir, exist_ok=True)
        path = tempfile.mkdtemp(dir=self.staging_dir)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def install(self, root: str, slot: str, bundle: Bundle) -> str:
        """Move a verified staging copy into ``slots/`` under a fresh name; returns it, store-relative.

        It stays safe from :meth:`gc` until :meth:`settled` (the table names it, or it is garbage now).
        """
        base = "%s-%s" % (slot, bundle.manifest_sha256[:12])
        with self._lock:
            name, count = base, 1
            while os.path.exists(os.path.join(self.slots_dir, name)):
                count += 1
                name = "%s-%d" % (base, count)
            relative = "%s/%s" % (SLOTS_DIR, name)
            self._in_flight.add(relative)
        os.rename(root, self.path(relative))  # same filesystem (both under the store): atomic, no second copy
        return relative

    def settled(self, relative: Optional[str]) -> None:
        """An installed directory is now in the table, or abandoned: gc may judge it again."""
        with self._lock:
            self._in_flight.discard(relative or "")

    def discard(self, relative: str) -> None:
        """Remove an installed directory that will never be in the table (a deploy that failed after install)."""
        shutil.rmtree(self.path(relative), ignore_errors=True)
        self.settled(relative)

    def path(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    def verify(self, slot: Slot) -> Bundle:
        """Re-verify a slot's bundle from disk (hashes and signature): the store may have been altered."""
        assert slot.bundle is not None
        bundle = verify_bundle(self.path(slot.bundle), self.public_key)
        if bundle.manifest_sha256 != slot.manifest_sha256:
            raise BundleError([FieldError(MANIFEST, "changed on disk: sha256 %s, slot table says %s" % (
                bundle.manifest_sha256, slot.manifest_sha256))], bundle.root)
        return bundle

    def set_aside(self, relative: str, reason: str) -> Optional[str]:
        """Move a damaged entry aside (kept as evidence, never served); returns where, or None if it could not."""
        if not os.path.exists(self.path(relative)):
            return None
        return move_aside(self.path(relative), reason, clock=self.wall_clock)

    def gc(self, keep: Callable[[], Iterable[str]]) -> List[str]:
        """Delete ``slots/`` entries that ``keep()`` (store-relative) does not name; returns what went.

        ``keep`` is read under the store's lock, after any install it must see: an install marks its directory
        in flight before the table can name it, and is settled only after the table does.
        """
        with self._lock:
            kept = set(keep()) | self._in_flight
            names = sorted(os.listdir(self.slots_dir)) if os.path.isdir(self.slots_dir) else []
            set_aside = sorted((n for n in names if SET_ASIDE_MARK in n), key=_set_aside_stamp)
            doomed = [n for n in names if SET_ASIDE_MARK not in n and "%s/%s" % (SLOTS_DIR, n) not in kept]
            doomed += set_aside[:-KEEP_SET_ASIDE] if KEEP_SET_ASIDE else set_aside
        for name in doomed:
            log.info("removing %s from the bundle store (no slot refers to it)", name)
            shutil.rmtree(os.path.join(self.slots_dir, name), ignore_errors=True)
        return doomed

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.root).replace(os.sep, "/")


def _set_aside_stamp(name: str) -> List[int]:
    """``a-0123.corrupt-1700000000-1`` -> [1700000000, 1]: the order in which entries were set aside."""
    return [int(part) for part in name.split(SET_ASIDE_MARK, 1)[1].split("-") if part.isdigit()]
