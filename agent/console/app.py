"""The console's web application: login, the fleet and box pages, their JSON, the live event stream, commands;
the rollout pages are :mod:`agent.console.rollout_pages`, what every page shares :mod:`agent.console.web` (why
Starlette, who may do what, the headers of every response).
"""

import asyncio
import json
import math
import os
import time
from typing import Any, Dict, List, Optional

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agent.console.rollout_pages import rollout_routes
from agent.console.watch import CommandError, FleetWatch
from agent.console.web import COOKIE, HERE, Console, SecurityHeaders, age, changing, client_address, event_stream
from agent.fleet.records import BoxState
from agent.fleet.status import BoxView, FleetView
from agent.protocol.verbs import PAUSE, RESTART, RESUME, ROLLBACK, SNAPSHOT, STATUS

PAGE_SIZE = 100
# The verbs a box page offers; each goes through the box's own parse before it is sent (FleetWatch.command)
CONSOLE_VERBS = (STATUS, SNAPSHOT, PAUSE, RESUME, ROLLBACK, RESTART)
JPEG_MAGIC = b"\xff\xd8\xff"



def row(box: BoxView, now: float) -> Dict[str, Any]:
    """A box as the fleet page shows it (and its JSON: the page's script redraws rows from this)."""
    serving = box.serving
    return {"device": box.device, "state": box.state.value, "groups": list(box.groups), "kind": box.kind,
            "model": box.model, "version": serving.version if serving is not None else None,
            "precision": box.precision, "fps": box.fps if box.fps is None or math.isfinite(box.fps) else None,
            "alerts": len(box.alerts), "last_alert": _alert_text(box.alerts[-1]) if box.alerts else None,
            "sources": _sources_text(box.sources), "sources_ok": all(s["state"] == "up" for s in box.sources.values()),
            "sources_note": "; ".join("%s: %s" % (name, s["error"]) for name, s in sorted(box.sources.items())
                                      if s["error"])[:300],
            "seen": age(box.last_seen, now), "malformed": box.malformed}


def box_detail(box: BoxView, watch: FleetWatch, now: float) -> Dict[str, Any]:
    feed = watch.feed(box.device)
    return {"row": row(box, now), "reason": box.reason, "backend": box.backend, "broker": box.broker,
            "slots": {name: {"version": e.version, "state": str(e.state), "sha256": e.manifest_sha256}
                      for name, e in sorted(box.entries().items())},
            "serving_slot": box.serving_slot, "last_rollback": _rollback_text(box.last_rollback),
            "alerts": [_alert_text(a) for a in box.alerts], "shadow": box.shadow,
            "cameras": [dict(s, name=name) for name, s in sorted(box.sources.items())],
            "pictures": sorted(feed.snapshots), "refused_snapshot": feed.refused_snapshot,
            "results": [_result_line(r) for r in list(feed.results)[-10:]],
            "commands": watch.command_log(box.device)}


def select(view: FleetView, group: Optional[str], state: Optional[str], query: Optional[str]) -> List[BoxView]:
    """The fleet page's boxes: of ``group``, in ``state``, whose id holds ``query``; sorted by id."""
    boxes = view.rows(group or None)
    if state:
        boxes = [b for b in boxes if b.state.value == state]
    if query:
        boxes = [b for b in boxes if query.lower() in b.device.lower()]
    return boxes


