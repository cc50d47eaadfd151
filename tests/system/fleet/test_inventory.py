"""The fleet's inventory without trusting the broker's retained store: announce answers, the operator's record,
``stale`` for an ``online`` nobody heard lately, totals that count each state as it is.

The view and the record are tested on messages built here (no broker); then ``fleet status`` and ``rollout``
on a real Mosquitto with real daemons, with the retained statuses cleared or left behind by a box that is gone.
The same on a RabbitMQ cluster is tests/system/cluster/test_cluster.py.
"""

import json
import os
import threading
import time

import pytest

from agent.cli.ctl import EXIT_OK
from agent.fleet.inventory import Inventory, record_path
from agent.fleet.link import Message
from agent.fleet.report import EXIT_PARTIAL
from agent.fleet.status import FleetView, render_table
from benchmarks.fleet_sim import SimulatedFleet
from tests.conftest import wait_for
from tests.support.fleet_support import bundles, rollout_args, run_cli  # noqa: F401 - bundles is a fixture

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)

NOW = 1.8e9


def status_message(device, state="online", ts=NOW, retain=True, **fields):
    body = dict(fields, state=state, device=device, ts=ts, groups=["g"])
    return Message("site/%s/status" % device, json.dumps(body).encode(), retain)


def test_an_online_status_nobody_heard_lately_is_stale_and_a_live_one_is_not():
    view = FleetView("site")
    view.apply(status_message("old", ts=NOW - 31, telemetry_interval_s=10.0))  # retained, 3.1 intervals old
    view.apply(status_message("recent", ts=NOW - 29, telemetry_interval_s=10.0))
    view.apply(status_message("answered", ts=NOW - 300, retain=False))  # heard live (an announce answer)
    view.apply(status_message("default", ts=NOW - 31))  # no interval in the status: the default 10 s
    view.apply(status_message("gone", state="offline", ts=NOW - 999))
    assert view.judge_stale(NOW) == 2
    states = {d: b.state for d, b in view.boxes.items()}
    assert states == {"old": "stale", "recent": "online", "answered": "online", "default": "stale",
                      "gone": "offline"}
    assert "31 s ago" in view.boxes["old"].reason and "10 s telemetry interval" in view.boxes["old"].reason
    assert not view.boxes["old"].online  # what a rollout asks: stale is not online


def test_a_stale_box_heard_live_again_is_online_and_a_retained_word_does_not_revive_it():
    """A long-running view (the console, a rollout) judges a silent box stale, then hears its telemetry."""
    view = FleetView("site")
    view.apply(status_message("quiet", ts=NOW - 31, telemetry_interval_s=10.0))
    assert view.judge_stale(NOW) == 1 and view.boxes["quiet"].state == "stale"
    view.apply(Message("site/quiet/telemetry", b'{"fps": 2.0, "ts": 1.8e9}', True))  # a retained copy: old news
    assert view.boxes["quiet"].state == "stale"
    view.apply(Message("site/quiet/telemetry", b'{"fps": 2.0, "ts": 1.8e9}', False))
    assert view.boxes["quiet"].state == "online" and view.boxes["quiet"].reason is None


def test_totals_count_each_state_as_it_is():
    view = FleetView("site")
    for device, state in (("a", "online"), ("b", "offline"), ("c", "online")):
        view.apply(status_message(device, state=state, retain=False))
    view.apply(status_message("d", ts=NOW - 100))
    view.judge_stale(NOW)
    view.apply(Message("site/e/telemetry", b'{"fps": 1.0, "ts": 1.8e9}', True))  # no status: unknown
    assert render_table(view.in_group(None), now=NOW).splitlines()[-1] == \
        "5 box(es): 2 online, 1 offline, 1 stale, 1 unknown"


