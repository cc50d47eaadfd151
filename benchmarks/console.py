"""Section ``console``: the web console over 10,000 boxes (issue 40: the fleet page's first paint at most 2 s, a box
page at most 1 s, the console's RSS at most 200 MiB).

A real Mosquitto holds 10,000 retained statuses (100 groups, each box online with a model, slots and a kind);
``atlas-edge console`` is started as an operator starts it and gathers them; then, logged in:

- ``fleet_page_s`` / ``box_page_s``: the HTML of the fleet page (its first 100 rows) and of a box page, median
  and worst of :data:`REQUESTS` requests each, over HTTP on loopback;
- ``fleet_first_paint_s`` / ``box_first_paint_s``: Chromium's first contentful paint of each page, from the start
  of the navigation (headless, Debian's Chromium through chromedriver; None, with the reason, where there is none);
- ``live_s``: a box's status changes while the fleet page is open; the seconds until its row shows it;
- ``rss_mib``: the console process's peak resident memory (VmHWM) after all of it.
"""

import http.cookiejar
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional

from benchmarks.harness import RunContext, target

log = logging.getLogger(__name__)

BOXES = {"quick": 2000, "full": 10000}
GROUPS = 100
REQUESTS = {"quick": 5, "full": 20}
PASSWORD = "bench console password"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PREFIX = "bench-console"
# A broker for a fleet this size lets the operator's client queue its whole retained burst (docs/console.md):
# with Mosquitto's default 1000 the console, subscribed at QoS 0, listed 9,305 of 10,000 boxes (1,020 at QoS 1)
BROKER_CONFIG = ("max_queued_messages 20000",)


def _statuses(broker: Any, count: int) -> None:
    """``count`` retained online statuses, as boxes publish them (agent.protocol.status)."""
    from agent.ops.mqtt_client import new_client
    from agent.protocol.status import status_message
    from agent.protocol.topics import status_topic

    client = new_client("bench-console-boxes")
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        infos = []
        for index in range(count):
            device = "box-%05d" % index
            slots = {"serving": "a", "slots": {"a": {"name": "demo", "version": "1.%d.0" % (index % 3),
                                                     "manifest_sha256": "%064x" % index, "state": "confirmed"},
                                               "b": None}}
            body = status_message("online", device, groups=["site-%02d" % (index % GROUPS)], model="demo",
                                  backend="onnxruntime", device_kind="atlas-200i-dk-a2", precision="int8",
                                  slots=slots, telemetry_interval_s=10.0)
            infos.append(client.publish(status_topic(PREFIX, device), json.dumps(body), qos=1, retain=True))
            if len(infos) >= 500:
                for info in infos:
                    info.wait_for_publish(30)
                infos = []
        for info in infos:
            info.wait_for_publish(30)
    finally:
        client.disconnect()
        client.loop_stop()


def _session(url: str) -> urllib.request.OpenerDirector:
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(url + "/login", data=urllib.parse.urlencode({"username": "bench", "password": PASSWORD}).encode(),
                timeout=30).read()
    return opener


