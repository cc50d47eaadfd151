"""The edge daemon's wiring: build the parts, start them in order, stop them in order.

The serving loop (:mod:`agent.pipeline.serving`) runs on the main thread, with one backend thread for the
backend calls it overlaps with letterbox and decode; sources read on their own threads
into a bounded queue; paho's thread only enqueues commands; commands (:mod:`agent.commands.handlers`) run one at a
time on the dispatcher's worker; the watchdog thread samples memory and pings systemd only when the serving
loop has shown progress. Changes to what the next batch sees reach the loop through one
:class:`~agent.pipeline.handover.BetweenBatches` queue.

Shutdown order matters: stop taking frames, finish every batch already taken, flush results to the broker (or
the outbox), publish ``offline``, then release the model.
"""

import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional

from agent._util.atomic import atomic_write
from agent._util.redact import redact_all
from agent.config.daemon_config import DaemonConfig, load_daemon_config
from agent.config.device_config import DeviceConfig, load_device_config
from agent.config.overrides import Overrides, load_with_overrides, overrides_path
from agent.config.schema import ConfigError
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.results import SequenceCounter
from agent.pipeline.serving import ResultCallback, ServingLoop
from agent.pipeline.sources import SourceSet
from agent.pipeline.stats import StageStats
from agent.protocol.events import SLOT_EVENTS, Event, event_of
from agent.protocol.status import status_answer

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_RESTART = 3  # non-zero so systemd's Restart=on-failure brings the daemon back
# Start-up time asked of systemd (EXTEND_TIMEOUT_USEC) as each step begins: bundle verify, model load, warm-up,
# golden check. One step on a slow board (an OM load on an Atlas 200 DK, a large bundle's hashes on an SD card)
# takes tens of seconds; two minutes per step is generous, and a step that hangs gets no further extension.
STARTUP_STEP_TIMEOUT_S = 120.0
DRIFT_REFERENCES = "drift-references.json"  # in the state directory: the serving model's learnt references
# Model events after which the retained status is republished (agent.protocol.events.SLOT_EVENTS), so that an
# operator (``atlas-edge fleet``) who subscribes later, or resumes a rollout, reads the slot states there
# instead of having missed the event.
__all__ = ["Daemon", "SLOT_EVENTS", "choose_backend", "configured_manifest", "run_daemon"]


def configured_manifest(config: DaemonConfig) -> Any:
    """``model.bundle``'s manifest (:class:`agent.bundle.manifest.Manifest`), read once at start: the backend is
    chosen against it and the model manager's first start installs only that manifest. None when it cannot be
    read: start-up then reports the bundle itself, and the backend is chosen by runtimes alone."""
    from agent.bundle.manifest import BundleError, load_manifest

    try:
        return load_manifest(config.model.bundle)
    except (BundleError, OSError) as exc:
        log.info("model.bundle's manifest not read (%s); start-up reports the bundle", exc)
        return None


def choose_backend(config: DaemonConfig, device: DeviceConfig, manifest: Any = None) -> str:
    """The configured backend, else the device's order (docs/backends.md) against ``manifest`` (the configured
    bundle's, :func:`configured_manifest`; None: by runtimes alone).

    A backend whose runtime does not import here is refused at once (BackendUnavailable: exit 78), naming the
    runtime and where it comes from, before the bundle is judged against it: that is the problem to fix.
    """
    from agent.pipeline.backends import BackendUnavailable, backend_for, backend_status

    chosen = config.model.backend
    if not chosen:
        if manifest is None:
            log.info("choosing the backend without the bundle's formats")
        chosen = backend_for(device, manifest)
    problem = backend_status().get(chosen, "ok")
    if problem != "ok":
        raise BackendUnavailable("backend %s (device %s) cannot run on this machine: %s" % (
            chosen, device.name, problem))
    return chosen