def test_the_record_lists_boxes_not_heard_this_time_and_forgets_decommissioned_ones(tmp_path):
    path = record_path(str(tmp_path / "op"), "site/a")
    assert os.path.basename(path) == "inventory-site%2Fa.json"
    first = FleetView("site")
    for device in ("cam-1", "cam-2", "cam-3"):
        first.apply(status_message(device, retain=False, broker="n1:1883"))
    record = Inventory(path, "site/a")
    record.fold(first, now=NOW)
    assert record.save()

    later = FleetView("site")
    later.apply(status_message("cam-1", retain=False))
    later.apply(Message("site/cam-3/status", b"", True))  # cam-3's retained status cleared: decommissioned
    record = Inventory(path, "site/a")
    record.fold(later, now=NOW + 60)
    assert record.fill(later, now=NOW + 60) == 1
    missing = later.boxes["cam-2"]
    assert (missing.state, missing.groups, missing.broker, missing.last_seen) == ("unknown", ["g"], "n1:1883", NOW)
    assert "not heard this time; last seen 60 s ago, online" == missing.reason
    assert "cam-3" not in later.boxes and "cam-3" not in record.boxes

    (tmp_path / "op" / "inventory-site%2Fa.json").write_text("{damaged")
    assert Inventory(path, "site/a").boxes == {}  # a damaged record costs the history, not the command
    assert Inventory(path, "other").boxes == {}


def test_status_and_rollout_find_boxes_by_their_answers_and_treat_a_ghost_as_offline(
        mosquitto, probe_factory, bundles, tmp_path, capsys):  # noqa: F811 - the fixture imported above
    prefix = "inv-%s" % os.urandom(3).hex()
    fleet = SimulatedFleet(str(tmp_path / "boxes"), mosquitto.host, mosquitto.port, bundles["v1"], 3,
                           observation_s=1.0, prefix=prefix).start()
    fleet.prefix = prefix
    try:
        probe = probe_factory(mosquitto, ["%s/+/status" % prefix])
        assert wait_for(lambda: len({t for t, _, _, _ in probe.messages}) == 3)
        # Their retained statuses are cleared (as a broker without a retained store would have none), and a
        # ghost left an "online" an hour ago, retained, and is gone without a will.
        ghost = {"state": "online", "device": "cpu-dev", "ts": time.time() - 3600, "groups": ["sim"],
                 "telemetry_interval_s": 30.0, "broker": "127.0.0.1:1"}
        retained = [(box.device_id, b"") for box in fleet.boxes] + [("ghost", json.dumps(ghost).encode())]
        for device, payload in retained:
            info = probe.client.publish("%s/%s/status" % (prefix, device), payload, qos=1, retain=True)
            info.wait_for_publish(5)

        code, shown = run_cli(["status", "--broker", mosquitto.url, "--prefix", prefix, "--json", "--listen", "1",
                               "--state-dir", str(tmp_path / "rollouts")], capsys)  # the rollout's, below
        assert code == EXIT_OK
        states = {b["device"]: (b["state"], b["heard_live"]) for b in shown["boxes"]}
        assert states == dict({b.device_id: ("online", True) for b in fleet.boxes}, ghost=("stale", False))

        # Box 2 goes away and its status with it: only the operator's record still knows it.
        fleet.boxes[2].stop()
        info = probe.client.publish("%s/%s/status" % (prefix, fleet.boxes[2].device_id), b"", qos=1, retain=True)
        info.wait_for_publish(5)
        code, report = run_cli(rollout_args(mosquitto, fleet, bundles, tmp_path, "--canary", "1", "--waves", "1"),
                               capsys)
        assert code == EXIT_PARTIAL, report  # ran to its end without reaching every box
        outcomes = {b["device"]: (b["outcome"], b["error"]) for b in report["boxes"]}
        assert outcomes[fleet.boxes[0].device_id] == outcomes[fleet.boxes[1].device_id] == ("confirmed", None)
        assert outcomes[fleet.boxes[2].device_id] == ("unseen", "in the inventory, no status heard")
        assert outcomes["ghost"][0] == "offline" and "not heard since" in outcomes["ghost"][1]
        assert fleet.boxes[2].deploys == 0
    finally:
        fleet.close()


SLOTS = {"serving": "a", "slots": {"a": {"name": "m", "version": "1", "manifest_sha256": "a" * 64,
                                         "state": "confirmed"}}}


def _retain(probe, topic, payload):
    info = probe.client.publish(topic, payload, qos=1, retain=True)
    info.wait_for_publish(5)


