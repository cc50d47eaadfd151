"""Unpack a bundle archive in two forward passes: look at everything first, then write.

The first pass (:func:`scan`) reads every header and every byte of data through :mod:`agent.lifecycle.tar`,
hashing each file and charging the disk budget, without writing anything. A deploy then authenticates what it
saw (:class:`Pin`: the manifest the command pinned, its signature when the box requires one, every file listed
in it with the size and hash found) *before* the second pass writes a single member, and the second pass
refuses any member that differs from what the first saw.

The budget counts what the files cost on disk, not their bytes: each member is charged its size rounded up to
the file system's block, plus one block for its inode and directory entry, so 50,000 one-byte files cost what
they really take. Directories count too: each directory the unpack would create, parents included, is charged
a block and an inode; inodes are budgeted beside bytes (the free inodes less a reserve), a path is at most
:data:`MAX_DEPTH` levels deep and an archive creates at most :data:`MAX_DIRECTORIES` directories. With a
:class:`Pin`, every path must be one the manifest names (or a parent of one), so what the archive writes is
what the manifest, hash-pinned and perhaps signed, vouches for. The whole unpack (both passes) has a deadline.
"""

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

from agent._util.disk import RESERVE_BYTES, free_bytes
from agent.bundle.manifest import MANIFEST, SIGNATURE, BundleError, parse_manifest
from agent.bundle.signing import signature_matches
from agent.config.schema import FieldError
from agent.errors import CommandError
from agent.lifecycle.tar import DIRECTORY, FILE, Member, Reader, TarError, hash_data, members

# A bundle is a few MB to a few hundred MB (several tiers of .om/.ms plus golden files); 1 GiB stops a wrong
# URL from filling the box's disk while leaving room for big multi-tier detectors.
DEFAULT_MAX_BYTES = 1 << 30
# Both passes over a 1 GiB bundle read from an SD card take well under a minute on a 310 board.
DEFAULT_UNPACK_DEADLINE_S = 120.0
MAX_MANIFEST_BYTES = 4 << 20  # read into memory to authenticate; a real manifest is a few KB
MAX_ERRORS = 10  # errors listed in one refusal; the rest are counted
# A bundle is flat (artifacts, golden/, calibration/ under one top directory): 16 levels is far more than any
# writer makes, and a 125-deep chain of directories (25,000 inodes for 200 members) is refused at its header.
MAX_DEPTH = 16
MAX_DIRECTORIES = 1000  # directories one archive may create, parents included
# Inodes left free on the staging file system for everything else on it (the outbox, the slot table, logs).
INODE_RESERVE = 4096
FIELD = "bundle"


