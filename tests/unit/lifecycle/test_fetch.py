"""Bringing bundles in when the network and the archive are hostile: the tar reader, the two-pass unpack that
authenticates before it writes, the disk budget, the download with its policy, and the same archives sent to a
real daemon through a real Mosquitto from an HTTP server on loopback."""

import gzip
import http.server
import io
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import time

import pytest

from agent.bundle.manifest import MANIFEST, BundleError
from agent.bundle.signing import sign_bundle
from agent.bundle.verify import sha256_file
from agent.config.schema import ConfigError
from agent.errors import CommandError
from agent.lifecycle.fetch import FetchError, download, fetch_bundle
from agent.lifecycle.fetch_policy import FetchPolicy
from agent.lifecycle.store import STAGING_DIR
from agent.lifecycle.tar import MAX_MEMBERS
from agent.lifecycle.unpack import Pin, unpack_archive
from tests.support import lifecycle_support as lifecycle
from tests.support.archive_support import (
    LoopbackHttpServer,
    gzip_bomb_archive,
    lying_archives,
    many_files_archive,
    negative_size_archive,
    pax_negative_size_archive,
    tar_header,
    tar_member,
    write,
)
from tests.support.lifecycle_support import (
    ServingLoop,
    assert_unchanged,
    deploy_request,
    new_version,
    no_progress,
    snapshot,
)
from tests.support.needs import needs_cryptography

base_bundle = lifecycle.base_bundle  # fixtures: the committed tiny bundle, and a model manager on it
harness = lifecycle.harness
WAIT_S = 30.0
SECONDS = 10.0  # "refused within seconds": a bound no honest refusal comes near, not a speed claim
ANY_PORT = tuple(range(1, 65536))  # the kernel picks the test servers' ports; the port rule has tests of its own
LOOPBACK = FetchPolicy(schemes=("http", "https"), hosts=("127.0.0.1",), ports=ANY_PORT)
LOOPBACK_CONFIG = {"schemes": ["http"], "hosts": ["127.0.0.1"], "ports": list(ANY_PORT)}


