"""The shipped units and install.sh under a real systemd 252: each behaviour asserted from what systemd and the
broker report (``systemctl show``, ``journalctl``, ``mosquitto_sub``), not from the daemon's own word.

The tests share one container (tests/system/systemd/conftest.py) and run in file order; each leaves its unit
running or stopped as it says.
"""

import re
import time

from tests.system.systemd.conftest import daemon_config

MAIN = "atlas-edge.service"


def active(box, unit: str) -> bool:
    return box.c.show(unit, "ActiveState")["ActiveState"] == "active"


def start(box, unit: str) -> None:
    box.c.run("systemctl start %s" % unit, timeout=240)  # Type=notify: returns once READY=1 came
    props = box.c.show(unit, "ActiveState", "SubState", "Type")
    assert props == {"ActiveState": "active", "SubState": "running", "Type": "notify"}


def test_install_put_the_units_and_root_only_credentials_in_place(box):
    listed = box.c.run("systemctl list-unit-files 'atlas-edge*' --no-legend")
    assert re.search(r"^atlas-edge\.service\s", listed, re.M) and re.search(r"^atlas-edge@\.service\s", listed,
                                                                            re.M)
    modes = box.c.run("stat -c '%a %U %n' /etc/atlas-edge /etc/atlas-edge/mqtt-password "
                      "/etc/atlas-edge/1/mqtt-password /etc/atlas-edge/atlas-edge.env").splitlines()
    assert modes == ["750 root /etc/atlas-edge", "600 root /etc/atlas-edge/mqtt-password",
                     "600 root /etc/atlas-edge/1/mqtt-password", "600 root /etc/atlas-edge/atlas-edge.env"]
    assert box.c.run("/opt/atlas-edge/venv/bin/python -c 'import agent; print(agent.__file__)'").startswith(
        "/opt/atlas-edge/venv/lib/python3")


def test_ready_is_reached_and_results_reach_the_broker(box):
    cursor = box.c.cursor(MAIN)
    start(box, MAIN)
    results = box.results("box-main", 3)
    assert len(results) == 3 and all("detections" in r for r in results)
    journal = box.c.journal(MAIN, cursor)
    assert "Started atlas-edge.service" in journal or "Started atlas-edge inference daemon" in journal
    status = box.c.show(MAIN, "StatusText", "MainPID")
    assert int(status["MainPID"]) > 0 and status["StatusText"]


def test_the_password_came_through_load_credential(box):
    """The broker refuses anonymous clients: serving proves the password reached the daemon, and it came from
    systemd's credential directory (a private ramfs copy of the root-only file), not the config."""
    pid = box.c.show(MAIN, "MainPID")["MainPID"]
    environ = box.c.run("tr '\\0' '\\n' < /proc/%s/environ" % pid)
    [directory] = [line.split("=", 1)[1] for line in environ.splitlines() if line.startswith("CREDENTIALS_DIRECTORY=")]
    assert directory == "/run/credentials/atlas-edge.service"
    assert box.c.run("stat -c '%%a %%U' %s/mqtt-password" % directory).split() == ["400", "atlas-edge"]
    assert box.c.run("cat %s/mqtt-password" % directory).strip() == "box-main-secret"
    assert box.c.run("findmnt -n -o FSTYPE,OPTIONS %s" % directory).split()[0] in ("ramfs", "tmpfs")
    assert "password: cred:mqtt-password" in box.c.run("grep password /etc/atlas-edge/config.yaml").replace('"', "")
    refused = box.c.run_status("mosquitto_sub -h 127.0.0.1 -t '#' -C 1 -W 3")
    assert refused.returncode != 0  # anonymous: not authorised


def test_reload_applies_a_threshold_change(box):
    scores = [d["score"] for r in box.results("box-main", 6) for d in r["detections"]]
    assert [s for s in scores if s < 0.95], scores  # at conf 0.3 the frames give detections the change will drop
    cursor = box.c.cursor(MAIN)
    box.c.write("/etc/atlas-edge/config.yaml", daemon_config("box-main", conf=0.95))
    box.c.run("systemctl reload %s" % MAIN, timeout=60)
    box.c.wait_until("the SIGHUP reload logged", lambda: "config reloaded" in box.c.journal(MAIN, cursor))
    # READY=1 (sent before that log line) ends "reloading"; systemd reads the notify socket on its own time
    box.c.wait_until("the unit active again after the reload", lambda: active(box, MAIN))
    assert box.c.show(MAIN, "NRestarts")["NRestarts"] == "0"
    # results published after the reload carry no detection under the new threshold
    later = box.results("box-main", 6)[-3:]
    assert all(d["score"] >= 0.95 for r in later for d in r["detections"])