class Budget:
    """How much a fetch may write under ``path``: the cap, or less when the disk cannot spare that much.

    ``reason`` names the binding number for error messages: the cap, or the free space and the reserve.
    """

    def __init__(self, path: str, cap: int, reserve: int = RESERVE_BYTES) -> None:
        free = free_bytes(path)
        spare = max(0, free - reserve)
        self.limit = min(cap, spare)
        stat = os.statvfs(path)
        self.block = max(512, stat.f_frsize or 4096)
        # Inodes: a file system that reports none (btrfs, some overlays) allocates them as it goes.
        self.inodes = max(0, stat.f_favail - INODE_RESERVE) if stat.f_files else None
        if cap <= spare:
            self.reason = "the limit of %d bytes" % cap
        else:
            self.reason = "the %d bytes free on %s less the reserve of %d bytes" % (free, path, reserve)

    def cost(self, size: int) -> int:
        """Disk a member takes: its blocks, plus one block for its inode and directory entry."""
        return -(-size // self.block) * self.block + self.block


@dataclass
class Scan:
    """What the first pass saw: every member, each file's sha256, and the manifest and signature bytes."""

    members: Dict[str, Member] = field(default_factory=dict)
    hashes: Dict[str, str] = field(default_factory=dict)
    kept: Dict[str, bytes] = field(default_factory=dict)  # manifest.json / manifest.sig at depth 0 or 1
    prefix: str = ""  # "" or "<top>/": where the bundle root is inside the archive
    cost: int = 0
    directories: Set[str] = field(default_factory=set)  # every directory the archive creates, parents included
    inodes: int = 0

    def charge(self, member: Member, budget: Budget) -> None:
        """Charge ``member`` and each directory it creates, parents included; refuse past a bound."""
        parts = member.name.split("/")
        if len(parts) > MAX_DEPTH:
            raise TarError("archive member %s... is %d levels deep, more than %d" % (
                member.name[:60], len(parts), MAX_DEPTH))
        dirs = parts if member.kind == DIRECTORY else parts[:-1]
        new = {"/".join(dirs[:i]) for i in range(1, len(dirs) + 1)} - self.directories
        self.directories |= new
        if len(self.directories) > MAX_DIRECTORIES:
            raise TarError("the archive creates more than %d directories" % MAX_DIRECTORIES)
        self.cost += budget.block * len(new) + (budget.cost(member.size) if member.kind == FILE else 0)
        if self.cost > budget.limit:
            raise TarError("archive unpacks to at least %d bytes, more than %s" % (self.cost, budget.reason))
        self.inodes += len(new) + (member.kind == FILE)
        if budget.inodes is not None and self.inodes > budget.inodes:
            raise TarError("archive creates at least %d files and directories, more than the %d inodes the disk "
                           "can spare" % (self.inodes, budget.inodes))

    @property
    def manifest(self) -> bytes:
        return self.kept[self.prefix + MANIFEST]

    @property
    def signature(self) -> Optional[bytes]:
        return self.kept.get(self.prefix + SIGNATURE)

    def files(self) -> Dict[str, Member]:
        """Files by their path relative to the bundle root."""
        return {name[len(self.prefix):]: m for name, m in self.members.items() if m.kind == FILE}


Check = Callable[[Scan], None]


def unpack_archive(archive: str, dest: str, max_bytes: int = DEFAULT_MAX_BYTES,
                   deadline_s: float = DEFAULT_UNPACK_DEADLINE_S, check: Optional[Check] = None,
                   cancelled: Optional[Callable[[], bool]] = None) -> str:
    """Extract a bundle tar into ``dest``; returns the bundle root (``dest`` or its single top directory).

    ``check`` runs between the passes and may refuse by raising; nothing is written before it returns. On a
    refusal during the second pass ``dest`` may hold part of the bundle: it is the caller's staging to delete.
    """
    os.makedirs(dest, exist_ok=True)
    budget = Budget(dest, max_bytes)
    deadline = time.monotonic() + deadline_s
    try:
        seen = scan(archive, budget, deadline, cancelled)
        if check is not None:
            check(seen)
        _extract(archive, dest, seen, budget, deadline, cancelled)
    except TarError as exc:
        raise archive_error(archive, str(exc)) from None
    return os.path.join(dest, seen.prefix.rstrip("/")) if seen.prefix else dest


def scan(archive: str, budget: Budget, deadline: float, cancelled: Optional[Callable[[], bool]] = None) -> Scan:
    """The first pass: headers checked, disk charged, files hashed; nothing written."""
    seen = Scan()
    with Reader(archive, deadline, cancelled=cancelled) as reader:
        for member, data in members(reader):
            if member.name in seen.members:
                raise TarError("archive member appears twice: %s" % member.name)
            seen.charge(member, budget)
            seen.members[member.name] = member
            if member.kind != FILE:
                continue
            if _is_kept(member, seen):
                body = b"".join(data)
                seen.kept[member.name] = body
                seen.hashes[member.name] = hashlib.sha256(body).hexdigest()
            else:
                seen.hashes[member.name] = hash_data(data)
    seen.prefix = _root_prefix(seen, archive)
    return seen


def _is_kept(member: Member, seen: Scan) -> bool:
    """Keep the first manifest/signature at the root and at depth one, if small: at most four, bounded."""
    parts = member.name.split("/")
    if len(parts) > 2 or parts[-1] not in (MANIFEST, SIGNATURE) or member.size > MAX_MANIFEST_BYTES:
        return False
    return not any(k.split("/")[-1] == parts[-1] and k.count("/") == len(parts) - 1 for k in seen.kept)


def _root_prefix(seen: Scan, archive: str) -> str:
    if MANIFEST in seen.kept:
        return ""
    tops = {name.split("/", 1)[0] for name in seen.members}
    if len(tops) == 1:
        top = tops.pop()
        if top + "/" + MANIFEST in seen.kept:
            return top + "/"
    raise BundleError([FieldError("manifest.json", "missing at the archive's root")], archive)


def _extract(archive: str, dest: str, seen: Scan, budget: Budget, deadline: float,
             cancelled: Optional[Callable[[], bool]]) -> None:
    """The second pass: write each member the first pass saw, refusing any that differs from it."""
    written = 0
    with Reader(archive, deadline, cancelled=cancelled) as reader:
        for member, data in members(reader):
            if seen.members.get(member.name) != member:
                raise TarError("the archive changed between reading and unpacking (%s)" % member.name)
            target = os.path.join(dest, member.name)
            if member.kind == DIRECTORY:
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            digest = hashlib.sha256()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "wb") as out:
                for chunk in data:
                    written += len(chunk)
                    if written > budget.limit:
                        raise TarError("archive unpacked past %s while extracting (%d bytes written)" % (
                            budget.reason, written))
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != seen.hashes[member.name]:
                raise TarError("the archive changed between reading and unpacking (%s)" % member.name)


