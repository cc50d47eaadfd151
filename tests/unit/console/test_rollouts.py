"""The console's rollouts (agent/console/rollouts.py, the routes of agent/console/rollout_pages.py): the form read
as ``fleet rollout`` reads its options, the preview placed by the engine's own rule, who may plan, start and
steer a rollout, and one rollout command started for real by the console, on a real Mosquitto."""

import json
import os
import time
from dataclasses import replace

import pytest

pytest.importorskip("starlette", reason="needs the [console] extra (starlette): the operator's side, not the box's")
pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the dev extra)")

from starlette.testclient import TestClient  # noqa: E402

from agent.console.accounts import Accounts  # noqa: E402
from agent.console.app import make_app  # noqa: E402
from agent.console.audit import AuditLog  # noqa: E402
from agent.console.rollouts import RolloutDesk, preview, spec_from_form  # noqa: E402
from agent.console.web import Console  # noqa: E402
from agent.fleet.link import Message  # noqa: E402
from agent.fleet.plan import RolloutError  # noqa: E402
from agent.fleet.status import FleetView  # noqa: E402
from tests.conftest import wait_for  # noqa: E402
from tests.support.console_support import PASSWORD, PREFIX, AnsweringBox, users_file, watch_on  # noqa: E402

SHA = "ab" * 32
OLD = "cd" * 32
FORM = {"group": "site-a", "bundle": "v2", "sha256": SHA.upper(), "canary": "1", "waves": "2",
        "confirm_timeout_s": "900"}


def test_the_form_is_read_as_the_rollout_command_reads_its_options():
    spec = spec_from_form(dict(FORM, max_failure_rate="0.1", rollback_on_abort="on"), "site")
    assert (spec.group, spec.bundle, spec.sha256, spec.prefix) == ("site-a", "v2", SHA, "site")
    assert (spec.canary, spec.waves, spec.max_failure_rate, spec.rollback_on_abort) == (1, 2, 0.1, True)
    assert spec.pause_after_canary is False and spec.max_failures is None  # unset: the command's defaults
    with pytest.raises(RolloutError) as refused:
        spec_from_form({"group": "site-a", "canary": "one", "max_failure_rate": "lots"}, "site")
    assert str(refused.value) == ("bundle is required; sha256 is required; canary: 'one' is not a whole number; "
                                  "max_failure_rate: 'lots' is not a number")
    with pytest.raises(RolloutError, match="--sha256 must be 64 hex digits"):
        spec_from_form(dict(FORM, sha256="beef"), "site")
    with pytest.raises(RolloutError, match="--archive-sha256 is required for a URL bundle"):
        spec_from_form(dict(FORM, bundle="https://artifacts.lan/v2.tar.gz"), "site")


def _status(device, groups, state="online", sha=OLD, **fields):
    slots = {"serving": "a", "slots": {"a": {"name": "m", "version": "1", "manifest_sha256": sha,
                                             "state": "confirmed"}}}
    body = dict(fields, state=state, device_id=device, device=device, device_kind="cpu-dev", ts=time.time(),
                groups=groups, slots=slots)
    return Message("site/%s/status" % device, json.dumps(body).encode(), False)


def test_the_preview_places_each_box_as_the_engine_would_and_plans_its_waves():
    view = FleetView("site")
    for index in range(5):
        view.apply(_status("cam-%d" % index, ["site-a"]))
    view.apply(_status("cam-there", ["site-a"], sha=SHA))
    view.apply(_status("cam-off", ["site-a"], state="offline"))
    view.apply(_status("cam-other", ["site-b"]))
    plan = preview(view, spec_from_form(FORM, "site"))
    assert plan["boxes"] == 7  # of the group; the other group's box is not counted
    assert [(w["size"], w["canary"]) for w in plan["waves"]] == [(1, True), (2, False), (2, False)]
    assert sum((w["devices"] for w in plan["waves"]), []) == ["cam-%d" % i for i in range(5)]
    assert plan["left_out"] == {"already": ["cam-there"], "offline": ["cam-off"]}
    waiting = preview(view, replace(spec_from_form(dict(FORM, waves="1"), "site"), wait_offline_s=60.0))
    assert waiting["waves"][-1]["devices"] == ["cam-off"] and "offline" not in waiting["left_out"]


