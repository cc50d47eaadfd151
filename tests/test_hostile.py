"""The box against a hostile network, end to end: a real daemon (subprocess), a real Mosquitto, and an HTTP
server on loopback that serves hostile archives. What is measured is what an attacker on the path could do:
make a deploy hang or eat memory, lock the operator out, fill staging, reach outside the source lane."""

import json
import os
import signal
import time

import pytest

from agent.bundle.verify import sha256_file
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from tests.conftest import MqttProbe, wait_for
from tests.test_e2e import SIZES, start_daemon, write_config
from tests.test_fetch import (
    _http_server,
    gzip_bomb_archive,
    lying_archives,
    many_files_archive,
    negative_size_archive,
    write,
)

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")

FINAL = ("succeeded", "failed")
ANSWER_S = 60.0  # a deadline for polls on a loaded CI machine, not a speed claim
REFUSED_WITHIN_S = 10.0  # "refused within seconds"
RSS_GROWTH_MB = 50.0


def _vm(pid, key):
    with open("/proc/%d/status" % pid) as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError(key)


class Box:
    """The running daemon, an operator's probe on the broker, and the loopback HTTP server's base URL."""

    def __init__(self, proc, probe, url, state):
        self.proc, self.probe, self.url, self.state = proc, probe, url, state
        self.sent = 0

    def command(self, verb, **fields):
        """Publish a command; returns its request id."""
        self.sent += 1
        request_id = "%s-%d" % (verb, self.sent)
        self.probe.publish("atlas-edge/e2e/cmd/%s" % verb, json.dumps(dict(fields, request_id=request_id)).encode())
        return request_id

    def final(self, request_id):
        acks = [a for a in self.probe.on("atlas-edge/e2e/ack/%s" % request_id) if a["state"] in FINAL]
        return acks[0] if acks else None

    def wait_final(self, request_id):
        assert wait_for(lambda: self.final(request_id) is not None, timeout=ANSWER_S), \
            "no final ack for %s" % request_id
        return self.final(request_id)

    def serving_version(self):
        return self.wait_final(self.command("status"))["result"]["model"]["version"]


