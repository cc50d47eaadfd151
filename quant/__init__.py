"""Host side of atlas-edge: data sets, training, Golden Stick SimQAT, exports, evaluation: ``atlas-edge qat``.

Imports MindSpore (and Golden Stick, lazily); never imported by the box. Modules, one concern each:
``config`` (the run's YAML schema), ``datasets`` (letterboxed by :mod:`agent.pipeline.preprocess`), ``networks``,
``detection_loss``, ``training``, ``fake_quant`` (CPU fake quantizers for SimQAT), ``evaluation`` (top-1,
mAP@0.5), ``export`` (MindIR/ONNX and read-back checks), ``int8_onnx`` (the int8 QDQ ONNX with the QAT
scales, numpy and onnx only), ``int8_artifact`` (its inputs from the QAT network, its read-back), ``pipeline``
(the ``atlas-edge qat`` run), ``checkpoints_from_bundle`` (a bundle's checkpoints from its own MindIRs, for
``--resume``), ``cli``.
The bundle's calibration set, golden set and manifest are written by :mod:`converters.bundle_writer`, which
``bundle create`` (:mod:`converters.byom`) shares.
"""
