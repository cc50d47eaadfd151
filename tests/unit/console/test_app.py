"""The console's web application (agent/console/app.py) through Starlette's TestClient, on a real Mosquitto with
boxes that publish statuses and answer commands: who may see and do what, CSRF, escaping of a hostile box's
strings, the snapshot's type check, the audit log."""

import json
import time

import pytest

pytest.importorskip("starlette", reason="needs the [console] extra (starlette): the operator's side, not the box's")
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the dev extra)")

from starlette.testclient import TestClient  # noqa: E402

from agent.console.accounts import Accounts  # noqa: E402
from agent.console.app import make_app  # noqa: E402
from agent.console.audit import AuditLog  # noqa: E402
from agent.console.sessions import LOGIN_FAILURES  # noqa: E402
from agent.console.web import CSP, Console  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.support.console_support import PASSWORD, AnsweringBox, users_file, watch_on  # noqa: E402

HOSTILE = "<img src=x onerror=alert(1)>"


@pytest.fixture
def rig(mosquitto, tmp_path):
    boxes = [AnsweringBox(mosquitto, "cam-a1", ["site-a"], model="demo 1.0.0", device_kind="cpu-dev",
                          answers={"status": {"ok": True}}),
             AnsweringBox(mosquitto, "cam-b1", ["site-b"], model="demo 1.0.0", device_kind="cpu-dev"),
             AnsweringBox(mosquitto, HOSTILE, ["site-b"], model="<script>alert(2)</script>",
                          device_kind="javascript:alert(3)")]
    watch = watch_on(mosquitto)
    assert wait_for(lambda: len(watch.view.boxes) == 3, 10)
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    console = Console(watch, Accounts.load(users_file(str(tmp_path))), audit)
    client = TestClient(make_app(console), base_url="http://127.0.0.1")
    try:
        yield client, boxes, console, str(tmp_path / "audit.jsonl")
    finally:
        client.close()
        watch.stop()
        audit.close()
        for box in boxes:
            box.close()


def login(client, name):
    answer = client.post("/login", data={"username": name, "password": PASSWORD}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return client.get("/api/box/cam-a1").json() and _csrf(client)


def _csrf(client):
    page = client.get("/").text
    return page.split('data-csrf="')[1].split('"')[0]


def audit_lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def test_logged_out_requests_are_redirected_or_401_and_change_nothing(rig):
    client, boxes, _console, _audit = rig
    assert client.get("/", follow_redirects=False).headers["location"] == "/login"
    assert client.get("/box/cam-a1", follow_redirects=False).status_code == 303
    for path in ("/api/fleet", "/api/box/cam-a1", "/live", "/box/cam-a1/picture/cam"):
        assert client.get(path).status_code == 401, path
    answer = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}})
    assert answer.status_code == 401
    assert boxes[0].received == []


def test_a_wrong_password_is_refused_and_repeated_failures_are_throttled(rig):
    client, _boxes, _console, audit = rig
    for _ in range(LOGIN_FAILURES):
        answer = client.post("/login", data={"username": "olga", "password": "wrong password!"})
        assert answer.status_code == 401 and "wrong user name or password" in answer.text
    answer = client.post("/login", data={"username": "olga", "password": PASSWORD})
    assert answer.status_code == 429 and "try again in" in answer.text
    results = [line["result"] for line in audit_lines(audit) if line["action"] == "login"]
    assert results == ["failed"] * LOGIN_FAILURES + ["throttled"]
    assert all(PASSWORD not in json.dumps(line) for line in audit_lines(audit))


def test_the_session_cookie_is_httponly_and_samesite_strict_and_no_secret_reaches_the_page(rig):
    client, _boxes, _console, _audit = rig
    answer = client.post("/login", data={"username": "olga", "password": PASSWORD}, follow_redirects=False)
    cookie = answer.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "secure" not in cookie
    page = client.get("/").text
    assert PASSWORD not in page and "$argon2" not in page
    assert client.get("/").headers["content-security-policy"] == CSP and "'unsafe-inline'" not in CSP


