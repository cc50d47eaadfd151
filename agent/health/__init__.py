"""Is the box healthy: memory readers and the leak detector, the progress monitor, the watchdog thread,
sd_notify and npu-smi.

May import ``pipeline`` and the layers below it; never its siblings ``lifecycle``, ``ops``, ``devtools``.
Layers: docs/architecture.md.
"""
