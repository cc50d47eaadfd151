"""The console's rollouts: each one an ``atlas-edge fleet`` process of its own, followed through its state file.

Why a process, not an engine in the console: the rollout command (agent/cli/fleet.py) is where every rule of a
rollout lives and is tested (the lock, the journal, resume, cancel, pause, revert, the final check); the console
starts that same command with its own broker options, so a rollout started from the page and one started from a
terminal are one thing to both, each shown here and each paused, cancelled or reverted from either side. The
process has its own MQTT connection (the console's one link stays the fleet's reader) and outlives a console
restart (its own session); its progress lines go to ``<id>.console.log`` beside the state file. The pages read
the state file, re-read only when it or its journal changed.
"""

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from agent.fleet.journal import RolloutLock, RolloutReader, RolloutState
from agent.fleet.plan import RolloutError, RolloutSpec, check_rollout_id, plan_waves, spec_arguments
from agent.fleet.records import RolloutStatus
from agent.fleet.report import report
from agent.fleet.rollout import MOVABLE, WAITS, placement
from agent.fleet.status import FleetView

LOG_LINES = 40  # of the rollout command's output, on its page
BOXES_SHOWN = 200  # per wave on the page; the counts cover them all
ROLLOUT_ACTIONS = ("pause", "resume", "cancel", "revert")  # what a rollout's page may ask of the rollout command
QUICK_S = 30.0  # pause and cancel only write beside the state file: their command ends at once
# What the form may set, and how each is read (the rest of the spec keeps the command's defaults)
INTEGERS = ("canary", "waves", "wave_size", "max_failures", "min_executed", "max_per_minute")
NUMBERS = ("max_failure_rate", "confirm_timeout_s", "step_timeout_s")
FLAGS = ("rollback_on_abort", "pause_after_canary")
TEXTS = ("group", "bundle", "sha256", "archive_sha256")


@dataclass
class Run:
    """A rollout command this console started: which action, its process, and how it ended."""

    action: str
    user: str
    process: subprocess.Popen
    started: float = field(default_factory=time.time)

    @property
    def code(self) -> Optional[int]:
        return self.process.poll()


def spec_from_form(form: Mapping[str, str], prefix: str) -> RolloutSpec:
    """The rollout the form describes, checked as ``fleet rollout`` checks its options; RolloutError names every
    field that is wrong."""
    values: Dict[str, Any] = {"prefix": prefix}
    problems = []
    for name in TEXTS:
        text = str(form.get(name, "")).strip()
        if text:
            values[name] = text.lower() if name.endswith("sha256") else text
    for name in INTEGERS + NUMBERS:
        text = str(form.get(name, "")).strip()
        if not text:
            continue
        try:
            values[name] = int(text) if name in INTEGERS else float(text)
        except ValueError:
            problems.append("%s: %r is not a%s number" % (name, text[:40], " whole" if name in INTEGERS else ""))
    for name in FLAGS:
        values[name] = str(form.get(name, "")) in ("on", "true", "1")
    missing = [name for name in ("group", "bundle", "sha256") if name not in values]
    if missing or problems:
        raise RolloutError("; ".join(["%s is required" % name for name in missing] + problems))
    spec = RolloutSpec(**values)
    spec.check()
    return spec


def preview(view: FleetView, spec: RolloutSpec) -> Dict[str, Any]:
    """What the rollout would do if it planned now, from the statuses the console holds: its waves and the boxes
    it would leave out, each placed by the engine's own rule (:func:`agent.fleet.rollout.placement`)."""
    placed: Dict[str, List[str]] = {}
    for box in view.in_group(spec.group):
        placed.setdefault(str(placement(box, spec)), []).append(box.device)
    waves = plan_waves(placed.get(MOVABLE, []), spec.canary, spec.waves, spec.wave_size)
    if placed.get(WAITS):
        waves.append(placed[WAITS])
    return {"boxes": sum(len(devices) for devices in placed.values()),
            "waves": [{"size": len(w), "devices": w[:BOXES_SHOWN], "canary": i == 0 and spec.canary > 0}
                      for i, w in enumerate(waves)],
            "left_out": {place: devices[:BOXES_SHOWN] for place, devices in sorted(placed.items())
                         if place not in (MOVABLE, WAITS)}}


