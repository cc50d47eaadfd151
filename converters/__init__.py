"""Host-side converters: MindSpore Lite ``converter_lite`` (.ms, Ascend MindIR) and CANN ``atc`` (.om, AIPP).

``atlas-edge convert`` reads a bundle's preprocessing contract and a device config, writes the AIPP and
converter configs, runs the tool and adds its output to the bundle's manifest (docs/converters.md).

Modules, one concern each:

- :mod:`converters.grammar`: the documented key sets and value domains of AIPP files, converter_lite
  configs and flags, and ATC flags, with a validator that rejects anything else;
- :mod:`converters.aipp`: the static AIPP config derived from the bundle's preprocessing;
- :mod:`converters.lite_config`: the converter_lite INI config and argument list;
- :mod:`converters.atc`: the ATC argument list;
- :mod:`converters.toolrun`: finding a tool, recording its version, running it with a timeout;
- :mod:`converters.convert`: the plan (dry-run) and its all-or-nothing execution into the bundle;
- :mod:`converters.cli`: ``add_arguments(parser)`` and ``run(args)`` for the ``atlas-edge`` entry point.

Nothing here is imported by the box's agent; only the standard library, NumPy and the agent's bundle and
device-config modules are used (no MindSpore at import time).
"""
