"""No deploy can hold the box (issue 29, items 3 and 4 and the PAX item), end to end: a real daemon (subprocess),
a real Mosquitto, and the attacker's HTTP server on loopback, listed in the box's fetch policy as the hostile
tests list theirs. A server that trickles its headers or a chunk-size line, an archive of tiny or empty gzip
members, 200 directories 125 levels deep, a PAX number of 5,000 digits: each ends within its deadline, a
``cancel`` ends it within 2 s, and ``rollback`` and ``set-config`` are answered while it runs.

Times are measured and printed (the acceptance figures); the assertions use generous, load-tolerant bounds
that today's code, which held such deploys for minutes, does not meet.
"""

import collections
import json
import os
import signal
import threading
import time

import pytest

from agent.bundle.verify import sha256_file
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import MqttProbe, wait_for
from tests.support.archive_support import (
    LoopbackHttpServer,
    bundle_with_directories,
    empty_members_archive,
    pax_digits_archive,
    tar_member,
    tiny_members_archive,
    trickling,
    write,
)
from tests.support.daemon_rig import SIZES, new_version, start_daemon, write_config

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

FINAL = ("succeeded", "failed")
ANSWER_S = 60.0  # a deadline for polls on a loaded CI machine, not a speed claim
TIMEOUT_S, DEADLINE_S, UNPACK_DEADLINE_S = 3.0, 6.0, 4.0  # the box's fetch policy here
CANCEL_S = 2.0  # the acceptance figure: a cancel ends a deploy within it
SLACK_S = 8.0  # what a loaded machine may add to a bound; today's code misses each by a minute or more
TRICKLE_FOR_S = 90.0  # how long the attacker's server keeps trickling (today's code waited for all of it)
TINY_BYTES = 6 << 20  # 6 MiB of tar data, a gzip member per byte: ~126 MiB (2 MiB was once read whole in 3.7 s)


def _port(url):
    return int(url.rsplit(":", 1)[1])


class Box:
    """The running daemon and an operator's probe on the broker."""

    def __init__(self, proc, probe, state):
        self.proc, self.probe, self.state = proc, probe, state
        self.sent = 0

    def command(self, verb, **fields):
        self.sent += 1
        request_id = "hd-%s-%d" % (verb, self.sent)
        self.probe.publish("atlas-edge/e2e/cmd/%s" % verb, json.dumps(dict(fields, request_id=request_id)).encode())
        return request_id

    def final(self, request_id):
        acks = [a for a in self.probe.on("atlas-edge/e2e/ack/%s" % request_id) if a["state"] in FINAL]
        return acks[0] if acks else None

    def wait_final(self, request_id, timeout=ANSWER_S):
        assert wait_for(lambda: self.final(request_id) is not None, timeout=timeout, interval=0.02), \
            "no final ack for %s within %.0f s" % (request_id, timeout)
        return self.final(request_id)

    def timed_final(self, request_id, since, timeout=ANSWER_S):
        """The final ack and the seconds from ``since`` to its arrival here."""
        ack = self.wait_final(request_id, timeout)
        return ack, time.monotonic() - since

    def serving_version(self):
        return self.wait_final(self.command("status"))["result"]["model_info"]["version"]

    def staging_empty(self):
        return os.listdir(os.path.join(self.state, "bundles", ".staging")) == []


class Servers:
    """Loopback HTTP servers started before the box, so its fetch.ports can name them: the archives' server
    and one per trickle (headers, chunk-size line)."""

    def __init__(self, www):
        self.handlers = {mode: trickling(mode, for_s=TRICKLE_FOR_S) for mode in ("headers", "chunk")}
        self.contexts = [LoopbackHttpServer(www)] + [LoopbackHttpServer(www, handler=h)
                                                    for h in self.handlers.values()]
        self.urls = [c.__enter__() for c in self.contexts]
        self.files, self.trickle = self.urls[0], dict(zip(self.handlers, self.urls[1:]))

    def close(self):
        for handler in self.handlers.values():
            handler.hung_up.set()  # ends any trickle still under way
        for context in self.contexts:
            context.__exit__(None, None, None)


