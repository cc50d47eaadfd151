"""Staged rollouts: canary, then waves; a box is done when its new model is confirmed; abort on a threshold.

Semantics (docs/fleet.md has the long form):

- **Targets.** Every box whose retained status names the group, gathered until the set has stopped growing
  for a settle window (a stalled link pauses the burst, it does not end it), checked against ``--expect N`` or
  an inventory of device ids. Every box heard is in the report: boxes of other groups are ``not_targeted``,
  inventory boxes never heard are ``unseen``, boxes that announce themselves during the rollout are taken in
  as a last wave. A rollout that did not reach every box ends ``partial``, never ``completed``.
- **A box's outcome** is bound to its identity: only an ack on the box's own ack topic, carrying the request
  id this rollout gave that box, counts for it. Anything else arriving there (another box's request id, an
  ack that does not parse) is recorded against the box that sent it. Statuses and acks are parsed
  (``messages.py``); a malformed one makes that box ``malformed``. Two different final answers to one request
  id mean two boxes share the device id: ``duplicate``.
- **Delivery.** A deploy a box missed while it was away (clean sessions lose it) is sent again, same request
  id, once the box is heard from (``delivery.py``: a status, an announce answer or telemetry, no will
  needed); ``busy`` and ``interrupted`` are retried with backoff under a new request id, up to
  ``--retries``; a success naming another manifest fails the box at once. Silence for ``--step-timeout``
  (progress acks restart it) or no confirmation ``--confirm-timeout`` after the deploy ends is ``timed_out``.
- **Abort.** A failed canary stops the rollout unless ``--continue-after-canary-failure``; after every outcome
  the thresholds (overall, rate, per failure type) are checked. Nothing is sent after an abort. With
  ``--rollback-on-abort`` (kept in the state file from the plan on) every box that was sent a deploy is
  followed until it settles, and each one seen on the new model, late or timed out ones included, gets a
  ``rollback``; a re-run after a kill finishes that.
- **Final check.** Before the rollout says ``completed`` (or reports an abort or a revert) every box is read
  once more (``final.py``): the report's per-box ``serving`` is what it serves at the end, an outcome that no
  longer holds is corrected (a confirmed box back on the old model is ``rolled_back``), and the status and
  exit code follow.
- **Idempotent and resumable.** Request ids derive from the rollout id, the device id and the attempt; the
  state is journaled (``journal.py``) before anything is sent; a re-run goes on where the last run stopped.
- **Clocks.** Wall time (``clock``) stamps the state file and report; deadlines run on ``monotonic``. A box sent
  by an earlier run is charged the wall time since its ``sent_at`` once, never less than zero.
"""

import logging
import os
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Callable, Deque, Dict, List, Optional

from agent.fleet.delivery import Delivery
from agent.fleet.final import FinalCheck
from agent.fleet.gate import ShadowGate
from agent.fleet.intake import POLL_S, Intake
from agent.fleet.journal import RolloutLock, RolloutState
from agent.fleet.judge import Judge, abort_reason
from agent.fleet.link import FleetLink
from agent.fleet.plan import RolloutError, RolloutSpec, check_rollout_id, plan_waves, request_id
from agent.fleet.records import (
    FAILURES,
    FINISHED,
    REACHED,
    BoxRecord,
    Outcome,
    Phase,
    RevertWish,
    RolloutRecord,
    RolloutStatus,
)
from agent.fleet.revert import Reverter
from agent.fleet.status import SETTLE_S, BoxView, collect
from agent.protocol.envelope import CommandEnvelope
from agent.protocol.requests import DeployRequest
from agent.protocol.topics import command_topic
from agent.protocol.verbs import DEPLOY, command_payload

log = logging.getLogger(__name__)

EXPECT_WAIT_S = 30.0  # how much longer the boxes are listened for while fewer than --expect were heard
Progress = Callable[[str], None]


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "atlas-edge", "rollouts")


WAITS, MOVABLE = "waits", "movable"  # placement()s that are no outcome: the last wave's, the waves'