def make_app(console: Console) -> Starlette:
    def login_page(request: Request) -> Response:
        if console.session(request) is not None:
            return RedirectResponse("/", status_code=303)
        return console.render("login.html", None, error=None)

    async def login(request: Request) -> Response:
        form = await request.form()
        name, password = str(form.get("username", ""))[:64], str(form.get("password", ""))
        client = request.client.host if request.client else "?"
        wait = console.throttle.wait_s("user:" + name, "client:" + client)
        if wait > 0:
            console.audit.record(name, "login", None, "throttled", client=client)
            return console.render("login.html", None, status=429,
                                  error="too many failed logins: try again in %.0f s" % math.ceil(wait))
        account = await asyncio.get_running_loop().run_in_executor(None, console.accounts.check, name, password)
        if account is None:
            console.throttle.failed("user:" + name, "client:" + client)
            console.audit.record(name, "login", None, "failed", client=client)
            return console.render("login.html", None, status=401, error="wrong user name or password")
        console.throttle.succeeded("user:" + name)
        console.audit.record(name, "login", None, "ok", client=client)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, console.sessions.open(account), httponly=True, samesite="strict",
                            secure=console.secure_cookie, path="/")
        return response

    async def logout(request: Request) -> Response:
        session = await changing(request, console, None)
        if isinstance(session, Response):
            return session
        console.sessions.close(request.cookies.get(COOKIE))
        console.audit.record(session.account.name, "logout", None, "ok", client=client_address(request))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    def fleet_page(request: Request) -> Response:
        session = console.session(request)
        if session is None:
            return RedirectResponse("/login", status_code=303)
        return console.render("fleet.html", session, **_fleet(console, request))

    def fleet_json(request: Request) -> Response:
        if console.session(request) is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        return JSONResponse(_fleet(console, request))

    def box_page(request: Request) -> Response:
        session = console.session(request)
        if session is None:
            return RedirectResponse("/login", status_code=303)
        device = request.path_params["device"]
        detail = _box(console, device)
        if detail is None:
            return console.render("missing.html", session, status=404, what="box", name=device)
        return console.render("box.html", session, box=detail, verbs=CONSOLE_VERBS,
                              may_change=session.account.may_change(detail["row"]["groups"]),
                              error=console.watch.error)

    def box_json(request: Request) -> Response:
        if console.session(request) is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        detail = _box(console, request.path_params["device"])
        return JSONResponse(detail) if detail is not None else JSONResponse({"error": "no such box"}, 404)

    def picture(request: Request) -> Response:
        if console.session(request) is None:
            return Response(status_code=401)
        device, source = request.path_params["device"], request.path_params["source"]
        taken = console.watch.feed(device).snapshots.get(source)
        if taken is None:
            return Response("no snapshot", status_code=404, media_type="text/plain")
        if not taken[1].startswith(JPEG_MAGIC):  # served only as what it claims to be
            return Response("the box's snapshot is not a JPEG", status_code=415, media_type="text/plain")
        return Response(taken[1], media_type="image/jpeg", headers={"Cache-Control": "no-store"})

    async def command(request: Request) -> Response:
        device = request.path_params["device"]
        detail = _box(console, device)
        groups = detail["row"]["groups"] if detail is not None else []
        session = await changing(request, console, groups)
        if isinstance(session, Response):
            return session
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            body = None
        verb = body.get("verb") if isinstance(body, dict) else None
        fields = body.get("fields", {}) if isinstance(body, dict) else None
        if verb not in CONSOLE_VERBS or not isinstance(fields, dict):
            console.audit.record(session.account.name, "command", device, "refused",
                                 {"verb": str(verb)[:40]}, client=client_address(request))
            return JSONResponse({"error": "verb must be one of %s, fields an object" % ", ".join(CONSOLE_VERBS)},
                                status_code=400)
        if detail is None:
            return JSONResponse({"error": "no such box"}, status_code=404)
        if verb == SNAPSHOT:
            await asyncio.get_running_loop().run_in_executor(None, console.watch.watch_box, device)
        try:
            ack = await asyncio.get_running_loop().run_in_executor(
                None, console.watch.command, device, verb, fields, session.account.name)
        except CommandError as exc:
            console.audit.record(session.account.name, "command", device, "not sent", {"verb": verb,
                                 "error": str(exc)}, client=client_address(request))
            return JSONResponse({"error": str(exc)}, status_code=400)
        result = "no final ack" if ack is None else ack.state
        console.audit.record(session.account.name, "command", device, result, {"verb": verb},
                             client=client_address(request))
        return JSONResponse({"state": result, "result": ack.result if ack is not None else None,
                             "error": ack.error_text() or None if ack is not None else None},
                            status_code=200 if ack is not None else 504)

    async def live(request: Request) -> Response:
        if console.session(request) is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        try:
            start = int(request.query_params.get("v", ""))
        except ValueError:  # no or a bad version: from now on
            start = console.watch.version

        seen = [start]

        def poll() -> Optional[str]:
            now, devices = console.watch.changes_after(seen[0], 0.0)
            if now == seen[0]:
                return None
            seen[0] = now
            return json.dumps({"version": now, "devices": devices})

        return event_stream(request, poll)

    routes = [
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/", fleet_page),
        Route("/api/fleet", fleet_json),
        Route("/box/{device}", box_page),
        Route("/api/box/{device}", box_json),
        Route("/box/{device}/picture/{source}", picture),
        Route("/box/{device}/command", command, methods=["POST"]),
        Route("/live", live),
        *rollout_routes(console),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Mount("/static", StaticFiles(directory=os.path.join(HERE, "static")), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])




