"""Tools for demos, tests and benchmarks, not for serving: the embedded Mosquitto, a RabbitMQ cluster on loopback
(the cluster lane) and the synthetic scenes.

May import ``pipeline`` and the layers below it; never its siblings ``lifecycle``, ``ops``, ``health`` (and they
never import it). Layers: docs/architecture.md.
"""