def placement(view: BoxView, spec: RolloutSpec) -> str:
    """Where a rollout planned now puts a box: ``not_targeted``, ``malformed``, ``offline`` (or ``waits`` for
    the last wave with ``--wait-offline``), ``already`` (serves the bundle, confirmed) or ``movable`` (its
    waves). The engine's plan and the console's preview of it both ask this."""
    if spec.group not in view.groups:
        return Outcome.NOT_TARGETED
    if view.malformed:
        return Outcome.MALFORMED
    if not view.online:
        return Outcome.OFFLINE if spec.wait_offline_s is None else WAITS
    if view.serves_confirmed(spec.sha256.lower()):
        return Outcome.ALREADY
    return MOVABLE


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class Rollout:
    """Runs one rollout to its end (or to a lost broker) over ``link``; see the module docstring."""

    def __init__(self, spec: RolloutSpec, rollout_id: str, state_dir: str, link: FleetLink,
                 progress: Progress = lambda line: None, listen_s: float = 0.0,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 settle_s: float = SETTLE_S, expect: Optional[int] = None,
                 inventory: Optional[List[str]] = None, resume: bool = False,
                 preflight: Optional[Callable[[List[Any]], None]] = None,
                 envelope: Optional[CommandEnvelope] = None) -> None:
        spec.check()
        self.spec = spec
        self.sha = spec.sha256.lower()
        self.rollout_id = check_rollout_id(rollout_id)
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, "%s.json" % rollout_id)
        self.link = link
        self.progress = progress
        self.listen_s = listen_s
        self.settle_s = settle_s
        self.expect = expect
        self.inventory = inventory
        self.resume = resume
        self.envelope = envelope or CommandEnvelope()  # dates and signs each deploy and rollback as it is sent
        self.preflight = preflight  # checks the gathered boxes of a new rollout; RolloutError refuses it
        self.clock = clock  # wall time: what the state file and report record
        self.monotonic = monotonic  # deadlines within this run
        self.intake = Intake(spec, self.rollout_id, link, progress, clock, monotonic,
                             self.path[:-len(".json")] + ".cancel", signed=self.envelope.signs)
        self.pause_path = self.path[:-len(".json")] + ".pause"  # 'fleet pause' asks for a pause before a wave
        self.view = self.intake.view  # filled by the intake from the messages
        self.judge = Judge(self.intake)
        self.delivery = Delivery(self.intake)  # what each box was sent this run, and whether it missed it
        self._sends: Deque[float] = deque()  # monotonic times of recent deploys, for --max-per-minute
        self.state: Optional[RolloutState] = None

    # --- the whole run -----------------------------------------------------------------------------------

    def run(self) -> RolloutState:
        try:
            os.makedirs(self.state_dir, exist_ok=True)
        except OSError as exc:
            raise RolloutError("cannot use --state-dir %s: %s" % (self.state_dir, exc.strerror or exc)) from None
        with RolloutLock(self.path[:-len(".json")] + ".lock"):
            state = RolloutState.load(self.path)
            if state is not None:
                self._check_same(state)
            self._gather()
            if state is None and self.preflight is not None:
                self.preflight([b for b in self.view.in_group(self.spec.group) if not b.malformed])
            self.state = state = state or self._plan()
            if state.status in FINISHED and state.revert != RevertWish.WANTED:
                self.progress("rollout %s already %s; reprinting its report" % (self.rollout_id, state.status))
                return state
            if state.journaled:
                state.compact()  # fold the last run's journal in: each run starts from one snapshot
            state.top(runs=state.record.runs + 1)
            try:
                self._drive(state)
            finally:
                state.save()
            state.compact()
            return state

    def _check_same(self, state: RolloutState) -> None:
        recorded = state.record.spec
        differs = sorted(k for k, v in asdict(self.spec).items() if recorded.get(k) != v)
        if differs:
            raise RolloutError("rollout %s was started with different %s (state file %s): re-run it as it was "
                               "started, or give a new --rollout-id" % (
                                   self.rollout_id, ", ".join(differs), state.path))

    def _gather(self) -> None:
        """Every status (announced or retained), until the set settles; longer (up to --listen) while fewer than
        expected."""
        # Every box is asked (not only the group's): a box of another group answering as a device id of this
        # one is a duplicate the gate refuses. Telemetry is liveness, as for 'fleet status'.
        collect(self.link, self.view, self.listen_s, settle_s=self.settle_s, monotonic=self.monotonic)
        deadline = self.monotonic() + EXPECT_WAIT_S
        while self.expect is not None and len(self.view.in_group(self.spec.group)) < self.expect and \
                self.monotonic() < deadline:
            message = self.link.get(POLL_S)
            if message is not None:
                self.view.apply(message)
        self.view.judge_stale(self.clock())  # an "online" nobody heard lately is treated like offline
        for box in self.view.boxes.values():
            self.intake.online[box.device] = box.online

    def _plan(self) -> RolloutState:
        boxes: Dict[str, BoxRecord] = {}
        movable: List[str] = []
        waiting: List[str] = []
        for view in self.view.in_group(None):
            box = BoxRecord.planned(request_id(self.rollout_id, view.device, DEPLOY), view.serving,
                                    view.last_rollback)
            boxes[view.device] = box
            place = placement(view, self.spec)
            if place in (Outcome.NOT_TARGETED, Outcome.MALFORMED):
                box.update(outcome=place, error=view.malformed if place == Outcome.MALFORMED else None)
            elif place in (Outcome.OFFLINE, WAITS):
                box.error = "offline at the start (%s)" % (view.reason or view.state)
                if place == Outcome.OFFLINE:
                    box.update(outcome=Outcome.OFFLINE)
                else:
                    box.update(waits=True, phase=Phase.PLANNED)
                    waiting.append(view.device)
            elif place == Outcome.ALREADY:
                box.update(outcome=Outcome.ALREADY, new=box.old)
            else:
                box.phase = Phase.PLANNED
                movable.append(view.device)
        for device in self.inventory or []:
            if device not in boxes:
                boxes[device] = BoxRecord.planned(None, outcome=Outcome.UNSEEN,
                                                  error="in the inventory, no status heard")
        targeted = [d for d, b in boxes.items() if b.outcome not in (Outcome.NOT_TARGETED, Outcome.UNSEEN)]
        if not targeted and not self.inventory:
            raise RolloutError("no box has announced itself in group %r under prefix %r" % (
                self.spec.group, self.spec.prefix))
        waves = plan_waves(movable, self.spec.canary, self.spec.waves, self.spec.wave_size)
        if waiting:
            waves.append(waiting)
        for index, wave in enumerate(waves):
            for device in wave:
                boxes[device].wave = index
        seen = sum(1 for d in targeted)
        shortfall = None
        if self.expect is not None and seen < self.expect:
            shortfall = "expected %d box(es) in group %s, heard %d" % (self.expect, self.spec.group, seen)
        state = RolloutState(self.path, RolloutRecord(
            rollout_id=self.rollout_id, spec=asdict(self.spec), status=RolloutStatus.RUNNING, waves=waves,
            started=self.clock(), shortfall=shortfall), boxes)
        skipped = [d for d, b in boxes.items()
                   if b.outcome in (Outcome.OFFLINE, Outcome.MALFORMED, Outcome.UNSEEN) or b.waits]
        self.progress("rollout %s: %d box(es) in group %s; %d in %d wave(s), %d already there, %d not reachable "
                      "now%s%s" % (self.rollout_id, len(targeted), self.spec.group, len(movable), len(waves),
                                   sum(1 for b in boxes.values() if b.outcome == Outcome.ALREADY), len(skipped),
                                   " (%s)" % ", ".join(skipped[:10]) if skipped else "",
                                   "; " + shortfall if shortfall else ""))
        state.compact()  # the spec (--rollback-on-abort included) is on disk before anything is sent
        return state

    def _drive(self, state: RolloutState) -> None:
        if state.status == RolloutStatus.PAUSED:
            if not self.resume:
                self.progress("rollout %s is paused: 'fleet resume' goes on" % self.rollout_id)
                return
            _remove(self.pause_path)  # asked for before this resume: answered by the pause it made
            state.top(status=RolloutStatus.RUNNING, approved=True)
            self.progress("rollout %s resumed" % self.rollout_id)
        index = 0
        while state.status == RolloutStatus.RUNNING and index < len(state.record.waves):
            waves = state.record.waves
            if index > 0 and self._pause_asked(state, index):
                break
            todo = [d for d in waves[index] if state.boxes[d].phase != Phase.DONE]
            if todo:
                canary = index == 0 and self.spec.canary > 0
                self.progress("wave %d/%d%s: %d box(es)" % (index + 1, len(waves), " (canary)" if canary else "",
                                                            len(todo)))
                self._run_wave(state, index, todo)
            if state.status == RolloutStatus.RUNNING and index == 0 and self.spec.canary > 0:
                self._after_canary(state, waves[0])
            index += 1
        if state.status == RolloutStatus.PAUSED:
            return
        for device, box in state.boxes.items():
            if box.phase == Phase.PLANNED:
                state.set(device, outcome=Outcome.NOT_STARTED, phase=Phase.DONE)
        state.save()
        if state.revert == RevertWish.WANTED:
            Reverter(self.intake, self.send, state, self.delivery).run()
            state.top(revert=RevertWish.DONE)
        FinalCheck(self.intake, state).run()  # what each box serves now decides the report, not what it said
        if state.status == RolloutStatus.RUNNING:
            incomplete = state.record.shortfall or any(b.outcome not in REACHED for b in state.boxes.values())
            state.top(status=RolloutStatus.PARTIAL if incomplete else RolloutStatus.COMPLETED)
        if state.record.finished is None:
            state.top(finished=self.clock())
        state.save()
        _remove(self.pause_path)  # asked for during the last wave: there is no next wave to pause before

    def _pause_asked(self, state: RolloutState, index: int) -> bool:
        """'fleet pause' asked for a pause: the waves before this one have ended (their boxes are judged), none of
        this wave's boxes is sent anything; 'fleet resume' goes on from here."""
        if not os.path.exists(self.pause_path):
            return False
        state.top(status=RolloutStatus.PAUSED)
        state.save()
        _remove(self.pause_path)  # answered: the state file says paused now
        self.progress("PAUSED by 'fleet pause' before wave %d/%d: 'fleet resume' goes on, 'fleet cancel' stops "
                      "here" % (index + 1, len(state.record.waves)))
        return True

    def _after_canary(self, state: RolloutState, canary: List[str]) -> None:
        failed = [d for d in canary if state.boxes[d].outcome in FAILURES]
        if failed and not self.spec.continue_after_canary_failure:
            self._abort(state, 0, "the canary failed (%s); --continue-after-canary-failure goes on regardless" %
                        ", ".join("%s %s" % (d, state.boxes[d].outcome) for d in failed))
        elif self.spec.pause_after_canary and not state.record.approved:
            state.top(status=RolloutStatus.PAUSED)
            state.save()
            self.progress("canary done; paused: 'fleet resume' sends the next waves, 'fleet cancel' stops here")

    def _abort(self, state: RolloutState, index: int, reason: str) -> None:
        state.top(status=RolloutStatus.ABORTED, abort={"reason": reason, "wave": index, "at": self.clock()},
                  revert=RevertWish.WANTED if self.spec.rollback_on_abort else None)
        state.save()  # on disk before the line: a kill right after it still reverts on the re-run
        self.progress("ABORT in wave %d: %s; no further box is sent a deploy" % (index + 1, reason))

    # --- one wave ----------------------------------------------------------------------------------------

    def _run_wave(self, state: RolloutState, index: int, devices: List[str]) -> None:
        devices = self._back_online(state, devices)
        if self.spec.gated:
            devices = self._gate(state, index, devices)
        if not devices:
            return
        self.intake.subscribe_acks(devices)
        now = self.clock()
        fresh = [d for d in devices if state.boxes[d].phase == Phase.PLANNED]
        for device in fresh:
            state.set(device, phase=Phase.SENT, sent_at=now)
        state.save()  # recorded before sending: a kill between the two re-sends the same request ids
        for device in devices:  # a box sent by an earlier run is charged from its recorded sent_at
            if state.boxes[device].phase in (Phase.SENT, Phase.DEPLOYED) and state.status == RolloutStatus.RUNNING:
                self._send_deploy(state, device, restart_clock=device in fresh)
        in_flight = [d for d in devices if state.boxes[d].phase != Phase.DONE]
        while in_flight:
            self.intake.pump(state)
            if state.status != RolloutStatus.RUNNING and (state.revert == RevertWish.WANTED or
                                                          state.status != RolloutStatus.ABORTED):
                outcome = Outcome.ABORTED if state.status == RolloutStatus.ABORTED else Outcome.CANCELLED
                for device in in_flight:  # followed by the revert (if wanted), not judged
                    state.set(device, outcome=outcome, phase=Phase.DONE, finished_at=self.clock(),
                              error="in flight when the rollout was %s" % state.status)
                state.save()
                return
            for device in list(in_flight):
                if self.judge.judge(state, device):
                    in_flight.remove(device)
                    self._report_box(state, device, len(in_flight))
                    reason = abort_reason(self.spec, state.outcomes(), len(in_flight))
                    if reason is not None and state.status == RolloutStatus.RUNNING:
                        self._abort(state, index, reason)
                elif state.status == RolloutStatus.RUNNING and (device in self.intake.resend or self.delivery.missed(
                        device, state.boxes[device].request_id or "")):
                    self.intake.resend.discard(device)
                    self.progress("  %-24s back online: deploy sent again" % device)
                    self._send_deploy(state, device)
                elif self.intake.retry_at.get(device, float("inf")) <= self.monotonic() and \
                        state.status == RolloutStatus.RUNNING:
                    del self.intake.retry_at[device]
                    self._send_deploy(state, device)
            state.save()

    def _gate(self, state: RolloutState, index: int, devices: List[str]) -> List[str]:
        """A gated rollout: the wave's planned boxes shadow the candidate first (gate.py); those that agree go on
        to the deploy with the boxes an earlier run already sent it, the others are finished, each checked
        against the abort rules as it is judged."""

        def judged(device: str) -> None:
            self._report_box(state, device, 0)
            reason = abort_reason(self.spec, state.outcomes(), 0)
            if reason is not None and state.status == RolloutStatus.RUNNING:
                self._abort(state, index, reason)

        planned = [d for d in devices if state.boxes[d].phase == Phase.PLANNED]
        agreed = ShadowGate(self.intake, self.send, self.rollout_id, self.progress).run(state, planned, judged)
        if state.status != RolloutStatus.RUNNING:
            agreed = []  # an abort or cancel during the gate: no deploy is sent
        return [d for d in devices if state.boxes[d].phase != Phase.PLANNED or d in agreed]

    def _send_deploy(self, state: RolloutState, device: str, restart_clock: bool = True) -> None:
        self._pace()
        rid = state.boxes[device].request_id or ""
        archive = self.spec.archive_sha256.lower() if self.spec.archive_sha256 is not None else None
        self.send(device, DEPLOY, DeployRequest(bundle=self.spec.bundle, sha256=self.sha, archive_sha256=archive), rid)
        self.delivery.sent(device, rid)
        if restart_clock:
            self.intake.anchor[device] = self.monotonic()
        self._sends.append(self.monotonic())

    def send(self, device: str, verb: str, request: Any, rid: str) -> None:
        """Publish one command to one box: ``request`` (the verb's request type) under request id ``rid``, built
        by the protocol (:func:`agent.protocol.verbs.command_payload`), dated and signed now (``--ttl``,
        ``--command-key``).

        Also a command sent again (a deploy re-sent with its request id when its box comes back, a rollback
        re-sent by a re-run) is dated and signed afresh: its validity counts from this send, so a box that was
        away longer than ``--ttl`` still takes it, and the request id keeps it from running twice (the box
        answers a known id from its record).
        """
        self.link.publish(command_topic(self.spec.prefix, verb, device=device),
                          self.envelope.wrap(device, verb, command_payload(verb, request, rid)))

    def _pace(self) -> None:
        """--max-per-minute: wait (reading messages) until fewer than N deploys went out in the last minute."""
        limit = self.spec.max_per_minute
        while limit is not None:
            while self._sends and self.monotonic() - self._sends[0] >= 60.0:
                self._sends.popleft()
            if len(self._sends) < limit:
                return
            self.intake.pump(self.state)

    def _back_online(self, state: RolloutState, devices: List[str]) -> List[str]:
        """The boxes of a wave that may be sent now: waiting boxes only once online (until --wait-offline)."""
        waits = [d for d in devices if state.boxes[d].waits and state.boxes[d].phase == Phase.PLANNED]
        if not waits:
            return devices
        self.progress("waiting up to %.0f s for %d box(es) offline at the start" % (self.spec.wait_offline_s or 0,
                                                                                   len(waits)))
        deadline = self.monotonic() + (self.spec.wait_offline_s or 0.0)
        while self.monotonic() < deadline and not all(self._is_online(d) for d in waits):
            self.intake.pump(state)
        late = [d for d in waits if not self._is_online(d)]
        for device in late:
            state.set(device, outcome=Outcome.OFFLINE, phase=Phase.DONE, finished_at=self.clock(),
                      error="offline at the start and not back within %.0f s" % (self.spec.wait_offline_s or 0.0))
            self.progress("  %-24s offline (not back in time)" % device)
        state.save()
        return [d for d in devices if d not in late]

    def _is_online(self, device: str) -> bool:
        view = self.view.boxes.get(device)
        return view is not None and view.online

    def _report_box(self, state: RolloutState, device: str, left: int) -> None:
        box = state.boxes[device]
        executed, failures = state.executed_and_failures()
        took = (box.finished_at or 0.0) - box.sent_at if box.sent_at else 0.0
        self.progress("  %-24s %-11s %6.1f s  [executed %d, failed %d, in flight %d]%s" % (
            device, box.outcome, took, executed, failures, left, "  " + box.error[:120] if box.error else ""))
