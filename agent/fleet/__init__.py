"""The operator's side of a fleet: every box at a glance and staged rollouts, over the boxes' own MQTT protocol.

``status`` asks every box to announce itself and folds the answers, the retained status topics (where the broker
sends them) and telemetry heard while listening into one view, judging an ``online`` nobody heard lately
``stale``; ``inventory`` is the operator's record of every box seen, so a silent one is listed, not lost; ``rollout``
plans canary and waves, sends ``deploy`` with request ids derived from the rollout and device ids, judges each
box by the slot states in its retained status, aborts on a failure threshold, optionally rolls moved boxes
back, and keeps its progress in a local state file so that a re-run continues where it stopped.

Topics, acks and statuses are built and read by :mod:`agent.protocol`. May import ``protocol``, ``config``,
``_util`` and ``errors``; never ``commands``, ``ops``, ``pipeline``, ``bundle``, ``lifecycle``, ``health``,
``devtools`` or ``cli`` (the CLI builds the MQTT client and hands it in). Layers: docs/architecture.md.
"""
