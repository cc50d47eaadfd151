"""Bring your own model: ``atlas-edge bundle create`` turns an ONNX or MindIR exported elsewhere (Ultralytics,
MindYOLO, MindCV) into a bundle: ``model_file`` reads what the file says about itself, ``decide`` settles tiers,
task, labels and pre/postprocessing, ``onnx_graph`` makes the graph edits the box's runtimes need, and
``create`` writes the bundle.

It makes bundles with the same writer as ``qat`` (:mod:`converters.bundle_writer`), so it sits in the lowest host
package and never imports ``quant``; MindSpore and ``onnx`` (the ``host`` extra) are imported only inside the
functions that need them. Nothing on the box imports it.
"""
