"""``fleet metrics``'s state without a broker: messages as the link hands them in, a clock the test moves, and
the exposition read back with prometheus_client's own parser (series, labels, states, forgetting, bounds).
"""

import json
import os
import shutil

import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client (the 'metrics' extra)")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from agent.fleet.journal import RolloutState  # noqa: E402
from agent.fleet.link import Message  # noqa: E402
from agent.fleet.metrics_bridge import (  # noqa: E402
    LABEL_MAX,
    ROLLOUT_STATES,
    SOURCES_KEPT,
    STATES,
    BridgeState,
    registry_for,
)
from agent.fleet.status import slots_json  # noqa: E402
from tests.conftest import REPO_ROOT  # noqa: E402

PREFIX = "t"
T0 = 1_000_000.0
SECRET = "hunter2-secret"
SLOTS = {"serving": "b", "slots": {"a": {"name": "shapes", "version": "1.0.0", "manifest_sha256": "1" * 64,
                                         "state": "standby"},
                                   "b": {"name": "shapes", "version": "2.0.0", "manifest_sha256": "2" * 64,
                                         "state": "confirmed"}}}


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


def status(device, state="online", groups=("g",), **extra):
    body = {"state": state, "device_id": device, "device": device, "device_kind": "atlas-200i-a2", "ts": T0,
            "groups": list(groups), "model": "shapes 2.0.0", "backend": "acl", "precision": "int8",
            "slots": SLOTS, "telemetry_interval_s": 10.0}
    body.update(extra)
    return body


def telemetry(**extra):
    body = {"ts": T0, "fps": 12.5, "frames": 420, "backend_busy_fraction": 0.25, "rss_mb": 100.0,
            "total_rss_mb": 150.0, "mqtt": {"outbox_messages": 3, "broker": "b1:1883"},
            "sources": {"cam": {"uri": "rtsp://admin:%s@10.0.0.9/live" % SECRET, "state": "up",
                                "frame_age_ms": {"p50": 80.0, "max": 120.0}}}}
    body.update(extra)
    return body


def msg(device, kind, body, retain=False):
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Message("%s/%s/%s" % (PREFIX, device, kind), payload, retain)


def scrape(bridge):
    text = prometheus_client.generate_latest(registry_for(bridge)).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return text, samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def totals(samples):
    return {state: value(samples, "atlas_edge_fleet_boxes", state=state) for state in STATES}


@pytest.fixture
def clock():
    return Clock()


def test_series_and_labels_of_an_online_box(clock):
    bridge = BridgeState(PREFIX, clock=clock)
    bridge.apply(msg("cam-1", "status", status("cam-1"), retain=True))
    bridge.apply(msg("cam-1", "telemetry", telemetry()))
    text, samples = scrape(bridge)
    ids = {"device": "cam-1", "group": "g"}
    assert value(samples, "atlas_edge_fleet_box_info", kind="atlas-200i-a2", model="shapes", version="2.0.0",
                 backend="acl", precision="int8", **ids) == 1
    assert value(samples, "atlas_edge_fleet_box_frames_served_total", **ids) == 420
    assert value(samples, "atlas_edge_fleet_box_frame_age_seconds", source="cam", **ids) == pytest.approx(0.08)
    assert value(samples, "atlas_edge_fleet_box_backend_busy_ratio", **ids) == 0.25
    assert value(samples, "atlas_edge_fleet_box_resident_memory_bytes", **ids) == 150 * 1024 * 1024
    assert value(samples, "atlas_edge_fleet_box_outbox_messages", **ids) == 3
    assert value(samples, "atlas_edge_fleet_box_last_seen_seconds", **ids) == T0
    assert value(samples, "atlas_edge_fleet_box_state", state="online", **ids) == 1
    assert value(samples, "atlas_edge_fleet_box_state", state="stale", **ids) == 0
    assert totals(samples) == {"online": 1, "stale": 0, "offline": 0, "malformed": 0, "unknown": 0}
    assert "# TYPE atlas_edge_fleet_box_frames_served_total counter" in text
    assert SECRET not in text and "rtsp://" not in text


def test_totals_by_state_with_fleet_status_rule(clock):
    bridge = BridgeState(PREFIX, clock=clock)
    bridge.apply(msg("on", "status", status("on"), retain=True))
    bridge.apply(msg("quiet", "status", status("quiet", telemetry_interval_s=1.0), retain=True))
    bridge.apply(msg("off", "status", {"state": "offline", "device_id": "off", "device": "off",
                                       "reason": "connection lost", "groups": ["g"]}, retain=True))
    bridge.apply(msg("bad", "status", status("bad", slots={"serving": "a", "slots": ["a list"]})))
    bridge.apply(msg("tele", "telemetry", telemetry()))  # heard only by its telemetry: no status yet
    clock.now = T0 + 5.0  # quiet's 3 x 1 s is past; on's 3 x 10 s is not
    _, samples = scrape(bridge)
    assert totals(samples) == {"online": 1, "stale": 1, "offline": 1, "malformed": 1, "unknown": 1}
    assert value(samples, "atlas_edge_fleet_box_state", device="quiet", group="g", state="stale") == 1
    # a stale box that speaks again live is online again (fleet status's heard-live rule, over a long run)
    bridge.apply(msg("quiet", "telemetry", telemetry(ts=T0 - 100.0)))
    _, samples = scrape(bridge)
    assert value(samples, "atlas_edge_fleet_box_state", device="quiet", group="g", state="online") == 1
    assert totals(samples)["stale"] == 0


