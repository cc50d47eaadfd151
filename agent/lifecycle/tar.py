"""A forward-only tar reader of our own, for archives that arrive from the network.

The standard library's :mod:`tarfile` is not trusted here: before the CVE-2025-8194 fix (and the box runs
Python 3.7) a member with a negative size makes it seek back onto the same header forever, and it accepts
sizes such as ``-1`` in octal fields and PAX records. This reader only ever reads *forward* from a stream, so
every member moves the archive on by at least one block by construction, and it checks each header before
acting on it: octal digits only, a matching checksum, a known type, a short clean name, a bounded count.

What it accepts is what ``atlas-edge bundle`` and GNU/Python tar write for a bundle: regular files and
directories in ustar, GNU (``L`` long names) and PAX (``x``: ``path``, ``size``; ``g`` ignored) formats.
Everything else (links, devices, FIFOs, sparse files, long link names) is refused by name.
"""

import hashlib
import time
import zlib
from dataclasses import dataclass
from typing import IO, Callable, Dict, Iterator, Optional, Tuple

from agent.errors import CommandError

BLOCK = 512
CHUNK = 1 << 16
ZERO_BLOCK = b"\0" * BLOCK
# A bundle holds artifacts, golden files and at most a calibration set of a few hundred images: 10,000
# members is generous, and stops a 1 MB archive of 200,000 empty files from creating them.
MAX_MEMBERS = 10000
# Whole path inside the archive, in bytes; one path component is at most 255 on every box file system.
MAX_NAME_BYTES = 256
# PAX records and GNU long names are read into memory: a bundle's are a few hundred bytes.
MAX_META_BYTES = 64 << 10
# Digits of a PAX number (a record's length, a size): 20 digits hold any 64-bit size. Longer is hostile, and past
# 4,300 digits Python 3.11's int() itself refuses with a ValueError of its own.
MAX_PAX_DIGITS = 20
# Compressed bytes taken from the file per step of the gunzip, between two deadline and cancel checks: however
# the stream is built (padding, thousands of tiny members), one step is a bounded amount of work.
RAW_PIECE = 1 << 16
# gzip members that decompress to nothing: a writer emits at most one (an empty input); back-to-back empty
# members are the trick that kept Python's gzip reader inside one read() for minutes.
MAX_EMPTY_GZIP_MEMBERS = 16
# NUL padding between or after gzip members (tape-block padding), in bytes.
MAX_GZIP_PADDING = 1 << 20

FILE, DIRECTORY = "file", "directory"
_REFUSED_TYPES = {b"1": "a hard link", b"2": "a symbolic link", b"3": "a character device",
                  b"4": "a block device", b"6": "a FIFO", b"K": "a GNU long link name", b"S": "a sparse file",
                  b"V": "a volume header", b"M": "a multi-volume continuation", b"D": "a GNU dump directory"}
_PAX_IGNORED = ("mtime", "atime", "ctime", "uid", "gid", "uname", "gname", "comment", "charset", "hdrcharset",
                "linkpath", "SCHILY.", "LIBARCHIVE.")


class TarError(ValueError):
    """The archive is malformed or holds something a bundle never does; the message names the member."""


@dataclass(frozen=True)
class Member:
    name: str  # normalised: no leading "./", no trailing "/"
    kind: str  # FILE or DIRECTORY
    size: int


