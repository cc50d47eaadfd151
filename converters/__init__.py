"""Host-side converters: MindSpore Lite ``converter_lite`` (.ms, Ascend MindIR) and CANN ``atc`` (.om, AIPP), and
what every bundle producer shares: the lowest host package (``quant`` sits above it and never the reverse).

``atlas-edge convert`` reads a bundle's preprocessing contract and a device config, writes the AIPP and
converter configs, runs the tool and adds its output to the bundle's manifest (docs/converters.md).
``atlas-edge bundle create`` (:mod:`converters.byom`) makes a bundle from a model trained elsewhere.

Modules, one concern each:

- :mod:`converters.grammar`: the documented key sets and value domains of AIPP files, converter_lite
  configs and flags, and ATC flags, with a validator that rejects anything else;
- :mod:`converters.aipp`: the static AIPP config derived from the bundle's preprocessing;
- :mod:`converters.lite_config`: the converter_lite INI config and argument list;
- :mod:`converters.atc`: the ATC argument list;
- :mod:`converters.toolrun`: finding a tool, recording its version, running it with a timeout; the versions of
  the host's own toolchain a bundle records;
- :mod:`converters.convert`: the plan (dry-run) and its all-or-nothing execution into the bundle;
- :mod:`converters.cli`: ``add_arguments(parser)`` and ``run(args)`` for the ``atlas-edge`` entry point;
- :mod:`converters.bundle_writer`: the calibration set, golden set and manifest of a new bundle (``qat`` and
  ``bundle create``), with their settings;
- :mod:`converters.runtimes`: an artifact's output on this host's runtimes (cv2.dnn, MindSpore), for read-back
  checks and golden sets;
- :mod:`converters.byom`: ``bundle create`` (bring your own model).

Nothing here is imported by the box's agent; at import time only the standard library, NumPy and the agent's
lower groups (NumPy, OpenCV) are used: MindSpore and ``onnx`` are imported inside the functions that need them.
"""
