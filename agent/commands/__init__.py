"""Commands: the dispatcher (intake checks, queues, the workers), its answers (acks recorded, then published;
drops counted), its request record (SQLite, for idempotent retries), the rate limit, the freshness of dated and
signed commands, and what each verb does (``handlers``). The protocol itself (topics, verbs, request
types, acks) is :mod:`agent.protocol`; the MQTT transport is :mod:`agent.ops`.

Sits between the daemon and the groups it drives: may import ``lifecycle``, ``ops``, ``health``, ``devtools`` and
every layer below; never ``cli``, ``daemon`` or its sibling ``fleet``. Layers: docs/architecture.md.
"""
