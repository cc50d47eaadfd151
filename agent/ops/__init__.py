"""The MQTT transport: the connection supervisor, messages in flight, the outbox replay, the durable outbox, and
Home Assistant discovery. What commands mean is :mod:`agent.commands`; topic names are :mod:`agent.protocol`.

May import ``protocol``, ``config``, ``_util`` and ``errors``; never ``commands``, ``cli``, ``devtools``.
"""
