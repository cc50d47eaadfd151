"""Staged rollouts: canary, then waves; a box is done when its new model is confirmed; abort on a threshold.

Semantics (docs/fleet.md has the long form):

- **Plan.** The targets are the boxes whose retained status names the group. Boxes offline at the start are
  reported ``offline`` and skipped, never counted as failures (with ``--wait-offline S`` they make a last wave
  instead, sent to each box that comes back within S seconds of that wave's start); boxes already serving the
  bundle confirmed are ``already``. The rest, sorted by device id, make the canary (``--canary N``) and then
  the waves.
- **A box's outcome.** ``confirmed`` when its retained status shows the bundle confirmed and serving (past its
  observation window); ``failed`` when the deploy command fails (bad bundle, golden mismatch, busy...);
  ``rolled_back`` when the box rolled the new model back itself (latency, errors, restart); ``timed_out`` when
  none of these happened within ``--confirm-timeout`` of sending. A box offline mid-rollout stays in flight
  until then (AWS IoT Jobs' in-progress timeout).
- **Abort.** After every outcome: more than ``--max-failures`` failures, or a failure rate (failures over
  executed boxes) above ``--max-failure-rate`` once ``--min-executed`` boxes have executed, aborts. No box is
  sent anything after that. Boxes of the current wave already sent are followed to their outcome, except with
  ``--rollback-on-abort``: then they are followed until their deploy ends, and every moved box (deployed and
  not rolled back by itself) gets a ``rollback`` back to its previous model.
- **Idempotent and resumable.** Request ids derive from the rollout id and the device id; the rollout id
  derives from prefix, group, bundle and sha256. Progress is written (atomically) to a state file after every
  step. A re-run of the same command re-sends the commands of boxes in flight with the same request ids (the
  box answers from its request record and never deploys twice) and goes on; a finished rollout only reprints
  its report.
- **Clocks.** Timestamps in the state file and report are wall time (``clock``), for people and for a later
  run. Deadlines within one run (``--confirm-timeout``, ``--wait-offline``, the revert wait) run on
  ``monotonic``, so an NTP step on the operator's machine neither stretches nor cuts them. A box sent by an
  earlier run is charged the wall time since its persisted ``sent_at`` once, when this run first judges it
  (never less than zero), and is timed on ``monotonic`` from then on.
"""

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent._util.atomic import atomic_write
from agent.config.names import name_problem
from agent.fleet.link import FleetLink, Message
from agent.fleet.status import FleetView, collect
from agent.ops.commands import FAILED, REQUEST_ID_MAX, REQUEST_ID_RE, SUCCEEDED

log = logging.getLogger(__name__)

STATE_SCHEMA = 1
ROLLOUT_ID_MAX = 24  # leaves room in a 64-character request id for the device and the verb
POLL_S = 0.2  # how often in-flight boxes are re-judged when no message arrives
DEFAULT_CONFIRM_TIMEOUT_S = 900.0  # a deploy plus a box's default 60 s observation window, with a wide margin
DEFAULT_REVERT_TIMEOUT_S = 120.0  # a rollback is a reference swap or one reload: a slow box still answers

# Outcomes. EXECUTED ones count towards the failure rate; FAILURES are the failed ones among them.
CONFIRMED, FAILED_OUTCOME, ROLLED_BACK, TIMED_OUT = "confirmed", "failed", "rolled_back", "timed_out"
ABORTED, OFFLINE, ALREADY, NOT_STARTED = "aborted", "offline", "already", "not_started"
EXECUTED = (CONFIRMED, FAILED_OUTCOME, ROLLED_BACK, TIMED_OUT)
FAILURES = (FAILED_OUTCOME, ROLLED_BACK, TIMED_OUT)
# Rollout states in the state file and report.
RUNNING, COMPLETED, ABORTED_ROLLOUT = "running", "completed", "aborted"
# Phases of a box in flight.
PLANNED, SENT, DEPLOYED, DONE = "planned", "sent", "deployed", "done"
ALREADY_SERVING = "already_serving"  # the box's error code for a deploy of what it serves


