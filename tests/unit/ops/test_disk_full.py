"""Issue 16's acceptance test: the outbox on a real 3 MB tmpfs, the disk full while the broker is away, then
space and broker back. Needs root (``mount -t tmpfs``) and Mosquitto; skips naming what is missing."""

import errno
import logging
import os
import subprocess
import time
from typing import Any, Dict, List, Tuple

import pytest
from conftest import WAIT_S, wait_for

from agent.config.mqtt_config import MqttConfig
from agent.ops.outbox import Outbox
from agent.ops.outbox_budget import DISK_FULL, MIN_RESERVE_BYTES
from agent.ops.transport import LOST, OUTBOXED, SENT, MqttTransport
from tests.support.outbox_support import distinct_deliveries

DEVICE = "cam-disk"
SOURCES = ("front", "back")
FILLER_BYTES = 1024 * 1024  # other files on the box's small disk
PADDING = "x" * 400  # a result of ~450 bytes, like a few detections
PUBLISHED_WHILE_AWAY = 4000  # per source: ~3.6 MB in all, more than the 3 MB disk
LIVE_AFTER = 100  # per source, after recovery
# Log lines (WARNING and above, from agent.*) allowed for the whole episode. The reconnect attempts while the
# broker is away are the supervisor's one line per attempt and are not counted here; everything the disk
# and the outbox say is, and it must not grow with the number of messages (8 000 here).
LOG_LINE_BOUND = 25


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        pytest.skip("needs a 3 MB tmpfs: `mount -t tmpfs` was refused (%s); run as root or with CAP_SYS_ADMIN"
                    % done.stdout.decode(errors="replace").strip())
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_to_the_brim(path: str) -> int:
    """Write zeros until the file system says ENOSPC; returns the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as handle:  # unbuffered: close() has nothing left to fail on
        try:
            while True:
                written += handle.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return written


def test_disk_full_with_the_broker_away_then_space_and_broker_back(small_disk, fresh_broker, probe_factory,
                                                                   caplog):
    caplog.set_level(logging.INFO)
    probe = probe_factory(fresh_broker, ["atlas-edge/%s/results/#" % DEVICE], client_id="disk-probe",
                          clean_session=False)
    alerts: List[Dict[str, Any]] = []
    # The shipped budget; the reserve scaled to a 3 MB disk (the box-wide 32 MiB would leave no room at all).
    outbox = Outbox(str(small_disk / "outbox.sqlite"), max_bytes=64 * 1024 * 1024, reserve_bytes=MIN_RESERVE_BYTES)
    config = MqttConfig(host=fresh_broker.host, port=fresh_broker.port, reconnect_min_s=0.05,
                        reconnect_max_s=0.2)
    transport = MqttTransport(config, DEVICE, outbox, replay_rate_hz=2000.0, on_alert=alerts.append)
    try:
        transport.start()
        assert wait_for(lambda: transport.connected)
        fresh_broker.stop()
        assert wait_for(lambda: not transport.connected)
        with open(str(small_disk / "filler"), "wb") as handle:
            handle.write(b"\0" * FILLER_BYTES)

        # 1. The broker is away and the disk fills: every publish returns, the oldest are dropped.
        outcomes = []
        for frame in range(PUBLISHED_WHILE_AWAY):
            for source in SOURCES:
                outcomes.append(transport.publish_result(source, {"frame": frame, "pad": PADDING}))
        assert outcomes.count(OUTBOXED) == len(outcomes) and LOST not in outcomes  # serving never stopped
        stats = transport.stats()
        assert stats["dropped_by_reason"][DISK_FULL] > 0 and stats["disk_pressure"]
        assert stats["dropped_by_reason"]["dropped_oldest"] == 0  # the configured budget was never the limit
        waiting = [(m.topic.rsplit("/", 1)[1], int(m.payload.split(b'"frame":')[1].split(b",")[0]))
                   for m in outbox.peek(100000)]
        kept: Dict[str, List[int]] = {source: [f for s, f in waiting if s == source] for source in SOURCES}
        for source in SOURCES:  # oldest first: what is left is the newest frames, contiguous, in order
            assert kept[source] == list(range(PUBLISHED_WHILE_AWAY - len(kept[source]), PUBLISHED_WHILE_AWAY))
        assert stats["dropped_by_reason"][DISK_FULL] == len(outcomes) - len(waiting)
        assert wait_for(lambda: [a["figures"].get("state") for a in alerts] == ["started"])

        # 2. The broker comes back while the disk is full to the last byte: replay must deliver each row
        #    once even where deleting it is refused.
        brim = fill_to_the_brim(str(small_disk / "brim"))
        fresh_broker.start()
        assert wait_for(lambda: transport.connected)
        began = time.monotonic()
        assert wait_for(lambda: len(outbox) == 0, timeout=60.0)
        replay_s = time.monotonic() - began  # reported below, never asserted (a shared, noisy machine)
        assert outbox.bytes > 0  # the deletes were refused (no byte free): the rows are only marked delivered
        # 3. Space comes back; then live frames flow.
        os.remove(str(small_disk / "brim"))
        os.remove(str(small_disk / "filler"))
        assert wait_for(lambda: outbox.bytes == 0)
        assert wait_for(lambda: [a["figures"].get("state") for a in alerts] == ["started", "ended"])
        live = [transport.publish_result(source, {"frame": PUBLISHED_WHILE_AWAY + i, "pad": PADDING})
                for i in range(LIVE_AFTER) for source in SOURCES]
        assert live == [SENT] * len(live)
        assert transport.flush(WAIT_S)
        expected = {source: kept[source] + list(range(PUBLISHED_WHILE_AWAY, PUBLISHED_WHILE_AWAY + LIVE_AFTER))
                    for source in SOURCES}
        total = sum(len(frames) for frames in expected.values())
        assert wait_for(lambda: len(distinct_deliveries(probe)) >= total)
        time.sleep(0.5)  # a duplicate would arrive after the originals: give it the chance to show
        got = distinct_deliveries(probe)
        for source in SOURCES:  # every stored result once, in order, then the live ones
            frames = [m["frame"] for topic, m in got if topic.endswith("/" + source)]
            assert frames == expected[source]
    finally:
        transport.stop(5.0)
        outbox.close()

    assert [(a["kind"], a["figures"]["state"]) for a in alerts] == [(DISK_FULL, "started"), (DISK_FULL, "ended")]
    assert alerts[1]["figures"]["dropped"] == stats["dropped_by_reason"][DISK_FULL]
    counted = [r for r in caplog.records if r.name.startswith("agent") and r.levelno >= logging.WARNING
               and r.name != "agent.ops.connection"]
    assert len(counted) <= LOG_LINE_BOUND, "\n".join(r.getMessage() for r in counted)
    assert any("could not delete" in r.getMessage() for r in counted)  # phase 2 did meet refused deletes
    report: Tuple[Any, ...] = (len(outcomes), stats["dropped_by_reason"][DISK_FULL], len(waiting),
                               len(waiting) / max(replay_s, 1e-9), brim, len(counted), len(alerts))
    print("\npublished %d while away; dropped %d disk_full; %d replayed at %.0f/s; brim %d bytes; %d log lines;"
          " %d alerts" % report)
