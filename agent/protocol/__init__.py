"""The MQTT protocol both sides speak: topic names, verbs, ack states, request ids, the error body, one request
type per verb, a command's envelope (date, signature), and typed readers for what an operator receives (a
box's status, an ack, a deploy's result).

The box (``commands``, ``ops``), ``cli ctl`` and ``fleet`` all build and parse through here, so a change to the
protocol is a change in one place. May import ``config`` (the schema engine), ``_util`` and ``errors`` only.
"""
