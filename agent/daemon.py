"""The edge daemon: sources → letterbox → batcher → backend → decode → MQTT, with commands and a watchdog.

One thread serves (the only one that runs inference, so a model switch between batches needs no lock);
sources read on their own threads into a bounded queue; paho's thread only enqueues commands; commands run
one at a time on the dispatcher's worker; the watchdog thread samples memory and pings systemd only when the
serving loop has shown progress.

Shutdown order matters: stop taking frames, let the batch in flight finish, flush results to the broker (or
the outbox), publish ``offline``, then release the model.
"""

import logging
import os
import queue
import signal
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional

from agent.config.daemon_config import DaemonConfig, load_daemon_config, merge_config
from agent.config.device_config import DeviceConfig, load_device_config
from agent.config.schema import ConfigError, to_dict
from agent.pipeline.batcher import Batcher
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.results import annotate, result_payload
from agent.pipeline.sources import Frame, SourceSet
from agent.pipeline.stats import StageStats

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_RESTART = 3  # non-zero so systemd's Restart=on-failure brings the daemon back
# A set-config waits this long for the serving loop (one batch plus a model's between-batches work).
CONFIG_HANDOVER_TIMEOUT_S = 5.0
# Model events after which the retained status is republished, so that an operator (``atlas-edge fleet``) who
# subscribes later, or resumes a rollout, reads the slot states there instead of having missed the event.
SLOT_EVENTS = ("switched", "confirmed", "rollback")
STARTED = time.time()


def choose_backend(config: DaemonConfig, device: DeviceConfig) -> str:
    """The configured backend, else the device's order (docs/backends.md) against the configured bundle."""
    from agent.lifecycle.bundle import BundleError, load_manifest
    from agent.pipeline.backends import backend_for

    if config.model.backend:
        return config.model.backend
    manifest = None
    try:
        manifest = load_manifest(config.model.bundle)
    except (BundleError, OSError) as exc:  # start-up reports the bundle itself; choose by runtimes alone
        log.info("choosing the backend without the bundle's formats: %s", exc)
    return backend_for(device, manifest)


