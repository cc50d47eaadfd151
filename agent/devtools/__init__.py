"""Tools for demos, tests and benchmarks, not for serving: the embedded Mosquitto, a RabbitMQ cluster on loopback
(the cluster lane), the synthetic scenes and the camera rig (a GStreamer RTSP server on loopback whose frames carry
their capture time).

May import ``pipeline`` and the layers below it; never its siblings ``lifecycle``, ``ops``, ``health`` (and they
never import it). Layers: docs/architecture.md.
"""