@pytest.fixture(scope="module")
def box(tmp_path_factory, mosquitto):
    tmp_path = tmp_path_factory.mktemp("hostile-deploy")
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:2], seed=5)
    www = tmp_path / "www"
    www.mkdir()
    servers = Servers(str(www))
    fetch = {"schemes": ["http"], "hosts": ["127.0.0.1"], "ports": [_port(u) for u in servers.urls],
             "timeout_s": TIMEOUT_S, "deadline_s": DEADLINE_S, "unpack_deadline_s": UNPACK_DEADLINE_S}
    config = write_config(tmp_path, mosquitto, frames, loop=True, fetch=fetch)
    probe = MqttProbe(mosquitto, ["atlas-edge/e2e/#"])
    proc = start_daemon(config)
    log_tail = collections.deque(maxlen=200)  # drained, or a full pipe would block the daemon's logging
    drain = threading.Thread(target=lambda: log_tail.extend(proc.stdout), daemon=True)
    drain.start()
    try:
        made = Box(proc, probe, str(tmp_path / "state"))
        made.servers, made.www, made.tmp = servers, str(www), tmp_path
        assert wait_for(lambda: proc.poll() is None and probe.count("atlas-edge/e2e/results") >= 2,
                        timeout=120), "the daemon never served: %s" % "".join(log_tail)[-2000:]
        yield made
    finally:
        probe.close()
        servers.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        drain.join(timeout=10)


def _deploy_trickle(box, mode):
    """A deploy from the trickling server; returns its request id once the box is reading the trickle."""
    handler = box.servers.handlers[mode]
    handler.trickling.clear()
    handler.hung_up.clear()
    deploy = box.command("deploy", bundle="%s/%s.tar.gz" % (box.servers.trickle[mode], mode), sha256="ab" * 32,
                         archive_sha256="cd" * 32)
    assert handler.trickling.wait(ANSWER_S), "the box never asked the %s trickle" % mode
    return deploy


@pytest.mark.parametrize("mode, bound_s, why", [
    ("headers", TIMEOUT_S, "could not connect to the server or read from it"),  # headers late: fetch.timeout_s
    ("chunk", DEADLINE_S, "took longer than 6 s (fetch.deadline_s)"),
])
def test_a_trickling_server_fails_the_deploy_at_its_deadline(box, mode, bound_s, why):
    started = time.monotonic()
    deploy = _deploy_trickle(box, mode)
    ack, took = box.timed_final(deploy, started)
    print("%s trickle: deploy failed after %.2f s (bound %.0f s)" % (mode, took, bound_s))
    assert ack["state"] == "failed" and ack["error"]["code"] == "invalid" and why in json.dumps(ack["error"]), ack
    assert took < bound_s + SLACK_S, took
    assert box.servers.handlers[mode].hung_up.wait(ANSWER_S)  # the box hung up on the attacker
    assert box.staging_empty() and box.serving_version() == "1.0.0"


@pytest.mark.parametrize("mode", ["headers", "chunk"])
def test_cancel_ends_a_trickling_deploy_within_2_s(box, mode):
    deploy = _deploy_trickle(box, mode)
    sent = time.monotonic()
    cancel = box.command("cancel")
    ack, took = box.timed_final(deploy, sent)
    print("%s trickle: cancel ended the deploy in %.2f s" % (mode, took))
    assert box.wait_final(cancel)["result"] == {"cancelled": True}
    assert ack["state"] == "failed" and ack["error"]["code"] == "cancelled", ack  # not the 3 s header timeout
    assert took < CANCEL_S + SLACK_S, took
    assert box.staging_empty()


def test_rollback_and_set_config_are_answered_while_a_hostile_deploy_runs(box):
    """set-config runs beside the download (not queued behind it); rollback preempts it: cancel, then roll
    back (this box keeps no previous model: nothing to roll back to, answered as such, never busy)."""
    deploy = _deploy_trickle(box, "chunk")
    sent = time.monotonic()
    change = box.command("set-config", config={"thresholds": {"conf": 0.3}})
    changed, change_s = box.timed_final(change, sent)
    assert changed["state"] == "succeeded", changed
    assert box.final(deploy) is None, "the deploy ended before set-config was answered"
    sent = time.monotonic()
    rollback = box.command("rollback")
    rolled, rollback_s = box.timed_final(rollback, sent)
    ended, deploy_s = box.timed_final(deploy, sent)
    print("set-config answered in %.2f s during the deploy; rollback in %.2f s, the deploy cancelled in %.2f s"
          % (change_s, rollback_s, deploy_s))
    assert rolled["state"] == "failed" and rolled["error"]["code"] == "nothing_to_roll_back", rolled
    assert ended["error"]["code"] == "cancelled", ended
    assert rollback_s < CANCEL_S + SLACK_S and deploy_s < CANCEL_S + SLACK_S
    assert box.serving_version() == "1.0.0"


