"""Protocol-only simulated boxes: many per process, one thread, one select loop; paho and the stdlib only.

These boxes know nothing of ``agent``: they speak the box protocol as docs/mqtt.md and docs/fleet.md write
it (a retained ``status`` with the slot table, its last will, ``cmd/deploy`` and ``cmd/rollback`` answered on
``ack/<request_id>`` as ``accepted`` -> ``in_progress`` -> ``succeeded`` | ``failed``, a request record that
answers a repeated request id without running it twice; ``cmd/shadow`` answered ``running`` and a retained final
report on ``shadow`` ``shadow_s`` later, docs/shadow.md; any other verb ``unknown_verb``, as a box that lacks
it). So a test of the operator tools against them shows what the tools do with what any box could send, not with
what this project's daemon happens to send.

Each box may carry one fault (:data:`FAULTS`): the misbehaviours an operator meets in a real fleet. The
``BoxFleet`` runs every box's paho client in one thread with a select loop (no thread per box), so a
thousand boxes cost a few MiB and a test of twenty stays cheap on a shared machine. Everything a box does
happens on that thread; other threads act through :meth:`BoxFleet.call`.

Sessions follow the box's policy (docs/architecture.md, "Broker sessions"): clean, commands subscribed at QoS 0,
the status published on every connect; after a lost connection a box tries the fleet's next broker (``hosts``, a
cluster's nodes) ``reconnect_s`` (:data:`RECONNECT_S`) later, in turn, as a daemon with ``mqtt.hosts`` does.
"""

import heapq
import json
import os
import queue
import selectors
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import paho.mqtt.client as mqtt

OLD = {"name": "shapes", "version": "1.0.0", "manifest_sha256": "1" * 64}
FAULTS = (
    "hang",              # accepts a deploy, says it started, then nothing
    "lwt_old",           # its connection dies in its first deploy (last will); back after away_s on the old model
    "lwt_new",           # the same, but back on the new model (that deploy had finished)
    "wrong_sha",         # its deploy 'succeeds' with another manifest than the one pinned
    "bad_slots",         # its retained status has slots.slots as a list
    "bad_rollback",      # its retained status has last_rollback as a string
    "bad_result",        # its success ack carries "result": "ok"
    "forge",             # on its own ack topic, it publishes a failed ack with another box's request id
    "clone",             # a second box with the same device id (a cloned SD card): it fails every deploy
    "late",              # confirms only after late_s (past the operator's timeout)
    "dup_acks",          # sends every final ack twice
    "busy_once",         # the first deploy is answered failed 'busy' (another command was running)
    "interrupted_once",  # the first deploy is answered failed 'interrupted' (it restarted meanwhile)
    "roll_back",         # deploys, then rolls the new model back itself in its window (latency)
    # issue 30: what the report got wrong before the final check and the re-sends
    "crash_after_confirm",  # confirms, dies crash_s later (no DISCONNECT) and is back after away_s on the old model
    "late_ack",          # runs its deploy silently ('accepted' only) and answers late_s later (past --step-timeout)
    "malformed_status",  # the status right after its switch is malformed (slots.slots a list); later ones are good
    "flapping",          # loses its connection every flap_s, back away_s later (what was sent meanwhile is lost)
    "announce_only",     # publishes its status only when asked (an announce), never on its own
    "no_announce",       # predates the announce: never answers one, its retained status is old; telemetry every 2 s
    "away_on_rollback",  # the first rollback finds it away (lost); back away_s later on what it served
    # issue 39: gated rollouts
    "disagree",          # its shadow run of any candidate measures score-aware F1 params["f1"] (default 0.40)
    "no_shadow",         # an agent from before shadow runs: answers the shadow verb unknown_verb
    "slow_shadow",       # answers its shadow command params["load_s"] (1.0) late (the candidate loading), and its
                         # run, which needs params["run_s"] (60) for its frames, ends at the command's max_s from then
                         # with a share of them compared, as the real run does (agent/pipeline/shadow.py)
    "mute_shadow",       # never answers its shadow command (the command was lost on the way)
)
AGREEING_F1 = 0.985  # the shadow report of a box without the disagree fault
# Statuses no reader parses (SimBox.make_unreadable): its body inside a JSON list; its body with a field nested
# 40 levels deep, past agent.protocol.messages.JSON_DEPTH_MAX (32), which the operator refuses before parsing.
UNREADABLE: Dict[str, Callable[[Dict[str, Any]], bytes]] = {
    "list": lambda body: json.dumps([body]).encode("utf-8"),
    "deep": lambda body: json.dumps(dict(body, extra=json.loads("[" * 40 + "]" * 40))).encode("utf-8"),
}
TELEMETRY_S = 2.0  # a no_announce box's telemetry interval
TICK_S = 0.05
RECONNECT_S = 0.5  # the daemon's reconnect_min_s: a box whose broker is gone tries the next one this much later
SUBSCRIBE_QOS = 0  # the daemon's (agent.ops.connection.SUBSCRIPTION_QOS): nothing durable homed on a node