class Peak:
    """This process's peak RSS growth (VmHWM after resetting it through /proc/self/clear_refs), in MB."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        self.base = _vm("VmRSS")
        return self

    def __exit__(self, *exc):
        self.growth_mb = (_vm("VmHWM") - self.base) / 1024.0


def _vm(key, pid="self"):
    with open("/proc/%s/status" % pid) as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1])  # kB
    raise AssertionError(key)


@pytest.mark.parametrize("make, reason", [
    (negative_size_archive, "size of a field is not an octal number"),
    (pax_negative_size_archive, "PAX size is not a non-negative integer"),
    (lambda: many_files_archive(200000), "more than %d members" % MAX_MEMBERS),
    (lambda: many_files_archive(50000, b"x"), "more than %d members" % MAX_MEMBERS),
    (gzip_bomb_archive, "archive unpacks to at least"),
])
def test_hostile_archives_are_refused_quickly_in_bounded_memory_writing_nothing(tmp_path, make, reason):
    archive = write(tmp_path / "hostile.tar.gz", make())
    dest = tmp_path / "out"
    started = time.monotonic()
    with Peak() as peak, pytest.raises(BundleError) as info:
        unpack_archive(archive, str(dest))
    assert reason in str(info.value)
    assert time.monotonic() - started < SECONDS
    assert peak.growth_mb < 50, peak.growth_mb
    assert os.listdir(str(dest)) == []


@pytest.mark.parametrize("lie", sorted(lying_archives()))
def test_headers_that_lie_are_refused(tmp_path, lie):
    archive = write(tmp_path / "lie.tar.gz", lying_archives()[lie])
    with pytest.raises(BundleError) as info:
        unpack_archive(archive, str(tmp_path / "out"))
    expected = {"size past the data": "ends in the middle of a member",
                "size short of the data": "checksum does not match",
                "bad checksum": "checksum does not match"}[lie]
    assert expected in str(info.value)
    assert os.listdir(str(tmp_path / "out")) == []


def test_the_disk_budget_counts_blocks_and_members_not_bytes(tmp_path):
    """300 one-byte files are 300 bytes of data but at least 300 blocks and inodes on disk."""
    archive = write(tmp_path / "small.tar.gz", many_files_archive(300, b"x"))
    with pytest.raises(BundleError, match=r"archive unpacks to at least \d+ bytes, more than the limit of "
                                          r"1000000 bytes"):
        unpack_archive(archive, str(tmp_path / "out"), max_bytes=1000000)
    assert os.listdir(str(tmp_path / "out")) == []


def test_a_slow_unpack_is_stopped_by_its_deadline(tmp_path):
    archive = write(tmp_path / "many.tar.gz", many_files_archive(2000, b"x"))
    with pytest.raises(BundleError, match="unpacking took longer than its deadline"):
        unpack_archive(archive, str(tmp_path / "out"), deadline_s=0.0)


def test_long_names_and_duplicates_are_refused(tmp_path):
    long_name = gzip.compress(_gnu_longname("a/" + "n" * 300) + tar_member("ignored", b"") + b"\0" * 1024)
    with pytest.raises(BundleError, match="name is longer than 256 bytes"):
        unpack_archive(write(tmp_path / "long.tar.gz", long_name), str(tmp_path / "a"))
    twice = gzip.compress(tar_member("m", b"1") + tar_member("./m", b"2") + b"\0" * 1024)
    with pytest.raises(BundleError, match="archive member appears twice: m"):
        unpack_archive(write(tmp_path / "twice.tar.gz", twice), str(tmp_path / "b"))


def _gnu_longname(name):
    raw = name.encode() + b"\0"
    h = bytearray(tar_header("././@LongLink", len(raw), kind=b"L"))
    return bytes(h) + raw + b"\0" * (-len(raw) % 512)


# --- authenticated before a byte is written -----------------------------------------------------------------

def _tar_of(bundle_dir, path, arcname="tiny"):
    with tarfile.open(str(path), "w:gz") as tar:
        tar.add(bundle_dir, arcname=arcname)
    return str(path)


def test_an_archive_is_authenticated_against_the_pinned_manifest_before_extraction(tmp_path, base_bundle):
    source = str(tmp_path / "tiny-2")
    sha = new_version(base_bundle, source, "2.0.0")
    good = _tar_of(source, tmp_path / "good.tar.gz")
    with pytest.raises(CommandError, match="the command pinned 0000"):
        unpack_archive(good, str(tmp_path / "a"), check=Pin("0" * 64))
    assert os.listdir(str(tmp_path / "a")) == []
    # a file changed after the manifest was written: the pinned manifest no longer vouches for it
    golden = os.path.join(source, "golden", "case0.npy")
    with open(golden, "ab") as handle:
        handle.write(b"tampered")
    with pytest.raises(BundleError) as info:
        unpack_archive(_tar_of(source, tmp_path / "tampered.tar.gz"), str(tmp_path / "b"), check=Pin(sha))
    assert [e.message for e in info.value.errors] == [
        "golden/case0.npy does not match the manifest's size and sha256"]
    # fourteen problems (the tampered file, twelve unlisted files, the unlisted directory extra/): ten listed, the
    # rest counted, so a refusal's size does not grow with the archive
    os.makedirs(os.path.join(source, "extra"))
    for i in range(12):
        open(os.path.join(source, "extra", "junk%02d" % i), "w").close()
    with pytest.raises(BundleError) as info:
        unpack_archive(_tar_of(source, tmp_path / "padded.tar.gz"), str(tmp_path / "c"), check=Pin(sha))
    messages = [e.message for e in info.value.errors]
    assert messages[0] == "unlisted file in bundle: extra/junk00"
    assert len(messages) == 11 and messages[-1] == "and 4 more"
    assert os.listdir(str(tmp_path / "b")) == [] and os.listdir(str(tmp_path / "c")) == []


@needs_cryptography
def test_with_a_key_an_unsigned_or_foreign_signed_archive_is_refused_before_extraction(tmp_path, base_bundle):
    from agent.cli.bundle import make_key_pair

    private, _public, public_hex = make_key_pair()
    foreign_private = make_key_pair()[0]
    source = str(tmp_path / "tiny-2")
    sha = new_version(base_bundle, source, "2.0.0")
    pin = Pin(sha, bytes.fromhex(public_hex))
    with pytest.raises(BundleError, match="missing: this box requires signed bundles"):
        unpack_archive(_tar_of(source, tmp_path / "u.tar.gz"), str(tmp_path / "a"), check=pin)
    sign_bundle(source, foreign_private)
    with pytest.raises(BundleError, match="signature does not match"):
        unpack_archive(_tar_of(source, tmp_path / "f.tar.gz"), str(tmp_path / "b"), check=pin)
    sign_bundle(source, private)
    root = unpack_archive(_tar_of(source, tmp_path / "s.tar.gz"), str(tmp_path / "c"), check=pin)
    assert sha256_file(os.path.join(root, MANIFEST)) == sha
    assert os.listdir(str(tmp_path / "a")) == [] and os.listdir(str(tmp_path / "b")) == []


# --- the download and its policy --------------------------------------------------------------------------

class _NoLengthHandler(http.server.BaseHTTPRequestHandler):
    """Streams 64 KiB without a Content-Length (HTTP/1.0: the end is the close), as a lying server might."""

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"\0" * 65536)

    def log_message(self, *args):
        pass


def _redirecting_to(target):
    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302, "Moved, see the internal wiki at 10.0.0.7")
            self.send_header("Location", target)
            self.end_headers()

        def log_message(self, *args):
            pass
    return Redirect


def test_download_refuses_more_than_the_limit_with_or_without_a_length(tmp_path):
    (tmp_path / "big.tar").write_bytes(b"\0" * 10000)
    small = FetchPolicy(LOOPBACK.schemes, LOOPBACK.hosts, max_bytes=1000, ports=ANY_PORT)
    with LoopbackHttpServer(str(tmp_path)) as url:
        with pytest.raises(FetchError, match="is 10000 bytes, more than the limit of 1000 bytes"):
            download(url + "/big.tar", str(tmp_path / "out"), small)
    with LoopbackHttpServer(str(tmp_path), handler=_NoLengthHandler) as url:
        with pytest.raises(FetchError, match="sent more than the limit of 1000 bytes"):
            download(url + "/x", str(tmp_path / "out"), small)
        assert download(url + "/x", str(tmp_path / "out"), LOOPBACK) == 65536


def test_download_of_a_silent_server_fails_with_a_coarse_cause(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts the connection in the kernel, never answers
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    quick = FetchPolicy(LOOPBACK.schemes, LOOPBACK.hosts, timeout_s=0.5, ports=ANY_PORT)
    try:
        messages = []
        for sock in (silent, closed):
            url = "http://127.0.0.1:%d/b.tar" % sock.getsockname()[1]
            with pytest.raises(FetchError) as info:
                download(url, str(tmp_path / "out"), quick)
            messages.append(str(info.value).replace(str(sock.getsockname()[1]), "PORT"))
    finally:
        silent.close()
        closed.close()
    # a timeout and a refusal read the same: the ack is no port scanner
    assert messages[0] == messages[1]
    assert "could not connect to the server or read from it" in messages[0]


def test_download_errors_hide_a_presigned_token_and_the_servers_text(tmp_path):
    with LoopbackHttpServer(str(tmp_path)) as url:
        with pytest.raises(FetchError) as info:
            download(url + "/missing.tar?token=s3cr3t", str(tmp_path / "out"), LOOPBACK)
    assert "download of %s/missing.tar?token=*** failed: the server answered HTTP 4xx" % url in str(info.value)
    assert "s3cr3t" not in str(info.value) and "Not Found" not in str(info.value)


def test_the_fetch_policy_refuses_loopback_private_and_other_schemes_by_default(tmp_path):
    policy = FetchPolicy()  # the defaults: https to public hosts only
    INTERNAL = " resolves to a loopback, private or link-local address"
    for url, reason in [
        ("http://example.com/b.tar", "scheme http is not allowed"),
        ("ftp://example.com/b.tar", "scheme ftp is not allowed"),
        ("file:///etc/passwd", "scheme file is not allowed"),
        ("https://127.0.0.1/b.tar", "127.0.0.1" + INTERNAL),
        ("https://localhost/b.tar", "localhost" + INTERNAL),
        ("https://10.1.2.3/b.tar", "10.1.2.3" + INTERNAL),
        ("https://169.254.169.254/latest/meta-data", "169.254.169.254" + INTERNAL),
        ("https://[::ffff:127.0.0.1]/b.tar", "::ffff:127.0.0.1" + INTERNAL),
    ]:
        with pytest.raises(FetchError, match="refused by the fetch policy: %s" % reason):
            download(url, str(tmp_path / "out"), policy)
    listed = FetchPolicy(schemes=("https",), hosts=("example.com",))
    with pytest.raises(FetchError, match="host other.example is not in fetch.hosts"):
        download("https://other.example/b.tar", str(tmp_path / "out"), listed)


def test_loopback_is_served_only_when_listed_by_address_network_or_name(tmp_path):
    (tmp_path / "b.tar").write_bytes(b"x" * 100)
    with LoopbackHttpServer(str(tmp_path)) as url:
        port = url.rsplit(":", 1)[1]
        with pytest.raises(FetchError, match="resolves to a loopback"):
            download(url + "/b.tar", str(tmp_path / "out"), FetchPolicy(schemes=("http",), ports=ANY_PORT))
        for hosts, base in [(("127.0.0.1",), url), (("127.0.0.0/8",), url),
                            (("localhost",), "http://localhost:%s" % port)]:
            policy = FetchPolicy(("http",), hosts, ports=ANY_PORT)
            assert download(base + "/b.tar", str(tmp_path / "out"), policy) == 100


def test_redirects_across_hosts_or_schemes_are_refused_unless_the_host_is_listed(tmp_path):
    (tmp_path / "b.tar").write_bytes(b"x" * 100)
    with LoopbackHttpServer(str(tmp_path)) as target:
        port = target.rsplit(":", 1)[1]
        other_host = "http://localhost:%s/b.tar" % port  # same server, another host name
        cases = [(other_host, "a redirect to another host not in fetch.hosts"),
                 ("ftp://127.0.0.1:%s/b.tar" % port, "a redirect to another scheme"),
                 ("https://127.0.0.1:%s/b.tar" % port, "a redirect to another scheme")]
        for location, reason in cases:
            with LoopbackHttpServer(str(tmp_path), handler=_redirecting_to(location)) as url:
                with pytest.raises(FetchError) as info:
                    download(url + "/x", str(tmp_path / "out"), LOOPBACK)
                assert "refused by the fetch policy: %s" % reason in str(info.value)
                assert "10.0.0.7" not in str(info.value)  # the server's text stays out
        with LoopbackHttpServer(str(tmp_path), handler=_redirecting_to(other_host)) as url:
            listed = FetchPolicy(("http",), ("127.0.0.1", "localhost"), ports=ANY_PORT)
            assert download(url + "/x", str(tmp_path / "out"), listed) == 100


def test_the_archive_digest_is_checked_while_downloading_before_anything_is_unpacked(tmp_path, base_bundle):
    served = tmp_path / "www"
    served.mkdir()
    source = str(tmp_path / "tiny-2")
    sha = new_version(base_bundle, source, "2.0.0")
    archive = _tar_of(source, served / "tiny-2.tar.gz")
    digest = sha256_file(archive)
    staging = tmp_path / "staging"
    staging.mkdir()
    with LoopbackHttpServer(str(served)) as url:
        with pytest.raises(CommandError) as info:
            fetch_bundle(url + "/tiny-2.tar.gz", str(tmp_path), str(staging), LOOPBACK, Pin(sha), "0" * 64)
        assert info.value.code == "sha256_mismatch" and info.value.field == "archive_sha256"
        assert not (staging / "bundle").exists()  # never opened, never unpacked
        root = fetch_bundle(url + "/tiny-2.tar.gz", str(tmp_path), str(staging), LOOPBACK, Pin(sha),
                            digest)
    assert sha256_file(os.path.join(root, MANIFEST)) == sha


def test_fetch_refuses_other_schemes_and_non_bundles(tmp_path):
    store = tmp_path / "store"
    (store / "incoming").mkdir(parents=True)
    (store / "incoming" / "notes.txt").write_text("x")
    (store / "incoming" / "empty").mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(FetchError, match="refused by the fetch policy: scheme ftp is not allowed"):
        fetch_bundle("ftp://example/b.tar", str(store), str(staging))
    with pytest.raises(FetchError, match="neither a bundle directory nor"):
        fetch_bundle("incoming/notes.txt", str(store), str(staging))
    with pytest.raises(FetchError, match="has no manifest.json at its root"):
        fetch_bundle("incoming/empty", str(store), str(staging))
    with pytest.raises(FetchError, match="does not exist in the bundle store"):
        fetch_bundle("incoming/nothing", str(store), str(staging))
    with pytest.raises(FetchError, match="outside the bundle store"):
        fetch_bundle(".", str(store), str(staging))  # the store itself is not a bundle


def test_a_url_deploy_must_name_the_archive_digest():
    with pytest.raises(ConfigError) as info:
        deploy_request({"bundle": "https://example.com/b.tar.gz", "sha256": "ab" * 32})
    assert [e.path for e in info.value.errors] == ["archive_sha256"]
    assert deploy_request({"bundle": "incoming/b.tar.gz", "sha256": "ab" * 32}).archive_sha256 is None


def test_deploy_from_an_http_url_listed_in_the_fetch_policy(harness, base_bundle, tmp_path):
    served = tmp_path / "www"
    served.mkdir()
    sha = new_version(base_bundle, str(tmp_path / "tiny-2"), "2.0.0")
    digest = sha256_file(_tar_of(str(tmp_path / "tiny-2"), served / "tiny-2.tar.gz", arcname="tiny-2"))
    with LoopbackHttpServer(str(served)) as base_url:
        url = base_url + "/tiny-2.tar.gz?token=s3cr3t"  # a pre-signed URL: its token stays out of acks
        request = deploy_request({"bundle": url, "sha256": sha, "archive_sha256": digest})
        refused = harness()
        refused.manager.start()
        with pytest.raises(FetchError, match="refused by the fetch policy: scheme http is not allowed"):
            refused.manager.deploy(request, no_progress)
        refused.manager.close()
        h = harness(fetch=LOOPBACK_CONFIG)
        h.manager.start()
        messages = []
        with ServingLoop(h.manager) as loop:
            loop.wait_batches(3)
            result = h.manager.deploy(request, messages.append)
    assert result["model"]["version"] == "2.0.0"
    assert h.manager.current.label == "tiny 2.0.0"
    assert messages[0] == "fetching %s/tiny-2.tar.gz?token=***" % base_url
    assert not any("s3cr3t" in m for m in messages)
    assert os.listdir(os.path.join(h.store, STAGING_DIR)) == []  # the archive and its unpacked copy are gone


# --- a deploy cannot fill the disk ----------------------------------------------------------------------

ZERO_CHUNK = 1 << 20


def _tar_gz_with_zeros(path, bundle_dir, zeros):
    """A real ``.tar.gz``: the bundle's files, then ``padding.bin`` of ``zeros`` zero bytes.

    The zeros are written as concatenated gzip members of 1 MiB each (RFC 1952 allows several members; Python's
    gzip and GNU tar read them), so a 1 GiB bomb costs one compression of 1 MiB and a megabyte of disk.
    """
    assert zeros % ZERO_CHUNK == 0
    head = io.BytesIO()
    with tarfile.open(fileobj=head, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(bundle_dir, arcname="tiny")
        # tarfile writes its end-of-archive blocks on close: cut them off, the zeros member follows
    body = head.getvalue().rstrip(b"\0")
    body += b"\0" * (-len(body) % tarfile.BLOCKSIZE)
    info = tarfile.TarInfo("tiny/padding.bin")
    info.size = zeros
    member = gzip.compress(b"\0" * ZERO_CHUNK, compresslevel=9)
    with open(path, "wb") as out:
        out.write(gzip.compress(body + info.tobuf(tarfile.PAX_FORMAT)))
        for _ in range(zeros // ZERO_CHUNK):
            out.write(member)
        out.write(gzip.compress(b"\0" * (2 * tarfile.BLOCKSIZE)))


@pytest.fixture
def small_disk(tmp_path):
    """Mounts a tmpfs of the given size at ``<tmp_path>/state`` (the harness's state dir): a real small disk.

    Skips, naming why, where this process may not mount (not root, or no CAP_SYS_ADMIN in a container).
    """
    mounted = []

    def mount(size_bytes):
        path = tmp_path / "state"
        path.mkdir(exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d" % size_bytes, "tmpfs", str(path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            pytest.skip("needs a tmpfs mount for a real small filesystem: %s" % done.stdout.decode().strip())
        mounted.append(str(path))
        return str(path)

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", path], check=False)


@pytest.mark.parametrize("disk_mb, zeros_mb, binding", [
    (2048, 1025, "the limit of 1073741824 bytes"),  # room for it, but over the 1 GiB cap
    (48, 24, "free on"),  # under the cap, but more than 48 MiB less the 32 MiB reserve
])
def test_an_archive_that_unpacks_past_the_cap_or_the_free_space_is_refused_before_extraction(
        small_disk, harness, base_bundle, tmp_path, disk_mb, zeros_mb, binding):
    state = small_disk(disk_mb << 20)
    h = harness()
    h.manager.start()
    source = str(tmp_path / "tiny-2")
    sha = new_version(base_bundle, source, "2.0.0")
    archive = h.incoming("bomb.tar.gz")
    _tar_gz_with_zeros(archive, source, zeros_mb << 20)
    assert os.path.getsize(archive) < 2 << 20  # small on the wire and on disk
    before = snapshot(h)
    free_before = shutil.disk_usage(state).free
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(2)
        with pytest.raises(BundleError) as info:
            h.manager.deploy(deploy_request({"bundle": "incoming/bomb.tar.gz", "sha256": sha}), no_progress)
        loop.wait_batches(2)
    message = str(info.value)
    assert "archive unpacks to at least" in message and binding in message
    if binding == "free on":
        assert "less the reserve of %d bytes" % (32 << 20) in message
    assert_unchanged(h, before)  # serving model, table and slot dirs unchanged; staging empty
    assert {label for label, _f, _g in loop.log} == {"tiny 1.0.0"}
    assert shutil.disk_usage(state).free >= free_before - (1 << 20)  # nothing was extracted
    assert h.events == []


class _TrickleHandler(http.server.BaseHTTPRequestHandler):
    """Declares 1 MB and sends a byte every 0.2 s: a download that would take days."""

    trickling = threading.Event()  # set once a byte went out: a download is under way (a subclass has its own)

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        try:
            for _ in range(1 << 20):
                self.wfile.write(b"\0")
                self.wfile.flush()
                self.trickling.set()
                time.sleep(0.2)  # the trickle's pace (the stand-in server's behaviour), not synchronisation
        except OSError:  # the box hung up: what a cancel does
            pass

    def log_message(self, *args):
        pass


def test_a_running_deploy_is_cancelled_and_changes_nothing(harness, tmp_path):
    h = harness(fetch=LOOPBACK_CONFIG)
    h.manager.start()
    before = snapshot(h)
    outcome = {}

    def deploy():
        try:
            h.manager.deploy(deploy_request({"bundle": url + "/slow.tar.gz", "sha256": "ab" * 32,
                                             "archive_sha256": "cd" * 32}), no_progress)
        except CommandError as exc:
            outcome["error"] = exc

    assert h.manager.cancel() == {"cancelled": False}  # nothing running: nothing to cancel
    handler = type("_WatchedTrickle", (_TrickleHandler,), {"trickling": threading.Event()})
    with LoopbackHttpServer(str(tmp_path), handler=handler) as url:
        runner = threading.Thread(target=deploy)
        runner.start()
        assert handler.trickling.wait(WAIT_S), "the download never started"  # cancelled mid-download
        assert h.manager.cancel() == {"cancelled": True}
        runner.join(WAIT_S)
        assert not runner.is_alive()
    assert outcome["error"].code == "cancelled"
    assert_unchanged(h, before)


def test_a_trickling_server_is_stopped_by_the_download_deadline(tmp_path):
    policy = FetchPolicy(LOOPBACK.schemes, LOOPBACK.hosts, deadline_s=1.0, ports=ANY_PORT)
    with LoopbackHttpServer(str(tmp_path), handler=_TrickleHandler) as url:
        with pytest.raises(FetchError, match="took longer than 1 s"):
            download(url + "/slow.tar.gz", str(tmp_path / "out"), policy)


def test_a_nul_byte_in_a_bundle_path_is_a_clear_refusal(tmp_path):
    with pytest.raises(FetchError, match="holds a NUL byte"):
        fetch_bundle("incoming/a\x00b", str(tmp_path), str(tmp_path))