def _fleet(console: Console, request: Request) -> Dict[str, Any]:
    params = request.query_params
    group, state, query = params.get("group") or None, params.get("state") or None, params.get("q") or None
    try:
        wanted = max(1, int(params.get("page", "1")))
    except ValueError:
        wanted = 1
    now = time.time()
    version = console.watch.version  # read first: a change while the rows are made is sent again, never lost

    def page_of(view: FleetView) -> Dict[str, Any]:
        boxes = select(view, group, state, query)
        pages = max(1, -(-len(boxes) // PAGE_SIZE))
        page = min(wanted, pages)
        return {"rows": [row(b, now) for b in boxes[(page - 1) * PAGE_SIZE:page * PAGE_SIZE]],
                "total": len(boxes), "page": page, "pages": pages,
                "groups": sorted({g for b in view.boxes.values() for g in b.groups})}

    found = console.watch.read(page_of)
    return dict(found, group=group or "", state=state or "", q=query or "", states=[s.value for s in BoxState],
                version=version, error=console.watch.error)


def _box(console: Console, device: str) -> Optional[Dict[str, Any]]:
    def detail_of(view: FleetView) -> Optional[Dict[str, Any]]:
        box = view.boxes.get(device)
        return box_detail(box, console.watch, time.time()) if box is not None else None

    version = console.watch.version  # read first, as in _fleet
    detail = console.watch.read(detail_of)
    if detail is not None:
        detail["version"] = version
    return detail




def _alert_text(alert: Any) -> str:
    if not isinstance(alert, dict):
        return str(alert)[:200]
    return ("%s: %s" % (alert.get("kind") or alert.get("alert") or "alert", alert.get("message") or ""))[:300]


def _result_line(result: Dict[str, Any]) -> Dict[str, Any]:
    detections = result.get("detections") if isinstance(result.get("detections"), list) else []
    return {"source": str(result.get("source")), "frame_id": result.get("frame_id"),
            "detections": [{"label": str(d.get("label")), "score": d.get("score"), "box": d.get("box")}
                           for d in detections[:50] if isinstance(d, dict)]}


def _rollback_text(rejection: Any) -> Optional[str]:
    """The slot table's last rollback as a line: which model went back, when and why (None: never)."""
    if not isinstance(rejection, dict):
        return None
    return ("%s %s rolled back at %s: %s" % tuple(str(rejection.get(k) or "?") for k in (
        "name", "version", "at", "reason")))[:300]


def _sources_text(sources: Dict[str, Dict[str, Any]]) -> str:
    """A box's cameras in a cell: ``2 up, 1 stalled`` (``-``: its telemetry named none, or none was heard)."""
    counts: Dict[str, int] = {}
    for health in sources.values():
        counts[health["state"]] = counts.get(health["state"], 0) + 1
    return ", ".join("%d %s" % (n, state) for state, n in sorted(counts.items(), key=lambda kv: kv[0] != "up")) \
        or "-"


