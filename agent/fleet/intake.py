"""What arrives during a rollout, folded in: statuses into the fleet view, acks bound to the box they came from.

An ack counts only for the box whose topic it came on (``<prefix>/<device>/ack/<request id>``) and only when
its request id is the one this rollout gave that box; anything else arriving there is recorded as an anomaly
of the sender. Two different final answers to one request id are two boxes answering as one device id. A
status tells when a box came back online (its lost deploy is sent again) and when a box of the group
announced itself after the plan (taken in as a last wave). ``fleet cancel`` leaves a request file that is
checked here, between messages.
"""

import json
import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from agent.fleet.journal import RolloutState
from agent.fleet.link import FleetLink, Message
from agent.fleet.plan import RolloutSpec, request_id
from agent.fleet.records import BoxRecord, Outcome, Phase, RevertWish, RolloutStatus
from agent.fleet.status import FleetView
from agent.protocol.messages import FAILED, FINAL_STATES, OFFLINE, Ack, ProtocolError, parse_ack
from agent.protocol.topics import ACK, SHADOW, STATUS, device_topic, shadow_topic, split_device_topic
from agent.protocol.verbs import DEPLOY

POLL_S = 0.2  # how often in-flight boxes are re-judged when no message arrives
ANOMALIES_KEPT = 5
# What a box answers, without recording it, to a message it refuses before reading it as a command: a missing or
# wrong signature (agent/commands/freshness.py) and a payload it cannot parse (dispatcher.py, reject_unparsed).
# Anyone on the broker can draw such an answer on a predictable fleet request id; a signed, well-formed command
# of the fleet's own never gets one (bad_signature also means a box with another key: it then times out).
FORGEABLE_REFUSALS = ("unsigned", "bad_signature", "bad_json", "too_large", "retained")


def one_line(text: str) -> str:
    """Box errors may span lines (a bundle's per-field errors): one line for the progress display and report."""
    return " ".join(str(text).split())


