"""Hostile tar archives written byte by byte, and a loopback HTTP server to serve them (a helper module, not a
test module): the fetch tests and the daemon-level hostile-input tests share them."""

import functools
import gzip
import http.server
import threading

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


