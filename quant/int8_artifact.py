"""The int8 ONNX artifact of a QAT run: its inputs read from the trained QAT network, and its read-back check.

Why the QAT network in memory and not the deploy MindIR: the network holds each quantizer inside the cell it
quantizes (``QuantCell.input_quantizer()`` / ``weight_quantizer()`` next to ``QuantCell.weight``, whose
parameter name is the float ONNX's initializer name), so nothing has to be matched up by following
``FakeQuantParam`` nodes through the MindIR's graph; and each quantizer's scale and zero point come from
Golden Stick's own ``LinearFakeQuantizer.get_scale_zp()``, the function ``convert()`` calls to fill the deploy
MindIR's ``FakeQuantParam`` nodes, so the numbers are the same ones. The run records the deploy MindIR's
``FakeQuantParam`` count beside the quantizer count used here.

The read-back check runs the int8 ONNX on onnxruntime on the whole held-out split (uint8 letterboxed frames,
as the box feeds it) and compares it with the MindSpore int8 simulation (the QAT network) on the same images.
"""

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from quant.int8_onnx import ActivationQuant, ConvQuant, Int8ExportError, QatTensors

log = logging.getLogger(__name__)

# A disagreement on an image's best (class, anchor) where the simulation scores the int8 pick this close to its
# own best is a tie, not a different decision (compare_detections); compare_outputs counts it as agreeing.
BEST_SCORE_TIE = 1e-3


def _activation(quantizer: Any, layer: str) -> ActivationQuant:
    if quantizer.symmetric() or quantizer.is_per_channel() or quantizer.num_bits() != 8:
        raise Int8ExportError("%s: the input quantizer is not per-tensor asymmetric 8-bit" % layer)
    scale, zero_point = quantizer.get_scale_zp()
    return ActivationQuant(float(np.float32(scale[0])), int(round(zero_point[0])))


def _weight(quantizer: Any, layer: str) -> ConvQuant:
    from quant.fake_quant import quant_range

    if not quantizer.symmetric() or quantizer.num_bits() != 8:
        raise Int8ExportError("%s: the weight quantizer is not symmetric 8-bit" % layer)
    scale, zero_point = quantizer.get_scale_zp()
    if any(zero_point):
        raise Int8ExportError("%s: weight zero points %s are not 0" % (layer, zero_point[:4]))
    qrange = quant_range(8, True, quantizer.narrow_range())
    return ConvQuant(ActivationQuant(1.0, 0), np.asarray(scale, np.float32), (int(qrange[0]), int(qrange[1])))


def qat_tensors(network: Any) -> QatTensors:
    """Parameter values and each quantized convolution's quantizers from a trained QAT network (before
    ``convert()``)."""
    from mindspore import nn
    from mindspore_gs.quantization.quant_cell import QuantCell

    params = {p.name: p.asnumpy() for p in network.get_parameters()}
    convs: Dict[str, ConvQuant] = {}
    for name, cell in network.cells_and_names():
        if not isinstance(cell, QuantCell):
            continue
        if not isinstance(cell.handler(), nn.Conv2d):
            raise Int8ExportError(
                "%s: a quantized %s; the int8 ONNX covers convolution networks only"
                % (name, type(cell.handler()).__name__)
            )
        inputs, weights = cell.input_quantizer(), cell.weight_quantizer()
        if inputs is None or weights is None:
            raise Int8ExportError("%s: a quantized convolution without input and weight quantizers" % name)
        if cell.output_quantizer() is not None:
            raise Int8ExportError("%s: convolution output quantizers are not supported" % name)
        weight = _weight(weights, name)
        convs[cell.handler().weight.name] = ConvQuant(_activation(inputs, name), weight.weight_scale,
                                                      weight.weight_range)
    return QatTensors(params, convs)