class RolloutDesk:
    """The rollouts of one state directory: listed, read, started and steered through the rollout command.

    ``link_args``: the broker and signing options of the console (``--broker``, ``--username``, ``--password
    env:…``, ``--tls-ca``, ``--ttl``, ``--command-key``) and ``env`` what the command's environment adds (the
    password itself: never on a command line).
    """

    def __init__(self, state_dir: str, prefix: str, link_args: Sequence[str], env: Mapping[str, str]) -> None:
        self.state_dir = state_dir
        self.prefix = prefix
        self.link_args = list(link_args)
        self.env = dict(env)
        self.reader: RolloutReader[Dict[str, Any]] = RolloutReader(state_dir, _read_report)
        self._runs: Dict[str, Run] = {}  # the last command started for each rollout
        self._children: List[subprocess.Popen] = []  # every one still running: reaped as it ends
        self._lock = threading.Lock()

    # --- reading ----------------------------------------------------------------------------------------

    def rollouts(self) -> List[Dict[str, Any]]:
        """Every rollout of the directory, newest first: id, group, status, counts, when, whether a process
        drives it."""
        found = self.reader.recent(time.time())
        rows = [{"rollout_id": rid, "group": r["spec"].get("group"), "bundle": r["spec"].get("bundle"),
                 "status": r["status"], "counts": r["counts"], "started": r["started"], "driven": self._driven(rid)}
                for rid, r in found.items()]
        for rid, run in self._runs_now().items():  # started here, not (yet) a state file: refused, or gathering
            if rid not in found:
                rows.append({"rollout_id": rid, "group": None, "bundle": None, "status": _run_state(run),
                             "counts": {}, "started": run.started, "driven": run.code is None})
        return sorted(rows, key=lambda r: -(r["started"] or 0))

    def detail(self, rollout_id: str) -> Optional[Dict[str, Any]]:
        """The rollout's page: its report (status, counts, every box), its waves with their boxes, the command
        this console ran for it and the end of its output; None when neither a state file nor a run is known."""
        found = self.reader.one(rollout_id)
        run = self._runs_now().get(rollout_id)
        if found is None and run is None:
            return None
        boxes = {b["device"]: b for b in (found or {}).get("boxes", [])}
        waves = []
        for index, devices in enumerate((found or {}).get("waves", [])):
            shown = [_box_line(boxes[d]) for d in devices[:BOXES_SHOWN] if d in boxes]
            waves.append({"index": index + 1, "size": len(devices), "boxes": shown,
                          "canary": index == 0 and (found or {}).get("spec", {}).get("canary", 0) > 0})
        outside = [_box_line(b) for d, b in sorted(boxes.items()) if b["wave"] is None][:BOXES_SHOWN]
        status = found["status"] if found is not None else _run_state(run)
        return {"rollout_id": rollout_id, "status": status, "found": found is not None,
                "spec": (found or {}).get("spec", {}), "counts": (found or {}).get("counts", {}),
                "abort": (found or {}).get("abort"), "cancel": (found or {}).get("cancel"),
                "started": (found or {}).get("started"), "finished": (found or {}).get("finished"),
                "waves": waves, "outside": outside, "driven": self._driven(rollout_id),
                "sent": sum(1 for b in boxes.values() if b["attempts"] > 0),
                "run": None if run is None else {"action": run.action, "user": run.user, "code": run.code,
                                                  "pid": run.process.pid},
                "log": self.log_tail(rollout_id)}

    def stamp(self, rollout_id: str) -> Tuple[Any, ...]:
        """Changes whenever the page would: the state files, the command's output, whether it still runs."""
        run = self._runs_now().get(rollout_id)
        return self.reader.stamp(rollout_id) + (_size(self._log_path(rollout_id)),
                                                None if run is None else (run.action, run.code))

    def log_tail(self, rollout_id: str) -> List[str]:
        try:
            with open(self._log_path(rollout_id), "rb") as handle:
                handle.seek(max(0, os.fstat(handle.fileno()).st_size - 16384))
                text = handle.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return []
        return text.splitlines()[-LOG_LINES:]

    def group_of(self, rollout_id: str) -> Optional[str]:
        found = self.reader.one(rollout_id)
        return found["spec"].get("group") if found is not None else None

    # --- acting (each through the rollout command) -------------------------------------------------------

    def start(self, spec: RolloutSpec, rollout_id: Optional[str], user: str) -> str:
        """Start ``fleet rollout`` for ``spec``; its id (given, or the command's own default). RolloutError: the
        id is taken (its page resumes it) or bad."""
        rollout_id = check_rollout_id(rollout_id or spec.default_id())
        with self._lock:
            if os.path.exists(os.path.join(self.state_dir, rollout_id + ".json")) or self._running(rollout_id):
                raise RolloutError("rollout %s exists already: open its page to resume, cancel or revert it" %
                                   rollout_id)
            self._spawn(rollout_id, "rollout", user, spec_arguments(spec) + ["--rollout-id", rollout_id])
        return rollout_id

    def resume(self, rollout_id: str, user: str) -> None:
        self._steer(rollout_id, "resume", user)

    def revert(self, rollout_id: str, user: str) -> None:
        self._steer(rollout_id, "revert", user)

    def quick(self, rollout_id: str, action: str) -> Tuple[int, str]:
        """``fleet pause`` or ``fleet cancel``: they only write beside the state file, so they are waited for;
        (exit code, what the command said)."""
        done = subprocess.run(self._command(action, rollout_id), capture_output=True, text=True, env=self._env(),
                              timeout=QUICK_S, stdin=subprocess.DEVNULL)
        said = (done.stdout + done.stderr).strip()
        self._append_log(rollout_id, "[console] fleet %s: %s" % (action, said or "exit %d" % done.returncode))
        return done.returncode, said

    def _steer(self, rollout_id: str, action: str, user: str) -> None:
        check_rollout_id(rollout_id)
        with self._lock:
            if self._running(rollout_id) and action != "revert":
                raise RolloutError("rollout %s is being driven by this console's %s" % (
                    rollout_id, self._runs[rollout_id].action))
            self._spawn(rollout_id, action, user, ["--rollout-id", rollout_id])

    def _spawn(self, rollout_id: str, action: str, user: str, options: List[str]) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        self._append_log(rollout_id, "[console] %s starts fleet %s" % (user, action))
        with open(self._log_path(rollout_id), "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", action] + self.link_args +
                ["--prefix", self.prefix, "--state-dir", self.state_dir] + options,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                start_new_session=True)  # a console restart leaves it running
        self._runs[rollout_id] = Run(action, user, process)
        self._children.append(process)

    def _command(self, action: str, rollout_id: str) -> List[str]:
        return [sys.executable, "-m", "agent", "fleet", action, "--rollout-id", rollout_id, "--state-dir",
                self.state_dir]

    def _env(self) -> Dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1", **self.env)

    def _runs_now(self) -> Dict[str, Run]:
        with self._lock:
            self._children = [child for child in self._children if child.poll() is None]  # no zombies left
            return dict(self._runs)

    def _running(self, rollout_id: str) -> bool:
        run = self._runs.get(rollout_id)
        return run is not None and run.code is None

    def _driven(self, rollout_id: str) -> bool:
        """Some process (this console's or a terminal's) holds the rollout's lock now."""
        if self._running(rollout_id):
            return True
        lock = os.path.join(self.state_dir, rollout_id + ".lock")
        if not os.path.exists(lock):
            return False
        try:
            with RolloutLock.probe(lock) as held:
                return held
        except OSError:
            return False

    def _log_path(self, rollout_id: str) -> str:
        return os.path.join(self.state_dir, rollout_id + ".console.log")

    def _append_log(self, rollout_id: str, line: str) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        with open(self._log_path(rollout_id), "a", encoding="utf-8") as log:
            log.write("%s %s\n" % (time.strftime("%H:%M:%S"), line))