def _empty() -> Dict[str, Any]:
    return {"state": "empty", "name": None, "version": None, "manifest_sha256": None, "since": None}


class SimBox:
    """One box: its slot table, its request record, its one fault; driven by the fleet's loop thread."""

    def __init__(self, fleet: "BoxFleet", device: str, groups: List[str], fault: Optional[str] = None,
                 params: Optional[Dict[str, Any]] = None, password: Optional[str] = None,
                 client_suffix: str = "") -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError("unknown fault %r (one of %s)" % (fault, ", ".join(FAULTS)))
        self.fleet = fleet
        self.device = device
        self.groups = groups
        self.fault = fault
        self.params = params or {}
        self.password = password
        self.client_id = "sim-%s%s" % (device, client_suffix)
        self.slots: Dict[str, Any] = {"serving": "a", "slots": {"a": dict(OLD, state="confirmed", since="t0"),
                                                               "b": _empty()}}
        self.record: Dict[str, Dict[str, Any]] = {}  # request id -> final ack
        self.deploys = 0  # deploy commands run (not answered from the record)
        self.shadow_reported_at: Optional[float] = None  # monotonic time its last final shadow report went out
        self.deploy_received_at: Optional[float] = None  # monotonic time its first deploy command arrived
        self.rollbacks = 0
        self.commands: List[Tuple[str, Dict[str, Any]]] = []  # (verb, payload) as received
        self.client: Optional[Any] = None
        self.connected = False
        self.broker = 0  # index in fleet.brokers of the broker it is on (or tries next)
        self._epoch = 0  # bumps at each drop: a reconnect scheduled before it is void
        self._busy = False
        self._faulted_once = False
        self._pending_token = 0  # bumps when a pending model is resolved: cancels its confirm timer
        self._running: Dict[str, str] = {}  # request id -> verb, while it runs: a repeat is answered in_progress
        self._malformed_next = False  # malformed_status: the next status has slots.slots as a list
        self.unreadable: Optional[str] = None  # set by make_unreadable(): every status from then on has that shape

    # --- connection --------------------------------------------------------------------------------------

    def topic(self, *parts: str) -> str:
        return "/".join((self.fleet.prefix, self.device) + parts)

    def status_body(self, state: str = "online") -> Dict[str, Any]:
        slots = json.loads(json.dumps(self.slots))
        if self.fault == "bad_slots" or self._malformed_next:
            self._malformed_next = False
            slots["slots"] = list(slots["slots"].values())
        elif self.fault == "bad_rollback":
            slots["last_rollback"] = "rolled back at some point"
        serving = self.slots["slots"][self.slots["serving"]]
        # docs/mqtt.md's status: the id under device_id (and device, as always), the kind under device_kind
        old = self.fault == "no_announce" and not self._faulted_once  # its retained status from long ago
        return {"state": state, "device_id": self.device, "device": self.device,
                "device_kind": self.params.get("kind", "sim"), "ts": time.time() - (600.0 if old else 0.0),
                "model": "%s %s" % (serving["name"], serving["version"]), "backend": self.params.get("backend", "sim"),
                "groups": list(self.groups), "slots": slots}

    def connect(self) -> None:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id, clean_session=True,
                             reconnect_on_failure=False)
        if self.password is not None:
            client.username_pw_set(self.device, self.password)
        will = {"state": "offline", "device_id": self.device, "device": self.device, "reason": "connection lost",
                "groups": self.groups}
        if not self.params.get("no_will"):  # no_will: as on RabbitMQ, whose dead node fires no will
            client.will_set(self.topic("status"), json.dumps(will), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.on_disconnect = lambda c, u, f, rc, p: self._lost(c)
        host, port = self.fleet.brokers[self.broker]
        try:
            client.connect(host, port, keepalive=60)
        except OSError:  # a dead node refuses at once: the next one, a moment later
            self._retry()
            return
        self.client = client
        self.fleet.watch(client)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            return
        self.connected = True
        groups = ["/".join((self.fleet.prefix, "group", g, "cmd", "announce")) for g in self.groups]
        client.subscribe([(self.topic("cmd", "#"), SUBSCRIBE_QOS), ("%s/announce" % self.fleet.prefix, SUBSCRIBE_QOS)]
                         + [(topic, SUBSCRIBE_QOS) for topic in groups])
        self.publish_status()
        if self.fault == "no_announce" and not self._faulted_once:
            self._faulted_once = True  # its first status was the old retained one; the telemetry starts now
            self.fleet.later(TELEMETRY_S, self._telemetry)
        if self.fault == "flapping":
            self.fleet.later(self.params.get("flap_s", 3.0), lambda: self.away(self.params.get("away_s", 1.0)))

    def _telemetry(self) -> None:
        self.send(self.topic("telemetry"), {"ts": time.time(), "fps": 10.0})
        self.fleet.later(TELEMETRY_S, self._telemetry)

    def _lost(self, client: Any) -> None:
        """Its broker dropped it (or refused its CONNACK): the next broker, ``fleet.reconnect_s`` later."""
        if client is self.client:
            self.drop()
            self._retry()

    def _retry(self) -> None:
        self.broker = (self.broker + 1) % len(self.fleet.brokers)
        epoch = self._epoch
        self.fleet.later(self.fleet.reconnect_s, lambda: self.connect() if epoch == self._epoch else None)

    def drop(self) -> None:
        """Lose the connection without a DISCONNECT: the broker publishes the last will (offline)."""
        client, self.client, self.connected = self.client, None, False
        self._epoch += 1
        if client is not None:
            self.fleet.unwatch(client)
            sock = client.socket()
            if sock is not None:
                sock.close()

    def stop(self) -> None:
        """A clean stop: status offline ('stopped'), then DISCONNECT (no will)."""
        if self.client is not None and self.connected:
            self.send(self.topic("status"), {"state": "offline", "device_id": self.device, "device": self.device,
                                             "reason": "stopped",
                                             "groups": self.groups}, retain=True)
            self.client.disconnect()
        self.drop()

    def away(self, seconds: float, then: Optional[Callable[[], None]] = None) -> None:
        """Connection dies now; back after ``seconds`` (``then`` runs just before it reconnects)."""
        self.drop()

        def back() -> None:
            if then is not None:
                then()
            self.connect()

        self.fleet.later(seconds, back)

    def send(self, topic: str, body: Any, retain: bool = False) -> None:
        if self.client is not None:
            self.client.publish(topic, json.dumps(body), qos=1, retain=retain)

    def publish_status(self, asked: bool = False) -> None:
        if self.fault == "announce_only" and not asked:
            return
        if self.unreadable is not None:
            payload = UNREADABLE[self.unreadable](self.status_body())
            if self.client is not None:
                self.client.publish(self.topic("status"), payload, qos=1, retain=True)
            return
        self.send(self.topic("status"), self.status_body(), retain=True)

    def make_unreadable(self, shape: str) -> None:
        """From now on its status (published now, retained, and each answer to an announce) has ``shape`` of
        :data:`UNREADABLE`: a box the operator knew, whose status then turns into something no reader parses."""
        if shape not in UNREADABLE:
            raise ValueError("unknown shape %r (one of %s)" % (shape, ", ".join(UNREADABLE)))
        self.unreadable = shape
        self.publish_status()

    def ack(self, request_id: str, verb: str, state: str, **fields: Any) -> None:
        body = dict(fields, request_id=request_id, verb=verb, state=state, ts=time.time())
        if state in ("succeeded", "failed"):
            self.record[request_id] = body
        self.send(self.topic("ack", request_id), body)
        if state in ("succeeded", "failed") and self.fault == "dup_acks":
            self.send(self.topic("ack", request_id), body)

    # --- commands ----------------------------------------------------------------------------------------

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        verb = message.topic.rsplit("/", 1)[-1]
        if verb == "announce":  # the fleet's or a group's: answered with the status (a box that predates it: not)
            if self.fault != "no_announce":
                self.publish_status(asked=True)
            return
        try:
            body = json.loads(message.payload.decode("utf-8"))
            rid = body["request_id"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return
        self.commands.append((verb, body))
        if rid in self.record:  # a retry: answered from the record, never run twice
            self.send(self.topic("ack", rid), self.record[rid])
            return
        if rid in self._running:  # sent again while it runs: still running
            self.ack(rid, verb, "in_progress", message="already running")
            return
        if verb == "rollback" and self.fault == "away_on_rollback" and not self._faulted_once:
            self._faulted_once = True  # it never read this rollback
            self.away(self.params.get("away_s", 2.0))
            return
        if verb == "deploy":
            if self.deploy_received_at is None:
                self.deploy_received_at = time.monotonic()
            self._deploy(rid, body)
        elif verb == "rollback":
            self._rollback(rid)
        elif verb == "shadow" and self.fault == "mute_shadow":
            pass  # lost on the way: never answered
        elif verb == "shadow" and self.fault == "slow_shadow":
            self.fleet.later(self.params.get("load_s", 1.0), lambda: self._shadow(rid, body))
        elif verb == "shadow" and self.fault != "no_shadow":
            self._shadow(rid, body)
        elif verb == "shadow-stop" and self.fault != "no_shadow":
            self.ack(rid, verb, "succeeded", result={"stopped": False, "discarded": bool(body.get("discard"))})
        else:  # as the real dispatcher answers a verb it does not have
            self.ack(rid, verb, "failed", error={"code": "unknown_verb", "message": "unknown verb %r" % verb,
                                                 "field": "verb"})

    def _shadow(self, rid: str, body: Dict[str, Any]) -> None:
        """Answered running at once; a finished report (retained) shadow_s later, its F1 by the box's fault."""
        bundle = self.fleet.bundles.get(str(body.get("bundle")))
        if bundle is None or bundle["manifest_sha256"] != body.get("sha256"):
            self.ack(rid, "shadow", "failed", error={"code": "fetch", "message": "no such bundle: %s" %
                                                     body.get("bundle")})
            return
        frames = int(body.get("frames", 200))
        self.ack(rid, "shadow", "succeeded", result={"state": "running", "frames": frames})
        f1 = self.params.get("f1", 0.40) if self.fault == "disagree" else AGREEING_F1
        length, reason = self.fleet.shadow_s, "compared %d frames" % frames
        if self.fault == "slow_shadow":
            max_s = float(body.get("max_s", 900))
            length, frames = max_s, int(frames * max_s / self.params.get("run_s", 60.0))
            reason = "max_s (%g s) reached after %d frames" % (max_s, frames)

        def report() -> None:
            figures = {"tp": 0, "fp": 0, "fn": 0, "precision": f1, "recall": f1, "f1": f1, "f1_interval": [f1, f1]}
            self.send(self.topic("shadow"), {
                "state": "finished", "reason": reason, "candidate": dict(bundle),
                "reference": self.serving(), "frames_compared": frames, "dropped_busy": 0, "candidate_errors": 0,
                "agreement": {"frames": frames, "reference_detections": 4 * frames, "strict": figures,
                              "score_aware": figures, "per_label": {"circle": figures}}}, retain=True)
            self.shadow_reported_at = time.monotonic()

        self.fleet.later(length, report)

    def _deploy(self, rid: str, body: Dict[str, Any]) -> None:
        if self._busy:
            self.ack(rid, "deploy", "failed", error={"code": "busy", "message": "another deploy is running"})
            return
        once = {"busy_once": "busy", "interrupted_once": "interrupted"}.get(self.fault or "")
        if once and not self._faulted_once:
            self._faulted_once = True
            self.ack(rid, "deploy", "accepted")
            self.ack(rid, "deploy", "failed", error={"code": once, "message": "simulated %s" % once})
            return
        if self.fault == "clone":
            self.ack(rid, "deploy", "failed", error={"code": "invalid", "message": "this clone cannot load it"})
            return
        self.ack(rid, "deploy", "accepted")
        self.ack(rid, "deploy", "in_progress", message="fetching %s" % body.get("bundle"))
        if self.fault == "forge":
            victim = self.params["victim_rid"]
            self.send(self.topic("ack", rid), {"request_id": victim, "verb": "deploy", "state": "failed",
                                               "ts": time.time(), "error": {"code": "invalid", "message": "forged"}})
        if self.fault == "hang":
            return
        self._running[rid] = "deploy"
        self.deploys += 1
        self._busy = True
        bundle = self.fleet.bundles.get(str(body.get("bundle")))
        if bundle is None or bundle["manifest_sha256"] != body.get("sha256"):
            self._busy = False
            self._running.pop(rid, None)
            code, why = ("fetch", "no such bundle") if bundle is None else ("sha256_mismatch", "other manifest")
            self.ack(rid, "deploy", "failed", error={"code": code, "message": "%s: %s" % (why, body.get("bundle"))})
            return
        model = dict(bundle)
        if self.fault == "wrong_sha":
            model["manifest_sha256"] = "e" * 64
        if self.fault in ("lwt_old", "lwt_new") and not self._faulted_once:
            self._faulted_once = True
            self.fleet.later(self.fleet.deploy_s / 2, lambda: self._die_mid_deploy(rid, model))
            return
        delay = self.params.get("late_s", 10.0) if self.fault == "late_ack" else self.fleet.deploy_s
        self.fleet.later(delay, lambda: self._deployed(rid, model))

    def _die_mid_deploy(self, rid: str, model: Dict[str, Any]) -> None:
        self._busy = False
        self._running.pop(rid, None)
        if self.fault == "lwt_new":
            self._install(model)
            self.record[rid] = {"request_id": rid, "verb": "deploy", "state": "succeeded", "ts": time.time(),
                                "result": {"slot": self._pending_slot(), "state": "pending", "model": model}}
            self.away(self.params.get("away_s", 2.0), then=lambda: self._confirm_now(model))
        else:
            self.record[rid] = {"request_id": rid, "verb": "deploy", "state": "failed", "ts": time.time(),
                                "error": {"code": "interrupted", "message": "the agent stopped before this "
                                          "command finished"}}
            self.away(self.params.get("away_s", 2.0))

    def _pending_slot(self) -> str:
        return "b" if self.slots["serving"] == "a" else "a"

    def _install(self, model: Dict[str, Any]) -> None:
        slot = self._pending_slot()
        self.slots["slots"][slot] = dict(model, state="pending", since="t1")
        self.slots["serving"] = slot
        self._pending_token += 1

    def _confirm_now(self, model: Dict[str, Any]) -> None:
        serving = self.slots["serving"]
        other = "a" if serving == "b" else "b"
        self.slots["slots"][serving]["state"] = "confirmed"
        if self.slots["slots"][other]["state"] != "empty":
            self.slots["slots"][other]["state"] = "standby"
        self._pending_token += 1

    def _deployed(self, rid: str, model: Dict[str, Any]) -> None:
        self._busy = False
        self._running.pop(rid, None)
        self._install(model)
        result: Any = {"slot": self.slots["serving"], "state": "pending", "model": model}
        self.ack(rid, "deploy", "succeeded", result="ok" if self.fault == "bad_result" else result)
        self._malformed_next = self.fault == "malformed_status"
        self.publish_status()
        token = self._pending_token
        observe = self.params.get("late_s", 0.0) if self.fault == "late" else self.fleet.observation_s

        def judged() -> None:
            if token != self._pending_token:
                return  # rolled back (or replaced) before its window ended
            if self.fault == "roll_back":
                self._reject("latency p95 over the limit in the observation window")
            else:
                self._confirm_now(model)
            self.publish_status()
            if self.fault == "crash_after_confirm":
                confirmed = self._pending_token  # a rollback before the crash bumps it
                self.fleet.later(self.params.get("crash_s", 0.3), lambda: self.away(
                    self.params.get("away_s", 1.0), then=lambda: self._crashed(confirmed)))

        self.fleet.later(observe, judged)

    def _crashed(self, token: int) -> None:
        """crash_after_confirm: back from the crash on the last confirmed model, unless a rollback came first."""
        if token == self._pending_token:
            self._reject("crashed in probation: back on the last confirmed model")

    def _reject(self, reason: str) -> None:
        pending = self.slots["serving"]
        bad = self.slots["slots"][pending]
        back = "a" if pending == "b" else "b"
        self.slots["last_rollback"] = {"name": bad["name"], "version": bad["version"],
                                       "manifest_sha256": bad["manifest_sha256"], "reason": reason, "at": "t2"}
        self.slots["slots"][pending] = _empty()
        self.slots["serving"] = back
        self.slots["slots"][back]["state"] = "confirmed"
        self._pending_token += 1

    def _rollback(self, rid: str) -> None:
        self.ack(rid, "rollback", "accepted")
        serving = self.slots["serving"]
        current = self.slots["slots"][serving]
        other = "a" if serving == "b" else "b"
        if current["state"] == "pending":
            self._reject("rollback command")
        elif self.slots["slots"][other]["state"] == "standby":
            self.slots["slots"][other]["state"] = "confirmed"
            current["state"] = "standby"
            self.slots["serving"] = other
            self._pending_token += 1
        else:
            self.ack(rid, "rollback", "failed", error={"code": "no_previous", "message": "nothing to go back to"})
            return
        self.rollbacks += 1
        back = self.slots["slots"][self.slots["serving"]]
        self.ack(rid, "rollback", "succeeded", result={"model": {k: back[k] for k in OLD}})
        self.publish_status()

    def serving(self) -> Dict[str, Any]:
        entry = self.slots["slots"][self.slots["serving"]]
        return {"version": entry["version"], "state": entry["state"]}


class BoxFleet:
    """Simulated boxes sharing one loop thread; ``bundles`` maps a bundle string to the model it holds."""

    def __init__(self, host: str, port: int, prefix: str, bundles: Dict[str, Dict[str, Any]],
                 observation_s: float = 0.5, deploy_s: float = 0.2,
                 hosts: Optional[List[Tuple[str, int]]] = None, reconnect_s: float = RECONNECT_S,
                 shadow_s: float = 0.3) -> None:
        self.host, self.port, self.prefix = host, port, prefix
        self.url = "mqtt://%s:%d" % (host, port)
        self.brokers = list(hosts) if hosts else [(host, port)]  # each box starts on the first, then in turn
        self.reconnect_s = reconnect_s  # a longer one keeps a box away while the operator sends (a test's choice)
        self.bundles = bundles
        self.observation_s = observation_s
        self.deploy_s = deploy_s
        self.shadow_s = shadow_s  # a shadow run's length, from its command to its final report
        self.boxes: List[SimBox] = []
        self._clients: Dict[Any, Any] = {}  # socket -> paho client
        self._timers: List[Tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._calls: "queue.Queue[Tuple[Callable[[], Any], queue.Queue]]" = queue.Queue()
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._loop, name="box-fleet", daemon=True)
        self.errors: List[str] = []

    def add(self, device: str, groups: Optional[List[str]] = None, fault: Optional[str] = None,
            **kwargs: Any) -> SimBox:
        box = SimBox(self, device, groups or ["sim"], fault, **kwargs)
        self.boxes.append(box)
        return box

    def start(self, timeout: float = 30.0) -> "BoxFleet":
        """Connect every box (on the loop thread) and wait until each one is connected."""
        self._thread.start()
        self.call(lambda: [box.connect() for box in self.boxes])
        deadline = time.monotonic() + timeout
        while not all(box.connected for box in self.boxes):
            if time.monotonic() > deadline:
                raise TimeoutError("simulated boxes not connected: %s" % [
                    b.device for b in self.boxes if not b.connected][:10])
            time.sleep(0.02)
        return self

    def box(self, device: str) -> SimBox:
        return next(b for b in self.boxes if b.device == device and b.fault != "clone")

    def call(self, action: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``action`` on the loop thread and return its result (boxes are not thread-safe)."""
        answer: "queue.Queue[Any]" = queue.Queue()
        self._calls.put((action, answer))
        ok, value = answer.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def later(self, delay: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (time.monotonic() + delay, self._seq, action))

    def watch(self, client: Any) -> None:
        sock = client.socket()
        self._clients[sock] = client
        self._selector.register(sock, selectors.EVENT_READ, client)

    def unwatch(self, client: Any) -> None:
        for sock, known in list(self._clients.items()):
            if known is client:
                self._forget(sock)

    def _forget(self, sock: Any) -> None:
        self._clients.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(lambda: [box.stop() for box in self.boxes], timeout=10.0)
            except Exception as exc:  # closing: record, never mask the test's own failure
                self.errors.append("close: %s" % exc)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10.0)
        self._selector.close()

    def _loop(self) -> None:
        """epoll through ``selectors`` (a thousand sockets are past ``select``'s limit); writes go out each turn."""
        last_misc = 0.0
        while not self._stop.is_set():
            self._run_calls()
            self._run_timers()
            for sock, client in list(self._clients.items()):
                if client.want_write():
                    self._step(sock, "write")
            if self._clients:
                for key, _ in self._selector.select(TICK_S):
                    self._step(key.fileobj, "read")
            else:
                time.sleep(TICK_S)
            if time.monotonic() - last_misc > 1.0:
                last_misc = time.monotonic()
                for sock in list(self._clients):
                    self._step(sock, "misc")

    def _step(self, sock: Any, what: str) -> None:
        client = self._clients.get(sock)
        if client is None:
            return
        try:
            rc = getattr(client, "loop_" + what)()
        except (OSError, ValueError) as exc:
            self.errors.append("%s: %s" % (what, exc))
            rc = 1
        if rc and rc != mqtt.MQTT_ERR_AGAIN:
            self._forget(sock)

    def _run_calls(self) -> None:
        while True:
            try:
                action, answer = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                answer.put((True, action()))
            except Exception as exc:  # handed back to the caller's thread
                answer.put((False, exc))

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, action = heapq.heappop(self._timers)
            try:
                action()
            except Exception as exc:  # a box's bug must not stop every other box
                self.errors.append("timer: %r" % exc)


def model(version: str, sha: str, name: str = "shapes") -> Dict[str, Any]:
    """A bundle's identity as a box reports it (what ``BoxFleet.bundles`` maps a bundle string to)."""
    return {"name": name, "version": version, "manifest_sha256": sha}


def random_prefix(stem: str = "sim") -> str:
    return "%s-%s" % (stem, os.urandom(3).hex())
