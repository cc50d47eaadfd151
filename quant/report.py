"""The run report: report.json (machine-readable) and report.txt (the summary printed at the end of a run)."""

import json
import os
from typing import Any, Dict, List, Optional

REPORT_JSON = "report.json"
REPORT_TEXT = "report.txt"


def metric_line(metrics: Dict[str, Any]) -> str:
    if "top1" in metrics:
        return "top-1 %.2f %% on %d held-out images" % (100 * metrics["top1"], metrics["images"])
    return "mAP@0.5 %.4f on %d held-out images" % (metrics["map50"], metrics["images"])


def metric_delta(
    float_metrics: Dict[str, Any], qat_metrics: Optional[Dict[str, Any]]
) -> Optional[Dict[str, float]]:
    """QAT minus float, in percentage points of the task's metric."""
    if not qat_metrics:
        return None
    key = "top1" if "top1" in float_metrics else "map50"
    return {key + "_points": round(100 * (qat_metrics[key] - float_metrics[key]), 3)}


def summary_text(report: Dict[str, Any]) -> str:
    """The readable summary printed at the end of a run and saved as report.txt."""
    lines = ["atlas-edge qat: %s %s (%s)" % (report["name"], report["version"], report["task"])]
    net = report["network"]
    lines.append(
        "network   %s (%s), %d parameters, float MindIR %s bytes"
        % (net["class"], net["kind"], net["parameters"], net["float_mindir_bytes"])
    )
    lines.append(
        "data      %s: %s training, %s held-out images"
        % (report["data"]["kind"], report["data"]["train_images"], report["data"]["test_images"])
    )
    lines.append("float     " + metric_line(report["float"]))
    if report["qat"]:
        lines.append("qat int8  " + metric_line(report["qat"]) + "  (%s)" % report["delta"])
    sim = report["checks"].get("int8sim_test_split")
    if sim:
        agreement = sim.get("top1_agreement")
        lines.append(
            "int8-sim MindIR on the held-out split: %s, max |diff| to the QAT network %.3g%s"
            % (
                metric_line(sim["metrics"]),
                sim["max_abs_diff"],
                "" if agreement is None else ", top-1 agreement %.2f %%" % (100 * agreement),
            )
        )
    lines.extend(_int8_onnx_lines(report["checks"]))
    for tier, shape in report["tiers"].items():
        lines.append("tier %-9s input %s -> output0 %s" % (tier, shape["input"], shape["output0"]))
    lines.append("artifacts (%d bytes in all):" % sum(v or 0 for v in report["artifacts"].values()))
    for name, size in report["artifacts"].items():
        lines.append("  %-40s %10s bytes" % (name, size))
    lines.append("seconds   " + ", ".join("%s %.1f" % kv for kv in report["seconds"].items()))
    if report.get("resumed_phases"):
        lines.append(
            "          (--resume: %s loaded from checkpoints; their training seconds are those of the"
            " run that trained them, total is this run)" % "/".join(report["resumed_phases"])
        )
    lines.append("toolchain " + ", ".join("%s %s" % kv for kv in report["toolchain"].items()))
    return "\n".join(lines) + "\n"


def _int8_onnx_lines(checks: Dict[str, Any]) -> List[str]:
    """The int8 ONNX on onnxruntime against the int8 simulation (quant.int8_artifact), or why there is none."""
    if "int8_onnx" in checks:
        return ["int8 ONNX not written: %s" % checks["int8_onnx"]["skipped"]]
    main = checks.get("int8_onnx_test_split")
    if not main:
        return []
    if "best_anchor_class_agreement" in main:
        ties = " (+%d tie(s))" % main["best_anchor_ties"] if main.get("best_anchor_ties") else ""
        agreement = "best-anchor class agreement %.2f %%%s, mean |score diff| %.2g, mean |box diff| %s px" % (
            100 * main["best_anchor_class_agreement"], ties, main["mean_score_diff"],
            "-" if main["mean_box_diff_px"] is None else "%.3g" % main["mean_box_diff_px"])
    else:
        agreement = "top-1 agreement %.2f %%, max |diff| %.3g" % (100 * main["top1_agreement"], main["max_abs_diff"])
    return [
        "int8 ONNX %s on onnxruntime, held-out split: %s" % (main["file"], metric_line(main["metrics"])),
        "          vs the int8 simulation: %s; %.3fx the float ONNX's bytes; %d negative-k channels, %d weights"
        " clipped" % (agreement, main["bytes_ratio_to_float"], main["negative_k_channels"], main["clipped_weights"]),
    ]


def write_report(out_dir: str, report: Dict[str, Any]) -> str:
    """Write report.json and report.txt into the bundle; returns the summary text."""
    with open(os.path.join(out_dir, REPORT_JSON), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
        handle.write("\n")
    text = summary_text(report)
    with open(os.path.join(out_dir, REPORT_TEXT), "w", encoding="utf-8") as handle:
        handle.write(text)
    return text
