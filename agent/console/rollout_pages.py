"""The console's rollout pages: the list and its form, the confirmation with the plan, a rollout's page with its
waves live, and the actions on it; every one through :class:`agent.console.rollouts.RolloutDesk`, which runs the
rollout command itself (agent/console/rollouts.py says why).
"""

import asyncio
import subprocess
import time
from typing import Any, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from agent.console.rollouts import ROLLOUT_ACTIONS, actions, preview, spec_from_form
from agent.console.sessions import Session
from agent.console.web import Console, changing, client_address, event_stream
from agent.fleet.plan import RolloutError, check_rollout_id


def rollout_routes(console: Console) -> List[Route]:
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
        session = await changing(request, console, [str(form.get("group", ""))])
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
        session = await changing(request, console, [str(form.get("group", ""))])
        if isinstance(session, Response):
            return session
        name = session.account.name
        try:
            spec = _form_spec(console, form)
            rollout_id = await asyncio.get_running_loop().run_in_executor(
                None, console.rollouts.start, spec, str(form.get("rollout_id", "")).strip() or None, name)
        except (RolloutError, OSError) as exc:
            console.audit.record(name, "rollout start", None, "refused", {"error": str(exc)[:300]},
                                 client=client_address(request))
            return _rollouts_page(console, session, status=400, form_error=str(exc), form=dict(form))
        console.audit.record(name, "rollout start", rollout_id, "started", {"group": spec.group, "bundle": spec.bundle,
                             "sha256": spec.sha256}, client=client_address(request))
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
        session = await changing(request, console, [group] if group else [])
        if isinstance(session, Response):
            return session
        name = session.account.name
        detail = _rollout(console, rollout_id) if action in ROLLOUT_ACTIONS else None
        if detail is None or action not in detail["actions"]:
            refusal = "no such rollout" if detail is None and action in ROLLOUT_ACTIONS else \
                "%s is not possible now (the rollout is %s)" % (action, detail["status"]) if detail is not None \
                else "the action is one of %s" % ", ".join(ROLLOUT_ACTIONS)
            console.audit.record(name, "rollout " + action[:20], rollout_id[:40], "refused", {"error": refusal},
                                 client=client_address(request))
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
                             {"said": said[-300:]}, client=client_address(request))
        return JSONResponse({"ok": code == 0, "said": said}, status_code=200 if code == 0 else 409)

    async def rollout_live(request: Request) -> Response:
        if console.session(request) is None or console.rollouts is None:
            return JSONResponse({"error": "log in first"}, status_code=401)
        rollout_id = request.path_params["rollout"]
        if not _is_id(rollout_id):
            return JSONResponse({"error": "no such rollout"}, status_code=404)

        seen = [None]

        def poll() -> Optional[str]:
            """One change at once (what changed between the page and the stream is not lost), then one per
            change of the rollout's files or of its command."""
            stamp = console.rollouts.stamp(rollout_id)
            if stamp == seen[0]:
                return None
            seen[0] = stamp
            return "{}"

        return event_stream(request, poll)

    return [
        Route("/rollouts", rollouts_page),
        Route("/api/rollouts", rollouts_json),
        Route("/rollouts/plan", rollout_plan, methods=["POST"]),
        Route("/rollouts/start", rollout_start, methods=["POST"]),
        Route("/rollouts/{rollout}", rollout_page),
        Route("/api/rollouts/{rollout}", rollout_json),
        Route("/rollouts/{rollout}/{action}", rollout_action, methods=["POST"]),
        Route("/live/rollouts/{rollout}", rollout_live),
    ]


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

