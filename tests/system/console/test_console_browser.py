"""The web console in a real browser (Debian's Chromium through its chromedriver, driven by Selenium) against real
daemons on a real Mosquitto: log in, the fleet live, an annotated snapshot checked against the box's own result,
a viewer's page, a hostile box whose strings must not run.

``make test`` installs Chromium and chromedriver from Debian (``make chromium``); elsewhere the module is skipped
with the reason it found. With ``ATLAS_EDGE_SCREENSHOTS=DIR`` the tests save the pages they see there
(docs/console.md's pictures were taken so).
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("starlette", reason="needs the [console] extra: the operator's side, not the box's")
pytest.importorskip("selenium", reason="needs selenium (the dev extra) to drive Chromium")

from agent.cli.demo import DEMO_BUNDLE  # noqa: E402
from tests.conftest import MqttProbe, wait_for  # noqa: E402
from tests.support.console_support import PASSWORD, AnsweringBox, users_file  # noqa: E402
from tests.support.daemon_rig import start_daemon, stop_daemons, write_config  # noqa: E402
from tests.support.lifecycle_support import NOISE_PROOF_FACTOR  # noqa: E402
from tests.support.shadow_support import candidate_bundle, serving_versions  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PREFIX = "console-e2e"
DEVICES = ("cam-north", "cam-south", "cam-gate")
HOSTILE_ID = "<img src=x onerror=alert(1)>"
LIVE_S = 5.0  # the acceptance bound for a change to show on an open page, without a reload
CANDIDATES = {"v2": "1.1.0", "v3": "1.2.0"}  # bundle name in the boxes' store -> its version
ROLLED = ("cam-north", "cam-south")  # group site-a: the rollouts' boxes
PAGE_S = 30  # a bound for a page to load, or an answer to arrive, on a loaded machine; never asserted as a duration
ROLLOUT_S = 120  # a bound for a rollout of two real daemons on a loaded machine; never asserted as a duration

pytestmark = pytest.mark.skipif(not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
                                reason="needs Debian's chromium and chromium-driver (make chromium)")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fleet(mosquitto, tmp_path_factory):
    """Three real daemons serving the demo bundle on looping frame folders, and a hostile box beside them."""
    import cv2

    from agent.devtools.scenes import generate_scenes

    root = tmp_path_factory.mktemp("console-fleet")
    frames = root / "frames"
    frames.mkdir()
    for index, (image, _boxes, _ids) in enumerate(generate_scenes(7, 6, (480, 640))):
        cv2.imwrite(str(frames / ("f%02d.png" % index)), image)
    probe = MqttProbe(mosquitto, ["%s/#" % PREFIX])
    procs, shas = {}, {}
    for device in DEVICES:
        home = root / device
        home.mkdir()
        for name, version in CANDIDATES.items():  # what the rollouts deploy, in each box's incoming store
            shas[name] = candidate_bundle(DEMO_BUNDLE, str(home / "state" / "bundles" / "incoming" / name), version)
        # The box's latency rule is not under test: a loaded machine must not roll a rollout's canary back
        model = {"bundle": DEMO_BUNDLE, "observation_s": 0, "latency_regression": NOISE_PROOF_FACTOR}
        config = write_config(home, mosquitto, frames, loop=True, device_id=device, model=model,
                              mqtt={"host": mosquitto.host, "port": mosquitto.port, "prefix": PREFIX,
                                    "groups": ["site-a" if device != "cam-gate" else "site-b"],
                                    "reconnect_min_s": 0.1, "reconnect_max_s": 1.0},
                              sources=[{"name": "cam", "uri": str(frames), "loop": True, "max_fps": 4}])
        procs[device] = start_daemon(config)
    hostile = AnsweringBox(mosquitto, HOSTILE_ID, ["site-b"], prefix=PREFIX, model="<script>alert(2)</script>",
                           device_kind="javascript:alert(3)")
    try:
        assert wait_for(lambda: _online(probe) >= set(DEVICES), 120), [p.poll() for p in procs.values()]
        yield {"broker": mosquitto, "procs": procs, "probe": probe, "root": root, "hostile": hostile, "shas": shas}
    finally:
        stop_daemons(list(procs.values()))
        hostile.close()
        probe.close()


def _online(probe):
    seen = set()
    for topic, payload, _retain, _dup in list(probe.messages):
        if topic.endswith("/status") and payload and json.loads(payload).get("state") == "online":
            seen.add(topic.split("/")[-2])
    return seen


@pytest.fixture(scope="module")
def console(fleet, tmp_path_factory):
    """``atlas-edge console`` as an operator runs it, on a free port."""
    folder = tmp_path_factory.mktemp("console")
    users = users_file(str(folder))
    port = _free_port()
    broker = fleet["broker"]
    proc = subprocess.Popen([sys.executable, "-m", "agent", "console", "--users", users, "--broker",
                             "mqtt://%s:%d" % (broker.host, broker.port), "--prefix", PREFIX, "--listen",
                             "127.0.0.1:%d" % port, "--listen-s", "1", "--state-dir", str(folder / "rollouts")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = "http://127.0.0.1:%d" % port

    def up():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return proc.poll() is not None

    assert wait_for(up, 60) and proc.poll() is None, proc.stdout.read() if proc.poll() is not None else ""
    yield {"url": url, "audit": str(folder / "console-audit.jsonl")}
    proc.terminate()
    proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400",
                     "--disable-gpu"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def log_in(driver, url, name):
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(url + "/login")
    driver.find_element(By.ID, "username").send_keys(name)
    driver.find_element(By.ID, "password").send_keys(PASSWORD)
    driver.find_element(By.ID, "login").click()
    assert wait_for(lambda: driver.current_url.rstrip("/") == url, PAGE_S), driver.current_url


def rows(driver):
    """device -> {cell class: text} of the fleet table, read in one script (the page redraws its rows live)."""
    return dict(driver.execute_script(
        "return Array.from(document.querySelectorAll('#rows tr')).map(tr => [tr.dataset.device,"
        " Object.fromEntries(Array.from(tr.cells).map(td => [td.className, td.textContent.trim()]))]);"))


def screenshot(driver, name):
    folder = os.environ.get("ATLAS_EDGE_SCREENSHOTS")
    if folder:
        os.makedirs(folder, exist_ok=True)
        driver.save_screenshot(os.path.join(folder, name + ".png"))


def severe_logs(driver):
    return [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def test_the_fleet_lists_the_daemons_and_a_stopped_one_shows_offline_live(fleet, console, browser):
    log_in(browser, console["url"], "vic")
    assert wait_for(lambda: set(DEVICES) <= set(rows(browser)), PAGE_S), rows(browser)
    listed = rows(browser)
    manifest = json.load(open(os.path.join(DEMO_BUNDLE, "manifest.json")))
    for device in DEVICES:
        assert listed[device]["state"] == "online", listed[device]
        assert listed[device]["model"] == "%s %s" % (manifest["name"], manifest["version"]), listed[device]
        assert listed[device]["kind"] == "cpu-dev" and listed[device]["version"] == manifest["version"]
    screenshot(browser, "fleet")
    browser.execute_script("window.stillTheSamePage = true")
    proc = fleet["procs"]["cam-gate"]
    stopped = time.monotonic()
    proc.terminate()  # its offline status goes out as it stops; the page is not reloaded
    assert wait_for(lambda: rows(browser).get("cam-gate", {}).get("state") == "offline", LIVE_S, interval=0.1), \
        rows(browser).get("cam-gate")
    print("offline on the open page %.2f s after the daemon was told to stop" % (time.monotonic() - stopped))
    proc.communicate(timeout=30)
    assert browser.execute_script("return window.stillTheSamePage === true")  # no reload happened
    assert severe_logs(browser) == []


def test_a_snapshot_on_the_box_page_shows_the_boxes_of_the_boxs_own_result(fleet, console, browser):
    import cv2
    from selenium.webdriver.common.by import By

    log_in(browser, console["url"], "olga")
    browser.get(console["url"] + "/box/cam-north")
    browser.find_element(By.ID, "verb-snapshot").click()
    answer = browser.find_element(By.ID, "command-answer")
    assert wait_for(lambda: answer.get_attribute("data-state") == "succeeded", 30), answer.text
    assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "img.snapshot") and browser.execute_script(
        "const i = document.querySelector('img.snapshot'); return i.complete && i.naturalWidth > 0"), PAGE_S)
    screenshot(browser, "box")
    src = browser.find_element(By.CSS_SELECTOR, "img.snapshot").get_attribute("src")
    # the picture exactly as the browser got it: fetched by the page's own session
    jpeg = bytes(browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {credentials: 'same-origin'}).then(r => r.arrayBuffer())"
        ".then(b => done(Array.from(new Uint8Array(b))));", src))
    picture = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert picture is not None and picture.shape[:2] == (480, 640)
    acks = [body for topic, body in fleet["probe"].json(PREFIX + "/cam-north/ack/")
            if body.get("verb") == "snapshot" and body.get("state") == "succeeded"]
    frame_id = acks[-1]["result"]["frame_id"]
    results = [body for topic, body in fleet["probe"].json(PREFIX + "/cam-north/results/")
               if body.get("frame_id") == frame_id]
    assert results, "the box published no result for frame %s" % frame_id
    detections = results[-1]["detections"]
    assert detections, "the frame has detections to draw"
    drawn = [_edge_share(picture, d["box"], d["class_id"]) for d in detections]
    # the control: the same boxes 17 px off (another box's edge may cross one of them, so judged together)
    shifted = [_edge_share(picture, [v + 17 for v in d["box"]], d["class_id"]) for d in detections]
    print("frame %s: %d detections; drawn edge shares %s, shifted %s" % (frame_id, len(detections), drawn, shifted))
    assert min(drawn) >= 0.9 and float(np.mean(shifted)) < 0.3, (detections, drawn, shifted)


def _edge_share(picture, box, class_id):
    """The share of the box's bottom edge (no label there) drawn in its class's colour."""
    from agent.pipeline.results import _PALETTE

    colour = np.array(_PALETTE[class_id % len(_PALETTE)], dtype=np.int32)
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    height, width = picture.shape[:2]
    y = min(max(y2, 0), height - 1)
    xs = range(max(x1 + 2, 0), min(x2 - 1, width))
    if not xs:
        return 0.0
    near = [np.abs(picture[max(0, y - 1):y + 2, x].astype(np.int32) - colour).sum(axis=1).min() <= 90 for x in xs]
    return float(np.mean(near))


def test_a_viewer_sees_no_buttons_and_its_post_is_refused(fleet, console, browser):
    from selenium.webdriver.common.by import By

    log_in(browser, console["url"], "vic")
    browser.get(console["url"] + "/box/cam-north")
    assert browser.find_elements(By.CSS_SELECTOR, "button.verb") == []
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/box/cam-north/command', {method: 'POST', credentials: 'same-origin', headers: {'Content-Type':"
        " 'application/json', 'X-CSRF-Token': document.body.dataset.csrf}, body: JSON.stringify({verb: 'status',"
        " fields: {}})}).then(r => done(r.status));")
    assert status == 403
    assert [e for e in severe_logs(browser) if "403" not in e["message"]] == []  # the refusal only; drained


def test_a_hostile_boxs_strings_are_shown_as_text_and_nothing_runs(fleet, console, browser):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    severe_logs(browser)  # drained: what earlier tests left
    log_in(browser, console["url"], "olga")
    assert wait_for(lambda: HOSTILE_ID in rows(browser), PAGE_S), rows(browser)
    assert rows(browser)[HOSTILE_ID]["model"] == "<script>alert(2)</script>"
    link = browser.find_element(By.XPATH, "//tr[@data-device=%s]//a" % json.dumps(HOSTILE_ID))
    link.click()
    assert wait_for(lambda: browser.find_elements(By.ID, "box-kind"), PAGE_S), browser.page_source[-2000:]
    assert browser.find_element(By.ID, "box-kind").text == "javascript:alert(3)"
    # raised while its page is open: the alert arrives live and is drawn by the page's script
    fleet["hostile"].alert({"kind": "<script>alert(4)</script>", "message": "<img src=y onerror=alert(5)>",
                            "ts": time.time()})
    assert wait_for(lambda: "<img src=y onerror=alert(5)>" in browser.execute_script(
        "return document.getElementById('alerts').textContent"), PAGE_S), browser.execute_script(
        "return document.getElementById('alerts').textContent")
    time.sleep(1.0)  # time for anything that would run to run
    with pytest.raises(NoAlertPresentException):
        _alert_text = browser.switch_to.alert.text  # noqa: F841 - raises when there is no dialog
    assert browser.execute_script("return document.querySelectorAll('img:not(.snapshot), script:not([src])')"
                                  ".length") == 0
    assert severe_logs(browser) == []
    screenshot(browser, "hostile-box")


def test_a_burst_of_changes_is_drawn_once_and_keeps_every_box_it_names(fleet, console, browser):
    """The page's live() waits 300 ms after a change to draw a burst once. A change for this box that arrives in
    that wait must not be lost behind another box's: the box page would then show its alert only at its next
    change. Driven through the page's own live() with a stand-in event source: two changes, 1 ms apart."""
    log_in(browser, console["url"], "olga")
    drawn = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        class StandIn { constructor() { this.on = {}; StandIn.last = this; }
                        addEventListener(name, handler) { this.on[name] = handler; } }
        const real = window.EventSource;
        window.EventSource = StandIn;
        const drawn = [];
        try { live("0", (change) => drawn.push(change)); } finally { window.EventSource = real; }
        const send = (change) => StandIn.last.on.change({data: JSON.stringify(change)});
        send({version: 1, devices: ["cam-north"]});
        setTimeout(() => send({version: 2, devices: ["cam-gate"]}), 1);
        setTimeout(() => send({version: 3, devices: null}), 1000);  // a second burst: null is "any box"
        const finish = () => setTimeout(drawn.length >= 2 ? () => done(drawn) : finish, 400);  // then any more
        setTimeout(finish, 1000);""")
    assert drawn == [{"version": 2, "devices": ["cam-north", "cam-gate"]}, {"version": 3, "devices": None}], drawn


# --- rollouts from the page --------------------------------------------------------------------------------------

def start_rollout(browser, url, bundle, sha, *, rollout_id, pause_after_canary=False):
    """The form filled and reviewed, the plan checked on the confirmation page, then started; returns the
    confirmation's waves as the page listed them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(url + "/rollouts")
    Select(browser.find_element(By.ID, "f-group")).select_by_value("site-a")
    for field, value in (("f-bundle", bundle), ("f-sha256", sha), ("f-canary", "1"), ("f-waves", "1"),
                         ("f-rollout-id", rollout_id)):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    if pause_after_canary:
        browser.find_element(By.ID, "f-pause-canary").click()
    browser.find_element(By.ID, "review").click()
    assert wait_for(lambda: browser.find_elements(By.ID, "confirm-start"), PAGE_S), browser.page_source[-2000:]
    waves = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#plan-waves li")]
    assert browser.find_element(By.ID, "c-sha256").text == sha
    if rollout_id == "ro-page":
        screenshot(browser, "rollout-confirm")
    browser.find_element(By.ID, "confirm-start").click()
    assert wait_for(lambda: browser.current_url.endswith("/rollouts/" + rollout_id), PAGE_S), browser.current_url
    return waves