class Daemon:
    def __init__(self, config: DaemonConfig, device: Optional[DeviceConfig] = None,
                 config_path: Optional[str] = None,
                 on_result: Optional[Callable[[Frame, Dict[str, Any]], None]] = None) -> None:
        self.config = config
        self.config_path = config_path
        self.device = device or load_device_config(config.device)
        self.backend = choose_backend(config, self.device)
        self.on_result = on_result
        self.stop_event = threading.Event()
        self.exit_code = EXIT_OK
        self.stop_reason = ""
        self.frames = queue.Queue(maxsize=config.batching.queue_size)
        self.batcher: Batcher[Frame] = Batcher(self.frames, config.batching.max_batch, config.batching.max_wait_ms)
        self.stats = StageStats()
        self.published = 0
        self.inference_errors = 0
        self.paused = False
        self.dropped_on_resume = 0
        self.latest: Optional[Frame] = None
        self.latest_result: Optional[Dict[str, Any]] = None
        self._last_telemetry = 0.0
        self._last_publish: Dict[str, float] = {}
        self._announced = False  # the retained status carries slots only once the model manager has started
        self.handover = BetweenBatches()  # config changes, swaps and rollbacks: run between batches, in order
        self._build_services()

    # --- construction -------------------------------------------------------------------------------------

    def _build_services(self) -> None:
        from agent.health.sdnotify import SystemdNotifier
        from agent.health.watchdog import MemoryWatchdog, ProgressMonitor, Watchdog
        from agent.lifecycle.model_manager import ModelManager
        from agent.ops.commands import CommandDispatcher
        from agent.ops.outbox import Outbox
        from agent.ops.transport import MqttTransport

        cfg = self.config
        os.makedirs(cfg.state_dir, exist_ok=True)
        self.outbox = Outbox(cfg.state_path(cfg.outbox.path), cfg.outbox.max_bytes)
        from agent.ops.discovery import HA_STATUS_TOPIC

        discovery = cfg.mqtt.homeassistant_discovery
        self.transport = MqttTransport(cfg.mqtt, cfg.device_id, self.outbox, on_message=self._on_message,
                                       replay_rate_hz=cfg.outbox.replay_rate_hz,
                                       extra_subscriptions=[HA_STATUS_TOPIC] if discovery else [],
                                       on_connected=self._publish_discovery if discovery else None)
        self.dispatcher = CommandDispatcher(self.transport, self._handlers(),
                                            record_path=cfg.state_path("requests.sqlite"))
        self.models = ModelManager(cfg, self.device, self.backend, on_event=self._publish_event,
                                   handover=self.handover)
        self.sources = SourceSet(list(cfg.sources), self.frames)
        self.notifier = SystemdNotifier()
        self.progress = ProgressMonitor(cfg.watchdog.inference_deadline_s)
        from agent.health.npu_smi import NpuSmiProbe

        npu = NpuSmiProbe(self.device.device_id) if self.device.target == "ascend" else None
        self.memory = MemoryWatchdog(cfg.watchdog, self.device.memory_budget_mb, npu,
                                     npu_budget_mb=self.device.npu_memory_budget_mb)
        self.watchdog = Watchdog(cfg.watchdog, self.memory, self.progress, self.notifier,
                                 on_alert=self._publish_alert, request_restart=self._restart_requested)

    def _handlers(self) -> Dict[str, Callable[[Dict[str, Any], Callable[[str], None]], Dict[str, Any]]]:
        return {
            "status": lambda payload, progress: self.status(),
            "validate": self._cmd_validate,
            "set-config": self._cmd_set_config,
            "deploy": lambda payload, progress: self.models.deploy(payload, progress),
            "rollback": lambda payload, progress: self.models.rollback(payload.get("reason", "operator")),
            "pause": lambda payload, progress: self._cmd_pause(True),
            "resume": lambda payload, progress: self._cmd_pause(False),
            "snapshot": self._cmd_snapshot,
            "restart": self._cmd_restart,
        }

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load and self-test the model before announcing readiness: READY=1 means 'serving'."""
        model = self.models.start()  # thresholds from the config are applied by the manager at load
        self.transport.set_status(self._presence("online"))
        self._announced = True
        self.transport.start()
        self.dispatcher.start()
        self.sources.start()
        self.notifier.ready()
        self.notifier.status("serving %s on %s" % (model.label, self.backend))
        self.watchdog.start()
        log.info("serving %s with %s; device %s (%s)", model.label, self.backend, self.config.device_id,
                 self.device.name)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM", EXIT_OK))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("SIGINT", EXIT_OK))
        if hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda *_: self._reload_requested())

    def request_stop(self, reason: str, exit_code: int = EXIT_OK) -> None:
        if not self.stop_event.is_set():
            log.info("stopping: %s", reason)
            self.stop_reason = reason
            self.exit_code = exit_code
            self.stop_event.set()

    def run(self, max_frames: Optional[int] = None, until_sources_end: bool = False) -> int:
        """Serve until stopped (or ``max_frames`` frames were published); returns the process exit code."""
        self.start()
        try:
            self.serve(max_frames, until_sources_end)
        finally:
            self.shutdown()
        return self.exit_code

    def serve(self, max_frames: Optional[int] = None, until_sources_end: bool = False) -> None:
        while not self.stop_event.is_set():
            self.handover.run_pending()
            self.models.between_batches()
            if self.paused:
                self.progress.idle_tick()  # paused on purpose is not a hang
                self._maybe_telemetry()
                self.stop_event.wait(0.05)
                continue
            batch = self.batcher.next_batch(self.stop_event)
            if batch:
                self._serve_batch(batch)
            else:
                self.progress.idle_tick()
                if until_sources_end and self.sources.all_finished() and self.frames.empty():
                    self.request_stop("sources finished")
            self._maybe_telemetry()
            if max_frames is not None and self.stats.frames >= max_frames:
                self.request_stop("%d frames done" % max_frames)

    def shutdown(self) -> None:
        timeout = self.config.watchdog.shutdown_timeout_s
        self.notifier.stopping()
        self.sources.stop(timeout=1.0)
        self.watchdog.stop()
        self.dispatcher.stop()
        self.dispatcher.close()
        flushed = self.transport.flush(timeout)
        if not flushed:
            log.warning("broker did not confirm every result within %.1fs; the rest is in the outbox", timeout)
        self.transport.stop(timeout)
        self.outbox.close()
        self.models.close()
        log.info("stopped (%s); published %d results", self.stop_reason, self.published)

    # --- the serving loop -----------------------------------------------------------------------------------

    def _serve_batch(self, batch: List[Frame]) -> None:
        model = self.models.current
        started = time.monotonic()
        self.progress.begin_inference()
        try:
            results = model.infer_frames([f.image for f in batch])
        except Exception as exc:  # a failing model must be reported and counted, and serving goes on
            self.inference_errors += 1
            self.stats.error()
            self.models.record_batch(len(batch), 0.0, failed=True)
            log.exception("inference failed on a batch of %d", len(batch))
            self._publish_event({"event": "inference_error", "error": str(exc)[:200]})
            return
        finally:
            self.progress.end_inference()
        infer_ms = results[0].timings_ms.get("infer", 0.0) if results else 0.0
        self.models.record_batch(len(batch), infer_ms, failed=False)
        identity = {"name": model.manifest.name, "version": model.manifest.version}
        labels = model.manifest.labels
        for frame, result in zip(batch, results):
            timings = dict(result.timings_ms)
            timings["queue"] = (started - frame.enqueued) * 1e3
            timings["total"] = (time.monotonic() - frame.enqueued) * 1e3
            payload = result_payload(frame, result, identity, labels, timings)
            self.stats.add(timings)
            self.latest, self.latest_result = frame, payload
            if self._rate_allows(frame.source):
                self.transport.publish_result(frame.source, payload)
                self.published += 1
            if self.on_result is not None:
                self.on_result(frame, payload)
        self.stats.frame_done(len(batch))
        self.progress.frame_done(len(batch))

    def _rate_allows(self, source: str) -> bool:
        limit = self.config.publish.max_rate_hz
        if limit <= 0:
            return True
        now = time.monotonic()
        if now - self._last_publish.get(source, 0.0) < 1.0 / limit:
            return False
        self._last_publish[source] = now
        return True

    def _maybe_telemetry(self) -> None:
        now = time.monotonic()
        if now - self._last_telemetry >= self.config.publish.telemetry_interval_s:
            self._last_telemetry = now
            self.transport.publish_telemetry(self.telemetry())

    # --- status and telemetry -------------------------------------------------------------------------------

    def telemetry(self) -> Dict[str, Any]:
        # The watchdog thread's last sample: npu-smi can take seconds, never run it on the serving thread.
        sample = self.memory.last_sample
        return {
            "ts": time.time(),
            "fps": round(self.stats.fps(), 2),
            "frames": self.stats.frames,
            "latency_ms": self.stats.percentiles(),
            "queue_depth": self.frames.qsize(),
            "inference_errors": self.inference_errors,
            "dropped_on_resume": self.dropped_on_resume,
            "sources": self.sources.counters(),
            "rss_mb": None if sample is None else sample.rss_mb,
            "npu_memory_mb": None if sample is None or sample.npu_used_mb is None else {
                "used": sample.npu_used_mb, "total": sample.npu_total_mb},
            "mqtt": self.transport.stats(),
        }

    def status(self) -> Dict[str, Any]:
        model = self.models.current
        info = self.telemetry()
        info.update({
            "device_id": self.config.device_id,
            "device": self.device.name,
            "backend": self.backend,
            "model": model.describe(),
            "slots": self.models.status(),
            "uptime_s": round(time.time() - STARTED, 1),
            "paused": self.paused,
        })
        return info

    def _presence(self, state: str) -> Dict[str, Any]:
        model = self.models.current
        return {"state": state, "device": self.device.name, "model": model.label, "backend": self.backend,
                "ts": time.time(), "groups": list(self.config.mqtt.groups), "slots": self.models.status()}

    def _publish_event(self, event: Dict[str, Any]) -> None:
        event = dict(event, ts=time.time())
        log.info("event: %s", event)
        self.transport.publish(self.transport.topic("events"), event)
        if self._announced and event.get("event") in SLOT_EVENTS:
            self.transport.set_status(self._presence("online"))

    def _publish_alert(self, alert: Dict[str, Any]) -> None:
        self.transport.publish(self.transport.topic("telemetry", "alert"), dict(alert, ts=time.time()))

    # --- commands (run on the dispatcher's worker thread) ---------------------------------------------------

    def _on_message(self, topic: str, payload: bytes) -> None:
        from agent.ops.discovery import HA_ONLINE, HA_STATUS_TOPIC

        if topic == HA_STATUS_TOPIC:
            if payload.strip() == HA_ONLINE:
                self._publish_discovery()  # Home Assistant restarted: it forgot non-retained state
            return
        self.dispatcher.submit(topic, payload)

    def _publish_discovery(self) -> None:
        from agent.ops.discovery import discovery_messages

        for topic, payload in discovery_messages(self.config.mqtt.prefix, self.config.device_id, self.device.name,
                                                 self.models.current.label):
            self.transport.publish(topic, payload, qos=1, retain=True, durable=False)

    def _cmd_validate(self, payload: Dict[str, Any], progress: Callable[[str], None]) -> Dict[str, Any]:
        changes = payload.get("config", {})
        merged = merge_config(self.config, changes)  # raises ConfigError with per-field errors
        return {"valid": True, "config": {k: to_dict(getattr(merged, k)) for k in changes}}

    def _cmd_set_config(self, payload: Dict[str, Any], progress: Callable[[str], None]) -> Dict[str, Any]:
        changes = payload.get("config", {})
        merged = merge_config(self.config, changes)
        # Applied by the serving loop between batches, all at once; withdrawn if the loop does not get to it.
        self.handover.submit(lambda: self._apply_config(merged), CONFIG_HANDOVER_TIMEOUT_S, what="config change")
        self._persist_config()
        return {"applied": sorted(changes)}

    def _apply_config(self, new: DaemonConfig) -> None:
        """Serving thread only (through the handover queue): switch every live section at once."""
        old = self.config
        self.config = new
        self.batcher.configure(new.batching.max_batch, new.batching.max_wait_ms)
        self.models.set_thresholds(new.thresholds)  # the serving model, the kept confirmed one, later deploys
        if new.sources != old.sources:
            self.sources.stop(timeout=1.0)
            self.sources = SourceSet(list(new.sources), self.frames)
            self.sources.start()
        self.notifier.ready()  # ends a SIGHUP's RELOADING=1 (harmless otherwise)

    def _persist_config(self) -> None:
        """Write the running config back so a restart keeps the change (atomic replace)."""
        if not self.config_path:
            return
        import yaml

        data = to_dict(self.config)
        data["state_dir"] = os.path.relpath(self.config.state_dir, os.path.dirname(os.path.abspath(
            self.config_path)))
        tmp = self.config_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            yaml.safe_dump(data, handle, sort_keys=False)
        os.replace(tmp, self.config_path)

    def _cmd_pause(self, paused: bool) -> Dict[str, Any]:
        """Pause stops inference at once; frames queued meanwhile are stale on resume, so they are dropped."""
        self.sources.pause(paused)
        stale = 0
        if not paused:
            while True:
                try:
                    self.frames.get_nowait()
                    stale += 1
                except queue.Empty:
                    break
            self.dropped_on_resume += stale
        self.paused = paused
        return {"paused": paused, "stale_frames_dropped": stale}

    def _cmd_snapshot(self, payload: Dict[str, Any], progress: Callable[[str], None]) -> Dict[str, Any]:
        import cv2

        frame, result = self.latest, self.latest_result
        if frame is None or result is None:
            from agent.errors import CommandError

            raise CommandError("no_frame", "no frame has been served yet")
        picture = annotate(frame.image, result.get("detections", []))
        ok, jpeg = cv2.imencode(".jpg", picture, [cv2.IMWRITE_JPEG_QUALITY, 85])
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        topic = self.transport.topic("snapshot", frame.source)
        self.transport.publish(topic, jpeg.tobytes(), qos=1, retain=False, durable=False)
        return {"topic": topic, "bytes": int(jpeg.size), "frame_id": frame.frame_id, "source": frame.source}

    def _cmd_restart(self, payload: Dict[str, Any], progress: Callable[[str], None]) -> Dict[str, Any]:
        # Acknowledge first, then stop: the ack must reach the operator before the process goes away.
        threading.Timer(0.5, self.request_stop, args=("restart command", EXIT_RESTART)).start()
        return {"restarting": True}

    def _restart_requested(self, reason: str) -> None:
        self.request_stop("watchdog: %s" % reason, EXIT_RESTART)

    def _reload_requested(self) -> None:
        """SIGHUP: re-read the config file; apply live sections if the whole file is valid, else keep serving."""
        if not self.config_path:
            return
        try:
            new = load_daemon_config(self.config_path)
        except ConfigError as exc:
            log.error("SIGHUP: config rejected, keeping the running one:\n%s", exc)
            return
        live = replace(self.config, thresholds=new.thresholds, batching=new.batching, publish=new.publish,
                       sources=new.sources)
        self.notifier.reloading()
        self.handover.post(lambda: self._apply_config(live), what="SIGHUP reload")  # a signal handler cannot wait
        log.info("SIGHUP: config reloaded (live sections applied; others need a restart)")


def run_daemon(config_path: str) -> int:
    config = load_daemon_config(config_path)
    logging.getLogger().setLevel(config.log_level)
    daemon = Daemon(config, config_path=config_path)
    daemon.install_signal_handlers()
    return daemon.run()

