"""The frame path: sources → letterbox → batcher → backend → decode → result payloads, plus stage stats, the
serving loop (``serving``) with its backend thread (``backend_thread``), and the between-batches handover
(``handover``), the one way into that loop.

May import ``bundle``, ``protocol``, ``config``, ``_util`` and ``errors``; never ``lifecycle``, ``ops``, ``health``,
``devtools`` or above: the loop reaches them through the Protocols in ``seams``. Layers: docs/architecture.md.
"""
