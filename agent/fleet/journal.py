"""A rollout's state on disk: a snapshot plus an append-only journal of changes, and a lock per rollout.

Saving used to rewrite and fsync the whole file after every box outcome: at 5,000 boxes 93 ms per save and
about 15 GB written per rollout. Now every change is one short JSON line appended to ``<id>.journal`` (one
fsync per batch of changes), and the snapshot ``<id>.json`` is rewritten only when a run starts and ends (the
journal is then emptied). Loading reads the snapshot and replays the journal; a torn last line (a kill in the
middle of a write) is ignored, as that change had not been acted on yet.

The lock (``<id>.lock``, ``flock``) keeps two operators from driving one rollout at once; the kernel drops it
when its process dies, so a SIGKILL never leaves a stale lock behind.
"""

import contextlib
import fcntl
import glob
import json
import os
import time
from typing import Any, Callable, Dict, Generic, Iterator, List, Optional, Tuple, TypeVar

from agent._util.atomic import atomic_write
from agent.config.schema import ConfigError, parse
from agent.fleet.plan import RolloutError, RolloutSpec
from agent.fleet.records import (
    EXECUTED,
    FAILURES,
    STATE_SCHEMA,
    BoxRecord,
    Outcome,
    RevertWish,
    RolloutRecord,
    RolloutStatus,
)

BOX_KEYS = ("wave", "phase", "outcome", "error", "request_id", "sent_at", "finished_at", "revert")
TOP_KEYS = ("rollout_id", "spec", "status", "waves", "boxes")
ENUM_BOX_KEYS = ("phase", "outcome", "revert")  # states: members of their enums (BoxRecord.from_dict)
NUMBER = (int, float)
TOP_TYPES = {"rollout_id": (str,), "runs": (int,), "started": NUMBER + (type(None),),
             "finished": NUMBER + (type(None),), "updated": NUMBER + (type(None),), "approved": (bool,),
             "shortfall": (str, type(None)), "abort": (dict, type(None)), "cancel": (dict, type(None))}


class _StoredSpec(RolloutSpec):
    """A spec as the state file keeps it, for its types only: its rules (``check``) run when it is driven."""

    check = None  # type: ignore[assignment]


def _damaged(path: str, why: str) -> RolloutError:
    return RolloutError("state file %s is damaged (%s); move it (and its .journal) away to start over" % (
        path, why))