@pytest.fixture
def rig(mosquitto, tmp_path):
    boxes = [AnsweringBox(mosquitto, "cam-a1", ["site-a"], model="demo 1.0.0", device_kind="cpu-dev"),
             AnsweringBox(mosquitto, "cam-b1", ["site-b"], model="demo 1.0.0", device_kind="cpu-dev")]
    watch = watch_on(mosquitto)
    assert wait_for(lambda: len(watch.view.boxes) == 2, 10)
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    desk = RolloutDesk(str(tmp_path / "rollouts"), PREFIX, ["--broker", mosquitto.url], {})
    console = Console(watch, Accounts.load(users_file(str(tmp_path))), audit, rollouts=desk)
    client = TestClient(make_app(console), base_url="http://127.0.0.1")
    try:
        yield client, boxes, desk, str(tmp_path / "audit.jsonl")
    finally:
        client.close()
        watch.stop()
        audit.close()
        for box in boxes:
            box.close()


def login(client, name):
    answer = client.post("/login", data={"username": name, "password": PASSWORD}, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    page = client.get("/rollouts").text
    return page.split('data-csrf="')[1].split('"')[0]


def test_a_viewer_sees_no_form_and_every_rollout_change_is_refused(rig):
    client, boxes, desk, _audit = rig
    for path in ("/rollouts/plan", "/rollouts/start", "/rollouts/ro-x/pause"):
        assert client.post(path, data=dict(FORM)).status_code == 401, path  # logged out
    assert client.get("/api/rollouts").status_code == 401 and client.get("/live/rollouts/ro-x").status_code == 401
    csrf = login(client, "vic")
    page = client.get("/rollouts").text
    assert 'id="rollout-form"' not in page and "no rollout yet" in page
    for path in ("/rollouts/plan", "/rollouts/start"):
        assert client.post(path, data=dict(FORM, csrf=csrf)).status_code == 403, path
    assert client.post("/rollouts/ro-x/pause", headers={"X-CSRF-Token": csrf}).status_code == 403
    assert desk.rollouts() == [] and all(box.received == [] for box in boxes)


def test_a_request_without_the_csrf_token_and_an_operator_of_another_group_are_refused(rig):
    client, boxes, desk, audit = rig
    csrf = login(client, "olga")
    assert client.post("/rollouts/plan", data=dict(FORM)).status_code == 403
    assert client.post("/rollouts/start", data=dict(FORM, csrf="wrong")).status_code == 403
    client.post("/logout", data={"csrf": csrf})
    csrf = login(client, "lim")  # an operator of site-b only
    assert 'id="rollout-form"' in client.get("/rollouts").text
    assert client.post("/rollouts/start", data=dict(FORM, csrf=csrf)).status_code == 403
    assert desk.rollouts() == [] and all(box.received == [] for box in boxes)
    refusals = [json.loads(line)["result"] for line in open(audit) if "refused" in line]
    assert refusals == ["refused: no valid CSRF token"] * 2 + ["refused: role operator"]


def test_the_review_page_shows_the_plan_and_a_bad_form_is_refused_naming_the_field(rig):
    client, boxes, desk, _audit = rig
    csrf = login(client, "olga")
    bad = client.post("/rollouts/plan", data=dict(FORM, csrf=csrf, sha256="beef", canary="x"))
    assert bad.status_code == 400 and "canary: &#39;x&#39; is not a whole number" in bad.text
    assert 'value="v2"' in bad.text  # the form keeps what was typed
    page = client.post("/rollouts/plan", data=dict(FORM, csrf=csrf))
    assert page.status_code == 200 and 'id="confirm-start"' in page.text
    assert 'id="c-group">site-a<' in page.text and SHA in page.text
    assert "canary: 1 box(es): cam-a1" in page.text and "cam-b1" not in page.text
    assert desk.rollouts() == [] and all(box.received == [] for box in boxes)  # nothing started, nothing sent


def test_a_started_rollout_runs_as_the_rollout_command_and_its_page_follows_it(rig):
    client, boxes, desk, audit = rig
    csrf = login(client, "olga")
    # The box answers the deploy "succeeded" with an empty result (no manifest): malformed, so the canary failed
    answer = client.post("/rollouts/start", data=dict(FORM, csrf=csrf, rollout_id="ro-t"),
                         follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/rollouts/ro-t"
    assert wait_for(lambda: client.get("/api/rollouts/ro-t").json()["run"]["code"] is not None, 60), \
        client.get("/api/rollouts/ro-t").json()
    detail = client.get("/api/rollouts/ro-t").json()
    assert detail["status"] == "aborted" and detail["counts"] == {"malformed": 1, "not_targeted": 1}
    assert [[b["device"] for b in w["boxes"]] for w in detail["waves"]] == [["cam-a1"]]
    assert [b["state"] for b in detail["waves"][0]["boxes"]] == ["malformed"]
    assert any("ABORT in wave 1" in line for line in detail["log"]), detail["log"]
    assert "olga starts fleet rollout" in detail["log"][0]
    assert [r["verb"] for r in boxes[0].received] == ["deploy"] and boxes[1].received == []
    assert detail["actions"] == ["revert"] and detail["run"]["code"] == 1  # aborted: exit 1
    page = client.get("/rollouts/ro-t").text
    assert 'id="action-revert"' in page and 'id="action-pause" hidden' in page
    again = client.post("/rollouts/start", data=dict(FORM, csrf=csrf, rollout_id="ro-t"))
    assert again.status_code == 400 and "rollout ro-t exists already" in again.text
    refused = client.post("/rollouts/ro-t/pause", headers={"X-CSRF-Token": csrf})
    assert refused.status_code == 409
    assert "pause is not possible now (the rollout is aborted)" in refused.json()["error"]
    starts = [json.loads(line) for line in open(audit) if '"rollout start"' in line]
    assert [(s["user"], s["target"], s["result"]) for s in starts] == [("olga", "ro-t", "started"),
                                                                      ("olga", None, "refused")]
    client.post("/logout", data={"csrf": csrf})
    csrf = login(client, "vic")
    page = client.get("/rollouts/ro-t").text
    assert "ABORT in wave 1" in page and "rollout-action" not in page  # a viewer sees it all, and no button
    assert client.post("/rollouts/ro-t/revert", headers={"X-CSRF-Token": csrf}).status_code == 403


def test_the_rollout_commands_get_the_consoles_broker_options_and_its_password_only_in_their_environment():
    import argparse

    from agent.cli.console import PASSWORD_ENV, add_arguments, rollout_desk

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--users", "u.json", "--broker", "mqtt://a:1883", "--broker", "mqtt://b:1883",
                              "--username", "ops", "--password", "s3cret pass", "--tls-ca", "ca.pem", "--ttl", "30",
                              "--state-dir", "/srv/rollouts", "--prefix", "site"])
    desk = rollout_desk(args)
    assert desk.link_args[:8] == ["--broker", "mqtt://a:1883", "--broker", "mqtt://b:1883", "--username", "ops",
                                  "--password", "env:" + PASSWORD_ENV]
    assert "s3cret pass" not in " ".join(desk.link_args) and desk.env == {PASSWORD_ENV: "s3cret pass"}
    assert desk.link_args[8:] == ["--tls-ca", os.path.abspath("ca.pem"), "--ttl", "30.0"]
    assert (desk.state_dir, desk.prefix) == ("/srv/rollouts", "site")