class RolloutError(Exception):
    """Bad arguments, or a state file that does not belong to this command; nothing was sent."""


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout was asked to do: a re-run must ask the same (the state file keeps it)."""

    group: str
    bundle: str
    sha256: str
    prefix: str = "atlas-edge"
    canary: int = 1
    waves: int = 3
    wave_size: Optional[int] = None
    max_failures: Optional[int] = None
    max_failure_rate: Optional[float] = None
    min_executed: int = 1
    confirm_timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S
    rollback_on_abort: bool = False
    wait_offline_s: Optional[float] = None

    def check(self) -> None:
        problems = []
        problem = name_problem(self.group)
        if problem:
            problems.append("--group %s" % problem)
        if not self.bundle:
            problems.append("--bundle must not be empty")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256.lower()):
            problems.append("--sha256 must be 64 hex digits (the manifest's, as 'bundle verify' prints)")
        if self.canary < 0 or self.waves < 1 or (self.wave_size is not None and self.wave_size < 1):
            problems.append("--canary must be >= 0, --waves and --wave-size >= 1")
        if self.max_failures is not None and self.max_failures < 0:
            problems.append("--max-failures must be >= 0")
        if self.max_failure_rate is not None and not 0 <= self.max_failure_rate < 1:
            problems.append("--max-failure-rate must be in [0, 1)")
        if self.min_executed < 1 or self.confirm_timeout_s <= 0:
            problems.append("--min-executed must be >= 1 and --confirm-timeout > 0")
        if self.wait_offline_s is not None and self.wait_offline_s <= 0:
            problems.append("--wait-offline must be > 0")
        if problems:
            raise RolloutError("; ".join(problems))

    def default_id(self) -> str:
        """Same command, same id: what makes a plain re-run resume instead of starting over."""
        key = "\n".join((self.prefix, self.group, self.bundle, self.sha256.lower()))
        return "ro-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def check_rollout_id(rollout_id: str) -> str:
    if not rollout_id or len(rollout_id) > ROLLOUT_ID_MAX or not REQUEST_ID_RE.match(rollout_id):
        raise RolloutError("--rollout-id must be 1-%d characters of A-Z a-z 0-9 _ . : -" % ROLLOUT_ID_MAX)
    return rollout_id


def request_id(rollout_id: str, device: str, verb: str) -> str:
    """``<rollout>.<device>.<verb>``; a device id that does not fit a request id is replaced by its hash."""
    candidate = "%s.%s.%s" % (rollout_id, device, verb)
    if len(candidate) <= REQUEST_ID_MAX and REQUEST_ID_RE.match(candidate):
        return candidate
    return "%s.h%s.%s" % (rollout_id, hashlib.sha256(device.encode("utf-8")).hexdigest()[:16], verb)


def plan_waves(devices: List[str], canary: int, waves: int, wave_size: Optional[int]) -> List[List[str]]:
    """Canary first (if any), then ``waves`` near-equal waves, or waves of ``wave_size``."""
    head, rest = devices[:canary], devices[canary:]
    planned = [head] if head else []
    if not rest:
        return planned
    if wave_size is None:
        count = min(waves, len(rest))
        size, extra = divmod(len(rest), count)
        start = 0
        for index in range(count):
            end = start + size + (1 if index < extra else 0)
            planned.append(rest[start:end])
            start = end
    else:
        planned += [rest[i:i + wave_size] for i in range(0, len(rest), wave_size)]
    return planned


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "atlas-edge", "rollouts")


class RolloutState:
    """The state file: the spec, the plan, and every box's phase, outcome and timings (JSON, atomic writes)."""

    def __init__(self, path: str, data: Dict[str, Any]) -> None:
        self.path = path
        self.data = data

    @classmethod
    def load(cls, path: str) -> Optional["RolloutState"]:
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise RolloutError("state file %s is unreadable (%s); move it away to start over" % (path, exc)
                               ) from None
        if not isinstance(data, dict) or data.get("schema") != STATE_SCHEMA:
            raise RolloutError("state file %s has an unknown schema; move it away to start over" % path)
        return cls(path, data)

    def save(self) -> None:
        self.data["updated"] = time.time()
        atomic_write(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")

    @property
    def boxes(self) -> Dict[str, Dict[str, Any]]:
        return self.data["boxes"]

    @property
    def status(self) -> str:
        return str(self.data["status"])

    def executed_and_failures(self) -> Tuple[int, int]:
        outcomes = [b.get("outcome") for b in self.boxes.values()]
        return sum(1 for o in outcomes if o in EXECUTED), sum(1 for o in outcomes if o in FAILURES)


def _one_line(text: str) -> str:
    """Box errors may span lines (a bundle's per-field errors): one line for the progress display and report."""
    return " ".join(text.split())


def abort_reason(spec: RolloutSpec, executed: int, failures: int) -> Optional[str]:
    """Why the rollout must stop now, or None (AWS IoT Jobs' abort criteria, failures over executed boxes)."""
    if spec.max_failures is not None and failures > spec.max_failures:
        return "%d failure(s), more than --max-failures %d" % (failures, spec.max_failures)
    if spec.max_failure_rate is not None and executed >= spec.min_executed and executed:
        rate = failures / executed
        if rate > spec.max_failure_rate:
            return "failure rate %.3f (%d of %d executed) above --max-failure-rate %.3f" % (
                rate, failures, executed, spec.max_failure_rate)
    return None


Progress = Callable[[str], None]


class Rollout:
    """Runs one rollout to its end (or to a lost broker) over ``link``; see the module docstring."""

    def __init__(self, spec: RolloutSpec, rollout_id: str, state_dir: str, link: FleetLink,
                 progress: Progress = lambda line: None, listen_s: float = 0.0,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic
                 ) -> None:
        spec.check()
        self.spec = spec
        self.rollout_id = check_rollout_id(rollout_id)
        self.path = os.path.join(state_dir, "%s.json" % rollout_id)
        self.link = link
        self.progress = progress
        self.listen_s = listen_s
        self.clock = clock  # wall time: what the state file and report record
        self.monotonic = monotonic  # deadlines within this run
        self._sent_mono: Dict[str, float] = {}  # device -> ``monotonic`` reading its deploy counts from
        self.view = FleetView(spec.prefix)
        self._acks: Dict[str, Dict[str, Any]] = {}  # request id -> latest ack seen in this run
        self._subscribed: set = set()

    # --- the whole run -----------------------------------------------------------------------------------

    def run(self) -> RolloutState:
        state = RolloutState.load(self.path)
        if state is not None:
            self._check_same(state)
        collect(self.link, self.view, self.listen_s, status_only=True)  # retained status of every box
        if state is None:
            state = self._plan()
        elif state.status != RUNNING and not self._reverts_left(state):
            self.progress("rollout %s already %s; reprinting its report" % (self.rollout_id, state.status))
            return state
        state.data["runs"] = state.data.get("runs", 0) + 1
        state.save()
        waves = state.data["waves"]
        for index, wave in enumerate(waves):
            if state.status != RUNNING:
                break
            todo = [d for d in wave if state.boxes[d]["phase"] != DONE]
            if todo:
                self.progress("wave %d/%d%s: %d box(es)" % (
                    index + 1, len(waves), " (canary)" if index == 0 and self.spec.canary else "", len(todo)))
                self._run_wave(state, index, todo)
        if state.status == RUNNING:
            state.data["status"] = COMPLETED
        for box in state.boxes.values():
            if box["phase"] == PLANNED and box["outcome"] is None:
                box["outcome"], box["phase"] = NOT_STARTED, DONE
        state.data["finished"] = self.clock()
        state.save()
        if state.status == ABORTED_ROLLOUT and self.spec.rollback_on_abort:
            self._revert(state)
        return state

    def _check_same(self, state: RolloutState) -> None:
        recorded = state.data["spec"]
        differs = sorted(k for k, v in asdict(self.spec).items() if recorded.get(k) != v)
        if differs:
            raise RolloutError("rollout %s was started with different %s (state file %s): re-run it as it was "
                               "started, or give a new --rollout-id" % (
                                   self.rollout_id, ", ".join(differs), state.path))

    def _plan(self) -> RolloutState:
        sha = self.spec.sha256.lower()
        boxes: Dict[str, Dict[str, Any]] = {}
        movable: List[str] = []
        waiting: List[str] = []
        for view in self.view.in_group(self.spec.group):
            serving = view.serving
            box = {"wave": None, "phase": PLANNED, "outcome": None, "error": None,
                   "old": {k: serving.get(k) for k in ("name", "version", "manifest_sha256")} if serving else None,
                   "new": None, "baseline_rollback": view.last_rollback,
                   "request_id": request_id(self.rollout_id, view.device, "deploy"),
                   "sent_at": None, "deployed_at": None, "finished_at": None, "revert": None}
            if not view.online:
                box["error"] = "offline at the start (%s)" % (view.reason or view.state)
                if self.spec.wait_offline_s is None:
                    box.update(outcome=OFFLINE, phase=DONE)
                else:
                    box["waits"] = True  # a last wave, if it comes back in time
                    waiting.append(view.device)
            elif view.serves_confirmed(sha):
                box.update(outcome=ALREADY, phase=DONE, new=box["old"])
            else:
                movable.append(view.device)
            boxes[view.device] = box
        if not boxes:
            raise RolloutError("no box has announced itself in group %r under prefix %r" % (
                self.spec.group, self.spec.prefix))
        waves = plan_waves(movable, self.spec.canary, self.spec.waves, self.spec.wave_size)
        if waiting:
            waves.append(waiting)
        for index, wave in enumerate(waves):
            for device in wave:
                boxes[device]["wave"] = index
        state = RolloutState(self.path, {
            "schema": STATE_SCHEMA, "rollout_id": self.rollout_id, "spec": asdict(self.spec),
            "status": RUNNING, "abort": None, "started": self.clock(), "finished": None, "runs": 0,
            "waves": waves, "boxes": boxes})
        skipped = [d for d, b in boxes.items() if b["outcome"] == OFFLINE or b.get("waits")]
        self.progress("rollout %s: %d box(es) in group %s; %d in %d wave(s), %d already there, %d offline%s" % (
            self.rollout_id, len(boxes), self.spec.group, len(movable), len(waves),
            sum(1 for b in boxes.values() if b["outcome"] == ALREADY), len(skipped),
            " (%s)" % ", ".join(skipped[:10]) if skipped else ""))
        state.save()
        return state

    # --- one wave ----------------------------------------------------------------------------------------

    def _run_wave(self, state: RolloutState, index: int, devices: List[str]) -> None:
        devices = self._back_online(state, devices)
        if not devices:
            return
        self._subscribe_acks(devices, "deploy")
        now, now_mono = self.clock(), self.monotonic()
        for device in devices:
            box = state.boxes[device]
            if box["phase"] == PLANNED:
                box["phase"], box["sent_at"] = SENT, now
                self._sent_mono[device] = now_mono
        state.save()  # recorded before sending: a kill between the two re-sends the same request ids
        payload = {"bundle": self.spec.bundle, "sha256": self.spec.sha256.lower()}
        for device in devices:
            box = state.boxes[device]
            if box["phase"] in (SENT, DEPLOYED):  # DEPLOYED on a re-run: the replayed ack says so again
                self.link.publish("%s/%s/cmd/deploy" % (self.spec.prefix, device),
                                  dict(payload, request_id=box["request_id"]))
        in_flight = [d for d in devices if state.boxes[d]["phase"] != DONE]
        while in_flight:
            self._pump()
            for device in list(in_flight):
                if self._judge(state, device):
                    in_flight.remove(device)
                    self._report_box(state, device, len(in_flight))
                    reason = abort_reason(self.spec, *state.executed_and_failures())
                    if reason is not None and state.status == RUNNING:
                        state.data["status"] = ABORTED_ROLLOUT
                        state.data["abort"] = {"reason": reason, "wave": index, "at": self.clock()}
                        self.progress("ABORT in wave %d: %s; no further box is touched" % (index + 1, reason))
                    state.save()
            if state.status == ABORTED_ROLLOUT and self.spec.rollback_on_abort:
                # Moved boxes go back now: follow the rest only until their deploy has ended.
                if all(state.boxes[d]["phase"] in (DEPLOYED, DONE) for d in in_flight):
                    for device in in_flight:
                        box = state.boxes[device]
                        box.update(outcome=ABORTED, phase=DONE, finished_at=self.clock(),
                                   error="deployed, not yet judged when the rollout aborted")
                    state.save()
                    return

    def _back_online(self, state: RolloutState, devices: List[str]) -> List[str]:
        """The boxes of a wave that may be sent now: waiting boxes only once online (until --wait-offline)."""
        waits = [d for d in devices if state.boxes[d].get("waits") and state.boxes[d]["phase"] == PLANNED]
        if not waits:
            return devices
        self.progress("waiting up to %.0f s for %d box(es) offline at the start" % (self.spec.wait_offline_s or 0,
                                                                                   len(waits)))
        deadline = self.monotonic() + (self.spec.wait_offline_s or 0.0)
        while self.monotonic() < deadline and not all(self._online(d) for d in waits):
            self._pump()
        late = [d for d in waits if not self._online(d)]
        for device in late:
            state.boxes[device].update(outcome=OFFLINE, phase=DONE, finished_at=self.clock(),
                                       error="offline at the start and not back within %.0f s" %
                                       (self.spec.wait_offline_s or 0.0))
            self.progress("  %-24s offline (not back in time)" % device)
        if late:
            state.save()
        return [d for d in devices if d not in late]

    def _online(self, device: str) -> bool:
        view = self.view.boxes.get(device)
        return view is not None and view.online

    def _judge(self, state: RolloutState, device: str) -> bool:
        """Advance one box from what its acks and status say; True once it has an outcome."""
        box = state.boxes[device]
        sha = self.spec.sha256.lower()
        ack = self._acks.get(box["request_id"])
        if ack is not None and box["phase"] == SENT:
            if ack.get("state") == SUCCEEDED:
                box["phase"], box["deployed_at"] = DEPLOYED, self.clock()
                model = (ack.get("result") or {}).get("model") or {}
                box["new"] = {k: model.get(k) for k in ("name", "version", "manifest_sha256")}
            elif ack.get("state") == FAILED:
                error = ack.get("error") or {}
                if error.get("code") != ALREADY_SERVING:  # a retry after the box confirmed: judged below
                    return self._finish(box, FAILED_OUTCOME, _one_line("%s: %s" % (
                        error.get("code"), error.get("message"))))
        view = self.view.boxes.get(device)
        if view is not None and box["phase"] in (SENT, DEPLOYED):
            if view.serves_confirmed(sha):
                box["new"] = box["new"] or {k: view.serving.get(k) for k in ("name", "version", "manifest_sha256")}
                return self._finish(box, CONFIRMED, None)
            rollback = view.last_rollback
            if rollback and rollback != box["baseline_rollback"] and rollback.get("manifest_sha256") == sha:
                return self._finish(box, ROLLED_BACK, _one_line(str(rollback.get("reason"))))
        if box["sent_at"] is not None and self._since_sent(device, box) > self.spec.confirm_timeout_s:
            where = "offline" if view is not None and not view.online else (
                "pending" if view is not None and view.holds(sha) == "pending" else box["phase"])
            return self._finish(box, TIMED_OUT, "not confirmed within %.0f s (last seen: %s)" % (
                self.spec.confirm_timeout_s, where))
        return False

    def _since_sent(self, device: str, box: Dict[str, Any]) -> float:
        """Seconds since the box's deploy went out, on ``monotonic`` (see "Clocks" in the module docstring)."""
        anchor = self._sent_mono.get(device)
        if anchor is None:  # sent by an earlier run: only its wall time is known, read once
            anchor = self.monotonic() - max(0.0, self.clock() - box["sent_at"])
            self._sent_mono[device] = anchor
        return self.monotonic() - anchor

    def _finish(self, box: Dict[str, Any], outcome: str, error: Optional[str]) -> bool:
        box.update(outcome=outcome, phase=DONE, error=error, finished_at=self.clock())
        return True

    def _report_box(self, state: RolloutState, device: str, left: int) -> None:
        box = state.boxes[device]
        executed, failures = state.executed_and_failures()
        took = box["finished_at"] - box["sent_at"] if box["sent_at"] else 0.0
        self.progress("  %-24s %-11s %6.1f s  [executed %d, failed %d, in flight %d]%s" % (
            device, box["outcome"], took, executed, failures, left,
            "  " + box["error"][:120] if box["error"] else ""))

    # --- messages ----------------------------------------------------------------------------------------

    def _subscribe_acks(self, devices: List[str], verb: str) -> None:
        topics = []
        for device in devices:
            topic = "%s/%s/ack/%s" % (self.spec.prefix, device, request_id(self.rollout_id, device, verb))
            if topic not in self._subscribed:
                topics.append(topic)
                self._subscribed.add(topic)
        if topics:
            self.link.subscribe(topics)  # before publishing: an ack cannot be missed

    def _pump(self) -> None:
        """Read what arrived (at least one poll interval), folding status and acks in."""
        message = self.link.get(POLL_S)
        while message is not None:
            self._apply(message)
            message = self.link.get(0.0)

    def _apply(self, message: Message) -> None:
        if "/ack/" in message.topic:
            body = message.json()
            if isinstance(body, dict) and isinstance(body.get("request_id"), str):
                previous = self._acks.get(body["request_id"])
                # a replayed 'in_progress' must not hide a final ack already seen
                if previous is None or previous.get("state") not in (SUCCEEDED, FAILED):
                    self._acks[body["request_id"]] = body
            return
        self.view.apply(message)

    # --- rollback on abort -------------------------------------------------------------------------------

    @staticmethod
    def _moved(box: Dict[str, Any]) -> bool:
        """Deployed and still on the new model: confirmed, or pending when the rollout aborted."""
        return box["outcome"] in (CONFIRMED, ABORTED) and box["deployed_at"] is not None

    def _reverts_left(self, state: RolloutState) -> bool:
        return state.status == ABORTED_ROLLOUT and self.spec.rollback_on_abort and any(
            self._moved(b) and (b["revert"] or {}).get("state") not in (SUCCEEDED, FAILED)
            for b in state.boxes.values())

    def _revert(self, state: RolloutState) -> None:
        devices = [d for d, b in sorted(state.boxes.items()) if self._moved(b) and
                   (b["revert"] or {}).get("state") not in (SUCCEEDED, FAILED)]
        if not devices:
            return
        self.progress("rolling back %d moved box(es) to their previous model" % len(devices))
        self._subscribe_acks(devices, "rollback")
        for device in devices:
            rid = request_id(self.rollout_id, device, "rollback")
            state.boxes[device]["revert"] = {"request_id": rid, "state": "sent", "sent_at": self.clock(),
                                             "to": None, "error": None}
        state.save()
        for device in devices:
            rid = state.boxes[device]["revert"]["request_id"]
            self.link.publish("%s/%s/cmd/rollback" % (self.spec.prefix, device),
                              {"request_id": rid, "reason": "rollout %s aborted" % self.rollout_id})
        waiting = list(devices)
        deadline = self.monotonic() + DEFAULT_REVERT_TIMEOUT_S
        while waiting and self.monotonic() < deadline:
            self._pump()
            for device in list(waiting):
                revert = state.boxes[device]["revert"]
                ack = self._acks.get(revert["request_id"])
                if ack is None or ack.get("state") not in (SUCCEEDED, FAILED):
                    continue
                waiting.remove(device)
                revert["state"] = ack["state"]
                revert["finished_at"] = self.clock()
                if ack["state"] == SUCCEEDED:
                    revert["to"] = (ack.get("result") or {}).get("model")
                else:
                    error = ack.get("error") or {}
                    revert["error"] = "%s: %s" % (error.get("code"), error.get("message"))
                self.progress("  %-24s reverted: %s%s" % (device, ack["state"],
                                                           " " + revert["error"] if revert["error"] else ""))
                state.save()
        for device in waiting:
            state.boxes[device]["revert"].update(state="timed_out",
                                                 error="no final ack within %.0f s" % DEFAULT_REVERT_TIMEOUT_S)
        state.save()


def report(state: RolloutState) -> Dict[str, Any]:
    """The final JSON report: counts, the abort, and per box old/new version, outcome, timings, revert."""
    data = state.data
    executed, failures = state.executed_and_failures()
    counts: Dict[str, int] = {}
    boxes = []
    for device in sorted(state.boxes):
        box = state.boxes[device]
        counts[box["outcome"] or "in_flight"] = counts.get(box["outcome"] or "in_flight", 0) + 1
        sent = box["sent_at"]
        boxes.append({
            "device": device, "wave": box["wave"], "outcome": box["outcome"], "error": box["error"],
            "old_version": (box["old"] or {}).get("version"), "new_version": (box["new"] or {}).get("version"),
            "request_id": box["request_id"] if sent is not None else None,
            "deploy_s": round(box["deployed_at"] - sent, 3) if sent and box["deployed_at"] else None,
            "confirm_s": round(box["finished_at"] - sent, 3) if sent and box["outcome"] == CONFIRMED else None,
            "reverted": (box["revert"] or {}).get("state") == SUCCEEDED if box["revert"] else None,
            "revert": box["revert"]})
    return {"rollout_id": data["rollout_id"], "spec": data["spec"], "status": data["status"],
            "abort": data["abort"], "started": data["started"], "finished": data["finished"],
            "wall_s": round(data["finished"] - data["started"], 3) if data["finished"] else None,
            "runs": data.get("runs", 1), "waves": data["waves"], "counts": counts, "executed": executed,
            "failures": failures, "failure_rate": round(failures / executed, 4) if executed else 0.0,
            "boxes": boxes}
