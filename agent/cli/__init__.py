"""The ``atlas-edge`` command line: the entry point, ``ctl``, ``bundle``, ``demo`` and ``fleet``.

The top of the import graph: may import any group; host-only commands import ``quant``/``converters`` lazily.
"""
