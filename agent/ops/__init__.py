"""The MQTT transport: the connection supervisor, messages in flight, the outbox replay, the durable outbox (with
its byte and disk budget, ``outbox_budget``), Home Assistant discovery, and the Prometheus
endpoint (``metrics``) that reads the daemon's figures at scrape time. What commands mean is
:mod:`agent.commands`; topic names are :mod:`agent.protocol`.

May import ``pipeline`` and the layers below it (it uses ``protocol``, ``config``, ``_util``); never its siblings
``lifecycle``, ``health``, ``devtools``. Layers: docs/architecture.md.
"""