class Reader:
    """Forward reads of a (possibly gzip-compressed) archive file, each checked against a deadline and cancel.

    A gzip stream is decompressed here, in steps of at most :data:`RAW_PIECE` compressed bytes and
    :data:`CHUNK` output bytes, with the deadline and cancel checked before every step: padding and empty or
    tiny members cannot keep one read busy (Python's :class:`gzip.GzipFile` loops over them inside one
    ``read()``). Members, empty members and padding are counted; empty members and padding are bounded.
    """

    def __init__(self, path: str, deadline: float, clock: Callable[[], float] = time.monotonic,
                 cancelled: Optional[Callable[[], bool]] = None) -> None:
        raw = open(path, "rb")
        self._raw: IO[bytes] = raw
        self._gzip = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        self.deadline = deadline
        self.clock = clock
        self.cancelled = cancelled or (lambda: False)
        self._out = bytearray()  # decompressed, not yet read
        self._input = b""  # compressed, not yet given to a decompressor
        self._member: Optional["zlib._Decompress"] = None  # the member being decompressed, None between members
        self._member_bytes = 0
        self._end = False
        self.gzip_members = self.empty_members = self.padding = 0

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()

    def check(self) -> None:
        """The deadline and cancel: raised here, between two bounded steps."""
        if self.clock() > self.deadline:
            raise TarError("unpacking took longer than its deadline")
        if self.cancelled():
            raise CommandError("cancelled", "the deploy was cancelled while unpacking; nothing changed")

    def read(self, n: int, allow_eof: bool = False) -> bytes:
        """Exactly ``n`` bytes (n ≤ CHUNK-ish callers), or b"" at a clean end when ``allow_eof``."""
        if not self._gzip:
            self.check()
            data = self._raw.read(n)
        else:
            while len(self._out) < n and not self._end:
                self.check()
                self._step(n)
            data = bytes(self._out[:n])
            del self._out[:n]
        if len(data) != n and not (allow_eof and not data):
            raise TarError("the archive ends in the middle of a member (truncated, or a header lies)")
        return data

    def _step(self, want: int) -> None:
        """Decompress at most one raw piece, stopping once ``want`` bytes are out."""
        if not self._input:
            self._input = self._raw.read(RAW_PIECE)
            if not self._input:
                if self._member is not None:
                    raise TarError("the archive's compression is damaged: the gzip stream ends inside a member")
                self._end = True
                return
        try:
            while self._input and len(self._out) < want:
                if self._member is None and not self._start_member():
                    continue
                assert self._member is not None
                data = self._member.decompress(self._input, max(want - len(self._out), 1))
                self._out += data
                self._member_bytes += len(data)
                if self._member.eof:
                    self._end_member()
                else:
                    self._input = self._member.unconsumed_tail
        except zlib.error as exc:  # bad CRC or length, not gzip, damaged deflate data
            raise TarError("the archive's compression is damaged: %s" % exc) from None

    def _start_member(self) -> bool:
        """Skip NUL padding (counted, bounded); False when the piece was all padding, else a member begins."""
        stripped = self._input.lstrip(b"\0")
        self.padding += len(self._input) - len(stripped)
        if self.padding > MAX_GZIP_PADDING:
            raise TarError("the gzip stream holds more than %d bytes of padding" % MAX_GZIP_PADDING)
        self._input = stripped
        if not stripped:
            return False
        self._member = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip header and trailer checked by zlib
        self._member_bytes = 0
        self.gzip_members += 1
        return True

    def _end_member(self) -> None:
        assert self._member is not None
        self._input = self._member.unused_data
        if self._member_bytes == 0:
            self.empty_members += 1
            if self.empty_members > MAX_EMPTY_GZIP_MEMBERS:
                raise TarError("the gzip stream holds more than %d empty members (a writer emits at most one)"
                               % MAX_EMPTY_GZIP_MEMBERS)
        self._member = None

    def chunks(self, size: int) -> Iterator[bytes]:
        """``size`` bytes of member data in chunks, then the padding to the next block (read and dropped)."""
        left = size
        while left:
            chunk = self.read(min(CHUNK, left))
            left -= len(chunk)
            yield chunk
        pad = -size % BLOCK
        if pad:
            self.read(pad)


def members(reader: Reader, max_members: int = MAX_MEMBERS) -> Iterator[Tuple[Member, Iterator[bytes]]]:
    """Each member with an iterator over its data; data the caller leaves unread is skipped (read, dropped)."""
    extended: Dict[str, object] = {}
    count = 0
    while True:
        header = reader.read(BLOCK, allow_eof=True)
        if not header or header == ZERO_BLOCK:
            return  # end of archive: a zero block, or (as some writers leave it) the end of the stream
        name, size, kind = _parse_header(header)
        count += 1
        if count > max_members:
            raise TarError("the archive holds more than %d members" % max_members)
        if kind in (b"x", b"g", b"L"):
            if size > MAX_META_BYTES:
                raise TarError("an extended header of %d bytes (more than %d)" % (size, MAX_META_BYTES))
            data = b"".join(reader.chunks(size))
            if kind == b"x":
                extended = _parse_pax(data)
            elif kind == b"L":
                extended = dict(extended, path=data.split(b"\0", 1)[0].decode("utf-8", "replace"))
            continue  # a global header's (b"g") fields are ignored: a bundle needs none of them
        name = str(extended.get("path", name))
        size = int(extended.get("size", size))  # type: ignore[call-overload]
        extended = {}
        member = Member(_clean_name(name), DIRECTORY if kind == b"5" else FILE, size)
        if member.kind == DIRECTORY and size:
            raise TarError("directory member %s declares %d bytes of data" % (member.name, size))
        data_iter = reader.chunks(size)
        yield member, data_iter
        for _ in data_iter:  # what the caller did not read is skipped, so the next header is in place
            pass