def test_a_set_config_survives_a_restart(box):
    ack = box.ctl("box-main", "set-config", {"config": {"thresholds": {"conf": 0.6}}})
    assert ack["state"] == "succeeded", ack
    before = box.c.show(MAIN, "MainPID")["MainPID"]
    box.c.run("systemctl restart %s" % MAIN, timeout=240)
    assert box.c.show(MAIN, "MainPID")["MainPID"] != before and active(box, MAIN)
    status = box.ctl("box-main", "status", {})
    assert status["state"] == "succeeded", status
    assert overridden_conf(status["result"]["overrides"]["values"]) == 0.6, status["result"]["overrides"]
    # and validate, reading the file (conf 0.95) and the state directory's overrides as run does, agrees
    validate = box.c.run("/opt/atlas-edge/venv/bin/atlas-edge validate /etc/atlas-edge/config.yaml")
    [line] = [line.split() for line in validate.splitlines() if line.split()[1:2] == ["thresholds.conf"]]
    assert line[:3] == ["*", "thresholds.conf", "0.6"], validate  # "*": the value comes from the overrides


def overridden_conf(values: dict) -> float:
    """thresholds.conf in an overrides report, whether keyed by section or by dotted path."""
    if "thresholds.conf" in values:
        return values["thresholds.conf"]
    return values["thresholds"]["conf"]


def test_a_hung_daemon_is_killed_by_the_watchdog_and_restarted(box):
    before = box.c.show(MAIN, "MainPID", "NRestarts", "WatchdogUSec")
    assert before["WatchdogUSec"] == "30s"
    cursor = box.c.cursor(MAIN)
    box.c.run("kill -STOP %s" % before["MainPID"])
    box.c.wait_until("a restart after the watchdog", lambda: int(box.c.show(MAIN, "NRestarts")["NRestarts"])
                     > int(before["NRestarts"]) and active(box, MAIN), timeout=120)
    journal = box.c.journal(MAIN, cursor)
    assert "Watchdog timeout" in journal and "SIGABRT" in journal, journal[-3000:]
    assert box.c.show(MAIN, "MainPID")["MainPID"] != before["MainPID"]
    assert len(box.results("box-main", 2)) == 2


def test_every_file_the_daemons_write_lies_under_their_state_directory(box):
    outside = files_written_outside(box, "/var/lib/atlas-edge")
    assert outside == [], outside
    assert box.c.run("find /var/lib/atlas-edge -user atlas-edge -type f | head -1").strip()  # the check sees files


def files_written_outside(box, allowed: str) -> list:
    """Files owned by the daemon's user anywhere but ``allowed``, less the kernel's trees and the credentials
    systemd itself hands to the user (/run/credentials, a ramfs that goes with the service)."""
    out = box.c.run("find / \\( -path /proc -o -path /sys -o -path /dev -o -path /run/credentials \\) -prune -o "
                    "-user atlas-edge -type f -print")
    return [path for path in out.splitlines() if path and not path.startswith(allowed + "/")]


def test_stop_ends_within_timeout_stop_sec_with_offline_on_the_broker(box):
    limit = box.c.show(MAIN, "TimeoutStopUSec")["TimeoutStopUSec"]
    assert limit == "30s"
    began = time.monotonic()
    box.c.run("systemctl stop %s" % MAIN, timeout=120)
    took = time.monotonic() - began
    props = box.c.show(MAIN, "ActiveState", "Result", "ExecMainStatus")
    assert props == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, props
    assert took < 30, "systemctl stop took %.1f s" % took  # systemd would have killed it at 30 s (Result=timeout)
    assert box.retained_status("box-main")["state"] == "offline"


def test_a_bad_config_exits_78_and_is_not_restarted(box):
    box.c.write("/etc/atlas-edge/config.yaml", daemon_config("box-main").replace('"max_fps": 4', '"max_fps": -1'))
    box.c.run_status("systemctl start %s" % MAIN, timeout=120)
    props = box.c.show(MAIN, "ActiveState", "SubState", "ExecMainStatus", "Result", "StatusText")
    # SubState would be auto-restart if systemd meant to try again: RestartPreventExitStatus=78 holds it
    assert props["ExecMainStatus"] == "78" and props["SubState"] == "failed", props
    assert props["ActiveState"] == "failed" and "sources[0].max_fps" in props["StatusText"]
    assert "cannot start" in box.c.journal(MAIN)
    box.c.write("/etc/atlas-edge/config.yaml", daemon_config("box-main", conf=0.6))
    box.c.run("systemctl reset-failed %s" % MAIN)