def actions(detail: Dict[str, Any]) -> List[str]:
    """What the rollout's page offers an operator now: pause a running rollout, resume one that is paused or that
    no process drives any more, cancel one that has not ended, revert one that has sent a box its deploy (also
    once it has ended: its boxes go back, and it ends cancelled)."""
    status, driven, found = detail["status"], detail["driven"], detail["found"]
    offered = []
    if found and status == RolloutStatus.RUNNING and driven:
        offered.append("pause")
    if found and (status == RolloutStatus.PAUSED or status == RolloutStatus.RUNNING and not driven):
        offered.append("resume")
    if found and status in (RolloutStatus.RUNNING, RolloutStatus.PAUSED):
        offered.append("cancel")
    if found and detail["sent"] > 0:
        offered.append("revert")
    return offered


def _read_report(path: str) -> Optional[Dict[str, Any]]:
    """The rollout's report (agent/fleet/report.py), each box with its phase too (planned, sent, deployed)."""
    try:
        state = RolloutState.load(path)
    except (RolloutError, OSError):  # a damaged or foreign file: not listed (fleet metrics logs it)
        return None
    if state is None:
        return None
    found = report(state)
    for box in found["boxes"]:
        box["phase"] = str(state.boxes[box["device"]].phase)
    return found


def _box_line(box: Dict[str, Any]) -> Dict[str, Any]:
    return {"device": box["device"], "state": box["outcome"] or box["phase"],
            "old_version": box["old_version"], "new_version": box["new_version"], "error": box["error"],
            "reverted": box["reverted"], "serving": (box.get("serving") or {}).get("version")}


def _run_state(run: Optional[Run]) -> str:
    if run is None:
        return "unknown"
    return "starting" if run.code is None else "ended before planning (exit %d)" % run.code


def _size(path: str) -> Optional[int]:
    try:
        return os.path.getsize(path)
    except OSError:
        return None