def test_a_status_that_cannot_be_read_is_malformed_in_the_group_the_record_gives_it(
        mosquitto, probe_factory, tmp_path, capsys):
    prefix = "mal-%s" % os.urandom(3).hex()
    probe = probe_factory(mosquitto, [])
    state_dir = str(tmp_path / "rollouts")
    for device in ("cam-1", "cam-2", "cam-3"):  # first seen well: the operator's record lists them in g
        body = {"state": "online", "device_id": device, "device": device, "ts": time.time(), "groups": ["g"],
                "slots": SLOTS}
        _retain(probe, "%s/%s/status" % (prefix, device), json.dumps(body).encode())
    code, shown = run_cli(["status", "--broker", mosquitto.url, "--prefix", prefix, "--json", "--listen", "1",
                           "--state-dir", state_dir], capsys)
    assert code == EXIT_OK and len(shown["boxes"]) == 3
    # Then: not an object, nested 40 levels deep, wrong types (groups a string).
    for device, payload in (("cam-1", b"[1, 2]"), ("cam-2", b"[" * 40 + b"]" * 40),
                            ("cam-3", json.dumps({"state": "online", "groups": "g", "slots": 7}).encode())):
        _retain(probe, "%s/%s/status" % (prefix, device), payload)
    code, report = run_cli(["rollout", "--broker", mosquitto.url, "--prefix", prefix, "--group", "g",
                            "--bundle", "b.tar.gz", "--sha256", "b" * 64, "--state-dir", state_dir,
                            "--no-preflight", "--json"], capsys)
    outcomes = {b["device"]: b["outcome"] for b in report["boxes"]}
    assert outcomes == {"cam-1": "malformed", "cam-2": "malformed", "cam-3": "malformed"}, report
    assert code == EXIT_PARTIAL and report["status"] == "partial"  # counted: not every box was reached


def test_a_box_that_does_not_answer_the_announce_but_speaks_telemetry_is_reached(
        mosquitto, probe_factory, tmp_path, capsys):
    """A box from before the announce: a retained 'online' 41 s old, telemetry every second, no answer."""
    prefix = "old-%s" % os.urandom(3).hex()
    probe = probe_factory(mosquitto, ["%s/old-box/cmd/#" % prefix])
    body = {"state": "online", "device_id": "old-box", "device": "old-box", "ts": time.time() - 41,
            "groups": ["g"], "telemetry_interval_s": 1.0, "slots": SLOTS}
    _retain(probe, "%s/old-box/status" % prefix, json.dumps(body).encode())
    stop = threading.Event()
    rid = "ro-old.old-box.deploy"

    def speak():  # the box's own cadence (telemetry each second, commands read each 0.1 s), not a synchronisation
        ticks, answered = 0, 0
        while not stop.wait(0.1):
            ticks += 1
            if ticks % 10 == 0:
                probe.client.publish("%s/old-box/telemetry" % prefix, json.dumps({"fps": 5.0, "ts": time.time()}))
            if probe.count("%s/old-box/cmd/deploy" % prefix) > answered:  # each deploy read is answered
                answered += 1
                ack = {"request_id": rid, "verb": "deploy", "state": "failed", "ts": time.time(),
                       "error": {"code": "invalid", "message": "this old box refuses it"}}
                probe.client.publish("%s/old-box/ack/%s" % (prefix, rid), json.dumps(ack), qos=1)

    speaker = threading.Thread(target=speak, daemon=True)
    speaker.start()
    try:
        code, report = run_cli(["rollout", "--broker", mosquitto.url, "--prefix", prefix, "--group", "g",
                                "--bundle", "b.tar.gz", "--sha256", "b" * 64, "--state-dir", str(tmp_path),
                                "--canary", "0", "--waves", "1", "--rollout-id", "ro-old", "--no-preflight",
                                "--json"], capsys)
    finally:
        stop.set()
        speaker.join(5)
    [box] = report["boxes"]
    assert (box["outcome"], box["error"]) == ("failed", "invalid: this old box refuses it"), box  # not 'offline'
    assert probe.count("%s/old-box/cmd/deploy" % prefix) == 1  # reached: sent its deploy, once
    assert code == EXIT_PARTIAL  # ran to its end without reaching every box
