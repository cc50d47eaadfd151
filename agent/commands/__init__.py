"""Commands: the dispatcher (intake checks, acks, one worker), its request record (SQLite, for idempotent
retries), the rate limit, and what each verb does (``handlers``). The protocol itself (topics, verbs, request
types, acks) is :mod:`agent.protocol`; the MQTT transport is :mod:`agent.ops`.

Sits between the daemon and the groups it drives: may import ``lifecycle``, ``ops``, ``health``, ``devtools`` and
every layer below; never ``cli``, ``daemon`` or its sibling ``fleet``. Layers: docs/architecture.md.
"""