def test_every_state_changing_endpoint_refuses_a_viewer_a_missing_csrf_token_and_no_session(rig):
    """Every POST route of the app (a new one joins this test by being routed), with the path parameters of a
    real box and a real rollout id: logged out 401, without or with a wrong CSRF token 403, a viewer 403."""
    client, boxes, desk, _audit = rig
    posts = sorted(route.path for route in client.app.routes if "POST" in (getattr(route, "methods", None) or ())
                   and route.path not in ("/login", "/logout"))  # before a session; a viewer may log out
    assert {"/box/{device}/command", "/rollouts/plan", "/rollouts/start", "/rollouts/{rollout}/{action}"} <= \
        set(posts), posts
    concrete = [p.replace("{device}", "cam-a1").replace("{rollout}", "ro-x").replace("{action}", "cancel")
                for p in posts]
    body = dict(FORM)
    for path in concrete:
        assert client.post(path, data=body).status_code == 401, path
    csrf = login(client, "olga")
    for path in concrete:
        assert client.post(path, data=body).status_code == 403, path
        assert client.post(path, data=dict(body, csrf="not-it"), headers={"X-CSRF-Token": "not-it"}).status_code \
            == 403, path
    client.post("/logout", data={"csrf": csrf})
    csrf = login(client, "vic")
    for path in concrete:
        assert client.post(path, data=dict(body, csrf=csrf), headers={"X-CSRF-Token": csrf}).status_code == 403, path
    assert desk.rollouts() == [] and all(box.received == [] for box in boxes)
