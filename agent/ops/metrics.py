"""The Prometheus endpoint (``metrics: {listen: HOST:PORT}``): the daemon's own figures as ``atlas_edge_*`` series.

A custom collector reads what status and telemetry already hold at scrape time (the serving loop's counters and
cumulative histograms, each source's health, the transport's and the dispatcher's counters, the watchdog's last
memory sample): the serving path pays nothing per frame for the endpoint. docs/metrics.md lists every series; it
is the one list, and tests/unit/ops/test_metrics.py checks this module against it.

No label carries a secret or an unbounded value: sources are named by their config ``name`` (never their URI,
which may hold a password), brokers by ``host:port``, commands by a verb of the protocol's table (anything else
is ``other``), never a frame or request id.

prometheus_client is imported here only, and only when the endpoint is configured (the ``metrics`` extra); the
config refuses ``metrics.listen`` where it is not installed (:class:`agent.config.daemon_config.MetricsConfig`).
"""

import functools
import logging
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, make_server

from agent._util.ratelog import LogLimiter
from agent.config.daemon_config import METRICS_PACKAGE
from agent.protocol.events import EVENT_KEY, Event
from agent.protocol.verbs import verb_names

log = logging.getLogger(__name__)

PREFIX = "atlas_edge_"
# The serving loop's stage names (agent/pipeline/inflight.py, serving.py) -> the ``stage`` label.
STAGES = {"queue": "queue", "preprocess": "preprocess", "wait_backend": "wait", "infer": "infer",
          "postprocess": "postprocess", "publish": "publish", "total": "total"}
SOURCE_STATES = ("connecting", "up", "stalled", "down", "failed")  # agent/pipeline/sources/health.py
WATCHDOG_STATES = ("ok", "no_input", "restart_requested")
# SourceHealth counters of frames a source read and did not serve -> the ``reason`` label.
SOURCE_DROPS = {"skipped": "skipped", "stale_dropped": "stale", "dropped_queue_full": "queue_full",
                "decode_errors": "decode_error"}
MB = 1024 * 1024
JOIN_S = 5.0  # bound on the server thread's end at shutdown

Status = Callable[[], Mapping[str, Any]]


class EventCounts:
    """Model swaps and rollbacks, counted from the daemon's events (rare: a lock is cheap here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.swaps = 0
        self.rollbacks = 0

    def observe(self, event: Mapping[str, Any]) -> None:
        kind = event.get(EVENT_KEY)
        with self._lock:
            if kind == Event.SWITCHED:
                self.swaps += 1
            elif kind == Event.ROLLBACK:
                self.rollbacks += 1


def import_client() -> Any:
    """prometheus_client, or a RuntimeError naming the package and the extra that provides it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise RuntimeError("the metrics endpoint needs %s: %s" % (METRICS_PACKAGE, exc)) from exc
    return prometheus_client


class BoxCollector:
    """Builds every box series from ``status()`` (the daemon's status answer), ``histograms()``
    (:meth:`agent.pipeline.stats.StageStats.histograms`), ``acks()`` (the dispatcher's) and ``events``."""

    def __init__(self, device_id: str, status: Status, histograms: Status,
                 acks: Callable[[], Mapping[Tuple[str, str], int]], events: EventCounts) -> None:
        self.device_id = device_id
        self._status, self._histograms, self._acks, self.events = status, histograms, acks, events
        self._verbs = frozenset(verb_names())
        self._failures = LogLimiter(log)  # a fault that lasts fails every scrape: said a few times, then counted

    def describe(self) -> List[Any]:
        return []  # registering must not run a collection; the families are known at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        try:
            families = self.families(self._status(), self._histograms(), self._acks())
        except Exception as exc:  # a scrape must never hurt the daemon; say why and answer what is always known
            self._failures.log(logging.ERROR, type(exc).__name__, "metrics: collecting the box's series failed: "
                               "%s: %s", type(exc).__name__, exc)
            up = GaugeMetricFamily(PREFIX + "collect_ok", "1 when the last scrape read every figure", labels=["device"])
            up.add_metric([self.device_id], 0)
            families = [up]
        return iter(families)

    def families(self, status: Mapping[str, Any], histograms: Mapping[str, Any],
                 acks: Mapping[Tuple[str, str], int]) -> List[Any]:
        b = _Builder(self.device_id)
        _sources(b, status.get("sources") or {})
        _serving(b, status, histograms)
        _model(b, status, self.events)
        _commands(b, acks, self._verbs)
        _transport(b, status.get("mqtt") or {})
        _health(b, status)
        _shadow(b, status.get("shadow"))
        _drift(b, status.get("drift"))
        b.gauge("collect_ok", "1 when the last scrape read every figure", {}, 1)
        return b.done()