def _timed_gets(opener: urllib.request.OpenerDirector, url: str, count: int) -> List[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        with opener.open(url, timeout=30) as answer:
            answer.read()
        times.append(time.perf_counter() - started)
    return times


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _peak_rss_mib(pid: int) -> Optional[float]:
    with open("/proc/%d/status" % pid) as handle:
        found = re.search(r"^VmHWM:\s+(\d+) kB", handle.read(), re.M)
    return round(int(found.group(1)) / 1024.0, 1) if found else None


def _browser_figures(url: str, opener: urllib.request.OpenerDirector, broker: Any) -> Dict[str, Any]:
    """First contentful paint of the fleet and a box page in Chromium, and how soon a change shows live."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        return {"browser": "none: needs Debian's chromium and chromium-driver (make chromium)"}
    try:
        from selenium import webdriver
        from selenium.webdriver.common.by import By
    except ImportError:
        return {"browser": "none: needs selenium (the dev extra)"}
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    paint = ("const p = performance.getEntriesByName('first-contentful-paint')[0];"
             "return p ? p.startTime / 1000 : null;")
    try:
        driver.get(url + "/login")
        driver.find_element(By.ID, "username").send_keys("bench")
        driver.find_element(By.ID, "password").send_keys(PASSWORD)
        driver.find_element(By.ID, "login").click()
        _wait(lambda: driver.find_elements(By.ID, "rows"), 30)
        figures: Dict[str, Any] = {"browser": "chromium " + driver.capabilities.get("browserVersion", "?")}
        driver.get(url + "/")
        figures["fleet_first_paint_s"] = _first_paint(driver, paint)
        figures["fleet_rows_shown"] = len(driver.find_elements(By.CSS_SELECTOR, "#rows tr"))
        driver.get(url + "/box/box-00042")
        figures["box_first_paint_s"] = _first_paint(driver, paint)
        driver.get(url + "/")
        from agent.ops.mqtt_client import new_client
        from agent.protocol.status import status_message
        from agent.protocol.topics import status_topic

        client = new_client("bench-console-change")
        client.connect(broker.host, broker.port)
        client.loop_start()
        started = time.monotonic()
        client.publish(status_topic(PREFIX, "box-00003"), json.dumps(status_message(
            "offline", "box-00003", groups=["site-03"], reason="bench")), qos=1, retain=True).wait_for_publish(10)

        def shown() -> bool:
            cells = driver.find_elements(By.CSS_SELECTOR, "#rows tr[data-device='box-00003'] td.state")
            return bool(cells) and cells[0].text == "offline"

        figures["live_s"] = round(time.monotonic() - started, 3) if _wait(shown, 30) else None
        client.disconnect()
        client.loop_stop()
        return figures
    finally:
        driver.quit()


def _first_paint(driver: Any, script: str) -> Optional[float]:
    """The page's first contentful paint (s from the navigation's start); the entry may come a moment after load."""
    found: List[Optional[float]] = [None]

    def painted() -> bool:
        found[0] = driver.execute_script(script)
        return found[0] is not None

    _wait(painted, 10)
    return round(found[0], 3) if found[0] is not None else None


def measure(context: RunContext, count: int, requests: int) -> Dict[str, Any]:
    from agent._util.process import terminate
    from agent.console.accounts import Accounts
    from agent.devtools.broker import EmbeddedBroker

    folder = tempfile.mkdtemp(prefix="bench-console-", dir=context.work_dir)
    users = os.path.join(folder, "users.json")
    accounts = Accounts.load(users, missing_ok=True)
    accounts.add("bench", "operator", PASSWORD)
    accounts.save()
    with EmbeddedBroker(extra_config=BROKER_CONFIG) as broker:
        started = time.monotonic()
        _statuses(broker, count)
        published_s = time.monotonic() - started
        port = _free_port()
        url = "http://127.0.0.1:%d" % port
        proc = subprocess.Popen([sys.executable, "-m", "agent", "console", "--users", users, "--broker",
                                 "mqtt://%s:%d" % (broker.host, broker.port), "--prefix", PREFIX, "--listen",
                                 "127.0.0.1:%d" % port, "--listen-s", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            if not _wait(lambda: _listening(port) or proc.poll() is not None, 120) or proc.poll() is not None:
                raise RuntimeError("the console did not start: %s" % (proc.stdout.read()[-2000:]))
            opener = _session(url)

            def total() -> int:
                with opener.open(url + "/api/fleet", timeout=30) as answer:
                    return json.load(answer)["total"]

            if not _wait(lambda: total() >= count, 120):
                raise RuntimeError("the console listed %d of %d boxes" % (total(), count))
            fleet = _timed_gets(opener, url + "/", requests)
            box = _timed_gets(opener, url + "/box/box-%05d" % (count // 2), requests)
            paged = _timed_gets(opener, url + "/?group=site-07&page=1", requests)
            figures = _browser_figures(url, opener, broker)
            rss = _peak_rss_mib(proc.pid)
        finally:
            terminate(proc, 30, "atlas-edge console")
    return dict({"boxes": count, "broker": "mosquitto, %s" % "; ".join(BROKER_CONFIG),
                 "statuses_published_s": round(published_s, 2),
                 "fleet_page_s": _summary(fleet), "box_page_s": _summary(box), "group_page_s": _summary(paged),
                 "rss_mib": rss, "requests": requests}, **figures)


def _summary(times: List[float]) -> Dict[str, float]:
    return {"median": round(statistics.median(times), 4), "max": round(max(times), 4)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def run(context: RunContext) -> Dict[str, Any]:
    try:
        import starlette  # noqa: F401
    except ImportError:
        return {"skipped": "needs the [console] extra (pip install 'atlas-edge[console]')"}
    result = measure(context, BOXES[context.profile.name], REQUESTS[context.profile.name])
    log.info("console: %d boxes; fleet page %.3f s (median HTTP), first paint %s s; box page %.3f s, first paint "
             "%s s; live %s s; RSS %.1f MiB", result["boxes"], result["fleet_page_s"]["median"],
             result.get("fleet_first_paint_s"), result["box_page_s"]["median"], result.get("box_first_paint_s"),
             result.get("live_s"), result["rss_mib"] or -1)
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    found = {"rss_mib": target(section.get("rss_mib"), "<=", 200),
             "fleet_page_max_s": target(section["fleet_page_s"]["max"], "<=", 2.0),
             "box_page_max_s": target(section["box_page_s"]["max"], "<=", 1.0)}
    if "fleet_first_paint_s" in section:
        found["fleet_first_paint_s"] = target(section["fleet_first_paint_s"], "<=", 2.0)
        found["box_first_paint_s"] = target(section["box_first_paint_s"], "<=", 1.0)
        found["live_s"] = target(section.get("live_s"), "<=", 2.0)
    return found