class Daemon:
    def __init__(self, config: DaemonConfig, device: Optional[DeviceConfig] = None,
                 config_path: Optional[str] = None, on_result: Optional[ResultCallback] = None,
                 overrides: Optional[Overrides] = None) -> None:
        """``config`` is the file's config with ``overrides`` already merged (:func:`load_with_overrides`);
        without them (the demo, tests) set-config starts a fresh overrides file in the state directory."""
        self.config = config
        self.config_path = config_path
        self.overrides = overrides if overrides is not None else Overrides(overrides_path(config))
        self._starting = True  # until READY=1: loading steps extend systemd's start timeout
        self.device = device or load_device_config(config.device)
        self.manifest = configured_manifest(config)  # read once: the backend's choice and the first start's
        self.backend = choose_backend(config, self.device, self.manifest)
        self.stop_event = threading.Event()
        self.exit_code = EXIT_OK
        self.stop_reason = ""
        self._announced = False  # the retained status carries slots only once the model manager has started
        self._ready_at: Optional[float] = None  # time.monotonic() at READY=1: the status answer's uptime
        self.handover = BetweenBatches()  # config changes, swaps and rollbacks: run between batches, in order
        self._build_services(on_result)

    # --- construction -------------------------------------------------------------------------------------

    def _build_services(self, on_result: Optional[ResultCallback]) -> None:
        from agent.commands.dispatcher import CommandDispatcher
        from agent.commands.freshness import freshness_of
        from agent.commands.handlers import CommandHandlers
        from agent.health.memory import MemoryWatchdog
        from agent.health.npu_smi import NpuSmiProbe
        from agent.health.progress import ProgressMonitor
        from agent.health.sdnotify import SystemdNotifier
        from agent.health.watchdog import Watchdog
        from agent.lifecycle.model_manager import ModelManager
        from agent.ops.outbox import Outbox
        from agent.ops.transport import MqttTransport
        from agent.protocol.topics import HA_STATUS_TOPIC

        cfg = self.config
        os.makedirs(cfg.state_dir, exist_ok=True)
        self.outbox = Outbox(cfg.state_path(cfg.outbox.path), cfg.outbox.max_bytes)
        discovery = cfg.mqtt.homeassistant_discovery
        self.transport = MqttTransport(cfg.mqtt, cfg.device_id, self.outbox, on_message=self._on_message,
                                       replay_rate_hz=cfg.outbox.replay_rate_hz,
                                       extra_subscriptions=[HA_STATUS_TOPIC] if discovery else [],
                                       on_connected=self._publish_discovery if discovery else None,
                                       on_alert=self._publish_alert, device_kind=self.device.name)
        self.models = ModelManager(lambda: self.config, self.device, self.backend, on_event=self._publish_event,
                                   handover=self.handover, on_phase=self._start_step, manifest=self.manifest,
                                   on_shadow_report=self._publish_shadow_report)
        self.notifier = SystemdNotifier()
        self.progress = ProgressMonitor(cfg.watchdog.inference_deadline_s)
        npu = NpuSmiProbe(self.device.device_id) if self.device.target == "ascend" else None
        self.memory = MemoryWatchdog(cfg.watchdog, self.device.memory_budget_mb, npu,
                                     npu_budget_mb=self.device.npu_memory_budget_mb,
                                     worker_pids=lambda: self.sources.worker_pids())
        frames: queue.Queue = queue.Queue(maxsize=cfg.batching.queue_size)
        # Made here and kept here: the watchdog recycles a source's worker and the metrics endpoint reads the
        # histograms through these references, not through the serving loop.
        self.sources = SourceSet(list(cfg.sources), frames, self._publish_alert)
        self.stats = StageStats()
        self.drift = self._build_drift()
        self.watchdog = Watchdog(cfg.watchdog, self.memory, self.progress, self.notifier,
                                 on_alert=self._publish_alert, request_restart=self._restart_requested,
                                 input_states=self.sources.summary, restart_worker=self.sources.recycle)
        self.numbering = SequenceCounter(cfg.state_path("sequence.json"))
        # The daemon uses the loop through its methods only (seams.ServingControl, its lifecycle, and the
        # between-batches changes inside a handover item); the commands get the control and a status provider.
        self.loop = ServingLoop(frames, self.sources, self.models, self.transport, self.progress, self.handover,
                                self.stop_event, cfg.batching.max_batch,
                                cfg.batching.max_wait_ms, cfg.publish, on_event=self._publish_event,
                                telemetry_extras=self._telemetry_extras, on_result=on_result,
                                numbering=self.numbering, stats=self.stats, drift=self.drift)
        self.handlers = CommandHandlers(self.loop, self.models, self.transport, self.handover,
                                        get_config=lambda: self.config, apply_config=self._apply_config,
                                        request_restart=self._restart, status=self._status,
                                        overrides=self.overrides)
        self.dispatcher = CommandDispatcher(self.transport, self.handlers.table(),
                                            record_path=cfg.state_path("requests.sqlite"),
                                            on_alert=self._publish_alert, on_announce=self._answer_announce,
                                            freshness=freshness_of(cfg.commands),
                                            group_verbs=cfg.commands.group_verbs,
                                            rate_per_s=cfg.commands.rate_per_s, burst=cfg.commands.burst)
        self.metrics = self._build_metrics()

    def _build_drift(self) -> Any:
        """Drift per source (agent/pipeline/drift.py) when ``drift.enabled``; its references are kept in the
        state directory so that a restart does not learn a drifted scene as the normal one."""
        if not self.config.drift.enabled:
            return None
        from agent.pipeline.drift import DriftWatch

        return DriftWatch(self.config.drift, on_alert=self._publish_alert, on_learnt=self._keep_drift_references)

    def _restore_drift(self) -> None:
        """At start, once the serving model is known: its kept references, or learn them anew."""
        if self.drift is None:
            return
        model = self.models.current.bundle.manifest_sha256
        try:
            with open(self.config.state_path(DRIFT_REFERENCES), encoding="utf-8") as handle:
                kept = json.load(handle)
        except (OSError, ValueError):
            kept = None
        if not self.drift.restore(kept, model):
            self.drift.relearn(model)

    def _keep_drift_references(self, references: Dict[str, Any]) -> None:
        try:
            atomic_write(self.config.state_path(DRIFT_REFERENCES), json.dumps(references))
        except OSError as exc:  # learnt again after a restart: worth a line, not a stop
            log.warning("could not keep the drift references in %s: %s", DRIFT_REFERENCES, exc)

    def _build_metrics(self) -> Any:
        """The Prometheus endpoint when ``metrics.listen`` is set. Bound here, before anything starts: an address
        that cannot be bound (taken, not this box's) is a config error (exit 78), named, like a bad bundle."""
        address = self.config.metrics.address()
        if address is None:
            return None
        from agent.config.schema import FieldError
        from agent.ops.metrics import BoxCollector, EventCounts, MetricsServer

        self.metric_events = EventCounts()
        collector = BoxCollector(self.config.device_id, lambda: self._status(windows=False),  # no percentiles
                                 self.stats.histograms, self.dispatcher.acks, self.metric_events)
        try:
            return MetricsServer(address, collector)
        except OSError as exc:
            raise ConfigError([FieldError("metrics.listen", "cannot listen on %s:%d: %s" % (
                address[0], address[1], exc.strerror or exc))]) from exc

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load and self-test the model before announcing readiness: READY=1 means 'serving'."""
        model = self.models.start()  # thresholds from the config are applied by the manager at load
        self._restore_drift()
        self._starting = False
        self._ready_at = time.monotonic()
        self.transport.set_status(self._presence())
        self._announced = True
        self.transport.start()
        for alert in self.overrides.alerts():  # a damaged or outdated overrides file: said once, at start
            self._publish_alert(alert)
        self.dispatcher.start()  # reports a damaged command record, if it found one
        for alert in self.numbering.alerts:  # and a damaged sequence file
            self._publish_alert(alert)
        self.loop.start_sources()
        self.notifier.ready()
        self.notifier.status("serving %s on %s" % (model.label, self.backend))
        self.watchdog.start()
        if self.metrics is not None:
            self.metrics.start()
        log.info("serving %s with %s; device %s (%s)", model.label, self.backend, self.config.device_id,
                 self.device.name)

    def install_signal_handlers(self) -> None:
        """Signals are relayed to a thread of their own: a handler only puts a callable on a SimpleQueue.

        Python runs handlers on the main thread, which is the serving loop. Doing the work in the handler
        (``stop_event.set()``, ``queue.Queue.put``) would take locks that the interrupted loop may hold at that
        instant, a deadlock; ``SimpleQueue.put`` is reentrant and documented safe there.
        """
        actions: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()

        def relay() -> None:
            while True:
                action = actions.get()
                try:
                    action()
                except Exception:  # a failed reload must not end signal handling
                    log.exception("signal handling failed")

        threading.Thread(target=relay, name="signals", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: actions.put(lambda: self.request_stop("SIGTERM", EXIT_OK)))
        signal.signal(signal.SIGINT, lambda *_: actions.put(lambda: self.request_stop("SIGINT", EXIT_OK)))
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda *_: actions.put(self._reload_requested))

    def request_stop(self, reason: str, exit_code: int = EXIT_OK) -> None:
        if not self.stop_event.is_set():
            log.info("stopping: %s", reason)
            self.stop_reason = reason
            self.exit_code = exit_code
            self.stop_event.set()

    def run(self, max_frames: Optional[int] = None, until_sources_end: bool = False) -> int:
        """Serve until stopped (or ``max_frames`` frames were served); returns the process exit code."""
        self.start()
        try:
            finished = self.loop.serve(max_frames, until_sources_end)
            if finished is not None:
                self.request_stop(finished)
        finally:
            self.shutdown()
        return self.exit_code

    def shutdown(self) -> None:
        timeout = self.config.watchdog.shutdown_timeout_s
        self.notifier.stopping()
        self.loop.stop_sources()
        self.watchdog.stop()
        self.models.cancel()  # a running deploy stops at its next check, not at the dispatcher's join timeout
        self.dispatcher.stop()
        self.dispatcher.close()
        flushed = self.transport.flush(timeout)
        if not flushed:
            log.warning("broker did not confirm every result within %.1fs; the rest is in the outbox", timeout)
        self.transport.stop(timeout)
        if self.metrics is not None:  # before the parts its collector reads are closed
            self.metrics.stop()
        self.outbox.close()
        published = self.loop.status()["published"]  # the view names the serving model: read it before its release
        self.models.close()
        log.info("stopped (%s); published %d results", self.stop_reason, published)

    # --- wiring between the parts ---------------------------------------------------------------------------

    def _apply_config(self, new: DaemonConfig) -> None:
        """Serving thread only (through the handover queue): switch every live section at once."""
        old = self.config
        self.config = new
        self.loop.configure(new.batching.max_batch, new.batching.max_wait_ms, new.publish)
        self.models.apply_thresholds()  # the serving model and the kept confirmed one; later loads read the config
        if new.sources != old.sources:
            removed, started = self.loop.replace_sources(list(new.sources))
            self._update_discovery(removed, started)
        self.notifier.ready()  # ends a SIGHUP's RELOADING=1 (harmless otherwise)

    def _telemetry_extras(self) -> Dict[str, Any]:
        # The watchdog thread's last sample: npu-smi can take seconds, never run it on the serving thread.
        sample = self.memory.last_sample
        figures = {} if sample is None else sample.as_dict()
        return {
            "rss_mb": None if sample is None else sample.rss_mb,  # the daemon alone; its camera workers by source:
            "workers_rss_mb": figures.get("workers_rss_mb"),
            "total_rss_mb": figures.get("total_rss_mb"),  # the daemon and its workers (what MemoryMax counts)
            "npu_memory_mb": None if sample is None or sample.npu_used_mb is None else {
                "used": sample.npu_used_mb, "total": sample.npu_total_mb},
            "npu_chip": None if sample is None else dict(sample.npu_chip) or None,  # utilisation, temp, power
            "mqtt": self.transport.stats(),
            "commands": self.dispatcher.stats(),  # received, accepted, failed by code, dropped by reason
            # limits, trend, pings and progress behind the watchdog's decisions (operations.md "Reading alerts")
            "watchdog": self.watchdog.snapshot(),
        }

    def _status(self, windows: bool = True) -> Dict[str, Any]:
        """The ``status`` command's answer (:class:`agent.protocol.status.StatusAnswer`), assembled here from each
        part's own view: who this box is and what it serves, as its retained status says it (the same fields:
        ``model`` is the label in both), the model in detail, the serving loop's figures and the daemon's (as in
        telemetry). ``windows``: ServingLoop.status's. A figure a part adds is added to the type first."""
        model = self.models.current
        extras = self._telemetry_extras()
        return status_answer(
            self.config.device_id, broker=extras["mqtt"]["broker"], model_info=model.describe(),
            uptime_s=None if self._ready_at is None else round(time.monotonic() - self._ready_at, 1),
            overrides=redact_all(self.overrides.report()), shadow=self.models.shadow_report(),
            drift=self.drift.report() if self.drift is not None else None,
            **self._presence(model), **self.loop.status(windows), **extras)

    def _presence(self, model: Any = None) -> Dict[str, Any]:
        """The daemon's fields of its retained status (:class:`agent.protocol.status.BoxStatus`), also the status
        answer's; the transport adds state, device id, time and broker. ``model``: the serving one, read once."""
        model = model if model is not None else self.models.current
        return {"device_kind": self.device.name, "model": model.label, "backend": self.backend,
                "precision": model.precision,
                "groups": list(self.config.mqtt.groups), "slots": self.models.status(),
                # the operator's clock for this box: silent for a few intervals, an "online" is not believed
                "telemetry_interval_s": self.config.publish.telemetry_interval_s}

    def _answer_announce(self) -> None:
        """An operator's announce request (fleet status, rollout): the live status, as on every switch."""
        if self._announced:
            self.transport.set_status(self._presence())

    def _publish_event(self, event: Dict[str, Any]) -> None:
        event = dict(event, ts=time.time())
        log.info("event: %s", event)
        if self.metrics is not None:
            self.metric_events.observe(event)
        self.transport.publish(self.transport.events_topic(), event)
        if self._announced and event_of(event) in SLOT_EVENTS:
            self.transport.set_status(self._presence())
        if self._announced and self.drift is not None and event_of(event) in (Event.SWITCHED, Event.ROLLBACK):
            # another model serves: it learns its own reference (at start, _restore_drift decides, once the
            # model manager, whose recovery may report a rollback before it serves, has started)
            self.drift.relearn(self.models.current.bundle.manifest_sha256)

    def _publish_shadow_report(self, report: Dict[str, Any]) -> None:
        """A shadow run's report, retained (the latest replaces the one before; an operator who looks later
        reads where the run stands or how it ended). The final one is durable (it outlives a broker outage in
        the outbox); a running one is not: the next replaces it anyway."""
        self.transport.publish(self.transport.shadow_topic(), dict(report, ts=time.time()), qos=1, retain=True,
                               durable=report.get("state") != "running")

    def _publish_alert(self, alert: Dict[str, Any]) -> None:
        self.transport.publish(self.transport.alert_topic(), dict(alert, ts=time.time()))

    def _on_message(self, topic: str, payload: bytes, retained: bool = False) -> None:
        """paho's thread: Home Assistant's birth message is answered here, everything else is a command."""
        from agent.protocol.topics import HA_ONLINE, HA_STATUS_TOPIC

        if topic == HA_STATUS_TOPIC:
            if payload.strip() == HA_ONLINE:
                self._publish_discovery()  # Home Assistant restarted: it forgot non-retained state
            return
        self.dispatcher.submit(topic, payload, retained)

    def _publish_discovery(self) -> None:
        from agent.ops.discovery import discovery_messages

        for topic, payload in discovery_messages(self.config.mqtt.prefix, self.config.device_id, self.device.name,
                                                 self.models.current.label, [s.name for s in self.config.sources]):
            self.transport.publish(topic, payload, qos=1, retain=True, durable=False)

    def _update_discovery(self, removed: List[str], started: List[str]) -> None:
        """After a source change: clear each removed source's retained Home Assistant config (durable: a broker
        away now must not leave a ghost sensor), and publish the configs again when a source was started."""
        if not self.config.mqtt.homeassistant_discovery:
            return
        from agent.ops.discovery import removal_messages

        for topic, payload in removal_messages(self.config.device_id, removed):
            self.transport.publish(topic, payload, qos=1, retain=True)
        if started:  # an added source's sensor (or a changed one's, again: retained, so harmless)
            self._publish_discovery()

    def _start_step(self, step: str) -> None:
        """The model manager begins a loading step: during start-up, ask systemd for time for it."""
        if self._starting:
            self.notifier.extend_timeout(STARTUP_STEP_TIMEOUT_S, status="starting: %s" % step)

    def _restart(self, reason: str) -> None:
        self.request_stop(reason, EXIT_RESTART)

    def _restart_requested(self, reason: str) -> None:
        self._restart("watchdog: %s" % reason)

    def _reload_requested(self) -> None:
        """SIGHUP: re-read the config file, merge the overrides over it as at start; apply live sections if the
        whole file is valid, else keep serving."""
        if not self.config_path:
            return
        try:
            new = self.overrides.apply(load_daemon_config(self.config_path))
        except ConfigError as exc:
            log.error("SIGHUP: config rejected, keeping the running one:\n%s", exc)
            return
        live = replace(self.config, thresholds=new.thresholds, batching=new.batching, publish=new.publish,
                       sources=new.sources)
        self.notifier.reloading()
        self.handover.post(lambda: self._apply_reloaded_config(live), what="SIGHUP reload")  # reload does not wait

    def _apply_reloaded_config(self, live: DaemonConfig) -> None:
        """Logged only once applied and READY=1 sent: a reader of the journal then sees the unit active again."""
        self._apply_config(live)
        log.info("SIGHUP: config reloaded (live sections applied; others need a restart)")


def run_daemon(config_path: str) -> int:
    config, overrides = load_with_overrides(config_path)
    logging.getLogger().setLevel(config.log_level)
    daemon = Daemon(config, config_path=config_path, overrides=overrides)
    daemon.install_signal_handlers()
    return daemon.run()