def _served(box, name, content):
    path = write(os.path.join(box.www, name), content)
    return "%s/%s" % (box.servers.files, name), sha256_file(path)


def _downloaded(box, url):
    """Whether the box holds the whole archive in its staging area (the download is over, the unpack begins)."""
    size = os.path.getsize(os.path.join(box.www, url.rsplit("/", 1)[1]))
    staging = os.path.join(box.state, "bundles", ".staging")
    for entry in os.listdir(staging):
        try:
            if os.path.getsize(os.path.join(staging, entry, "download.tar")) == size:
                return True
        except OSError:  # not there yet, or already unpacked and removed
            pass
    return False


def test_an_archive_of_tiny_gzip_members_is_cancelled_within_2_s_and_stopped_at_its_deadline(box):
    """Each byte of the tar its own gzip member: the reader works through it in bounded pieces, checking the
    deadline and cancel between two pieces (empty members are refused outright: the next test)."""
    url, digest = _served(box, "tiny-members.tar.gz", tiny_members_archive(TINY_BYTES))
    started = time.monotonic()
    deploy = box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256=digest)
    ack, took = box.timed_final(deploy, started)
    print("tiny gzip members (%d MiB): unpack deadline after %.2f s (download included)" % (
        os.path.getsize(os.path.join(box.www, "tiny-members.tar.gz")) >> 20, took))
    assert ack["error"]["code"] == "invalid" and "unpacking took longer than its deadline" in json.dumps(ack), ack
    assert took < UNPACK_DEADLINE_S + SLACK_S, took
    deploy = box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256=digest)
    assert wait_for(lambda: _downloaded(box, url), timeout=ANSWER_S, interval=0.01)  # now it unpacks
    sent = time.monotonic()
    box.command("cancel")
    ack, took = box.timed_final(deploy, sent)
    print("tiny gzip members: cancel ended the deploy in %.2f s" % took)
    assert ack["error"]["code"] == "cancelled", ack
    assert took < CANCEL_S + SLACK_S and box.staging_empty()


def test_an_archive_of_empty_gzip_members_is_refused_at_once(box):
    tail = tar_member("x.bin", b"x") + b"\0" * 1024
    url, digest = _served(box, "empty-members.tar.gz", empty_members_archive(64, tail))
    started = time.monotonic()
    ack, took = box.timed_final(box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256=digest), started)
    print("64 MiB of empty gzip members: refused in %.2f s" % took)
    assert ack["error"]["code"] == "invalid" and "more than 16 empty members" in json.dumps(ack), ack
    assert took < UNPACK_DEADLINE_S + SLACK_S and box.staging_empty()


def test_200_directories_125_deep_are_refused_before_any_directory_is_made(box):
    """A valid, hash-pinned bundle with 200 directory members 125 levels deep (25,000 directories)."""
    store = os.path.join(box.state, "bundles")
    relative, sha = new_version(box.tmp, store, "1.1.0")
    path = bundle_with_directories(os.path.join(store, relative), os.path.join(box.www, "deep.tar.gz"), "demo")
    started = time.monotonic()
    deploy = box.command("deploy", bundle="%s/deep.tar.gz" % box.servers.files, sha256=sha,
                         archive_sha256=sha256_file(path))
    ack, took = box.timed_final(deploy, started)
    print("200 x 125-deep directories: refused in %.2f s" % took)
    assert ack["state"] == "failed" and ack["error"]["code"] == "invalid", ack
    assert "levels deep, more than 16" in json.dumps(ack), ack  # said by the first pass: nothing written yet
    assert box.staging_empty() and box.serving_version() == "1.0.0"


def test_a_pax_number_of_5000_digits_is_invalid_not_internal(box):
    url, digest = _served(box, "pax-digits.tar.gz", pax_digits_archive(5000))
    ack = box.wait_final(box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256=digest))
    assert ack["state"] == "failed" and ack["error"]["code"] == "invalid", ack
    assert "PAX size is not a non-negative integer of at most 20 digits" in json.dumps(ack), ack