class _Builder:
    """Families by name, each sample with the ``device`` label first."""

    def __init__(self, device_id: str) -> None:
        from prometheus_client import core

        self.core, self.device_id = core, device_id
        self._families: Dict[str, Any] = {}

    def _family(self, kind: str, name: str, doc: str, labels: List[str], prefix: str = PREFIX) -> Any:
        family = self._families.get(name)
        if family is None:
            cls = {"gauge": self.core.GaugeMetricFamily, "counter": self.core.CounterMetricFamily,
                   "histogram": self.core.HistogramMetricFamily}[kind]
            family = self._families[name] = cls(prefix + name, doc, labels=["device"] + labels)
        return family

    def gauge(self, name: str, doc: str, labels: Mapping[str, str], value: Optional[float],
              prefix: str = PREFIX) -> None:
        family = self._family("gauge", name, doc, list(labels), prefix)
        if value is not None:
            family.add_metric([self.device_id] + [str(v) for v in labels.values()], float(value))

    def counter(self, name: str, doc: str, labels: Mapping[str, str], value: Optional[float]) -> None:
        """``name`` without ``_total``: the client library adds it to the exposed series."""
        family = self._family("counter", name, doc, list(labels))
        if value is not None:
            family.add_metric([self.device_id] + [str(v) for v in labels.values()], float(value))

    def histogram(self, name: str, doc: str, labels: Mapping[str, str], snapshot: Mapping[str, Any],
                  scale: float = 1.0) -> None:
        family = self._family("histogram", name, doc, list(labels))
        buckets = [(_bucket_label(bound * scale), count) for bound, count in snapshot["buckets"]]
        family.add_metric([self.device_id] + [str(v) for v in labels.values()], buckets,
                          snapshot["sum"] * scale)

    def done(self) -> List[Any]:
        return list(self._families.values())


