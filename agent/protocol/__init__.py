"""The MQTT protocol both sides speak: topic names, the verb table (``verbs``: each verb's request type,
worker, group default, handler and help), ack states, request ids, the error body, a command's envelope (date,
signature), the retained status (``status``: one builder for the box, one reader for the operator), and typed
readers for what an operator receives (an ack, a deploy's result).

The box (``commands``, ``ops``), ``cli ctl`` and ``fleet`` all build and parse through here, so a change to the
protocol is a change in one place. May import ``config`` (the schema engine), ``_util`` and ``errors`` only.
"""
