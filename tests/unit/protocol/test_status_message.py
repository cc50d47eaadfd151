"""The retained status has one type and one builder (agent/protocol/status.py): the daemon, the transport and
the last will all build it there, with the device id and the device kind under their own keys. The transport
used to overwrite the daemon's ``device`` (the kind) with the id, so the fleet's pre-flight never saw the kind of
a real box; here a real daemon's status, through the real transport and Mosquitto, is read by the fleet's
reader and pre-flight checks the box."""

import json
import os
import shutil
import signal

import pytest

from agent.bundle.verify import sha256_file
from agent.cli.demo import DEMO_BUNDLE, write_sample_frames
from agent.cli.fleet_preflight import preflight
from agent.config.schema import ConfigError
from agent.fleet.link import Message
from agent.fleet.status import FleetView
from agent.protocol.status import ModelInfo, parse_status, parse_status_answer, status_answer, status_message
from tests.conftest import MqttProbe
from tests.support.daemon_rig import SIZES, start_daemon, write_config


def test_the_builder_names_id_and_kind_apart_and_refuses_a_field_the_type_lacks():
    message = status_message("online", "cam-01", device_kind="atlas-200dk", backend="acl", ts=5.0)
    assert message == {"state": "online", "device_id": "cam-01", "device": "cam-01", "device_kind": "atlas-200dk",
                       "backend": "acl", "ts": 5.0}
    status = parse_status(json.loads(json.dumps(message)))
    assert (status.device_id, status.device_kind, status.online) == ("cam-01", "atlas-200dk", True)
    with pytest.raises(TypeError, match="device_knd"):
        status_message("online", "cam-01", device_knd="atlas-200dk")
    will = status_message("offline", "cam-01", reason="connection lost", groups=["g"], device_kind=None)
    assert will["device_id"] == "cam-01" and "device_kind" not in will and isinstance(will["ts"], float)
    with pytest.raises(ConfigError, match="telemetry_interval_s"):  # what the operator's reader would refuse
        status_message("online", "cam-01", telemetry_interval_s="often")
    with pytest.raises(ConfigError, match="slots.serving"):
        status_message("online", "cam-01", slots={"serving": 1})


def test_the_status_answer_is_the_retained_status_and_more_with_one_meaning_of_model():
    presence = {"device_kind": "atlas-200dk", "model": "tiny 1.0.0", "backend": "acl", "precision": "int8",
                "groups": ["g"], "slots": {"serving": "a", "slots": {}}, "telemetry_interval_s": 5.0}
    info = {"name": "tiny", "version": "1.0.0", "task": "detect-yolov8", "backend": "acl", "precision": "int8",
            "manifest_sha256": "ab" * 32, "tiers": [[256, 256]], "artifacts": {"256x256": "model.om"}}
    retained = status_message("online", "cam-01", **presence)
    answer = json.loads(json.dumps(status_answer("cam-01", model_info=info, uptime_s=3.5, paused=False,
                                                 **presence)))
    for name, value in retained.items():  # every retained field, with the same value, in the answer
        assert name == "ts" or answer[name] == value, name
    typed = parse_status_answer(answer)
    assert typed.model == parse_status(answer).model == "tiny 1.0.0"  # the label, in both
    assert typed.model_info == ModelInfo(**info) and typed.uptime_s == 3.5 and typed.paused is False
    with pytest.raises(TypeError, match="fps_now"):  # a figure added without its field: refused on the box
        status_answer("cam-01", fps_now=3.0)
    with pytest.raises(TypeError, match="layout"):  # describe() grew a key ModelInfo lacks
        status_answer("cam-01", model_info=dict(info, layout="NCHW"))


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                    reason="examples/demo-bundle is missing (make demo-bundle)")
def test_a_real_daemons_status_carries_its_kind_and_the_fleet_checks_it(tmp_path, mosquitto):
    frames_dir = tmp_path / "frames"
    write_sample_frames(str(frames_dir), sizes_hw=SIZES[:2], seed=3)
    status = MqttProbe(mosquitto, ["atlas-edge/e2e/status"])
    proc = start_daemon(write_config(tmp_path, mosquitto, frames_dir))
    try:
        assert status.wait(lambda m: any(s.get("state") == "online" for _t, s in m), timeout=120), \
            proc.stdout.read() if proc.poll() is not None else ""
        topic, payload, retained, _dup = next(m for m in status.messages if json.loads(m[1])["state"] == "online")
        body = json.loads(payload)
        assert (body["device_id"], body["device_kind"], body["device"]) == ("e2e", "cpu-dev", "e2e")
        view = FleetView("atlas-edge")
        assert view.apply(Message(topic, payload, retained)) == "e2e"
        box = view.boxes["e2e"]
        assert box.online and box.kind == "cpu-dev" and box.backend == body["backend"]
        said = []
        bundle = shutil.copytree(DEMO_BUNDLE, str(tmp_path / "store" / "demo"))  # as the operator has it
        check = preflight(bundle, sha256_file(os.path.join(bundle, "manifest.json")), None, said.append)
        assert check is not None
        check([box])  # the demo bundle runs on a cpu-dev box: no misfit, and the box's kind was checked
        assert not any("not checked" in line for line in said), said
        proc.send_signal(signal.SIGTERM)
        assert status.wait(lambda m: m[-1][1].get("state") == "offline", timeout=60)
        stopped = status.json()[-1][1]
        assert (stopped["device_id"], stopped["reason"], stopped["device_kind"]) == ("e2e", "stopped", "cpu-dev")
    finally:
        if proc.poll() is None:
            proc.kill()
        status.close()
