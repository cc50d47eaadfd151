"""The frame path: sources → letterbox → batcher → backend → decode → result payloads, plus stage stats, the
serving loop (``serving``) and the between-batches handover (``handover``), the one way into that loop.

May import ``config``, ``lifecycle`` (a bundle's manifest), ``_util`` and ``errors``; never ``ops``, ``health``,
``cli`` or ``devtools``: the loop reaches them through the Protocols in ``serving``.
"""
