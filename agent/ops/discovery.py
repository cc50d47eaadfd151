"""Home Assistant MQTT discovery: the box appears as a device with sensors read from its own topics.

Configs are retained, published after every connect and again whenever Home Assistant announces itself on
its birth topic (``homeassistant/status`` = ``online``): HA users otherwise see entities turn "unavailable"
after an HA restart when discovery was published only once. A source removed from the config has its retained
config cleared (:func:`removal_messages`: an empty retained payload, which Home Assistant reads as "delete this
entity"), so no ghost sensor stays behind.
"""

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.protocol.messages import OFFLINE, ONLINE
from agent.protocol.topics import HA_ONLINE, HA_PREFIX, HA_STATUS_TOPIC, ha_config_topic, status_topic, telemetry_topic

__all__ = ["HA_ONLINE", "HA_PREFIX", "HA_STATUS_TOPIC", "config_topic", "discovery_messages", "removal_messages",
           "source_sensors", "source_object_id"]

# (object id, name, template over the telemetry JSON, unit)
TELEMETRY_SENSORS = (
    ("fps", "Frames per second", "{{ value_json.fps }}", "fps"),
    ("infer_p50", "Inference p50", "{{ value_json.latency_ms.infer.p50 | default(none) }}", "ms"),
    ("total_p90", "Frame latency p90", "{{ value_json.latency_ms.total.p90 | default(none) }}", "ms"),
    ("queue_depth", "Queue depth", "{{ value_json.queue_depth }}", None),
    ("rss", "Memory (RSS)", "{{ value_json.rss_mb | default(none) }}", "MB"),
    ("inference_errors", "Inference errors", "{{ value_json.inference_errors }}", None),
)


def config_topic(device_id: str, object_id: str) -> str:
    """The retained discovery topic of one sensor of this box."""
    return ha_config_topic(device_id, object_id)


def source_object_id(name: str) -> str:
    return "source_%s" % name


def removal_messages(device_id: str, sources: Sequence[str]) -> List[Tuple[str, bytes]]:
    """(topic, empty retained payload) clearing the discovery config of each of ``sources``."""
    return [(config_topic(device_id, source_object_id(name)), b"") for name in sources]


def source_sensors(sources: Sequence[str]) -> List[Tuple[str, str, str, Optional[str]]]:
    """One sensor per source: its state (connecting/up/stalled/down/failed), from the telemetry's ``sources``."""
    return [(source_object_id(name), "Source %s" % name,
             "{{ value_json.sources[%s].state | default(none) }}" % json.dumps(name), None) for name in sources]


def discovery_messages(prefix: str, device_id: str, device_kind: str, model_label: str,
                       sources: Sequence[str] = ()) -> List[Tuple[str, bytes]]:
    """(topic, retained payload) for each sensor of this box, and one per source."""
    device = {"identifiers": ["atlas-edge-%s" % device_id], "name": "atlas-edge %s" % device_id,
              "model": device_kind, "sw_version": model_label, "manufacturer": "atlas-edge"}
    availability = {"topic": status_topic(prefix, device_id), "value_template": "{{ value_json.state }}",
                    "payload_available": ONLINE, "payload_not_available": OFFLINE}
    messages = []
    for object_id, name, template, unit in (*TELEMETRY_SENSORS, *source_sensors(sources)):
        unique = "atlas_edge_%s_%s" % (device_id, object_id)
        config: Dict[str, Any] = {
            "name": name, "unique_id": unique, "object_id": unique, "state_topic": telemetry_topic(prefix, device_id),
            "value_template": template, "device": device, "availability": [availability],
        }
        if unit:
            config["unit_of_measurement"] = unit
        messages.append((config_topic(device_id, object_id), json.dumps(config, sort_keys=True).encode("utf-8")))
    return messages
