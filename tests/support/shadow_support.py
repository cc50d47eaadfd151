"""Candidates for shadow runs (a helper module, not a test module): the demo bundle's int8 as a bundle of its own,
and broken copies of it (labels shifted by one). The pipeline, lifecycle, daemon and fleet tests of shadow runs
share these."""

import json
import os
import shutil

from agent.bundle.manifest import MANIFEST
from agent.bundle.verify import sha256_file, write_manifest


def gated_bundles(root, boxes, source=None, more=None):
    """What a gated fleet of ``boxes`` daemons starts from: ``root/serving``, ``source`` (default: the demo) at
    1.0.0 serving its float, and in each box's incoming store (``root/box<i>``) its int8 at 1.1.0;
    ``more(incoming, shas)`` adds a fleet's other candidates there. Returns ``(serving, shas)``: candidate name ->
    manifest sha256."""
    from agent.cli.demo import DEMO_BUNDLE

    source = source or DEMO_BUNDLE
    serving = str(root / "serving")
    candidate_bundle(source, serving, "1.0.0", serve="float")
    shas = {}
    for index in range(boxes):
        incoming = root / ("box%d" % index) / "state" / "bundles" / "incoming"
        shas["int8"] = candidate_bundle(source, str(incoming / "int8"), "1.1.0")
        if more is not None:
            more(incoming, shas)
    return serving, shas


def candidate_bundle(src, dst, version, serve="int8", shift_labels=False):
    """A copy of ``src`` as release ``version`` serving only its ``serve`` artifacts (``int8`` or ``float``; the
    others stay in the bundle with role ``convert``: the float ones are the quantized golden rule's reference),
    its labels rotated by one when ``shift_labels`` (the same network, a label file from another version).
    Returns its manifest sha."""
    shutil.copytree(src, dst)
    for extra in ("manifest.sig",):
        if os.path.exists(os.path.join(dst, extra)):
            os.remove(os.path.join(dst, extra))
    with open(os.path.join(dst, MANIFEST)) as handle:
        data = json.load(handle)
    data["version"] = version
    for art in data["artifacts"]:
        if (art["precision"] == "int8") != (serve == "int8"):
            art["role"] = "convert"
    if shift_labels:
        data["labels"] = data["labels"][1:] + data["labels"][:1]
    write_manifest(dst, data)
    return sha256_file(os.path.join(dst, MANIFEST))



def gated_daemons(mosquitto, root, prefix, serving, shas, devices, sources, answer_s):
    """Real daemons (``agent run`` processes) ``devices`` of group ``g``, the i-th reading ``sources[i]`` and serving
    ``serving`` on onnxruntime, each with its home ``root/box<i>``; yields ``{broker, prefix, probe, root, shas}``
    once each has said what it serves (within ``answer_s``), and stops them after. Device ids must differ between
    fleets alive at once: a box's MQTT client id is made from it, and two would take each other's session."""
    from tests.conftest import MqttProbe, wait_for
    from tests.support.daemon_rig import start_daemon, stop_daemons, write_config
    from tests.support.lifecycle_support import NOISE_PROOF_FACTOR

    probe = MqttProbe(mosquitto, ["%s/#" % prefix])
    procs = []
    try:
        for index, device in enumerate(devices):
            home = root / ("box%d" % index)
            mqtt = {"host": mosquitto.host, "port": mosquitto.port, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0,
                    "prefix": prefix, "groups": ["g"]}
            # Not under test here: the latency rule, and the candidate's priority (tests/unit/pipeline/
            # test_shadow.py, the shadow bench): beside other test work a nice-19 candidate gets next to no CPU
            # (two boxes' 30-frame yolov8t runs had not ended after 600 s in a clean-clone run under load)
            model = {"bundle": serving, "observation_s": 0, "backend": "onnxruntime",
                     "latency_regression": NOISE_PROOF_FACTOR, "shadow_nice": 0}
            procs.append(start_daemon(write_config(home, mosquitto, None, device_id=device, mqtt=mqtt, model=model,
                                                   sources=sources[index])))
        assert wait_for(lambda: serving_versions(probe, prefix).keys() >= set(devices), timeout=answer_s,
                        interval=0.2), [p.poll() for p in procs]
        yield {"broker": mosquitto, "prefix": prefix, "probe": probe, "root": root, "shas": shas}
    finally:
        stop_daemons(procs)
        probe.close()


def outcomes(err, boxes):
    """A rollout's progress lines and each box's outcome, error and shadow record, in full: an assertion's message
    (a tuple there is cut short)."""
    return "%s\n%s" % (err[-6000:], "\n".join("%s: %s: %s; shadow %s" % (
        device, box.get("outcome"), box.get("error"), box.get("shadow")) for device, box in sorted(boxes.items())))


def serving_versions(probe, prefix):
    """device -> the version its latest online status says it serves (each box's own word)."""
    seen = {}
    for topic, payload, _retain, _qos in list(probe.messages):
        if topic.startswith(prefix + "/") and topic.endswith("/status") and payload:
            body = json.loads(payload)
            if body.get("state") == "online" and body.get("slots"):
                slots = body["slots"]
                seen[body["device_id"]] = slots["slots"][slots["serving"]]["version"]
    return seen


SHADOW_BOUND_S = 600  # a gated rollout's --shadow-timeout in the real-daemon tests; never asserted as a duration


def gated_rollout(fleet, name, capsys, *extra):
    """``fleet rollout`` of the candidate ``incoming/<name>`` to group ``g`` of :func:`gated_daemons`' fleet, gated
    on 20 shadow frames at score-aware F1 0.95, canary 1 then one wave; (exit code, JSON report, stderr).

    The shadow bound is SHADOW_BOUND_S: a run ends once it compared its frames, so a passing run does not wait
    for it, and a machine busy with other tests slows the candidate down (under stress-ng --cpu 6, at nice 19,
    the yolov8t canary's 30 frames took 142 s)."""
    from agent.cli import fleet as fleet_cli

    args = ["rollout", "--broker", fleet["broker"].url, "--prefix", fleet["prefix"], "--group", "g",
            "--bundle", "incoming/%s" % name, "--sha256", fleet["shas"][name],
            "--bundle-file", str(fleet["root"] / "box0" / "state" / "bundles" / "incoming" / name),
            "--state-dir", str(fleet["root"] / "rollouts"), "--listen", "2", "--canary", "1", "--waves", "1",
            "--json", "--shadow-frames", "20", "--min-agreement", "0.95", "--shadow-timeout", str(SHADOW_BOUND_S),
            "--confirm-timeout", "150"] + list(extra)
    code = fleet_cli.main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, json.loads(captured.out), captured.err
