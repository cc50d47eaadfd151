"""Is the box healthy: memory readers and the leak detector, the progress monitor, the watchdog thread,
sd_notify and npu-smi.

May import ``config``, ``_util`` and ``errors`` only (nothing above it).
"""
