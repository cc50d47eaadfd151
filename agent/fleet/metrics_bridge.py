"""``fleet metrics``: the boxes' own status and telemetry, heard over MQTT, served as Prometheus series.

For boxes Prometheus cannot reach (behind NAT, on cellular): the bridge subscribes to every box's retained
``status`` and its ``telemetry`` (never alerts, results or acks), asks the boxes to announce themselves once
connected, and answers each scrape from what it kept. Statuses are folded by :class:`FleetView` (the parsing
``fleet status`` and the rollout engine use), and a box's state follows ``fleet status``'s rule
(:func:`too_quiet`): an ``online`` box silent for more than three of its telemetry intervals is ``stale``.

**Bounded memory per box.** Of a status the view keeps the parsed fields and the serving slot's entry only (the
rest of the slot table is dropped after each status); of telemetry a handful of numbers and at most
:data:`SOURCES_KEPT` frame ages; label values are cut to :data:`LABEL_MAX` characters. No payload is kept.
A box not heard of for ``forget_after_s`` (:data:`DEFAULT_FORGET_AFTER_S`; its newest time is the later of
its own timestamps and when the bridge last heard it live) is dropped from every series; it comes back when it
speaks again. Rollouts come from the state directory (read only, through :class:`RolloutState`), those whose
files changed within ``forget_after_s``.

The bridge owns reconnecting (the link does not): a lost broker is retried every :data:`RECONNECT_S`, the
series stay (``atlas_edge_fleet_bridge_connected`` says 0) and ages keep growing, so boxes turn ``stale``.
``prometheus_client`` (the ``metrics`` extra) is imported when the series are built, not at import time.
"""

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from agent.fleet.inventory import Inventory, record_path
from agent.fleet.journal import RolloutReader, RolloutState
from agent.fleet.link import FleetLink, LinkError, Message
from agent.fleet.plan import RolloutError
from agent.fleet.records import BoxState, Outcome, Phase, RolloutStatus
from agent.fleet.status import FleetView, too_quiet
from agent.protocol.status import SlotsView
from agent.protocol.topics import STATUS, TELEMETRY, announce_topic, device_topic, split_device_topic

log = logging.getLogger(__name__)

DEFAULT_PORT = 9469  # beside the box endpoint's; 127.0.0.1 unless --listen names another address
DEFAULT_FORGET_AFTER_S = 24 * 3600.0  # a box silent for a day has left: its series go
STATES = (BoxState.ONLINE, BoxState.STALE, BoxState.OFFLINE, BoxState.MALFORMED,
          BoxState.UNKNOWN)  # unknown: heard only by its telemetry, no status yet
SOURCES_KEPT = 16  # frame ages kept per box (a box's sources, by name); more are not mirrored
LABEL_MAX = 120  # characters of a label value taken from a box's message
RECONNECT_S = 5.0  # between attempts after the broker was lost
POLL_S = 1.0  # the loop's wait for a message: how soon a stop is seen
FORGET_EVERY_S = 60.0  # how often the loop drops boxes silent past forget-after (each scrape does too)
MIB = 1024.0 * 1024.0
IN_FLIGHT = (Phase.PLANNED, Phase.SENT, Phase.DEPLOYED)  # a rollout box's state before it has an outcome
ROLLOUT_STATES = tuple(str(p) for p in IN_FLIGHT) + tuple(str(o) for o in Outcome)


@dataclass
class Figures:
    """What the bridge keeps of one box beside its :class:`BoxView`: telemetry's numbers and when it spoke."""

    frames: Optional[float] = None  # frames served since the daemon started (its own count)
    busy: Optional[float] = None
    rss_bytes: Optional[float] = None
    outbox: Optional[float] = None
    ages: Dict[str, float] = field(default_factory=dict)  # source -> frame age p50, seconds
    heard_at: Optional[float] = None  # the bridge's clock at its latest live message
    first_at: float = 0.0  # the bridge's clock when it was first heard of (a status with no time at all)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _label(value: Any) -> str:
    return "" if value is None else str(value)[:LABEL_MAX]


