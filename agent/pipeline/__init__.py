"""The frame path: sources → letterbox → batcher → backend → decode → result payloads, plus stage stats.

May import ``config``, ``_util`` and ``errors``; never ``lifecycle``, ``ops``, ``health``, ``cli`` or ``devtools``.
"""