def test_an_operator_sends_a_command_with_its_csrf_token_and_the_box_answers(rig):
    client, boxes, _console, audit = rig
    csrf = login(client, "olga")
    refused = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}})
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
    wrong = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}}, headers={"X-CSRF-Token": "x"})
    assert wrong.status_code == 403 and boxes[0].received == []
    answer = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}},
                         headers={"X-CSRF-Token": csrf})
    assert answer.status_code == 200 and answer.json()["state"] == "succeeded"
    assert answer.json()["result"] == {"ok": True}
    assert [r["verb"] for r in boxes[0].received] == ["status"]
    log = client.get("/api/box/cam-a1").json()["commands"]
    assert [(c["user"], c["verb"], c["state"]) for c in log] == [("olga", "status", "succeeded")]
    commands = [line for line in audit_lines(audit) if line["action"] == "command"]
    assert [(c["user"], c["target"], c["result"]) for c in commands] == [("olga", "cam-a1", "succeeded")]


def test_a_bad_verb_or_field_is_refused_by_the_console_and_nothing_is_sent(rig):
    client, boxes, _console, _audit = rig
    csrf = login(client, "olga")
    answer = client.post("/box/cam-a1/command", json={"verb": "deploy", "fields": {}},
                         headers={"X-CSRF-Token": csrf})
    assert answer.status_code == 400 and "verb must be one of" in answer.json()["error"]
    answer = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {"bundel": "x"}},
                         headers={"X-CSRF-Token": csrf})
    assert answer.status_code == 400 and "bundel" in answer.json()["error"]
    time.sleep(0.3)
    assert boxes[0].received == []


def test_a_viewer_sees_no_buttons_and_every_change_is_403(rig):
    client, boxes, _console, audit = rig
    csrf = login(client, "vic")
    page = client.get("/box/cam-a1").text
    assert "verb-status" not in page and 'class="verb"' not in page
    answer = client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}},
                         headers={"X-CSRF-Token": csrf})
    assert answer.status_code == 403 and "role" in answer.json()["error"]
    assert boxes[0].received == []
    assert [line["result"] for line in audit_lines(audit) if line["user"] == "vic" and line["action"] != "login"] \
        == ["refused: role viewer"]


def test_an_operator_limited_to_a_group_commands_only_its_boxes(rig):
    client, boxes, _console, _audit = rig
    csrf = login(client, "lim")
    assert 'class="verb"' not in client.get("/box/cam-a1").text
    assert 'class="verb"' in client.get("/box/cam-b1").text
    assert client.post("/box/cam-a1/command", json={"verb": "status", "fields": {}},
                       headers={"X-CSRF-Token": csrf}).status_code == 403
    assert client.post("/box/cam-b1/command", json={"verb": "status", "fields": {}},
                       headers={"X-CSRF-Token": csrf}).json()["state"] == "succeeded"
    assert boxes[0].received == [] and len(boxes[1].received) == 1


def test_a_hostile_boxs_strings_are_escaped_in_pages_and_json(rig):
    client, boxes, console, _audit = rig
    boxes[2].alert({"kind": "<script>alert(4)</script>", "message": "<img src=y onerror=alert(5)>", "ts": time.time()})
    assert wait_for(lambda: console.watch.view.boxes[HOSTILE].alerts, 10)
    login(client, "olga")
    fleet = client.get("/").text
    assert "&lt;img src=x onerror=alert(1)&gt;" in fleet and HOSTILE not in fleet
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in fleet and "<script>alert" not in fleet
    box = client.get("/box/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E").text
    assert "&lt;img src=y onerror=alert(5)&gt;" in box and "<img src=y" not in box
    assert "javascript:alert(3)" in box and 'href="javascript' not in box


def test_the_sources_health_of_a_boxs_telemetry_is_shown_on_the_fleet_and_box_pages(rig):
    client, boxes, console, _audit = rig
    boxes[2].telemetry({"ts": time.time(), "fps": 4.0, "sources": {
        "gate": {"state": "up", "fps_in": 4.0, "last_error": None},
        HOSTILE: {"state": "stalled", "fps_in": 0.0, "last_error": {"cause": "stalled",
                                                                   "message": "<script>alert(7)</script>"}}}})
    boxes[0].telemetry({"ts": time.time(), "fps": 2.0, "sources": {"cam": {"state": "up", "fps_in": 2.0}}})
    assert wait_for(lambda: len(console.watch.view.boxes[HOSTILE].sources) == 2 and console.watch.view.boxes[
        "cam-a1"].sources, 10)
    login(client, "vic")
    rows = {r["device"]: r for r in client.get("/api/fleet").json()["rows"]}
    assert (rows[HOSTILE]["sources"], rows[HOSTILE]["sources_ok"]) == ("1 up, 1 stalled", False)
    assert (rows["cam-a1"]["sources"], rows["cam-a1"]["sources_ok"]) == ("1 up", True)
    assert rows["cam-b1"]["sources"] == "-"  # no telemetry heard from it
    assert "<script>alert(7)</script>" in rows[HOSTILE]["sources_note"]
    fleet = client.get("/").text
    assert "sources-bad" in fleet and "1 up, 1 stalled" in fleet and "<script>alert(7)" not in fleet
    page = client.get("/box/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E").text
    assert 'class="camera-stalled"' in page and "&lt;script&gt;alert(7)&lt;/script&gt;" in page
    assert "<script>alert(7)" not in page and "<img src=x" not in page
    cameras = client.get("/api/box/cam-a1").json()["cameras"]
    assert cameras == [{"name": "cam", "state": "up", "fps_in": 2.0, "error": None}]