def test_install_again_upgrades_in_place_and_keeps_config_credentials_and_state(box):
    kept = "/etc/atlas-edge/config.yaml /etc/atlas-edge/mqtt-password /var/lib/atlas-edge/overrides.json"
    before = box.c.run("sha256sum %s; find /var/lib/atlas-edge -type f | sort | xargs sha256sum" % kept)
    venv_before = box.c.run("stat -c %Y /opt/atlas-edge/venv/lib/python3*/site-packages/agent/__init__.py")
    out = box.install()
    assert "= /etc/atlas-edge/mqtt-password exists: kept" in out and "= venv /opt/atlas-edge/venv exists" in out
    assert box.c.run("sha256sum %s; find /var/lib/atlas-edge -type f | sort | xargs sha256sum" % kept) == before
    assert box.c.run("stat -c %Y /opt/atlas-edge/venv/lib/python3*/site-packages/agent/__init__.py") != venv_before
    start(box, MAIN)
    assert len(box.results("box-main", 2)) == 2
    status = box.ctl("box-main", "status", {})
    assert overridden_conf(status["result"]["overrides"]["values"]) == 0.6


def test_two_npu_instances_serve_side_by_side_and_restart_independently(box):
    for unit in ("atlas-edge@1.service", "atlas-edge@2.service"):
        start(box, unit)
    for device_id in ("box-npu1", "box-npu2"):
        assert len(box.results(device_id, 2)) == 2
    one, two = (box.c.show(u, "MainPID", "NRestarts", "StateDirectory", "DeviceAllow", "Environment")
                for u in ("atlas-edge@1.service", "atlas-edge@2.service"))
    assert one["StateDirectory"] == "atlas-edge/1" and two["StateDirectory"] == "atlas-edge/2"
    assert "/dev/davinci1 rw" in one["DeviceAllow"] and "/dev/davinci2 rw" in two["DeviceAllow"]
    assert "ASCEND_RT_VISIBLE_DEVICES=1" in one["Environment"]
    box.c.run("systemctl restart atlas-edge@1.service", timeout=240)
    assert box.c.show("atlas-edge@1.service", "MainPID")["MainPID"] != one["MainPID"]
    assert box.c.show("atlas-edge@2.service", "MainPID")["MainPID"] == two["MainPID"]  # untouched
    assert len(box.results("box-npu1", 2)) == 2 and len(box.results("box-npu2", 2)) == 2
    for unit in ("atlas-edge@1.service", "atlas-edge@2.service"):
        box.c.run("systemctl stop %s" % unit, timeout=120)
    assert files_written_outside(box, "/var/lib/atlas-edge") == []
    for number in ("1", "2"):  # each instance's store in its own state directory
        assert box.c.run("find /var/lib/atlas-edge/%s -name manifest.json | head -1" % number).strip()


def test_systemd_analyze_security_inside_the_box(box):
    out = box.c.run("systemd-analyze security --no-pager atlas-edge.service atlas-edge@1.service")
    print(out)
    scores = re.findall(r"Overall exposure level for (\S+): (\d+\.\d+)", out)
    assert len(scores) == 2 and all(float(score) <= 2.0 for _unit, score in scores), scores


def test_a_unit_whose_daemon_writes_outside_its_state_directory_is_caught(box):
    """The control case: a broken drop-in (no ProtectSystem=, state in /srv) and the same check fails it."""
    box.c.write("/etc/systemd/system/atlas-edge@2.service.d/broken.conf",
                "[Service]\nProtectSystem=no\nReadWritePaths=\n")
    box.c.write("/etc/atlas-edge/2/config.yaml", daemon_config("box-npu2").replace(
        '"/var/lib/atlas-edge/2"', '"/srv/box-npu2-state"'))
    box.c.run("systemctl daemon-reload && mkdir -p /srv/box-npu2-state && chown atlas-edge /srv/box-npu2-state")
    try:
        start(box, "atlas-edge@2.service")
        outside = files_written_outside(box, "/var/lib/atlas-edge")
        assert outside and all(p.startswith("/srv/box-npu2-state/") for p in outside), outside
    finally:
        box.c.run("rm /etc/systemd/system/atlas-edge@2.service.d/broken.conf && systemctl daemon-reload && "
                  "systemctl stop atlas-edge@2.service", timeout=120)


def test_the_shipped_unit_refuses_the_same_state_directory_outside(box):
    """Without the broken drop-in, the same config cannot write there: the unit confines it (EROFS)."""
    box.c.run("rm -rf /srv/box-npu2-state/* && systemctl reset-failed atlas-edge@2.service || true")
    box.c.run_status("systemctl start atlas-edge@2.service", timeout=120)
    assert box.c.show("atlas-edge@2.service", "ActiveState")["ActiveState"] != "active"
    assert box.c.run("find /srv/box-npu2-state -type f | wc -l").strip() == "0"
    assert files_written_outside(box, "/var/lib/atlas-edge") == []
