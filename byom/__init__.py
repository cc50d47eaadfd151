"""Bring your own model: ``atlas-edge bundle create`` turns an ONNX or MindIR exported elsewhere (Ultralytics,
MindYOLO, MindCV) into a bundle (``create``), with the graph edits the box's runtimes need (``onnx_graph``).

A host package (MindSpore, onnx): between ``agent.cli``, which dispatches to it, and ``quant``, whose bundle
writer it reuses; nothing on the box imports it.
"""
