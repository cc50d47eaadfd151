"""A simulated FleetLink for rollout tests with no broker (a helper module, not a test module): the boxes'
statuses and acks as messages, simulated time instead of waiting, a wall clock that can step. test_fleet,
test_fleet_journal and tests/fixtures/fleet_journal/make_fixture.py import these instead of importing each other.
It needs only ``agent.fleet.link.Message``, so make_fixture.py can run it against an old tree of the engine."""

import json

from agent.fleet.link import Message

SIM_PREFIX = "sim-fleet"
SIM_SHA = "b" * 64
WALL0 = 1.8e9  # the operator's wall clock at simulated time 0
STEP_AT_S = 2.0  # simulated time of the NTP step: after every deadline below has started


class LostBroker(Exception):
    """Test-only: ends a simulated run, as a dropped broker connection ends a real one."""


class SimulatedLink:
    """Test-only stand-in for FleetLink: no broker; ``get`` advances simulated time instead of waiting.

    ``answer(topic, payload)`` returns the messages a command brings back (acks); the wall clock the rollout
    gets is simulated time plus ``step`` once ``STEP_AT_S`` is reached, or ``offset`` between runs.
    """

    def __init__(self, statuses, answer=lambda topic, payload: [], step=0.0, start=0.0, offset=0.0,
                 lose_at=None, lag=0.0):
        self.mono = start
        self.lag = lag  # what the operator publishes on a topic it subscribed to comes back this much later
        self.subscribed = set()
        self.start = start
        self.step = step
        self.offset = offset
        self.lose_at = lose_at
        self.answer = answer
        self.queue = [Message("%s/%s/status" % (SIM_PREFIX, d), json.dumps(b).encode(), True)
                      for d, b in statuses.items()]
        self.published = []  # (simulated time, topic)
        self.later = []  # (simulated time, message): what boxes say on their own, later
        self.marks = {}

    def wall(self):
        stepped = self.mono - self.start >= STEP_AT_S
        return WALL0 + self.offset + self.mono + (self.step if stepped else 0.0)

    def subscribe(self, topics):
        self.subscribed.update(topics)

    def publish(self, topic, payload):
        self.published.append((self.mono, topic))
        if topic in self.subscribed:  # a broker sends a client's own message back to its subscription (no wildcards)
            echo = Message(topic, json.dumps(payload).encode(), False)
            if self.lag:
                self.later.append((self.mono + self.lag, echo))
            else:
                self.queue.append(echo)
        self.queue.extend(self.answer(topic, payload))

    def get(self, timeout):
        if self.queue:
            return self.queue.pop(0)
        self.mono += timeout
        due = [m for at, m in self.later if at <= self.mono]
        self.later = [(at, m) for at, m in self.later if at > self.mono]
        self.queue.extend(due)
        if self.lose_at is not None and self.mono - self.start >= self.lose_at:
            raise LostBroker()
        assert self.mono - self.start < 10 * 86400, "a deadline never came"
        return None

    def progress(self, line):
        if line.startswith("waiting up to"):
            self.marks["wait"] = self.mono
        for mark in ("timed_out", "revert: not settled"):  # the moment a deadline ended (the final check follows)
            if mark in line:
                self.marks.setdefault(mark, self.mono)


def _online(device):
    return {"state": "online", "groups": ["sim"], "slots": {"serving": "a", "slots": {"a": {
        "name": "m", "version": "1", "manifest_sha256": "a" * 64, "state": "confirmed"}}}}


def _ack(device, payload, state, **fields):
    body = dict(fields, request_id=payload["request_id"], verb="deploy", state=state)
    return Message("%s/%s/ack/%s" % (SIM_PREFIX, device, payload["request_id"]), json.dumps(body).encode(), False)
