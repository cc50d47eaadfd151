"""A real command dispatcher and transport on a real Mosquitto, with handlers that count their calls (a helper
module, not a test module): the command tests and the freshness tests share it instead of importing each other."""

import itertools
import json
import threading
from typing import Any, Callable, Dict, List, Optional

import pytest

from agent.commands.dispatcher import CommandDispatcher
from agent.config.mqtt_config import MqttConfig
from agent.errors import CommandError
from agent.ops.outbox import Outbox
from agent.ops.transport import MqttTransport
from agent.protocol.verbs import request_types, verb_names
from tests.conftest import WAIT_S, MqttProbe, wait_for

_devices = itertools.count()


SHA = "ab" * 32


class Handlers:
    """Handlers for every verb that count their calls; each behaves in one way a real one can. Each gets its
    verb's request type, already parsed by the dispatcher."""

    def __init__(self) -> None:
        self.calls: Dict[str, int] = dict.fromkeys(verb_names(), 0)
        self.release = threading.Event()

    def table(self) -> Dict[str, Callable[[Any, Callable[[str], None]], Optional[Dict[str, Any]]]]:
        return {verb: self._counted(verb, getattr(self, verb.replace("-", "_"))) for verb in verb_names()}

    def _counted(self, verb: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(request: Any, progress: Callable[[str], None]) -> Any:
            assert isinstance(request, request_types()[verb])
            self.calls[verb] += 1
            return fn(request, progress)

        return handler

    def status(self, request, progress):
        return {"state": "serving", "calls": self.calls["status"]}

    def validate(self, request, progress):
        return {"valid": True, "sections": sorted(request.config)}

    def set_config(self, request, progress):
        raise CommandError("not_live", "mqtt settings need a restart", field="mqtt")

    def deploy(self, request, progress):
        progress("downloading")
        progress("verifying")
        return {"bundle": request.bundle, "sha256": request.sha256}

    def rollback(self, request, progress):
        return None  # a handler may return nothing: an empty result

    def pause(self, request, progress):
        return {"paused": True}

    def cancel(self, request, progress):
        return {"cancelled": False}

    def resume(self, request, progress):
        return {"paused": False}

    def snapshot(self, request, progress):
        raise RuntimeError("camera went away")

    def restart(self, request, progress):
        assert self.release.wait(WAIT_S)
        return {"restarting": True}

    def shadow(self, request, progress):
        progress("loading the candidate")
        return {"state": "running", "sample": request.sample}

    def shadow_stop(self, request, progress):
        return {"stopped": True, "discarded": request.discard}


class CommandSystem:
    """A transport and a dispatcher for one device on the broker, and an operator client watching its acks."""

    def __init__(self, broker, tmp_path, probe_factory, groups=(), device: Optional[str] = None,
                 **dispatcher_args: Any) -> None:
        self.device = device or "dev-%d" % next(_devices)
        self.prefix = "atlas-edge"
        self.handlers = Handlers()
        config = MqttConfig(host=broker.host, port=broker.port, groups=list(groups), reconnect_min_s=0.05,
                            reconnect_max_s=0.2)
        outbox = Outbox(str(tmp_path / ("%s-%d.sqlite" % (self.device, next(_devices)))), 1 << 24)
        self.transport = MqttTransport(config, self.device, outbox)
        self.dispatcher = CommandDispatcher(self.transport, self.handlers.table(), **dispatcher_args)
        self.transport.set_message_handler(self.dispatcher.submit)
        self.operator: MqttProbe = probe_factory(broker, ["%s/%s/ack/#" % (self.prefix, self.device)])
        self.dispatcher.start()
        self.transport.start()
        # Subscribed once the online status is acknowledged: the broker handles SUBSCRIBE before that PUBLISH.
        assert wait_for(lambda: self.transport.stats()["acked"] >= 1)

    def send(self, verb: str, payload: Any, group: Optional[str] = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        if group:
            topic = "%s/group/%s/cmd/%s" % (self.prefix, group, verb)
        else:
            topic = "%s/%s/cmd/%s" % (self.prefix, self.device, verb)
        self.operator.publish(topic, data)

    def acks(self, request_id: str) -> List[Dict[str, Any]]:
        return self.operator.on("%s/%s/ack/%s" % (self.prefix, self.device, request_id))

    def final(self, request_id: str, count: int = 1) -> Dict[str, Any]:
        """The request's ``count``-th final ack (waits for it)."""

        def finals() -> List[Dict[str, Any]]:
            return [a for a in self.acks(request_id) if a["state"] in ("succeeded", "failed")]

        assert wait_for(lambda: len(finals()) >= count), "no final ack for %s: %s" % (request_id,
                                                                                     self.acks(request_id))
        return finals()[count - 1]

    def settle(self, received: int) -> None:
        """Wait until ``received`` messages reached the dispatcher (the broker's PUBACK to the sender does not
        mean delivery) and everything they caused is done."""
        assert wait_for(lambda: self.dispatcher.stats()["received"] >= received)
        assert self.dispatcher.wait_idle(WAIT_S)
        assert self.transport.flush(WAIT_S)

    def close(self) -> None:
        self.dispatcher.stop(5.0)
        self.transport.stop(5.0)
        self.dispatcher.close()


@pytest.fixture
def system_factory(mosquitto, tmp_path, probe_factory):
    made: List[CommandSystem] = []

    def make(**kwargs: Any) -> CommandSystem:
        made.append(CommandSystem(mosquitto, tmp_path, probe_factory, **kwargs))
        return made[-1]

    yield make
    for system in made:
        system.close()


@pytest.fixture
def system(system_factory) -> CommandSystem:
    return system_factory()
