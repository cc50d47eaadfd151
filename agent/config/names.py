"""Names that become topic levels (device ids, groups, source names, the prefix) must mean the same on any broker.

MQTT gives ``/``, ``+`` and ``#`` their meaning; RabbitMQ's MQTT plugin maps topics onto AMQP routing keys, where
``.`` separates words and ``*`` is a one-word wildcard: a box named ``cam.04`` publishes on
``atlas-edge/cam/04/...`` there and every command to it is dropped. So these characters are refused everywhere
a name is taken (config files, ``ctl``, ``fleet``), with the reason, before anything is sent.
"""

from typing import Optional

RESERVED = (
    ("/", "MQTT's topic-level separator"),
    ("+", "an MQTT wildcard"),
    ("#", "an MQTT wildcard"),
    (".", "RabbitMQ's topic-level separator (AMQP routing keys)"),
    ("*", "RabbitMQ's one-word wildcard (AMQP topic bindings)"),
    ("\x00", "not allowed in MQTT topics"),
)


def name_problem(name: object, levels: bool = False) -> Optional[str]:
    """Why ``name`` cannot be a topic level (None when it can); ``levels`` lets a prefix hold inner ``/``."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    if levels:
        if name.startswith("/") or name.endswith("/") or "//" in name:
            return "must not start or end with '/' nor hold an empty level (got %r)" % name
        if name.startswith("$"):
            return "must not start with '$': brokers keep those topics for themselves (got %r)" % name
    for char, meaning in RESERVED:
        if char in name and not (levels and char == "/"):
            return "must not contain %r: %s (got %r)" % (char, meaning, name)
    return None