def read_telemetry(body: Dict[str, Any], figures: Figures) -> None:
    """Fold the numbers the bridge mirrors from one telemetry message (docs/mqtt.md) into ``figures``."""
    figures.frames = _number(body.get("frames"))
    figures.busy = _number(body.get("backend_busy_fraction"))
    total = _number(body.get("total_rss_mb"))  # the daemon and its camera workers: what MemoryMax counts
    total = total if total is not None else _number(body.get("rss_mb"))
    figures.rss_bytes = None if total is None else total * MIB
    mqtt = body.get("mqtt")
    figures.outbox = _number(mqtt.get("outbox_messages")) if isinstance(mqtt, dict) else None
    ages: Dict[str, float] = {}
    sources = body.get("sources")
    for name, report in sorted(sources.items())[:SOURCES_KEPT] if isinstance(sources, dict) else ():
        age = report.get("frame_age_ms") if isinstance(report, dict) else None
        p50 = _number(age.get("p50")) if isinstance(age, dict) else None
        if p50 is not None:
            ages[_label(name)] = p50 / 1000.0
    figures.ages = ages


class BridgeState:
    """Every box heard under ``prefix`` (a :class:`FleetView` and its :class:`Figures`), behind one lock: the MQTT
    loop writes, scrapes read. ``groups``: only boxes of one of these are exported (all when empty)."""

    def __init__(self, prefix: str, groups: Sequence[str] = (), state_dir: Optional[str] = None,
                 forget_after_s: float = DEFAULT_FORGET_AFTER_S, clock: Callable[[], float] = time.time) -> None:
        self.prefix = prefix
        self.groups = set(groups)
        self.forget_after_s = forget_after_s
        self.clock = clock
        self.view = FleetView(prefix)
        self.figures: Dict[str, Figures] = {}
        self.rollouts = RolloutReader(state_dir, _read_rollout, forget_after_s) if state_dir else None
        if state_dir:  # a recorded box whose status turns unreadable stays in its group's series (as malformed)
            self.view.known_groups.update(Inventory(record_path(state_dir, prefix), prefix).known_groups())
        self.connected: Dict[str, bool] = {}  # broker -> connected now
        self.messages = 0
        self.forgotten = 0
        self.lock = threading.Lock()

    def subscriptions(self) -> List[str]:
        """Every box's status and telemetry; alerts are not mirrored (their payloads are unbounded)."""
        return [device_topic(self.prefix, "+", STATUS), device_topic(self.prefix, "+", TELEMETRY)]

    def apply(self, message: Message) -> Optional[str]:
        """Fold one message in (status or telemetry); returns its device, None for anything else."""
        parts = split_device_topic(self.prefix, message.topic)
        if parts is None or parts[1] not in ((STATUS,), (TELEMETRY,)):
            return None
        now = self.clock()
        with self.lock:
            self.messages += 1
            device = self.view.apply(message)
            if device is None:
                return None
            box = self.view.boxes.get(device)
            if box is None:  # a cleared retained status: decommissioned
                self.figures.pop(device, None)
                return device
            figures = self.figures.setdefault(device, Figures(first_at=now))
            if not message.retain:
                figures.heard_at = now
            body = message.json() if parts[1] == (TELEMETRY,) else None
            if isinstance(body, dict):
                read_telemetry(body, figures)
            serving = box.serving
            box.slots = SlotsView(serving=box.serving_slot, slots={box.serving_slot or "": serving}) \
                if serving is not None else None
            self.view.identities.pop(device, None)  # duplicate ids are fleet status's question, not a series
            self.view.cleared.discard(device)
        return device

    def last_word(self, device: str) -> float:
        """The newest time the box spoke: its own timestamps, when it was heard live, else first heard of."""
        box, figures = self.view.boxes[device], self.figures.get(device) or Figures()
        times = [t for t in (box.last_seen, figures.heard_at) if t is not None]
        return max(times) if times else figures.first_at

    def state(self, device: str, now: float) -> str:
        """``fleet status``'s state: ``online`` turns ``stale`` when silent too long (:func:`too_quiet`)."""
        box = self.view.boxes[device]
        if box.state == BoxState.ONLINE and too_quiet(self.last_word(device), box.telemetry_interval_s, now):
            return BoxState.STALE
        return box.state if box.state in STATES else BoxState.UNKNOWN

    def forget(self, now: float) -> List[str]:
        """Drop every box silent for longer than ``forget_after_s``; returns their ids."""
        with self.lock:
            gone = [d for d in self.view.boxes if now - self.last_word(d) > self.forget_after_s]
            for device in gone:
                self.view.boxes.pop(device, None)
                self.figures.pop(device, None)
            self.forgotten += len(gone)
        if gone:
            log.info("forgot %d box(es) silent for over %.0f s: %s", len(gone), self.forget_after_s,
                     ", ".join(gone[:10]))
        return gone

    def exported(self) -> Iterator[str]:
        return (d for d in sorted(self.view.boxes) if not self.groups or
                self.groups.intersection(self.view.boxes[d].groups))

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape (prometheus_client's collector protocol)."""
        now = self.clock()
        self.forget(now)
        with self.lock:
            families = _box_families(self, now)
            families += _bridge_families(self)
        if self.rollouts is not None:
            families += _rollout_families(self.rollouts.recent(now))
        return iter(families)


def _box_families(bridge: "BridgeState", now: float) -> List[Any]:
    """The per-box series and the totals by state (caller holds the lock)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    pre = "atlas_edge_fleet_"
    totals = GaugeMetricFamily(pre + "boxes", "Boxes by state, by fleet status's rule", labels=["state"])
    info = GaugeMetricFamily(pre + "box_info", "A box's identity and serving model (always 1)", labels=[
        "device", "group", "kind", "model", "version", "backend", "precision"])
    state = GaugeMetricFamily(pre + "box_state", "1 for the box's current state, 0 for the others",
                              labels=["device", "group", "state"])
    seen = GaugeMetricFamily(pre + "box_last_seen_seconds", "Unix time the box last spoke",
                             labels=["device", "group"])
    frames = CounterMetricFamily(pre + "box_frames_served", "Frames served, the box's own count since its "
                                 "daemon started", labels=["device", "group"])
    age = GaugeMetricFamily(pre + "box_frame_age_seconds", "Median age of a source's frames when its results "
                            "went out", labels=["device", "group", "source"])
    busy = GaugeMetricFamily(pre + "box_backend_busy_ratio", "Fraction of time the backend was busy",
                             labels=["device", "group"])
    rss = GaugeMetricFamily(pre + "box_resident_memory_bytes", "RSS of the daemon and its camera workers",
                            labels=["device", "group"])
    outbox = GaugeMetricFamily(pre + "box_outbox_messages", "Messages waiting in the box's outbox",
                               labels=["device", "group"])
    counts = dict.fromkeys(STATES, 0)
    for device in bridge.exported():
        box, figures = bridge.view.boxes[device], bridge.figures.get(device) or Figures()
        current = bridge.state(device, now)
        counts[current] += 1
        ids = [_label(device), _label(",".join(sorted(box.groups)))]
        serving = box.serving
        info.add_metric(ids + [_label(box.kind), _label(serving.name if serving is not None and serving.name
                                                        else box.model),
                               _label(serving.version if serving is not None else None), _label(box.backend),
                               _label(box.precision)], 1)
        for name in STATES:
            state.add_metric(ids + [name.value], 1 if name == current else 0)
        seen.add_metric(ids, bridge.last_word(device))
        for family, value in ((frames, figures.frames), (busy, figures.busy), (rss, figures.rss_bytes),
                              (outbox, figures.outbox)):
            if value is not None:
                family.add_metric(ids, value)
        for source, seconds in figures.ages.items():
            age.add_metric(ids + [source], seconds)
    for name in STATES:
        totals.add_metric([name.value], counts[name])
    return [totals, info, state, seen, frames, age, busy, rss, outbox]


def _bridge_families(bridge: "BridgeState") -> List[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    connected = GaugeMetricFamily("atlas_edge_fleet_bridge_connected", "1 while the bridge is connected to this "
                                  "broker", labels=["broker"])
    for broker, up in sorted(bridge.connected.items()):
        connected.add_metric([broker], 1 if up else 0)
    messages = CounterMetricFamily("atlas_edge_fleet_bridge_messages", "Status and telemetry messages folded in")
    messages.add_metric([], bridge.messages)
    forgotten = CounterMetricFamily("atlas_edge_fleet_bridge_boxes_forgotten", "Boxes dropped after "
                                    "--forget-after of silence")
    forgotten.add_metric([], bridge.forgotten)
    return [connected, messages, forgotten]


def _rollout_families(progress: Dict[str, Tuple[str, Dict[str, int]]]) -> List[Any]:
    from prometheus_client.core import GaugeMetricFamily

    boxes = GaugeMetricFamily("atlas_edge_fleet_rollout_boxes", "A rollout's boxes by outcome (planned, sent, "
                              "deployed while in flight)", labels=["rollout", "state"])
    status = GaugeMetricFamily("atlas_edge_fleet_rollout_status", "1 for the rollout's current status",
                               labels=["rollout", "status"])
    for rollout, (current, counts) in sorted(progress.items()):
        for name in ROLLOUT_STATES:
            boxes.add_metric([rollout, name], counts.get(name, 0))
        for name in RolloutStatus:
            status.add_metric([rollout, str(name)], 1 if str(name) == current else 0)
    return [boxes, status]


def _read_rollout(path: str) -> Optional[Tuple[str, Dict[str, int]]]:
    try:
        state = RolloutState.load(path)
    except (RolloutError, OSError) as exc:  # one damaged or foreign file must not cost the others
        log.warning("rollout state %s not read: %s", path, exc)
        return None
    if state is None:
        return None
    counts: Dict[str, int] = {}
    for box in state.boxes.values():
        key = str(box.outcome) if box.outcome is not None else str(box.phase)
        counts[key] = counts.get(key, 0) + 1
    return str(state.status), counts


class MetricsServer:
    """The text exposition of ``registry`` on ``GET /metrics`` (and ``/``), one thread per scrape."""

    def __init__(self, host: str, port: int, registry: Any) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # a scrape every 15 s is not news
                return

        server_class = type("Server", (ThreadingHTTPServer,), {"daemon_threads": True})
        if ":" in host:
            import socket

            server_class.address_family = socket.AF_INET6
        self.httpd = server_class((host, port), Handler)
        self.address = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fleet-metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)


def registry_for(bridge: BridgeState) -> Any:
    """A registry holding only the bridge's series (not the process's default collectors)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(bridge)  # type: ignore[arg-type]  # a collector: it has collect()
    return registry