def _replay(journal: str, top: Dict[str, Any], boxes: Any) -> int:
    """Apply the journal's change records to the snapshot as read (``top``: its own fields, ``boxes``: its plain
    box objects); returns how many there were."""
    try:
        with open(journal, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise _damaged(journal, str(exc)) from None
    count = 0
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        count += 1
        try:
            entry = json.loads(line)
            if "b" in entry:
                boxes.setdefault(entry["b"], {}).update(entry["f"])
            else:
                top.update(entry["t"])
        except (ValueError, KeyError, TypeError, AttributeError):
            if number >= len(lines) - 2:  # the torn last line of a killed write
                return count
            raise _damaged(journal, "line %d is not a change record" % (number + 1)) from None
    return count


def _check(path: str, top: Dict[str, Any], boxes: Any) -> None:
    missing = [k for k in TOP_KEYS if k not in top and (k != "boxes" or boxes is None)]
    if missing or not isinstance(boxes, dict) or not isinstance(top["waves"], list):
        raise _damaged(path, "missing or bad %s" % (", ".join(missing) or "boxes/waves"))
    for wave in top["waves"]:
        for device in wave if isinstance(wave, list) else [None]:
            if device not in boxes:
                raise _damaged(path, "wave names %r, which has no box entry" % (device,))
    for device, box in boxes.items():
        if not isinstance(box, dict) or any(k not in box for k in BOX_KEYS):
            raise _damaged(path, "box %r lacks %s" % (device, [k for k in BOX_KEYS if not (
                isinstance(box, dict) and k in box)]))


def _check_types(path: str, top: Dict[str, Any], boxes: Dict[str, Any]) -> None:
    """Every field of the right type (a hand-edited or damaged file is refused here, never a traceback later):
    the spec and each box by their dataclasses (states are checked as members of their enums by
    :meth:`BoxRecord.from_dict` and :meth:`RolloutRecord.from_dict`), the rollout's own fields by
    :data:`TOP_TYPES`."""
    problems = ["%s has the wrong type (%s)" % (k, type(top[k]).__name__) for k, t in TOP_TYPES.items()
                if k in top and (not isinstance(top[k], t) or isinstance(top[k], bool) and bool not in t)]
    try:
        parse(_StoredSpec, top.get("spec"), "spec")
        for device, box in boxes.items():
            parse(BoxRecord, {k: v for k, v in box.items() if k not in ENUM_BOX_KEYS}, "box %r" % device)
    except ConfigError as exc:
        problems.append(" ".join(str(exc).split()))
    if problems:
        raise _damaged(path, "; ".join(problems))


def journal_path(path: str) -> str:
    """``<id>.journal`` beside the snapshot ``<id>.json``."""
    return path[:-len(".json")] + ".journal" if path.endswith(".json") else path + ".journal"


class RolloutState:
    """The rollout's own fields (:class:`RolloutRecord`) and every box's record; change through :meth:`set`,
    :meth:`add` and :meth:`top`.

    ``record`` and ``boxes`` are what the snapshot holds (its top-level fields and its ``boxes`` object),
    written back by :meth:`compact`.
    """

    def __init__(self, path: str, record: RolloutRecord, boxes: Optional[Dict[str, BoxRecord]] = None) -> None:
        self.path = path
        self.journal = journal_path(path)
        self.record = record
        self.boxes: Dict[str, BoxRecord] = boxes if boxes is not None else {}
        self.bytes_written = 0  # what this process wrote to the state files (the bench reports it)
        self._pending: List[str] = []
        self._counts: Optional[Dict[Outcome, int]] = None  # outcome -> boxes, kept up to date by set()
        self.journaled = 0  # change records in the journal file (replayed at load, appended since)

    @classmethod
    def load(cls, path: str) -> Optional["RolloutState"]:
        """The state file at ``path`` with its journal replayed, None when there is none; RolloutError when it is
        damaged. Files written by earlier versions (plain strings for every state) load the same."""
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise _damaged(path, str(exc)) from None
        if not isinstance(data, dict) or data.get("schema") != STATE_SCHEMA:
            raise RolloutError("state file %s has an unknown schema; move it away to start over" % path)
        top = {k: v for k, v in data.items() if k != "boxes"}
        raw = data.get("boxes")
        journaled = _replay(journal_path(path), top, raw)
        _check(path, top, raw)
        boxes = {}
        for device, box in raw.items():
            try:
                boxes[device] = BoxRecord.from_dict(box)
            except (ValueError, TypeError) as exc:
                raise _damaged(path, "box %r: %s" % (device, exc)) from None
        try:  # the rollout's own states too: a member of its enum, or the file is damaged
            record = RolloutRecord.from_dict(top)
        except (ValueError, TypeError) as exc:
            raise _damaged(path, str(exc)) from None
        _check_types(path, top, raw)
        state = cls(path, record, boxes)
        state.journaled = journaled
        return state

    # --- changes -----------------------------------------------------------------------------------------

    @property
    def status(self) -> RolloutStatus:
        return self.record.status

    @property
    def revert(self) -> Optional[RevertWish]:
        """Whether moved boxes are to go back (``--rollback-on-abort``, ``fleet cancel --revert``)."""
        return self.record.revert

    def set(self, device: str, **fields: Any) -> BoxRecord:
        """Change one box; the change is journaled at the next :meth:`save`."""
        box = self.boxes[device]
        before = box.outcome
        changed = box.update(**fields)
        if self._counts is not None and "outcome" in fields:
            self._count(before, -1)
            self._count(box.outcome, 1)
        self._pending.append(json.dumps({"b": device, "f": changed}, sort_keys=True))
        return box

    def add(self, device: str, box: BoxRecord) -> None:
        """A box the plan did not have (one that announced itself later), journaled whole."""
        self.boxes[device] = box
        self._count(box.outcome, 1)
        self._pending.append(json.dumps({"b": device, "f": box.as_dict()}, sort_keys=True))

    def top(self, **fields: Any) -> None:
        """Change the rollout's own fields (status, abort, waves...); ValueError for a field it does not have."""
        changed = self.record.update(**fields)
        self._pending.append(json.dumps({"t": changed}, sort_keys=True))

    def save(self) -> None:
        """Append what changed since the last save, durably; nothing changed, nothing written."""
        if not self._pending:
            return
        text = "\n".join(self._pending) + "\n"
        self.journaled += len(self._pending)
        self._pending = []
        with open(self.journal, "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        self.bytes_written += len(text.encode("utf-8"))

    def compact(self) -> None:
        """Rewrite the snapshot with everything and empty the journal (at the start and end of a run)."""
        self._pending = []
        self.record.updated = time.time()
        data = dict(self.record.as_dict(), boxes={device: box.as_dict() for device, box in self.boxes.items()})
        text = json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n"
        atomic_write(self.path, text)
        self.bytes_written += len(text.encode("utf-8"))
        with open(self.journal, "w", encoding="utf-8"):
            pass
        self.journaled = 0

    def _count(self, outcome: Optional[Outcome], step: int) -> None:
        if outcome and self._counts is not None:
            self._counts[outcome] = self._counts.get(outcome, 0) + step
            if not self._counts[outcome]:
                del self._counts[outcome]

    def outcomes(self) -> Dict[Outcome, int]:
        """Boxes per outcome; counted once, then kept by :meth:`set` (judged after every outcome)."""
        if self._counts is None:
            self._counts = {}
            for box in self.boxes.values():
                self._count(box.outcome, 1)
        return dict(self._counts)

    def executed_and_failures(self) -> Tuple[int, int]:
        counts = self.outcomes()
        return (sum(n for o, n in counts.items() if o in EXECUTED),
                sum(n for o, n in counts.items() if o in FAILURES))


class RolloutLock:
    """An exclusive ``flock`` on ``<state>.lock`` for the life of one run; RolloutError if another holds it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: Optional[int] = None

    def __enter__(self) -> "RolloutLock":
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(self._fd, 64).decode("ascii", "replace").strip() or "?"
            os.close(self._fd)
            self._fd = None
            raise RolloutError("rollout is being driven by another process (pid %s, lock %s): wait for it, or "
                               "'fleet cancel' it" % (holder, self.path)) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode("ascii"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    @contextlib.contextmanager
    def probe(path: str) -> Iterator[bool]:
        """True while another process drives the rollout; else holds the lock for the block (no race). An error
        raised in the block passes through (it is not taken for the lock being held)."""
        lock = RolloutLock(path)
        try:
            lock.__enter__()
        except RolloutError:
            yield True
            return
        try:
            yield False
        finally:
            lock.__exit__()


Read = TypeVar("Read")
Stamp = Tuple[Optional[Tuple[float, int]], ...]


class RolloutReader(Generic[Read]):
    """The rollouts of a state directory, read only (``fleet metrics``, the console): ``read(path)`` of each
    ``<id>.json``, re-run only when the file or its journal changed since it was last read."""

    def __init__(self, state_dir: str, read: Callable[[str], Optional[Read]],
                 recent_s: float = float("inf")) -> None:
        self.state_dir = state_dir
        self.read = read
        self.recent_s = recent_s
        self._cache: Dict[str, Tuple[Stamp, Optional[Read]]] = {}

    def recent(self, now: float) -> Dict[str, Read]:
        """rollout id -> what ``read`` made of it, for rollouts whose files changed within ``recent_s``."""
        found: Dict[str, Read] = {}
        recent = set()
        for path in glob.glob(os.path.join(glob.escape(self.state_dir), "*.json")):
            name = os.path.basename(path)[:-len(".json")]
            if name.endswith(".report") or name.startswith("inventory-"):
                continue
            stamp = self.stamp(name)
            newest = max((s[0] for s in stamp if s is not None), default=0.0)
            if now - newest > self.recent_s:
                continue
            value = self._read(name, stamp)
            if value is not None:
                found[name] = value
            recent.add(name)
        for gone in set(self._cache) - recent:
            self._cache.pop(gone, None)  # two readers at once may both see it gone
        return found

    def one(self, rollout_id: str) -> Optional[Read]:
        """What ``read`` makes of one rollout (None: no such file, or ``read`` said None)."""
        return self._read(rollout_id, self.stamp(rollout_id))

    def stamp(self, rollout_id: str) -> Stamp:
        """(mtime, size) of the state file and its journal (None for one that is missing): a change is a new
        stamp."""
        base = os.path.join(self.state_dir, rollout_id)
        return tuple(_stat(base + suffix) for suffix in (".json", ".journal"))

    def _read(self, name: str, stamp: Stamp) -> Optional[Read]:
        cached = self._cache.get(name)
        if cached is None or cached[0] != stamp:  # an unreadable file too: read (and logged) once per change
            cached = self._cache[name] = (stamp, self.read(os.path.join(self.state_dir, name + ".json"))
                                          if stamp[0] is not None else None)
        return cached[1]


def _stat(path: str) -> Optional[Tuple[float, int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime, info.st_size