@pytest.fixture(scope="module")
def box(tmp_path_factory, mosquitto):
    tmp_path = tmp_path_factory.mktemp("hostile")
    frames = tmp_path / "frames"
    write_sample_frames(str(frames), sizes_hw=SIZES[:2], seed=5)
    www = tmp_path / "www"
    www.mkdir()
    config = write_config(tmp_path, mosquitto, frames, loop=True,
                          fetch={"schemes": ["http"], "hosts": ["127.0.0.1"]})
    probe = MqttProbe(mosquitto, ["atlas-edge/e2e/#"])
    proc = start_daemon(config)
    try:
        with _http_server(str(www)) as url:
            made = Box(proc, probe, url, str(tmp_path / "state"))
            made.www = str(www)
            assert wait_for(lambda: proc.poll() is None and made.probe.count("atlas-edge/e2e/results") >= 2,
                            timeout=120), "the daemon never served"
            yield made
    finally:
        probe.close()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def _valid_archive(www):
    """The demo bundle as a .tar.gz: a well-formed archive, refused here only for its digest."""
    import tarfile

    path = os.path.join(www, "demo.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(DEMO_BUNDLE, arcname="demo")
    return path


def test_hostile_archives_are_refused_while_status_and_rollback_are_answered_and_serving_goes_on(box):
    demo = _valid_archive(box.www)
    cases = [  # (name, archive bytes or path, archive_sha256 override, expected code, expected message part)
        ("negative-size.tar.gz", negative_size_archive(), None, "invalid", "is not an octal number"),
        ("200k-empty-files.tar.gz", many_files_archive(200000), None, "invalid", "more than 10000 members"),
        ("50k-one-byte-files.tar.gz", many_files_archive(50000, b"x"), None, "invalid", "more than 10000 members"),
        ("gzip-bomb.tar.gz", gzip_bomb_archive(), None, "invalid", "archive unpacks to at least"),
        ("lying-header.tar.gz", lying_archives()["size past the data"], None, "invalid",
         "ends in the middle of a member"),
        ("digest-mismatch.tar.gz", demo, "0" * 64, "sha256_mismatch", "nothing was unpacked"),
    ]
    pid = box.proc.pid
    assert box.serving_version() == "1.0.0"
    base_rss = _vm(pid, "VmRSS")
    with open("/proc/%d/clear_refs" % pid, "w") as handle:
        handle.write("5")  # VmHWM from here on is the peak during the attacks
    timings = {}
    for name, content, pinned, code, part in cases:
        path = content if isinstance(content, str) else write(os.path.join(box.www, name), content)
        url = "%s/%s" % (box.url, os.path.basename(path))
        started = time.monotonic()
        deploy = box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256=pinned or sha256_file(path))
        status = box.command("status")
        rollback = box.command("rollback")
        refused = box.wait_final(deploy)
        timings[name] = time.monotonic() - started
        answered = box.wait_final(status), box.wait_final(rollback)
        assert refused["state"] == "failed" and refused["error"]["code"] == code, refused
        assert part in json.dumps(refused["error"]), refused
        assert len(json.dumps(refused)) < 4096  # bounded: no list of 200,000 names
        assert answered[0]["state"] == "succeeded" and answered[0]["result"]["model"]["version"] == "1.0.0"
        assert answered[1]["error"]["code"] == "nothing_to_roll_back"  # answered, and nothing moved
        assert timings[name] < REFUSED_WITHIN_S, timings
        assert os.listdir(os.path.join(box.state, "bundles", ".staging")) == []
    growth = _vm(pid, "VmHWM") - base_rss
    assert growth < RSS_GROWTH_MB, "peak RSS grew %.1f MB during the attacks" % growth
    results_before = box.probe.count("atlas-edge/e2e/results")
    assert wait_for(lambda: box.probe.count("atlas-edge/e2e/results") >= results_before + 3, timeout=ANSWER_S)
    newest = box.probe.on("atlas-edge/e2e/results/cam")[-1]
    assert newest["model"]["version"] == "1.0.0" and box.proc.poll() is None
    print("refused in (s):", {k: round(v, 2) for k, v in timings.items()}, "peak RSS growth MB: %.1f" % growth)


def test_deploy_urls_outside_the_fetch_policy_are_refused_with_a_coarse_cause(box):
    """This box lists only 127.0.0.1 (the test's server); the unit tests cover the default empty list."""
    for url, part in [("http://localhost:%s/demo.tar.gz" % box.url.rsplit(":", 1)[1],
                       "host localhost is not in fetch.hosts"),
                      ("http://10.0.0.7/demo.tar.gz", "host 10.0.0.7 is not in fetch.hosts"),
                      ("ftp://127.0.0.1/demo.tar.gz", "scheme ftp is not allowed")]:
        ack = box.wait_final(box.command("deploy", bundle=url, sha256="ab" * 32, archive_sha256="cd" * 32))
        assert ack["state"] == "failed" and part in ack["error"]["message"], ack
    assert box.serving_version() == "1.0.0"


@pytest.mark.parametrize("change, field", [
    ({"sources": [{"name": "cam", "uri": "/etc", "loop": True}]}, "sources[0].uri"),
    ({"sources": [{"name": "spy", "uri": "http://127.0.0.1:1/"}]}, "sources[0].uri"),
    ({"batching": {"queue_size": 1000000000}}, "batching.queue_size"),
    ({"publish": {"telemetry_interval_s": 1e-6}}, "publish.telemetry_interval_s"),
    ({"thresholds": {"conf": float("nan")}}, "thresholds.conf"),
    ({"publish": {"max_rate_hz": float("inf")}}, "publish.max_rate_hz"),
])
def test_a_remote_set_config_outside_its_lane_is_refused_as_invalid(box, change, field):
    ack = box.wait_final(box.command("set-config", config=change))
    assert ack["state"] == "failed" and ack["error"]["code"] == "invalid", ack
    assert field in [e["field"] for e in ack["error"]["errors"]], ack
    assert not os.path.exists(os.path.join(box.state, "overrides.json"))  # nothing recorded
