"""Operations over MQTT: the transport (connection, in-flight, replay), the durable outbox, the command
dispatcher with its request record, the verbs' handlers (``handlers``) and Home Assistant discovery.

May import ``config``, ``pipeline``, ``lifecycle``, ``health``, ``_util`` and ``errors``; never ``cli``, ``devtools``.
"""