def onnxruntime_missing() -> Optional[str]:
    """None when onnxruntime imports, else why not (the int8 ONNX is then not written)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return "onnxruntime is not installed (%s)" % exc
    return None


def compare_detections(int8_out: np.ndarray, sim_out: np.ndarray, conf: float) -> Dict[str, Any]:
    """int8 vs simulated int8 outputs, (N, 4 + nc, A) each.

    ``best_anchor_class_agreement``: share of images whose highest score (over anchors and classes) is of the
    same class in both; ``best_anchor_ties``: images where it is not, but the simulation scores the int8
    model's pick within :data:`BEST_SCORE_TIE` of its own best (two objects scored alike, 0.99970 against
    0.99969 in the case that failed a full run, which rounding orders either way); ``anchor_class_agreement``:
    share of the anchors the simulation scores >= ``conf`` whose top class is the same in both; score
    difference over every score, box difference (pixels) over those confident anchors.
    """
    scores_int8, scores_sim = int8_out[:, 4:], sim_out[:, 4:]
    classes = scores_sim.shape[1]
    flat_int8, flat_sim = scores_int8.reshape(len(int8_out), -1), scores_sim.reshape(len(sim_out), -1)
    pick_int8, pick_sim = flat_int8.argmax(1), flat_sim.argmax(1)
    best_int8, best_sim = pick_int8 // scores_int8.shape[2], pick_sim // scores_sim.shape[2]
    same = best_int8 == best_sim
    tied = ~same & (flat_sim[np.arange(len(flat_sim)), pick_int8] >= flat_sim.max(1) - BEST_SCORE_TIE)
    confident = scores_sim.max(1) >= conf  # (N, A)
    top_int8, top_sim = scores_int8.argmax(1), scores_sim.argmax(1)
    boxes = np.abs(int8_out[:, :4] - sim_out[:, :4]).transpose(0, 2, 1)[confident]  # (K, 4)
    return {
        "images": int(len(int8_out)),
        "classes": int(classes),
        "best_anchor_class_agreement": float(np.mean(same)),
        "best_anchor_ties": int(tied.sum()),
        "confident_anchors": int(confident.sum()),
        "anchor_class_agreement": float(np.mean(top_int8[confident] == top_sim[confident]))
        if confident.any() else None,
        "mean_score_diff": float(np.mean(np.abs(scores_int8 - scores_sim))),
        "max_score_diff": float(np.max(np.abs(scores_int8 - scores_sim))),
        "mean_box_diff_px": float(boxes.mean()) if len(boxes) else None,
    }


def compare_classes(int8_out: np.ndarray, sim_out: np.ndarray) -> Dict[str, Any]:
    return {
        "images": int(len(int8_out)),
        "top1_agreement": float(np.mean(int8_out.argmax(1) == sim_out.argmax(1))),
        "max_abs_diff": float(np.max(np.abs(int8_out - sim_out))),
    }


# The run fails when the int8 ONNX picks another best class than the simulation on more images than this: a
# file that does not reproduce its QAT network never enters a bundle (exports are held to 1e-4; int8 rounding
# in another runtime flips a few near-ties, so this check is on decisions, not values).
MIN_BEST_CLASS_AGREEMENT = 0.95
INT8_SUFFIX = ".int8.onnx"


def int8_name(float_onnx: str) -> str:
    """``model_256x256.onnx`` -> ``model_256x256.int8.onnx``."""
    return float_onnx[: -len(".onnx")] + INT8_SUFFIX


def compare_outputs(int8_out: np.ndarray, sim_out: np.ndarray, task: str, conf: float) -> Dict[str, Any]:
    """The read-back figures for ``task``; raises Int8ExportError when the decisions disagree too often."""
    if int8_out.shape != sim_out.shape:
        raise Int8ExportError("int8 ONNX output shape %s, simulation %s" % (int8_out.shape, sim_out.shape))
    if task == "classify":
        result = compare_classes(int8_out, sim_out)
        agreement = result["top1_agreement"]
    else:
        result = compare_detections(int8_out, sim_out, conf)
        agreement = result["best_anchor_class_agreement"] + result["best_anchor_ties"] / len(int8_out)
    if agreement < MIN_BEST_CLASS_AGREEMENT:
        raise Int8ExportError(
            "the int8 ONNX agrees with the int8 simulation on %.1f %% of %d images (at least %.0f %% needed; "
            "ties within %g of the best score count as agreeing)"
            % (100 * agreement, len(int8_out), 100 * MIN_BEST_CLASS_AGREEMENT, BEST_SCORE_TIE)
        )
    return result


def _held_out_frames(config: Any, data: Any, spec: Any, tier: Tuple[int, int], batch: int) -> np.ndarray:
    """Letterboxed uint8 BGR frames: the whole held-out split at the main tier, else its first originals."""
    from agent.pipeline.preprocess import letterbox_for

    if tier == tuple(config.export.tiers[0]):
        return data.test.images
    count = min(len(data.originals), batch)
    return np.stack([letterbox_for(data.originals[i], tier, spec)[0] for i in range(count)])


def write_int8_artifacts(
    out_dir: str, config: Any, qat_network: Any, data: Any, spec: Any, score: Callable[[np.ndarray], Any],
    batch: int,
) -> Tuple[Dict[str, Any], List[Any]]:
    """``model_<tier>.int8.onnx`` beside each float ONNX, each read back on onnxruntime against the int8
    simulation; returns (report checks, manifest artifact plans). Without onnxruntime, or for a network with
    other quantized layers than convolutions, nothing is written and the checks say why."""
    from converters.bundle_writer import ArtifactPlan, tier_name
    from converters.onnx_input import MODEL_INPUT
    from converters.runtimes import run_on_host
    from quant.int8_onnx import write_int8_onnx

    skipped = onnxruntime_missing() or (None if config.export.onnx else "export.onnx is false")
    tensors = None
    try:
        tensors = None if skipped else qat_tensors(qat_network)
    except Int8ExportError as exc:
        skipped = str(exc)
    if tensors is None:
        log.warning("no int8 ONNX: %s", skipped)
        return {"int8_onnx": {"skipped": skipped}}, []
    from quant.training import predict  # MindSpore: only once there is a network to compare with

    checks: Dict[str, Any] = {}
    artifacts = []
    for tier in [tuple(t) for t in config.export.tiers]:
        float_path = os.path.join(out_dir, "model_%s.onnx" % tier_name(tier))
        path = int8_name(float_path)
        frames = _held_out_frames(config, data, spec, tier, batch)
        try:
            stats = write_int8_onnx(float_path, tensors, spec, path)
            int8_out = np.concatenate([run_on_host(path, "onnx", frames[i : i + 1], "int8")
                                       for i in range(len(frames))])
            check = compare_outputs(int8_out, predict(qat_network, frames, spec, batch), config.task,
                                    config.postprocessing.conf)
        except Int8ExportError as exc:
            raise Int8ExportError("%s: %s" % (path, exc)) from None
        check.update(stats.as_dict(), file=os.path.basename(path), quantizers=2 * len(tensors.convs),
                     bytes_ratio_to_float=round(os.path.getsize(path) / os.path.getsize(float_path), 4))
        main = tier == tuple(config.export.tiers[0])
        if main:
            check["metrics"] = score(int8_out)
        checks["int8_onnx_test_split" if main else check["file"]] = check
        log.info("int8 ONNX %s vs the int8 simulation: %s", check["file"], check)
        artifacts.append(ArtifactPlan(check["file"], tier, 1, "onnx", "int8", "serve", model_input=dict(MODEL_INPUT)))
    return checks, artifacts