# --- authentication before extraction ----------------------------------------------------------------------

@dataclass(frozen=True)
class Pin:
    """What a deploy vouches for, checked against the first pass before a byte is extracted.

    The command pins the manifest's sha256; with a key configured, the manifest must be signed by it; and the
    manifest then vouches for every other file by size and sha256. So a tampered, foreign or padded archive is
    refused having written nothing.
    """

    manifest_sha256: str
    public_key: Optional[bytes] = None

    def __call__(self, seen: Scan) -> None:
        check_manifest_pin(hashlib.sha256(seen.manifest).hexdigest(), self.manifest_sha256)
        if self.public_key is not None:
            if seen.signature is None:
                raise BundleError([FieldError("manifest.sig", "missing: this box requires signed bundles")])
            if not signature_matches(seen.manifest, seen.signature, self.public_key):
                raise BundleError([FieldError("manifest.sig", "signature does not match the manifest and key")])
        try:
            manifest = parse_manifest(json.loads(seen.manifest.decode("utf-8")))
        except (ValueError, UnicodeDecodeError) as exc:
            raise BundleError([FieldError("manifest.json", "not valid JSON: %s" % exc)]) from None
        listed = {art.file: (art.size, art.sha256) for art in manifest.artifacts}
        listed.update({name: (entry.size, entry.sha256) for name, entry in manifest.files.items()})
        errors = []
        for rel, member in sorted(seen.files().items()):
            if rel in (MANIFEST, SIGNATURE):
                continue
            if rel not in listed:
                errors.append(FieldError("files", "unlisted file in bundle: %s" % rel))
            elif listed[rel] != (member.size, seen.hashes[seen.prefix + rel]):
                errors.append(FieldError("files", "%s does not match the manifest's size and sha256" % rel))
        errors += [FieldError("files", "file missing: %s" % name) for name in sorted(set(listed) - set(seen.files()))]
        errors += _unlisted_directories(seen, set(listed) | {MANIFEST, SIGNATURE})
        if errors:
            raise BundleError(bounded(errors))


def _unlisted_directories(seen: Scan, paths: Set[str]) -> List[FieldError]:
    """Directories the archive would create that are no parent of a path the manifest names."""
    allowed = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    top = seen.prefix.rstrip("/")
    return [FieldError("files", "unlisted directory in bundle: %s" % name[len(seen.prefix):])
            for name in sorted(seen.directories) if name != top and name[len(seen.prefix):] not in allowed]


def check_manifest_pin(actual: Optional[str], pinned: str) -> None:
    if actual != pinned:
        raise CommandError("sha256_mismatch", "the bundle's manifest.json has sha256 %s, the command pinned %s" % (
            actual or "(none)", pinned), field="sha256")


def bounded(errors: List[FieldError], limit: int = MAX_ERRORS) -> List[FieldError]:
    """The first ``limit`` errors and one that counts the rest: a refusal's size does not grow with the input."""
    if len(errors) <= limit:
        return errors
    return errors[:limit] + [FieldError(errors[limit].path, "and %d more" % (len(errors) - limit))]


def archive_error(archive: str, message: str) -> BundleError:
    return BundleError([FieldError(FIELD, message)], archive)
