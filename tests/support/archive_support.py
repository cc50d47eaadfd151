"""Hostile tar archives written byte by byte, and a loopback HTTP server to serve them (a helper module, not a
test module): the fetch tests and the daemon-level hostile-input tests share them."""

import functools
import gzip
import http.server
import tarfile
import threading
import time
import zlib

JOIN_S = 30.0  # bound on joining the server's thread


def tar_header(name, size=0, kind=b"0", size_field=None, checksum_delta=0):
    """One ustar header; ``size_field`` overrides the octal size (e.g. b"-0000001000")."""
    h = bytearray(512)
    raw = name.encode()
    h[0:len(raw)] = raw
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"%011o\0" % 0
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % (sum(h) + checksum_delta)
    return bytes(h)


def tar_member(name, data):
    return tar_header(name, len(data)) + data + b"\0" * (-len(data) % 512)


def negative_size_archive():
    """The CVE-2025-8194 wedge: a member whose size is negative, so tarfile seeks back onto its own header."""
    body = tar_header("a", size_field=b"-0000001000") + b"\0" * 1024
    return gzip.compress(body, compresslevel=9)


def pax_negative_size_archive():
    record = b"size=-512\n"
    record = b"%d " % (len(record) + 3) + record
    return gzip.compress(tar_header("pax", len(record), kind=b"x") + record + b"\0" * (-len(record) % 512)
                         + tar_header("a", 0) + b"\0" * 1024)


def many_files_archive(count, data=b""):
    """``count`` files named f/NNNNNN with ``data`` each, gzip-compressed (a 200,000-file bomb is ~1 MB)."""
    chunks = [tar_member("f/%06d" % i, data) for i in range(count)]
    return gzip.compress(b"".join(chunks) + b"\0" * 1024, compresslevel=6)


def gzip_bomb_archive(declared=4 << 30, zeros_mb=64):
    """A member declaring 4 GiB of zeros: 64 MiB of them follow, as concatenated gzip members (tiny on disk)."""
    zeros = gzip.compress(b"\0" * (1 << 20), compresslevel=9)
    return gzip.compress(tar_header("big.bin", declared)) + zeros * zeros_mb


def lying_archives():
    """Headers that lie: a size past the end of the data, a size short of it, a checksum that does not add up."""
    data = b"x" * 1000
    return {
        "size past the data": gzip.compress(tar_header("w.bin", 5000) + data),
        "size short of the data": gzip.compress(tar_header("w.bin", 10) + data + b"\0" * 1048),
        "bad checksum": gzip.compress(tar_header("w.bin", 1000, checksum_delta=1) + data + b"\0" * 1048),
    }


def write(path, data):
    with open(str(path), "wb") as handle:
        handle.write(data)
    return str(path)


class LoopbackHttpServer:
    """A real HTTP server on 127.0.0.1 serving ``directory``; yields its base URL."""

    def __init__(self, directory, handler=None):
        handler = handler or functools.partial(_QuietHandler, directory=directory)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=JOIN_S)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass




# --- archives that attack the gunzip, the directory budget and the number parsers (issue 29) ----------------

def gzip_member(data):
    """One gzip member holding ``data`` (zlib, so Python 3.7's gzip.compress without mtime= is not needed)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def empty_members_archive(mb, tail=b""):
    """``mb`` MiB of back-to-back empty gzip members, then ``tail`` (a tar) as one member: what kept Python's
    gzip reader inside one read() for minutes."""
    empty = gzip_member(b"")
    return empty * ((mb << 20) // len(empty)) + gzip_member(tail)


def tiny_members_archive(size):
    """A tar of one file of ``size`` zeros, each of its bytes a gzip member of its own (~21 bytes each)."""
    per_byte = [gzip_member(bytes([b])) for b in range(256)]
    data = tar_header("big.bin", size) + b"\0" * (size + (-size % 512)) + b"\0" * 1024
    return b"".join(per_byte[b] for b in data)


def pax_digits_archive(digits=5000):
    """A PAX header whose size is a number of ``digits`` digits (past 4,300 Python 3.11's int() refuses it)."""
    record = b"size=" + b"9" * digits + b"\n"
    length = len(record) + 1 + len(str(len(record) + 5))
    record = b"%d " % length + record
    return gzip.compress(tar_header("pax", len(record), kind=b"x") + record + b"\0" * (-len(record) % 512)
                         + tar_header("a", 0) + b"\0" * 1024)


def bundle_with_directories(bundle_dir, path, arcname, count=200, depth=125):
    """``bundle_dir`` as a .tar.gz under ``arcname``, plus ``count`` directory members ``depth`` levels deep
    (~250-byte names, PAX): 25,000 directories from 200 members."""
    with tarfile.open(str(path), "w:gz", format=tarfile.PAX_FORMAT) as tar:
        tar.add(bundle_dir, arcname=arcname)
        for i in range(count):
            info = tarfile.TarInfo("%s/d%03d/%s" % (arcname, i, "/".join("a" * (depth - 2))))
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            tar.addfile(info)
    return str(path)


class TrickleServerHandler(http.server.BaseHTTPRequestHandler):
    """Answers a byte every ``PACE_S`` for ``FOR_S`` seconds, in the headers (``MODE`` "headers") or in a
    chunk-size line ("chunk"). A subclass per test (:func:`trickling`) has its own events."""

    MODE, PACE_S, FOR_S = "headers", 1.0, 60.0
    trickling = threading.Event()  # a byte went out: the box is reading
    hung_up = threading.Event()  # the box closed the connection

    def do_GET(self):
        started = time.monotonic()
        if self.MODE == "chunk":
            self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        else:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
        try:
            while time.monotonic() - started < self.FOR_S:
                self.wfile.write(b"0" if self.MODE == "chunk" else b"X")
                self.wfile.flush()
                self.trickling.set()
                self.hung_up.wait(self.PACE_S)  # the trickle's pace (the attacker's behaviour), not synchronisation
        except OSError:
            self.hung_up.set()

    def log_message(self, *args):
        pass


def trickling(mode, pace_s=1.0, for_s=60.0):
    """A :class:`TrickleServerHandler` subclass with its own events."""
    return type("Trickle_%s" % mode, (TrickleServerHandler,), {
        "MODE": mode, "PACE_S": pace_s, "FOR_S": for_s, "trickling": threading.Event(),
        "hung_up": threading.Event()})