def follow(browser, until, timeout=ROLLOUT_S):
    """The rollout page's status as it changes, read every 0.1 s without a reload, until it reads ``until``."""
    from selenium.webdriver.common.by import By

    seen = []

    def status():
        text = browser.find_element(By.ID, "rollout-status").text
        if not seen or seen[-1] != text:
            seen.append(text)
        return text == until

    assert wait_for(status, timeout, interval=0.1), (seen, browser.find_element(By.ID, "rollout-log").text)
    return seen


def box_states(browser):
    return dict(browser.execute_script(
        "return Array.from(document.querySelectorAll('#waves tr[data-device]')).map(tr => [tr.dataset.device,"
        " tr.querySelector('td.state').textContent]);"))


def press(browser, action):
    """An action button of the rollout page; cancel and revert ask to confirm, and the dialog is accepted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element(By.ID, "action-" + action).click()
    if action in ("cancel", "revert"):
        WebDriverWait(browser, 5).until(expected_conditions.alert_is_present())
        browser.switch_to.alert.accept()
    answer = browser.find_element(By.ID, "rollout-answer")
    assert wait_for(lambda: answer.get_attribute("data-state"), 30), answer.text
    assert answer.get_attribute("data-state") == "ok", answer.text


def test_a_rollout_started_from_the_page_moves_every_box_live_and_revert_puts_them_back(fleet, console, browser):
    from selenium.webdriver.common.by import By

    probe, shas = fleet["probe"], fleet["shas"]
    log_in(browser, console["url"], "olga")
    waves = start_rollout(browser, console["url"], "incoming/v2", shas["v2"], rollout_id="ro-page")
    assert waves == ["canary: 1 box(es): cam-north", "1 box(es): cam-south"], waves
    browser.execute_script("window.stillTheSamePage = true")
    seen = follow(browser, "completed")
    print("rollout statuses shown live:", seen)
    assert seen[0] in ("starting", "running") and "running" in seen, seen  # progress, not only the end
    assert browser.execute_script("return window.stillTheSamePage === true")
    assert box_states(browser) == dict.fromkeys(ROLLED, "confirmed")
    assert browser.find_element(By.ID, "r-bundle").text == "incoming/v2"  # filled in live: the page came first
    assert HOSTILE_ID + ": not_targeted" in browser.find_element(By.ID, "outside").text  # the hostile box: text
    assert browser.execute_script("return document.querySelectorAll('img, script:not([src])').length") == 0
    assert wait_for(lambda: {d: v for d, v in serving_versions(probe, PREFIX).items() if d in ROLLED} ==
                    dict.fromkeys(ROLLED, "1.1.0"), 30), serving_versions(probe, PREFIX)  # each box's own word
    screenshot(browser, "rollout")
    assert browser.find_element(By.ID, "action-pause").get_attribute("hidden") is not None  # ended: no pause
    press(browser, "revert")
    follow(browser, "cancelled")
    assert wait_for(lambda: box_states(browser) == dict.fromkeys(ROLLED, "confirmed (reverted)"), 30), \
        box_states(browser)
    assert wait_for(lambda: {d: v for d, v in serving_versions(probe, PREFIX).items() if d in ROLLED} ==
                    dict.fromkeys(ROLLED, "1.0.0"), 30), serving_versions(probe, PREFIX)
    assert severe_logs(browser) == []


def test_a_paused_rollout_is_resumed_or_cancelled_from_the_page(fleet, console, browser):
    probe, shas = fleet["probe"], fleet["shas"]
    log_in(browser, console["url"], "olga")
    start_rollout(browser, console["url"], "incoming/v3", shas["v3"], rollout_id="ro-cancel", pause_after_canary=True)
    follow(browser, "paused")
    assert box_states(browser) == {"cam-north": "confirmed", "cam-south": "planned"}
    press(browser, "cancel")
    follow(browser, "cancelled", 30)
    assert box_states(browser) == {"cam-north": "confirmed", "cam-south": "not_started"}
    assert wait_for(lambda: serving_versions(probe, PREFIX).get("cam-north") == "1.2.0", 30)
    assert serving_versions(probe, PREFIX)["cam-south"] == "1.0.0"  # never sent the deploy
    press(browser, "revert")
    assert wait_for(lambda: box_states(browser).get("cam-north") == "confirmed (reverted)", ROLLOUT_S), \
        box_states(browser)
    assert wait_for(lambda: serving_versions(probe, PREFIX).get("cam-north") == "1.0.0", 30)

    start_rollout(browser, console["url"], "incoming/v3", shas["v3"], rollout_id="ro-resume", pause_after_canary=True)
    follow(browser, "paused")
    press(browser, "resume")
    follow(browser, "completed")
    assert box_states(browser) == dict.fromkeys(ROLLED, "confirmed")
    assert wait_for(lambda: {d: v for d, v in serving_versions(probe, PREFIX).items() if d in ROLLED} ==
                    dict.fromkeys(ROLLED, "1.2.0"), 30), serving_versions(probe, PREFIX)
    browser.get(console["url"] + "/rollouts")
    listed = dict(browser.execute_script(
        "return Array.from(document.querySelectorAll('#rollouts tr[data-rollout]')).map(tr => [tr.dataset.rollout,"
        " tr.querySelector('td.status').textContent]);"))
    assert listed == {"ro-page": "cancelled", "ro-cancel": "cancelled", "ro-resume": "completed"}, listed
    screenshot(browser, "rollouts")
    assert severe_logs(browser) == []
