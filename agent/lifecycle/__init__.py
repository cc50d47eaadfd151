"""A model's life on the box: bundle schema and verification, fetch and unpack, A/B slots, the bundle store,
the probation window, start-up recovery and the model manager that hot-swaps between batches.

May import ``pipeline``, ``config``, ``_util`` and ``errors``; never ``ops``, ``health``, ``cli`` or ``devtools``.
"""