def run_bridge(bridge: BridgeState, connect: Callable[[], FleetLink], stop: threading.Event,
               reconnect_s: float = RECONNECT_S) -> None:
    """Fold the boxes' messages into ``bridge`` until ``stop`` is set, reconnecting through ``connect`` (which
    raises LinkError when no broker takes the connection). The first connection has been made by the caller's
    ``connect`` beforehand when it wants a failure to end the command."""
    while not stop.is_set():
        try:
            link = connect()
        except LinkError as exc:
            log.warning("fleet metrics: %s; retrying in %.0f s", exc, reconnect_s)
            stop.wait(reconnect_s)
            continue
        try:
            _serve_link(bridge, link, stop)
        except LinkError as exc:
            log.warning("fleet metrics: %s; reconnecting in %.0f s", exc, reconnect_s)
            stop.wait(reconnect_s)
        finally:
            with bridge.lock:
                bridge.connected[link.where] = False
            link.close()


def _serve_link(bridge: BridgeState, link: FleetLink, stop: threading.Event) -> None:
    link.subscribe(bridge.subscriptions())
    link.publish(announce_topic(bridge.prefix), {"ts": time.time()})  # after the SUBACK: no answer missed
    with bridge.lock:
        bridge.connected = {link.where: True}
    log.info("fleet metrics: listening to %s under %s", link.where, bridge.prefix)
    forget_at = time.monotonic() + FORGET_EVERY_S
    while not stop.is_set():
        if time.monotonic() >= forget_at:  # also without scrapes: memory stays bounded by the boxes heard lately
            bridge.forget(bridge.clock())
            forget_at = time.monotonic() + FORGET_EVERY_S
        message = link.get(POLL_S)
        while message is not None:
            bridge.apply(message)
            message = link.get(0.0)
