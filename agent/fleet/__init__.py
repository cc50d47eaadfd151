"""The operator's side of a fleet: every box at a glance and staged rollouts, over the boxes' own MQTT protocol.

``status`` asks every box to announce itself and folds the answers, the retained status topics (where the broker
sends them) and telemetry heard while listening into one view, judging an ``online`` nobody heard lately ``stale``;
``inventory`` is the operator's record of every box seen, so a silent one is listed, not lost. A rollout is
``rollout`` (the engine: targets, canary and waves, abort, pause, resume) with its rooms: ``plan`` (the spec,
waves, request ids and abort rules), ``intake`` (statuses and acks bound to the box whose topic they came on),
``judge`` (a box's outcome from its own word, retries, timeouts), ``revert`` (moved boxes put back after an abort
or cancel), ``journal`` (the state file as a snapshot plus a journal, and the lock), ``records`` (a box's record,
the rollout's own fields, and every state of a box and a rollout as an enum) and ``report`` (every known box with
its outcome, and the exit codes). ``judge`` and ``revert`` are handed the ``intake`` (and ``revert`` the engine's
``send``): they never import the engine.

Verbs, requests, topics, acks and statuses are built and read by :mod:`agent.protocol`. May import ``protocol``,
``config``, ``_util`` and ``errors``; never ``commands``, ``ops``, ``pipeline``, ``bundle``, ``lifecycle``,
``health``, ``devtools`` or ``cli`` (the CLI builds the MQTT client and hands it in). Layers: docs/architecture.md.
"""
