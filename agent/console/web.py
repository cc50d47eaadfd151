"""What every page of the console shares: the :class:`Console` (its watch, accounts, sessions, audit log,
templates), the security headers of every response, the gate of every state-changing request and the pages' event
stream.

Starlette because it is small, typed, maintained by the encode team that also keeps uvicorn, and needs nothing
else at run time but Jinja2 (whose autoescaping renders every string a box sends as text) and python-multipart
(its form parser). Every response carries a Content-Security-Policy with no inline script or style, so a string a
hostile box slipped past an escape still could not run; the pages' one script is a static file, and it writes
what it receives with ``textContent``, never as markup.

Who may do what: a request without a session is redirected to the login page (pages) or answered 401 (``/api``,
``/live``); every state-changing request (POST) needs a session whose role may change the groups it touches, and
the session's CSRF token in ``X-CSRF-Token`` or the form, else 403 (:func:`changing`). Each one is written to the
audit log.
"""

import asyncio
import os
import time
from typing import Any, Callable, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from agent.console.accounts import Accounts, Role
from agent.console.audit import AuditLog
from agent.console.rollouts import RolloutDesk
from agent.console.sessions import LoginThrottle, Session, Sessions, csrf_ok
from agent.console.watch import FleetWatch

HERE = os.path.dirname(os.path.abspath(__file__))
COOKIE = "atlas_edge_console"
EVENT_WAIT_S = 15.0  # the event stream's longest silence: a comment then keeps proxies from closing it
LIVE_POLL_S = 0.25  # how often an open page's stream looks for changes
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


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
        self.templates.filters["age"] = age

    def render(self, name: str, session: Optional[Session], status: int = 200, **values: Any) -> Response:
        values.setdefault("error", self.watch.error)
        page = self.templates.get_template(name).render(
            session=session, user=session.account if session else None,
            operator=session is not None and session.account.role == Role.OPERATOR, **values)
        return Response(page, status_code=status, media_type="text/html; charset=utf-8")

    def session(self, request: Request) -> Optional[Session]:
        return self.sessions.get(request.cookies.get(COOKIE))


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


async def changing(request: Request, console: Console, groups: Optional[List[str]]):
    """The session of a state-changing request that may go on, else the refusing response (401, 403)."""
    session = console.session(request)
    if session is None:
        return JSONResponse({"error": "log in first"}, status_code=401)
    token = request.headers.get("x-csrf-token")
    if token is None and request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        token = (await request.form()).get("csrf")
    if not csrf_ok(session, token):
        console.audit.record(session.account.name, request.url.path, None, "refused: no valid CSRF token",
                             client=client_address(request))
        return JSONResponse({"error": "missing or wrong CSRF token"}, status_code=403)
    if groups is not None and not session.account.may_change(groups):
        console.audit.record(session.account.name, request.url.path, None, "refused: role %s" % (
            session.account.role.value), client=client_address(request))
        return JSONResponse({"error": "your role may not change this box"}, status_code=403)
    return session


def event_stream(request: Request, poll: Callable[[], Optional[str]]) -> StreamingResponse:
    """Server-Sent Events for an open page: ``poll()`` every :data:`LIVE_POLL_S` (cheap: no thread is parked per
    page), each answer that is not None sent as a ``change`` event; a comment after :data:`EVENT_WAIT_S` of
    silence keeps proxies from closing the stream."""
    async def stream():
        quiet_since = time.monotonic()
        while not await request.is_disconnected():
            data = poll()
            if data is not None:
                quiet_since = time.monotonic()
                yield "event: change\ndata: %s\n\n" % data
            elif time.monotonic() - quiet_since > EVENT_WAIT_S:
                quiet_since = time.monotonic()
                yield ": quiet\n\n"
            await asyncio.sleep(LIVE_POLL_S)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def client_address(request: Request) -> str:
    return request.client.host if request.client else "?"


def age(then: Optional[float], now: Optional[float] = None) -> str:
    if not isinstance(then, (int, float)):
        return "-"
    seconds = max(0.0, (now or time.time()) - then)
    return "%.0f s" % seconds if seconds < 120 else "%.0f min" % (seconds / 60) if seconds < 7200 else \
        "%.0f h" % (seconds / 3600)