def hash_data(data: Iterator[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in data:
        digest.update(chunk)
    return digest.hexdigest()


def _parse_header(header: bytes) -> Tuple[str, int, bytes]:
    """(name, size, type) of one 512-byte header; raises TarError on anything a bundle's writers never emit."""
    try:
        stored = _octal(header[148:156], "checksum")
    except TarError:
        stored = -1  # data where a header should be: reported as the checksum mismatch it also is
    unsigned = sum(header[:148]) + 8 * 0x20 + sum(header[156:])
    signed = unsigned - 2 * sum(b for b in header[:148] + header[156:] if b > 127)
    if stored not in (unsigned, signed):
        raise TarError("a header's checksum does not match (not a tar archive, or a damaged one)")
    magic = header[257:265]
    if magic not in (b"ustar\x0000", b"ustar  \0"):
        raise TarError("a header is not ustar, GNU or PAX (magic %r)" % magic)
    kind = header[156:157]
    if kind == b"\0" or kind == b"7":
        kind = b"0"
    name = header[0:100].split(b"\0", 1)[0]
    if magic == b"ustar\x0000" and header[345:500].strip(b"\0"):
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    shown = name.decode("utf-8", "replace")[:MAX_NAME_BYTES]
    if kind in _REFUSED_TYPES:
        raise TarError("archive member is not a plain file: %s (%s)" % (shown, _REFUSED_TYPES[kind]))
    if kind not in (b"0", b"5", b"x", b"g", b"L"):
        raise TarError("archive member %s has an unknown type %r" % (shown, kind))
    return shown, _octal(header[124:136], "size of %s" % shown), kind


def _octal(field: bytes, what: str) -> int:
    """An octal header number: digits 0-7 only, so no sign and no base-256 (sizes over 8 GiB)."""
    text = field.replace(b"\0", b" ").strip(b" ")
    if not text:
        return 0
    if any(c not in b"01234567" for c in text):
        raise TarError("the %s field is not an octal number: %r" % (what, field))
    return int(text, 8)


def _parse_pax(data: bytes) -> Dict[str, object]:
    """``path`` and ``size`` of a PAX extended header; other keys a bundle's writers use are ignored."""
    out: Dict[str, object] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        length_text = data[pos:space] if space > pos else b""
        if not length_text.isdigit() or len(length_text) > MAX_PAX_DIGITS:
            raise TarError("a PAX record has no length, or one of more than %d digits" % MAX_PAX_DIGITS)
        length = int(length_text)
        record = data[space + 1:pos + length]
        if length <= 0 or pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise TarError("a PAX record is malformed")
        key, value = record[:-1].split(b"=", 1)
        keyname = key.decode("utf-8", "replace")
        if keyname == "path":
            out["path"] = value.decode("utf-8", "replace")
        elif keyname == "size":
            if not value.isdigit() or len(value) > MAX_PAX_DIGITS:  # "-512": how CVE-2025-8194 archives loop tarfile
                raise TarError("a PAX size is not a non-negative integer of at most %d digits: %r" % (
                    MAX_PAX_DIGITS, value[:40]))
            out["size"] = int(value)
        elif keyname.startswith("GNU.sparse"):
            raise TarError("archive member is a sparse file (PAX %s)" % keyname)
        elif not keyname.startswith(_PAX_IGNORED):
            raise TarError("a PAX record has an unknown key %r" % keyname[:40])
        pos += length
    return out


def _clean_name(name: str) -> str:
    """The member path without "./" and trailing "/"; refuses absolute, "..", empty and odd names."""
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise TarError("archive member name is longer than %d bytes: %s..." % (MAX_NAME_BYTES, name[:60]))
    if any(ord(c) < 32 or c == "\\" for c in name):
        raise TarError("archive member name has a control character or a backslash: %r" % name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or not parts or ".." in parts:
        raise TarError("archive member escapes the bundle: %s" % name)
    return "/".join(parts)
