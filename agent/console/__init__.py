"""The operator's web console (``atlas-edge console``, the ``[console]`` extra; docs/console.md): the fleet, each
box with its annotated snapshots and commands, live, behind accounts with roles.

Operator side only: it reads the boxes over the same MQTT protocol as ``fleet status`` (:mod:`agent.fleet`) and
changes a box only through the protocol's verbs. The box never imports it.
"""