def test_a_snapshot_is_served_as_a_jpeg_only_and_a_huge_one_is_not_kept(rig):
    client, boxes, console, _audit = rig
    login(client, "olga")
    console.watch.watch_box("cam-a1")
    boxes[0].snapshot("cam", b"\xff\xd8\xff\xe0 a jpeg body")
    boxes[0].snapshot("html", b"<html><script>alert(6)</script></html>")
    assert wait_for(lambda: len(console.watch.feed("cam-a1").snapshots) == 2, 10)
    jpeg = client.get("/box/cam-a1/picture/cam")
    assert jpeg.status_code == 200 and jpeg.headers["content-type"] == "image/jpeg"
    assert jpeg.headers["x-content-type-options"] == "nosniff"
    assert client.get("/box/cam-a1/picture/html").status_code == 415
    from agent.console.watch import SNAPSHOT_MAX_BYTES

    boxes[0].snapshot("big", b"\xff\xd8\xff" + b"0" * SNAPSHOT_MAX_BYTES)
    assert wait_for(lambda: console.watch.feed("cam-a1").refused_snapshot, 10)
    assert "big" not in console.watch.feed("cam-a1").snapshots
    assert client.get("/box/cam-a1/picture/big").status_code == 404


def test_the_fleet_pages_and_filters_by_group_state_and_id(rig):
    client, boxes, console, _audit = rig
    login(client, "vic")
    assert client.get("/api/fleet").json()["total"] == 3
    assert [r["device"] for r in client.get("/api/fleet?group=site-b&q=cam").json()["rows"]] == ["cam-b1"]
    boxes[1].publish_status("offline", reason="stopped")
    assert wait_for(lambda: client.get("/api/fleet?state=offline").json()["total"] == 1, 10)


def test_logout_ends_the_session_and_needs_its_csrf_token(rig):
    client, _boxes, _console, audit = rig
    csrf = login(client, "olga")
    assert client.post("/logout", data={"csrf": "wrong"}).status_code == 403
    answer = client.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/login"
    assert client.get("/api/fleet").status_code == 401
    assert [line["action"] for line in audit_lines(audit)][-1] == "logout"


def test_a_box_page_shows_its_slots_and_its_last_rollback(rig):
    client, boxes, console, _audit = rig
    slots = {"serving": "a", "slots": {
        "a": {"name": "demo", "version": "1.0.0", "manifest_sha256": "a" * 64, "state": "confirmed"},
        "b": {"name": "demo", "version": "1.1.0", "manifest_sha256": "b" * 64, "state": "standby"}},
        "last_rollback": {"name": "demo", "version": "1.1.0", "manifest_sha256": "b" * 64,
                          "reason": "<b>golden</b> failed", "at": "2026-12-04T10:00:00Z"}}
    boxes[0].publish_status("online", slots=slots)
    assert wait_for(lambda: console.watch.view.boxes["cam-a1"].slots is not None, 10)
    login(client, "vic")
    detail = client.get("/api/box/cam-a1").json()
    assert detail["slots"]["b"] == {"version": "1.1.0", "state": "standby", "sha256": "b" * 64}
    assert detail["last_rollback"] == "demo 1.1.0 rolled back at 2026-12-04T10:00:00Z: <b>golden</b> failed"
    page = client.get("/box/cam-a1").text
    assert "a (serving)" in page and "&lt;b&gt;golden&lt;/b&gt; failed" in page and "<b>golden" not in page
