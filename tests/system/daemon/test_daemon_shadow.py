"""Shadow runs through a real daemon and a real Mosquitto, commanded with ``atlas-edge ctl`` (docs/shadow.md): the
demo bundle's int8 beside its float serving model agrees, a copy with its labels shifted by one does not, neither
publishes a result, the report is retained on the box's shadow topic, in ``status`` and in the metrics, a bad
request fails naming its cause with nothing left behind, and a deploy of the candidate switches to it without a
second download."""

import json
import os
import re
import shutil
import signal
import urllib.request

import pytest

from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.devtools.broker import free_port
from tests.conftest import MqttProbe
from tests.support.daemon_rig import ctl, start_daemon, wait_status, write_config
from tests.support.lifecycle_support import NOISE_PROOF_FACTOR
from tests.support.shadow_support import candidate_bundle

pytestmark = [
    pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                       reason="examples/demo-bundle is missing (make demo-bundle)"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("prometheus_client") is None,
                       reason="needs prometheus_client (pip install 'atlas-edge[metrics]')"),
]

SHADOW_TOPIC = "atlas-edge/e2e/shadow"
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "metrics.md")
REPORT_S = 180
CAMERA_SIZES = [(480, 640), (480, 480), (480, 800)]


def shadow_series():
    """The docs/metrics.md rows exported after a shadow run."""
    return [line.split("|")[1].strip().strip("`") for line in open(DOCS)
            if line.startswith("| `atlas_edge_shadow_") and "after a shadow run" in line]


def _final_report(probe, version, timeout=REPORT_S):
    def ended(messages):
        return any(r.get("state") != "running" and r["candidate"]["version"] == version for _t, r in messages)

    assert probe.wait(ended, timeout=timeout), [(r["state"], r["frames_compared"]) for _t, r in probe.json()]
    return [r for _t, r in probe.json() if r["state"] != "running" and r["candidate"]["version"] == version][-1]


def _answer(done):
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shadow_runs_compare_a_candidate_on_live_frames_and_a_deploy_promotes_it(tmp_path, mosquitto):
    frames = tmp_path / "frames"
    # 42 distinct scenes at a camera's sizes: each compared about once, a sample that means something
    write_sample_frames(str(frames), sizes_hw=CAMERA_SIZES * 14, seed=21)
    serving = str(tmp_path / "shapes-1.0.0")
    candidate_bundle(DEMO_BUNDLE, serving, "1.0.0", serve="float")
    port = free_port("127.0.0.1")
    config = write_config(tmp_path, mosquitto, frames, loop=True, bundle=serving,
                          model={"bundle": serving, "observation_s": 0, "backend": "onnxruntime",
                                 "latency_regression": NOISE_PROOF_FACTOR},
                          metrics={"listen": "127.0.0.1:%d" % port})
    incoming = tmp_path / "state" / "bundles" / "incoming"
    healthy_sha = candidate_bundle(DEMO_BUNDLE, str(incoming / "int8"), "1.1.0")
    shifted_sha = candidate_bundle(DEMO_BUNDLE, str(incoming / "shifted"), "1.2.0", shift_labels=True)
    reports = MqttProbe(mosquitto, [SHADOW_TOPIC])
    results = MqttProbe(mosquitto, ["atlas-edge/e2e/results/#"])
    proc = start_daemon(config)
    try:
        wait_status(mosquitto)
        slots = tmp_path / "state" / "bundles" / "slots"
        entries = sorted(os.listdir(str(slots)))

        # refused on the box, naming the cause; nothing loaded, nothing left in the store
        wrong = ctl(mosquitto, "shadow", "--json", json.dumps({"bundle": "incoming/int8", "sha256": "0" * 64}))
        assert wrong.returncode == 1 and "sha256" in wrong.stdout + wrong.stderr
        missing = ctl(mosquitto, "shadow", "--json", json.dumps({"bundle": "incoming/none", "sha256": healthy_sha}))
        assert missing.returncode == 1 and "incoming/none" in missing.stdout + missing.stderr
        # refused on the operator's machine, naming the field, before anything is sent
        typo = ctl(mosquitto, "shadow", "--json", json.dumps({"bundel": "incoming/int8", "sha256": healthy_sha}))
        assert typo.returncode == 2 and "bundel" in typo.stderr
        out_of_range = ctl(mosquitto, "shadow", "--json",
                           json.dumps({"bundle": "incoming/int8", "sha256": healthy_sha, "sample": 1.5}))
        assert out_of_range.returncode == 2 and "sample" in out_of_range.stderr
        assert sorted(os.listdir(str(slots))) == entries and reports.json() == []

        verdicts = {}
        for name, sha, version in (("shifted", shifted_sha, "1.2.0"), ("int8", healthy_sha, "1.1.0")):
            started = ctl(mosquitto, "shadow", "--json", json.dumps(
                {"bundle": "incoming/%s" % name, "sha256": sha, "frames": 40, "max_s": 150}), "--timeout", "120",
                timeout=120)
            assert started.returncode == 0, started.stdout + started.stderr
            assert _answer(started)["result"]["state"] == "running"
            final = _final_report(reports, version)
            assert final["state"] == "finished" and final["frames_compared"] == 40, final
            verdicts[name] = final["agreement"]
            print(name, "strict F1", final["agreement"]["strict"]["f1"], "score-aware F1",
                  final["agreement"]["score_aware"]["f1"], "on", final["agreement"]["reference_detections"],
                  "detections;", final["dropped_busy"], "dropped busy; candidate p95",
                  final["candidate_latency_ms"]["p95"], "ms")
        assert verdicts["int8"]["score_aware"]["f1"] >= 0.95 and verdicts["shifted"]["score_aware"]["f1"] < 0.5
        # the candidates never published: every result came from the serving model
        assert {r["model"]["version"] for _t, r in results.json()} == {"1.0.0"}

        status = _answer(ctl(mosquitto, "status"))["result"]
        assert status["shadow"]["state"] == "finished" and status["shadow"]["candidate"]["version"] == "1.1.0"
        scraped = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
        missing_series = [name for name in shadow_series() if not re.search(r"^%s\{" % name, scraped, re.M)]
        assert shadow_series() and not missing_series, missing_series
        assert re.search(r'^atlas_edge_shadow_f1\{[^}]*reading="score_aware"[^}]*\} 0\.9', scraped, re.M)

        shutil.rmtree(str(incoming / "int8"))  # the source is gone: the deploy uses the candidate's own copy
        deployed = ctl(mosquitto, "deploy", "--json", json.dumps({"bundle": "incoming/int8", "sha256": healthy_sha}),
                       "--timeout", "120", timeout=120)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert results.wait(lambda m: m[-1][1]["model"]["version"] == "1.1.0", timeout=60)
        assert results.json()[-1][1]["model"]["precision"] == "int8"
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        reports.close()
        results.close()
    assert "Traceback" not in out, out[-3000:]