def test_a_box_is_forgotten_after_its_silence_and_comes_back(clock):
    bridge = BridgeState(PREFIX, forget_after_s=60.0, clock=clock)
    bridge.apply(msg("old", "status", status("old"), retain=True))
    bridge.apply(msg("live", "status", status("live")))
    clock.now = T0 + 50.0
    bridge.apply(msg("live", "telemetry", telemetry(ts=clock.now)))
    clock.now = T0 + 61.0
    _, samples = scrape(bridge)
    assert value(samples, "atlas_edge_fleet_box_info", device="old", group="g", kind="atlas-200i-a2",
                 model="shapes", version="2.0.0", backend="acl", precision="int8") is None
    assert not [k for k in samples if ("device", "old") in k[1]]
    assert value(samples, "atlas_edge_fleet_box_last_seen_seconds", device="live", group="g") == T0 + 50.0
    assert value(samples, "atlas_edge_fleet_bridge_boxes_forgotten_total") == 1
    assert sum(totals(samples).values()) == 1
    bridge.apply(msg("old", "status", status("old", ts=clock.now)))
    _, samples = scrape(bridge)
    assert value(samples, "atlas_edge_fleet_box_state", device="old", group="g", state="online") == 1


def test_memory_per_box_is_bounded(clock):
    bridge = BridgeState(PREFIX, clock=clock)
    many = {"s%03d" % i: {"frame_age_ms": {"p50": float(i), "max": 1.0}, "uri": "x" * 10000} for i in range(200)}
    bridge.apply(msg("cam-1", "status", status("cam-1", groups=["g" * 1000])))
    bridge.apply(msg("cam-1", "telemetry", telemetry(sources=many)))
    bridge.apply(msg("cam-1", "telemetry/alert", {"kind": "x", "message": "y" * 10000}))  # not mirrored
    figures, box = bridge.figures["cam-1"], bridge.view.boxes["cam-1"]
    assert len(figures.ages) == SOURCES_KEPT
    kept = {"serving": "b", "slots": {"b": dict(SLOTS["slots"]["b"], since=None)}, "last_rollback": None,
            "pending": None}
    assert slots_json(box.slots) == kept  # the serving entry only
    assert box.alerts == [] and bridge.view.identities == {}
    _, samples = scrape(bridge)
    groups = {dict(k[1]).get("group") for k in samples if "group" in dict(k[1])}
    assert groups == {"g" * LABEL_MAX}


def test_group_filter_and_a_cleared_status(clock):
    bridge = BridgeState(PREFIX, groups=["h"], clock=clock)
    bridge.apply(msg("in-h", "status", status("in-h", groups=["g", "h"])))
    bridge.apply(msg("in-g", "status", status("in-g", groups=["g"])))
    bridge.apply(msg("gone", "status", status("gone", groups=["h"]), retain=True))
    bridge.apply(msg("gone", "status", b"", retain=True))  # fleet forget: decommissioned
    _, samples = scrape(bridge)
    assert value(samples, "atlas_edge_fleet_box_state", device="in-h", group="g,h", state="online") == 1
    assert totals(samples)["online"] == 1
    assert "gone" not in bridge.view.boxes and "gone" not in bridge.figures


def test_rollout_progress_from_the_state_directory(tmp_path, clock, caplog):
    fixture = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal", "in_progress")
    for suffix in (".json", ".journal"):
        shutil.copy(os.path.join(fixture, "ro-today" + suffix), str(tmp_path))
    (tmp_path / "ro-today.report.json").write_text("{}")
    (tmp_path / "broken.json").write_text("not json")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    clock.now = os.stat(str(tmp_path / "ro-today.json")).st_mtime
    bridge = BridgeState(PREFIX, state_dir=str(tmp_path), clock=clock)
    _, samples = scrape(bridge)
    state = RolloutState.load(str(tmp_path / "ro-today.json"))
    expected = {}
    for box in state.boxes.values():
        key = str(box.outcome or box.phase)
        expected[key] = expected.get(key, 0) + 1
    got = {s: value(samples, "atlas_edge_fleet_rollout_boxes", rollout="ro-today", state=s) for s in ROLLOUT_STATES}
    assert {k: v for k, v in got.items() if v} == expected and sum(got.values()) == len(state.boxes)
    assert value(samples, "atlas_edge_fleet_rollout_status", rollout="ro-today", status=str(state.status)) == 1
    assert not [k for k in samples if ("rollout", "broken") in k[1] or ("rollout", "ro-today.report") in k[1]]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # read only
    scrape(bridge)  # an unchanged file is not read again: the damaged one is reported once, not every scrape
    assert [r.getMessage() for r in caplog.records if "broken.json" in r.getMessage()] == [
        r.getMessage() for r in caplog.records if "not read" in r.getMessage()] and len(
        [r for r in caplog.records if "broken.json" in r.getMessage()]) == 1
    clock.now += bridge.forget_after_s + 1  # finished long ago: no longer served
    _, samples = scrape(bridge)
    assert not [k for k in samples if k[0].startswith("atlas_edge_fleet_rollout")]
