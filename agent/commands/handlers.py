"""The daemon's command verbs: what ``status``, ``validate``, ``set-config``, ``pause``, ``snapshot``, ``restart``
(and, through the model manager, ``deploy``, ``rollback``, ``shadow`` and ``shadow-stop``) do.

Handlers run on the command dispatcher's workers. Anything that changes what the next batch sees goes to the
serving loop through the between-batches handover: set-config submits the daemon's switch, pause and resume
go through the loop's :class:`~agent.pipeline.seams.ServingControl`, which submits them there. ``status`` is
the daemon's answer (a provider it hands in), ``snapshot`` the loop's latest result, replaced whole.
"""

import threading
from typing import Any, Callable, Dict, Optional

from agent._util.compat import Protocol
from agent._util.redact import redact_all
from agent.commands.dispatcher import Handler, Progress, handlers_of
from agent.config.daemon_config import DaemonConfig, merge_config
from agent.config.overrides import Overrides
from agent.config.schema import to_dict
from agent.errors import CommandError
from agent.lifecycle.model_manager import TRIGGER_OPERATOR, ModelManager
from agent.pipeline.handover import BetweenBatches
from agent.pipeline.results import annotate
from agent.pipeline.seams import ServingControl
from agent.protocol.requests import (
    ConfigRequest,
    DeployRequest,
    NoFields,
    RollbackRequest,
    ShadowRequest,
    ShadowStopRequest,
)

# A set-config, pause or resume waits this long for the serving loop (one batch plus a model's between-batches
# work); a change the loop did not take by then is withdrawn, and the command fails with nothing changed.
HANDOVER_TIMEOUT_S = 5.0
# The restart ack must reach the operator before the process goes away.
RESTART_DELAY_S = 0.5
SNAPSHOT_JPEG_QUALITY = 85  # a picture for a person, not for a model: small beats exact


class Publisher(Protocol):
    """What handlers publish through (the MQTT transport): this device's snapshot topic, and messages."""

    def snapshot_topic(self, source: str) -> str: ...

    def publish(self, topic: str, payload: Any, qos: Optional[int] = None, retain: bool = False,
                durable: bool = True) -> str: ...


class CommandHandlers:
    """The verb table of one daemon; the daemon owns the config and applies it (``apply_config``)."""

    def __init__(self, serving: ServingControl, models: ModelManager, publisher: Publisher,
                 handover: BetweenBatches, get_config: Callable[[], DaemonConfig],
                 apply_config: Callable[[DaemonConfig], None], request_restart: Callable[[str], None],
                 status: Callable[[], Dict[str, Any]], overrides: Overrides) -> None:
        self.serving = serving
        self.models = models
        self.publisher = publisher
        self.handover = handover
        self.get_config = get_config
        self.apply_config = apply_config
        self.request_restart = request_restart
        self.status = status  # the daemon's status answer: the loop's view, the daemon's figures, who it is
        self.overrides = overrides

    def table(self) -> Dict[str, Handler]:
        """Verb → handler, for :class:`agent.commands.dispatcher.CommandDispatcher`: the methods the verb table
        (:mod:`agent.protocol.verbs`) names; each gets its verb's request type."""
        return handlers_of(self)

    # -- the verb table's methods: (request, progress) -> result ---------------------------------------------

    def status_command(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        return self.status()

    def deploy(self, request: DeployRequest, progress: Progress) -> Dict[str, Any]:
        return self.models.deploy(request, progress)

    def rollback(self, request: RollbackRequest, progress: Progress) -> Dict[str, Any]:
        return self.models.rollback(request.reason or TRIGGER_OPERATOR)

    def pause_command(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        return self.pause(True)

    def resume_command(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        return self.pause(False)

    def cancel(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        return self.models.cancel()

    def shadow(self, request: ShadowRequest, progress: Progress) -> Dict[str, Any]:
        return self.models.shadow(request, progress)

    def shadow_stop(self, request: ShadowStopRequest, progress: Progress) -> Dict[str, Any]:
        return self.models.shadow_stop(request.discard)

    def validate(self, request: ConfigRequest, progress: Progress) -> Dict[str, Any]:
        changes = request.config
        merged = merge_config(self.get_config(), changes)  # raises ConfigError with per-field errors
        return {"valid": True, "config": redact_all({k: to_dict(getattr(merged, k)) for k in changes})}

    def set_config(self, request: ConfigRequest, progress: Progress) -> Dict[str, Any]:
        """Validate, record in the overrides file (durable: a restart keeps it), then apply between batches.

        The operator's config file is never written (read-only under the unit, and it carries their comments).
        If the serving loop does not take the change, the overrides file is put back: nothing changed.
        """
        changes = request.config
        merged = merge_config(self.get_config(), changes)
        try:
            previous = self.overrides.record(changes)
        except OSError as exc:
            raise CommandError("storage", "could not record the change in %s: %s" % (
                self.overrides.path, exc)) from exc
        try:
            # Applied by the serving loop between batches, all at once; withdrawn if the loop does not get to it.
            self.handover.submit(lambda: self.apply_config(merged), HANDOVER_TIMEOUT_S,
                                 what="config change")
        except BaseException:
            self.overrides.restore(previous)
            raise
        return {"applied": sorted(changes), "overrides": self.overrides.path}

    def pause(self, paused: bool) -> Dict[str, Any]:
        """Answered once the serving loop applied it between batches: after a pause, no frame is taken."""
        if paused:
            self.serving.pause(HANDOVER_TIMEOUT_S)
            return {"paused": True, "stale_frames_dropped": 0}
        return {"paused": False, "stale_frames_dropped": self.serving.resume(HANDOVER_TIMEOUT_S)}

    def snapshot(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        import cv2

        latest = self.serving.latest()
        if latest is None:
            raise CommandError("no_frame", "no frame has been served yet")
        frame, result = latest
        picture = annotate(frame.image, result.get("detections", []))
        ok, jpeg = cv2.imencode(".jpg", picture, [cv2.IMWRITE_JPEG_QUALITY, SNAPSHOT_JPEG_QUALITY])
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        topic = self.publisher.snapshot_topic(frame.source)
        self.publisher.publish(topic, jpeg.tobytes(), qos=1, retain=False, durable=False)
        return {"topic": topic, "bytes": int(jpeg.size), "frame_id": frame.frame_id, "source": frame.source}

    def restart(self, request: NoFields, progress: Progress) -> Dict[str, Any]:
        # Acknowledge first, then stop: the ack must reach the operator before the process goes away.
        threading.Timer(RESTART_DELAY_S, self.request_restart, args=("restart command",)).start()
        return {"restarting": True}