class Intake:
    """The fleet view, the acks that count, and the per-box timing the engine judges by; see the module doc."""

    def __init__(self, spec: RolloutSpec, rollout_id: str, link: FleetLink, progress: Callable[[str], None],
                 clock: Callable[[], float], monotonic: Callable[[], float], cancel_path: str,
                 signed: bool = False) -> None:
        self.spec = spec
        self.signed = signed  # the fleet signs its commands: a refusal in FORGEABLE_REFUSALS is not their answer
        self.rollout_id = rollout_id
        self.link = link
        self.progress = progress
        self.clock = clock
        self.monotonic = monotonic
        self.cancel_path = cancel_path
        self.view = FleetView(spec.prefix)
        self.acks: Dict[Tuple[str, str], Ack] = {}  # (device, request id) -> latest ack that counts
        self.anchor: Dict[str, float] = {}  # device -> monotonic reading its current step counts from
        self.retry_at: Dict[str, float] = {}  # device -> monotonic time its retry is due
        self.online: Dict[str, bool] = {}
        self.resend: Set[str] = set()  # sent while offline, back now: the deploy goes out again
        self.heard: Dict[str, float] = {}  # device -> monotonic time of its latest live message (delivery.py)
        self.status_heard: Dict[str, float] = {}  # device -> monotonic time of its latest live status
        self.acked_at: Dict[Tuple[str, str], float] = {}  # (device, request id) -> when its final ack arrived
        self.echoed: Dict[str, float] = {}  # mark -> monotonic time the operator's own marked message came back
        # device -> the shadow reports it published (gate.py): (retained?, report), latest last
        self.shadow_reports: Dict[str, List[Tuple[bool, Any]]] = {}
        self._subscribed: Set[str] = set()
        self._echo_topics: Set[str] = set()
        self._forged_seen: Set[Tuple[str, str, str]] = set()  # (device, request id, code) logged this run

    def finish(self, state: RolloutState, device: str, outcome: Outcome, error: Optional[str],
               **extra: Any) -> bool:
        """The box's rollout ended with ``outcome``; True (judged)."""
        state.set(device, outcome=outcome, phase=Phase.DONE, error=error, finished_at=self.clock(), **extra)
        self.retry_at.pop(device, None)
        return True

    # --- messages ----------------------------------------------------------------------------------------

    def subscribe_acks(self, devices: List[str]) -> None:
        """Each box's own ack topics (``<prefix>/<device>/ack/#``): what arrives there is that box's word."""
        topics = []
        for device in devices:
            topic = device_topic(self.spec.prefix, device, ACK, "#")
            if topic not in self._subscribed:
                topics.append(topic)
                self._subscribed.add(topic)
        if topics:
            self.link.subscribe(topics)  # before publishing: an ack cannot be missed

    def subscribe_shadow(self, devices: List[str]) -> None:
        """Each box's shadow report topic (retained: a report from before arrives first, marked so)."""
        topics = [shadow_topic(self.spec.prefix, d) for d in devices
                  if shadow_topic(self.spec.prefix, d) not in self._subscribed]
        if topics:
            self._subscribed.update(topics)
            self.link.subscribe(topics)

    def watch_echo(self, topic: str) -> None:
        """Subscribe to ``topic``, one the operator publishes on, so that its own messages there come back
        (``delivery.Barrier``); LinkError if the broker refuses."""
        if topic not in self._echo_topics:
            self.link.subscribe([topic])
            self._echo_topics.add(topic)

    def pump(self, state: Optional[RolloutState]) -> None:
        """Read what arrived (at least one poll interval), folding status and acks in; then a cancel request."""
        message = self.link.get(POLL_S)
        while message is not None:
            self._apply(state, message)
            message = self.link.get(0.0)
        if state is not None:
            self._check_cancel(state)

    def _apply(self, state: Optional[RolloutState], message: Message) -> None:
        if message.topic in self._echo_topics:  # the operator's own message back: when the broker passed it on
            body = message.json()
            mark = body.get("mark") if isinstance(body, dict) else None
            if isinstance(mark, str):
                self.echoed.setdefault(mark, self.monotonic())
            return
        parts = split_device_topic(self.spec.prefix, message.topic)
        if parts is not None and len(parts[1]) == 2 and parts[1][0] == ACK and state is not None:
            self._on_ack(state, parts[0], parts[1][1], message)
            return
        if parts is not None and parts[1] == (SHADOW,):
            self.shadow_reports.setdefault(parts[0], []).append((bool(message.retain), message.json()))
            return
        device = self.view.apply(message)
        view = self.view.boxes.get(device) if device is not None else None
        status = parts is not None and len(parts[1]) == 1 and parts[1][0] == STATUS
        # A retained copy says nothing about the box now, and neither does an 'offline' status: a last will is
        # the broker's word for a box that is gone (a re-send it triggered would reach nobody; a box that flaps
        # every 4 s had each of its rollback's re-sends timed by its will into its next absence), a clean stop
        # the box's last word before it leaves.
        if view is not None and not message.retain and not (status and view.state == OFFLINE):
            self.heard[device] = self.monotonic()
            if status:
                self.status_heard[device] = self.heard[device]
        if device is None or state is None:
            return
        online = view is not None and view.online
        was = self.online.get(device)
        self.online[device] = online
        box = state.boxes.get(device)
        if box is None:
            if view is not None and self.spec.group in view.groups:
                self._take_in(state, device)
        elif online and was is False and box.phase == Phase.SENT and device not in self.retry_at:
            self.resend.add(device)

    def _take_in(self, state: RolloutState, device: str) -> None:
        """A box of the group that announced itself after the plan: a last wave (or reported, if too late)."""
        view = self.view.boxes[device]
        rid = request_id(self.rollout_id, device, DEPLOY)
        box = BoxRecord.planned(rid, outcome=Outcome.NOT_STARTED, error="announced itself after the plan")
        if state.status == RolloutStatus.RUNNING and view.online and not view.malformed:
            waves = state.record.waves
            late = state.record.late_wave
            if late is None or late != len(waves) - 1 or any(
                    state.boxes[d].phase != Phase.PLANNED for d in waves[late]):
                waves = waves + [[]]
                late = len(waves) - 1
            waves[late] = waves[late] + [device]
            box = BoxRecord.planned(rid, view.serving, view.last_rollback, wave=late, phase=Phase.PLANNED)
            state.top(waves=waves, late_wave=late)
            self.progress("  %-24s announced itself after the plan: taken into wave %d" % (device, late + 1))
        state.add(device, box)

    def _on_ack(self, state: RolloutState, device: str, topic_rid: str, message: Message) -> None:
        box = state.boxes.get(device)
        if box is None:
            return
        own = topic_rid == box.request_id or (box.revert is not None and topic_rid == box.revert.request_id) or (
            box.shadow is not None and topic_rid in (box.shadow.get("request_id"), box.shadow.get("stop_id")))
        try:
            ack = parse_ack(message.json())
        except ProtocolError as exc:
            if own and box.phase in (Phase.SENT, Phase.DEPLOYED):
                self.finish(state, device, Outcome.MALFORMED, "ack %s: %s" % (topic_rid, exc))
            else:
                self._anomaly(state, device, "malformed ack on %s: %s" % (message.topic, exc))
            return
        if ack.request_id != topic_rid or not own:
            if ack.request_id.startswith(self.rollout_id + ".") and not own:
                self._anomaly(state, device, "published an ack for request %s, not its own" % ack.request_id)
            elif ack.request_id != topic_rid:
                self._anomaly(state, device, "ack on %s names request %s" % (message.topic, ack.request_id))
            return
        key = (device, topic_rid)
        if self._forged(state, device, ack):
            return
        previous = self.acks.get(key)
        if previous is not None and previous.state in FINAL_STATES:
            if ack.state in FINAL_STATES and ack.state != previous.state:
                self._duplicate(state, device, "two different final answers to %s (%s, then %s): two boxes "
                                "answer as %s" % (topic_rid, previous.state, ack.state, device))
            return  # a replayed 'in_progress' must not hide a final ack already seen
        self.acks[key] = ack
        if ack.state in FINAL_STATES:
            self.acked_at[key] = self.monotonic()
        if device in self.anchor and ack.state not in FINAL_STATES and box.phase == Phase.SENT:
            self.anchor[device] = self.monotonic()  # progress restarts the step timeout

    def _forged(self, state: RolloutState, device: str, ack: Ack) -> bool:
        """A refusal the fleet's own signed command cannot get (someone else's unsigned command under its
        request id, refused unrecorded by the box, whose signed one still runs): ignored, logged once per id."""
        code = ack.error.code if ack.state == FAILED and ack.error is not None else None
        if not self.signed or code not in FORGEABLE_REFUSALS:
            return False
        what = "ignored a forged answer to %s: failed %s (someone else's command under this request id; or this " \
               "box holds another command key)" % (ack.request_id, code)
        if (device, ack.request_id, code) not in self._forged_seen:
            self._forged_seen.add((device, ack.request_id, code))
            self._anomaly(state, device, what)
            self.progress("  %-24s %s" % (device, what))
        return True

    def _duplicate(self, state: RolloutState, device: str, why: str) -> None:
        self._anomaly(state, device, why)
        if state.boxes[device].outcome != Outcome.DUPLICATE:
            self.progress("  %-24s DUPLICATE device id: %s" % (device, why))
            self.finish(state, device, Outcome.DUPLICATE, why)

    def _anomaly(self, state: RolloutState, device: str, what: str) -> None:
        kept = state.boxes[device].anomalies + [one_line(what)[:300]]
        state.set(device, anomalies=kept[-ANOMALIES_KEPT:])

    def _check_cancel(self, state: RolloutState) -> None:
        path = self.cancel_path
        if state.status not in (RolloutStatus.RUNNING, RolloutStatus.PAUSED) or not os.path.exists(path):
            return
        try:
            with open(path, encoding="utf-8") as handle:
                request = json.load(handle)
            revert = bool(request.get("revert")) if isinstance(request, dict) else False
        except (OSError, ValueError):
            revert = False
        state.top(status=RolloutStatus.CANCELLED, cancel={"at": self.clock(), "revert": revert},
                  revert=RevertWish.WANTED if revert else None)
        state.save()
        self.progress("CANCELLED by 'fleet cancel'%s; no further box is sent a deploy" % (
            ": moved boxes go back" if revert else ""))
