"""The console's web application (Starlette): pages, their JSON, the live event stream, commands.

Starlette because it is small, typed, maintained by the encode team that also keeps uvicorn, and needs nothing
else at run time but Jinja2 (whose autoescaping renders every string a box sends as text) and python-multipart
(its form parser). Every response carries a Content-Security-Policy with no inline script or style, so a string a
hostile box slipped past an escape still could not run; the pages' one script is a static file, and it writes
what it receives with ``textContent``, never as markup.

Who may do what: a request without a session is redirected to the login page (pages) or answered 401 (``/api``,
``/live``); every state-changing request (POST) needs a session whose role may change the box's groups, and the
session's CSRF token in ``X-CSRF-Token`` or the form, else 403. Each one is written to the audit log.
"""

import asyncio
import json
import math
import os
import subprocess
import time
from typing import Any, Dict, List, Optional

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agent.console.accounts import Accounts, Role
from agent.console.audit import AuditLog
from agent.console.rollouts import ROLLOUT_ACTIONS, RolloutDesk, actions, preview, spec_from_form
from agent.console.sessions import LoginThrottle, Session, Sessions, csrf_ok
from agent.console.watch import CommandError, FleetWatch
from agent.fleet.plan import RolloutError, check_rollout_id
from agent.fleet.records import BoxState
from agent.fleet.status import BoxView, FleetView
from agent.protocol.verbs import PAUSE, RESTART, RESUME, ROLLBACK, SNAPSHOT, STATUS

HERE = os.path.dirname(os.path.abspath(__file__))
COOKIE = "atlas_edge_console"
PAGE_SIZE = 100
EVENT_WAIT_S = 15.0  # the event stream's longest silence: a comment then keeps proxies from closing it
LIVE_POLL_S = 0.25  # how often an open page's stream looks for changes
# The verbs a box page offers; each goes through the box's own parse before it is sent (FleetWatch.command)
CONSOLE_VERBS = (STATUS, SNAPSHOT, PAUSE, RESUME, ROLLBACK, RESTART)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
JPEG_MAGIC = b"\xff\xd8\xff"


