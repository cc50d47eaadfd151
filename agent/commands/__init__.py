"""Commands: the dispatcher (intake checks, acks, one worker), its request record (SQLite, for idempotent
retries), the rate limit, and what each verb does (``handlers``). The protocol itself (topics, verbs, request
types, acks) is :mod:`agent.protocol`; the MQTT transport is :mod:`agent.ops`.

Sits between the daemon and the groups it drives: may import ``ops``, ``lifecycle``, ``pipeline``, ``health``,
``protocol``, ``config``, ``_util`` and ``errors``; never ``cli``, ``daemon``, ``fleet`` or ``devtools``.
"""
