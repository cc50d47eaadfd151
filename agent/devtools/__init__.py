"""Tools for demos, tests and benchmarks, not for serving: the embedded Mosquitto and the synthetic scenes.

May import ``config``, ``_util`` and ``errors``; nothing in ``pipeline``, ``lifecycle`` or ``ops`` imports it.
"""