class Console:
    """What the routes share: the fleet's watch, the accounts, sessions, throttle and audit log."""

    def __init__(self, watch: FleetWatch, accounts: Accounts, audit: AuditLog, secure_cookie: bool = False,
                 rollouts: Optional[RolloutDesk] = None) -> None:
        import jinja2

        self.watch = watch
        self.rollouts = rollouts  # None: the rollouts pages say the console was started without a state dir
        self.accounts = accounts
        self.audit = audit
        self.sessions = Sessions()
        self.throttle = LoginThrottle()
        self.secure_cookie = secure_cookie
        self.templates = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(HERE, "templates")),
                                            autoescape=True, undefined=jinja2.StrictUndefined)
        self.templates.filters["age"] = _age

    def render(self, name: str, session: Optional[Session], status: int = 200, **values: Any) -> Response:
        values.setdefault("error", self.watch.error)
        page = self.templates.get_template(name).render(
            session=session, user=session.account if session else None,
            operator=session is not None and session.account.role == Role.OPERATOR, **values)
        return Response(page, status_code=status, media_type="text/html; charset=utf-8")

    def session(self, request: Request) -> Optional[Session]:
        return self.sessions.get(request.cookies.get(COOKIE))


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
            "seen": _age(box.last_seen, now), "malformed": box.malformed}


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
        session = await _changing(request, console, None)
        if isinstance(session, Response):
            return session
        console.sessions.close(request.cookies.get(COOKIE))
        console.audit.record(session.account.name, "logout", None, "ok", client=_client(request))
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
        session = await _changing(request, console, groups)
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
                                 {"verb": str(verb)[:40]}, client=_client(request))
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
                                 "error": str(exc)}, client=_client(request))
            return JSONResponse({"error": str(exc)}, status_code=400)
        result = "no final ack" if ack is None else ack.state
        console.audit.record(session.account.name, "command", device, result, {"verb": verb}, client=_client(request))
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

        async def stream():
            """Polls the watch's version (cheap) instead of parking a thread per open page in a wait."""
            version, quiet_since = start, time.monotonic()
            while not await request.is_disconnected():
                now, devices = console.watch.changes_after(version, 0.0)
                if now != version:
                    version, quiet_since = now, time.monotonic()
                    yield "event: change\ndata: %s\n\n" % json.dumps({"version": now, "devices": devices})
                elif time.monotonic() - quiet_since > EVENT_WAIT_S:
                    quiet_since = time.monotonic()
                    yield ": quiet\n\n"
                await asyncio.sleep(LIVE_POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    def rollouts_page(request: Request) -> Response:
        session = console.session(request)
        if session is None:
            return RedirectResponse("/login", status_code=303)
        return _rollouts_page(console, session)

    def rollouts_json(request: Request) -> Response:
        if console.session(request) is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        return JSONResponse({"rollouts": console.rollouts.rollouts() if console.rollouts else []})

    async def rollout_plan(request: Request) -> Response:
        """The form's rollout shown before anything is sent: its spec, its waves as planned now, what it leaves
        out; the confirmation carries the same fields to /rollouts/start."""
        form = await request.form()
        session = await _changing(request, console, [str(form.get("group", ""))])
        if isinstance(session, Response):
            return session
        try:
            spec = _form_spec(console, form)
        except RolloutError as exc:
            return _rollouts_page(console, session, status=400, form_error=str(exc), form=dict(form))
        plan = console.watch.read(lambda view: preview(view, spec))
        return console.render("rollout_confirm.html", session, spec=spec, plan=plan,
                              fields={k: str(v) for k, v in form.items() if k != "csrf"},
                              rollout_id=str(form.get("rollout_id", "")).strip() or spec.default_id())

    async def rollout_start(request: Request) -> Response:
        form = await request.form()
        session = await _changing(request, console, [str(form.get("group", ""))])
        if isinstance(session, Response):
            return session
        name = session.account.name
        try:
            spec = _form_spec(console, form)
            rollout_id = await asyncio.get_running_loop().run_in_executor(
                None, console.rollouts.start, spec, str(form.get("rollout_id", "")).strip() or None, name)
        except (RolloutError, OSError) as exc:
            console.audit.record(name, "rollout start", None, "refused", {"error": str(exc)[:300]},
                                 client=_client(request))
            return _rollouts_page(console, session, status=400, form_error=str(exc), form=dict(form))
        console.audit.record(name, "rollout start", rollout_id, "started", {"group": spec.group, "bundle": spec.bundle,
                             "sha256": spec.sha256}, client=_client(request))
        return RedirectResponse("/rollouts/%s" % rollout_id, status_code=303)

    def rollout_page(request: Request) -> Response:
        session = console.session(request)
        if session is None:
            return RedirectResponse("/login", status_code=303)
        detail = _rollout(console, request.path_params["rollout"])
        if detail is None:
            return console.render("missing.html", session, status=404, what="rollout",
                                  name=request.path_params["rollout"])
        group = detail["spec"].get("group")
        return console.render("rollout.html", session, rollout=detail, actions=ROLLOUT_ACTIONS,
                              may_change=session.account.may_change([group] if group else []))

    def rollout_json(request: Request) -> Response:
        if console.session(request) is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        detail = _rollout(console, request.path_params["rollout"])
        return JSONResponse(detail) if detail is not None else JSONResponse({"error": "no such rollout"}, 404)

    async def rollout_action(request: Request) -> Response:
        rollout_id, action = request.path_params["rollout"], request.path_params["action"]
        desk = console.rollouts
        group = desk.group_of(rollout_id) if desk is not None and _is_id(rollout_id) else None
        session = await _changing(request, console, [group] if group else [])
        if isinstance(session, Response):
            return session
        name = session.account.name
        detail = _rollout(console, rollout_id) if action in ROLLOUT_ACTIONS else None
        if detail is None or action not in detail["actions"]:
            refusal = "no such rollout" if detail is None and action in ROLLOUT_ACTIONS else \
                "%s is not possible now (the rollout is %s)" % (action, detail["status"]) if detail is not None \
                else "the action is one of %s" % ", ".join(ROLLOUT_ACTIONS)
            console.audit.record(name, "rollout " + action[:20], rollout_id[:40], "refused", {"error": refusal},
                                 client=_client(request))
            return JSONResponse({"error": refusal}, status_code=404 if detail is None else 409)
        loop = asyncio.get_running_loop()
        try:
            if action in ("pause", "cancel"):
                code, said = await loop.run_in_executor(None, desk.quick, rollout_id, action)
            else:
                await loop.run_in_executor(None, getattr(desk, action), rollout_id, name)
                code, said = 0, "fleet %s started" % action
        except (RolloutError, OSError, subprocess.SubprocessError) as exc:
            code, said = 2, str(exc)
        console.audit.record(name, "rollout " + action, rollout_id, "ok" if code == 0 else "failed",
                             {"said": said[-300:]}, client=_client(request))
        return JSONResponse({"ok": code == 0, "said": said}, status_code=200 if code == 0 else 409)

    async def rollout_live(request: Request) -> Response:
        if console.session(request) is None or console.rollouts is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        rollout_id = request.path_params["rollout"]
        if not _is_id(rollout_id):
            return JSONResponse({"error": "no such rollout"}, status_code=404)

        async def stream():
            """One change at once (what changed between the page and the stream is not lost), then one per change
            of the rollout's files or of its command."""
            stamp, quiet_since = None, time.monotonic()
            while not await request.is_disconnected():
                now = console.rollouts.stamp(rollout_id)
                if now != stamp:
                    stamp, quiet_since = now, time.monotonic()
                    yield "event: change\ndata: {}\n\n"
                elif time.monotonic() - quiet_since > EVENT_WAIT_S:
                    quiet_since = time.monotonic()
                    yield ": quiet\n\n"
                await asyncio.sleep(LIVE_POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

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
        Route("/rollouts", rollouts_page),
        Route("/api/rollouts", rollouts_json),
        Route("/rollouts/plan", rollout_plan, methods=["POST"]),
        Route("/rollouts/start", rollout_start, methods=["POST"]),
        Route("/rollouts/{rollout}", rollout_page),
        Route("/api/rollouts/{rollout}", rollout_json),
        Route("/rollouts/{rollout}/{action}", rollout_action, methods=["POST"]),
        Route("/live/rollouts/{rollout}", rollout_live),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Mount("/static", StaticFiles(directory=os.path.join(HERE, "static")), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)])


