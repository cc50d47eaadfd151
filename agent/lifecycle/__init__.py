"""A model's life on the box: fetch and unpack, A/B slots, the bundle store, the probation window, start-up
recovery, the swap of what serves (between batches) and the model manager that orchestrates them. The bundle
format itself is :mod:`agent.bundle`.

May import ``pipeline`` and the layers below it (``bundle``, ``protocol``, ``config``, ``_util``, ``errors``);
never its siblings ``ops``, ``health``, ``devtools``. Layers: docs/architecture.md.
"""