@functools.lru_cache(maxsize=64)  # the bounds are fixed (agent/pipeline/stats.py): formatted once, not per scrape
def _bucket_label(bound: float) -> str:
    """A bucket's ``le`` as the client library writes it (``0.005``, ``+Inf``)."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


def _sources(b: _Builder, sources: Mapping[str, Mapping[str, Any]]) -> None:
    for name, health in sorted(sources.items()):
        src = {"source": name}  # the config's name: never the URI (it may carry a password)
        b.counter("frames_read", "frames a source handed to the frame queue", src, health.get("frames"))
        b.counter("frames_served", "frames of a source whose result was handed over", src, health.get("served"))
        for key, reason in SOURCE_DROPS.items():
            b.counter("frames_dropped", "frames a source read and did not serve, by reason",
                      dict(src, reason=reason), health.get(key))
        age = health.get("frame_age_ms") or {}
        b.gauge("frame_age_seconds", "median capture-to-result age of a source's recent results (seconds)", src,
                None if age.get("p50") is None else age["p50"] / 1e3)
        current = str(health.get("state"))
        for state in SOURCE_STATES + (() if current in SOURCE_STATES else (current,)):  # a state added later too
            b.gauge("source_state", "1 for the state a source is in, 0 for the others", dict(src, state=state),
                    1 if current == state else 0)
        b.counter("source_reconnects", "times a source was reopened", src, health.get("reopens"))


def _serving(b: _Builder, status: Mapping[str, Any], histograms: Mapping[str, Any]) -> None:
    b.counter("results_published", "results handed to the broker or the outbox", {}, status.get("published"))
    b.counter("results_discarded", "results not handed over, by reason", {"reason": "publish_error"},
              status.get("publish_errors"))
    for reason, count in sorted(((status.get("mqtt") or {}).get("dropped_by_reason") or {}).items()):
        b.counter("results_discarded", "results not handed over, by reason", {"reason": "outbox_" + reason}, count)
    for stage, snapshot in sorted((histograms.get("stages_ms") or {}).items()):
        if stage in STAGES:
            b.histogram("stage_seconds", "per-frame latency of each serving stage (seconds)",
                        {"stage": STAGES[stage]}, snapshot, scale=1e-3)
    if histograms.get("batch"):
        b.histogram("batch_size", "frames per batch handed to the backend", {}, histograms["batch"])
    b.gauge("backend_busy_ratio", "fraction of recent time the backend was running a call",
            {"backend": status.get("backend") or ""}, status.get("backend_busy_fraction"))


def _model(b: _Builder, status: Mapping[str, Any], events: EventCounts) -> None:
    model = status.get("model_info") or {}  # the serving model in detail (agent.protocol.status.ModelInfo)
    slot = (status.get("slots") or {}).get("serving") or ""
    for tier, artifact in sorted((model.get("artifacts") or {}).items()):
        labels = {"model": model.get("name") or "", "version": model.get("version") or "", "slot": slot,
                  "artifact": artifact, "precision": model.get("precision") or "",
                  "backend": model.get("backend") or "", "tier": tier}
        b.gauge("model_info", "the serving model, one series per input tier", labels, 1)
    b.counter("model_swaps", "models switched to since start", {}, events.swaps)
    b.counter("model_rollbacks", "rollbacks since start", {}, events.rollbacks)


def _drift(b: _Builder, sources: Optional[Mapping[str, Any]]) -> None:
    """Drift per source (agent/pipeline/drift.py): 1 while drifting, and the two figures once judged."""
    for name, figures in sorted((sources or {}).items()):
        src = {"source": name}
        b.gauge("drift_active", "1 while the source drifts from its reference, 0 otherwise", src,
                1 if figures.get("drifting") else 0)
        b.gauge("drift_score_w1", "Wasserstein-1 between the window's reported scores and the reference's", src,
                figures.get("score_w1"))
        b.gauge("drift_detections_change", "relative change in detections per frame against the reference", src,
                figures.get("detections_change"))


def _shadow(b: _Builder, report: Optional[Mapping[str, Any]]) -> None:
    """The last shadow run (docs/shadow.md): its state, sample and agreement, labelled by candidate."""
    if not report:
        return
    candidate = report.get("candidate") or {}
    labels = {"candidate": "%s %s" % (candidate.get("name") or "", candidate.get("version") or "")}
    b.gauge("shadow_running", "1 while a shadow run compares a candidate on live frames", labels,
            1 if report.get("state") == "running" else 0)
    for key, doc in (("frames_compared", "frames the candidate was compared on"),
                     ("dropped_busy", "sampled frames dropped because the candidate was still busy"),
                     ("candidate_errors", "frames on which the candidate raised")):
        b.gauge("shadow_" + key, doc, labels, report.get(key))
    agreement = report.get("agreement") or {}
    for reading in ("strict", "score_aware"):
        figures = agreement.get(reading) or {}
        for key in ("f1", "precision", "recall"):
            b.gauge("shadow_" + key, "the candidate's %s against the serving model's detections" % key,
                    dict(labels, reading=reading), figures.get(key))
    b.gauge("shadow_score_wasserstein1", "distance between the two models' reported score distributions",
            labels, agreement.get("score_wasserstein1"))
    latency = report.get("candidate_latency_ms") or {}
    if latency.get("p95") is not None:
        b.gauge("shadow_candidate_latency_p95_seconds", "the candidate's p95 latency per frame (seconds)", labels,
                latency["p95"] / 1e3)


def _commands(b: _Builder, acks: Mapping[Tuple[str, str], int], verbs: frozenset) -> None:
    counts: Dict[Tuple[str, str], int] = {}
    for (verb, state), count in acks.items():
        key = (verb if verb in verbs else "other", state)
        counts[key] = counts.get(key, 0) + count
    for (verb, outcome), count in sorted(counts.items()):
        b.counter("commands", "command acks published, by verb and outcome (the ack's state)",
                  {"verb": verb, "outcome": outcome}, count)


def _transport(b: _Builder, mqtt: Mapping[str, Any]) -> None:
    b.gauge("outbox_messages", "messages waiting in the outbox", {}, mqtt.get("outbox_messages"))
    b.gauge("outbox_bytes", "bytes waiting in the outbox", {}, mqtt.get("outbox_bytes"))
    b.gauge("outbox_oldest_age_seconds", "age of the oldest message waiting in the outbox (0 when empty)", {},
            mqtt.get("outbox_oldest_age_s"))
    broker = mqtt.get("broker")
    b.gauge("broker_connected", "1 while connected to the broker named (host:port)",
            {"broker": _broker_label(broker)}, 1 if mqtt.get("connected") else 0)


def _broker_label(broker: Any) -> str:
    """``host:port`` of the broker the transport is or was last on (never a user or password)."""
    if isinstance(broker, (list, tuple)) and len(broker) == 2:
        return "%s:%s" % (broker[0], broker[1])
    return "" if broker is None else str(broker).rpartition("@")[2]


def _health(b: _Builder, status: Mapping[str, Any]) -> None:
    doc = "resident memory of the daemon and of each source's worker process (bytes)"
    if status.get("rss_mb") is not None:
        b.gauge("resident_memory_bytes", doc, {"process": "daemon"}, status["rss_mb"] * MB)
    for name, mb in sorted((status.get("workers_rss_mb") or {}).items()):
        b.gauge("resident_memory_bytes", doc, {"process": name}, mb * MB)
    watchdog = status.get("watchdog") or {}
    slope = watchdog.get("rss_slope_mb_per_hour")
    b.gauge("memory_growth_bytes_per_hour", "the leak detector's RSS trend over its window", {},
            None if slope is None else slope * MB)
    state = "restart_requested" if watchdog.get("restart_requested") else (
        "no_input" if watchdog.get("no_input") else "ok")
    for name in WATCHDOG_STATES:
        b.gauge("watchdog_state", "1 for the watchdog's current state, 0 for the others", {"state": name},
                1 if name == state else 0)
    _npu_chip(b, status.get("npu_chip") or {})
    npu = status.get("npu_memory_mb")
    if npu:  # npu-exporter's names and unit (MB) for a 310-class part's memory, so its dashboards read these too
        for key, name in (("used", "npu_chip_info_used_memory"), ("total", "npu_chip_info_total_memory")):
            b.gauge(name, "NPU memory %s (MB) as npu-smi reports it: DDR on 310-class parts, HBM on 910-class" % key,
                    {}, npu.get(key), prefix="")


# npu-exporter's series (names, units, ``id`` label) from the figures npu-smi's table gave: absent where it printed NA
NPU_CHIP_SERIES = (("utilization", "npu_chip_info_utilization", "NPU AI Core utilisation (%) as npu-smi reports it"),
                   ("temperature", "npu_chip_info_temperature", "NPU chip temperature (C) as npu-smi reports it"),
                   ("power", "npu_chip_info_power", "NPU chip power (W) as npu-smi reports it"))


def _npu_chip(b: _Builder, chip: Mapping[str, Any]) -> None:
    for key, name, doc in NPU_CHIP_SERIES:
        if chip.get(key) is not None:
            b.gauge(name, doc, {"id": chip.get("id")}, chip[key], prefix="")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics: %s", format % args)


class MetricsServer:
    """The endpoint's HTTP server on its own thread: ``/metrics`` (and any path) answers the registry, each request
    on a thread of its own. :meth:`cpu_s` is what the endpoint has cost in CPU (benchmarks/metrics_cost.py)."""

    def __init__(self, address: Tuple[str, int], collector: BoxCollector) -> None:
        client = import_client()
        from prometheus_client.exposition import ThreadingWSGIServer

        self.registry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        host, port = address
        self._lock = threading.Lock()
        self._answers_cpu_s = 0.0
        count = self._count_answer

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                started = time.thread_time()  # this request's thread: reading, collecting, writing, closing
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    count(time.thread_time() - started)

        self._httpd = make_server(host, port, client.make_wsgi_app(self.registry), Server,
                                  handler_class=_QuietHandler)
        self.address = self._httpd.server_address[:2]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True)

    def _count_answer(self, cpu_s: float) -> None:
        with self._lock:
            self._answers_cpu_s += cpu_s

    def cpu_s(self) -> float:
        """CPU seconds the endpoint has used so far: every answered request's thread, and the listening thread's
        own clock (accepting, starting a thread per request, waking every half second) where the platform has
        per-thread clocks (Linux)."""
        with self._lock:
            answers = self._answers_cpu_s
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
            return answers
        try:
            return answers + time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # the thread ended between the two lines (a stop)
            return answers

    def start(self) -> None:
        self._thread.start()
        log.info("metrics endpoint on http://%s:%d/metrics", *self.address)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(JOIN_S)