class SecurityHeaders:
    """Pure ASGI middleware (streams pass through unbuffered): the headers of every response."""

    HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
               (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + self.HEADERS)
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _changing(request: Request, console: Console, groups: Optional[List[str]]):
    """The session of a state-changing request that may go on, else the refusing response (401, 403)."""
    session = console.session(request)
    if session is None:
        return JSONResponse({"error": "log in first"}, status_code=401)
    token = request.headers.get("x-csrf-token")
    if token is None and request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        token = (await request.form()).get("csrf")
    if not csrf_ok(session, token):
        console.audit.record(session.account.name, request.url.path, None, "refused: no valid CSRF token",
                             client=_client(request))
        return JSONResponse({"error": "missing or wrong CSRF token"}, status_code=403)
    if groups is not None and not session.account.may_change(groups):
        console.audit.record(session.account.name, request.url.path, None, "refused: role %s" % (
            session.account.role.value), client=_client(request))
        return JSONResponse({"error": "your role may not change this box"}, status_code=403)
    return session


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


def _rollouts_page(console: Console, session: Session, status: int = 200, form_error: Optional[str] = None,
                   form: Optional[Dict[str, Any]] = None) -> Response:
    groups = console.watch.read(lambda view: sorted({g for b in view.boxes.values() for g in b.groups}))
    return console.render("rollouts.html", session, status=status, desk=console.rollouts is not None,
                          rollouts=console.rollouts.rollouts() if console.rollouts else [], groups=groups,
                          form_error=form_error, form=form or {}, now=time.time())


def _form_spec(console: Console, form: Any) -> Any:
    if console.rollouts is None:
        raise RolloutError("this console was started without a place for rollouts (--state-dir)")
    return spec_from_form({k: str(v) for k, v in form.items()}, console.watch.prefix)


def _rollout(console: Console, rollout_id: str) -> Optional[Dict[str, Any]]:
    if console.rollouts is None or not _is_id(rollout_id):
        return None
    detail = console.rollouts.detail(rollout_id)
    if detail is not None:
        detail["actions"] = actions(detail)
    return detail


def _is_id(rollout_id: str) -> bool:
    try:
        check_rollout_id(rollout_id)
    except RolloutError:
        return False
    return True


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


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


def _age(then: Optional[float], now: Optional[float] = None) -> str:
    if not isinstance(then, (int, float)):
        return "-"
    seconds = max(0.0, (now or time.time()) - then)
    return "%.0f s" % seconds if seconds < 120 else "%.0f min" % (seconds / 60) if seconds < 7200 else \
        "%.0f h" % (seconds / 3600)
