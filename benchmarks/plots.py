"""PNG plots of a run (matplotlib, Agg backend: no display needed); one file per section that ran."""

import logging
import os
from typing import Any, Callable, Dict, List

from benchmarks.formatting import format_value

log = logging.getLogger(__name__)

DPI = 100  # small files: these are committed next to the JSON
FIGSIZE = (8.0, 4.5)


class MissingMatplotlib(RuntimeError):
    """--plots was asked for and matplotlib is not installed; the message says how to get it."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingMatplotlib(
            "--plots needs matplotlib: pip install matplotlib (the 'dev' extra has it)"
        ) from None


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _preprocess(plt: Any, section: Dict[str, Any]) -> Any:
    cases = list(section["cases"])
    kinds = (
        ("resize", "cv2.resize (floor)"),
        ("fill", "agent fill, float32"),
        ("fill_uint8_aipp", "agent fill, uint8 AIPP"),
        ("straightforward", "straightforward"),
    )
    fig, ax = plt.subplots(figsize=FIGSIZE)
    width = 0.8 / len(kinds)
    for k, (key, label) in enumerate(kinds):
        medians = [section["cases"][c]["ms"][key]["median"] for c in cases]
        errors = [
            [m - section["cases"][c]["ms"][key]["q1"] for c, m in zip(cases, medians)],
            [section["cases"][c]["ms"][key]["q3"] - m for c, m in zip(cases, medians)],
        ]
        ax.bar(
            [i + k * width for i in range(len(cases))], medians, width, yerr=errors, label=label, capsize=2
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
    ax.set_ylabel("ms per frame (median, IQR)")
    ax.set_title("Preprocessing: fill vs the cv2.resize floor")
    ax.legend()
    return fig


def _postprocess(plt: Any, section: Dict[str, Any]) -> Any:
    det = section["detect_yolov8"]
    labels = ["YOLOv8 decode+NMS"] + [
        "top-5, batch %d" % c["batch"] for c in section["classify_top5"].values()
    ]
    entries = [det] + list(section["classify_top5"].values())
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for k, (key, label) in enumerate((("agent", "agent"), ("straightforward", "straightforward"))):
        ax.bar(
            [i + k * 0.4 for i in range(len(entries))],
            [e["ms"][key]["median"] for e in entries],
            0.4,
            label=label,
        )
    ax.set_xticks([i + 0.2 for i in range(len(entries))], labels)
    ax.set_ylabel("ms (median)")
    ax.set_title("Post-processing")
    ax.legend()
    return fig


def _batching(plt: Any, section: Dict[str, Any]) -> Any:
    backends = [b for b, r in section["backends"].items() if "skipped" not in r]
    fig, axes = plt.subplots(
        len(backends), 2, figsize=(FIGSIZE[0] * 1.4, FIGSIZE[1] * len(backends)), squeeze=False
    )
    for row, backend in enumerate(backends):
        result = section["backends"][backend]
        overload, paced = result["overload"]["cells"], result["paced"]["cells"]
        waits = sorted({c["max_wait_ms"] for c in overload})
        for wait in waits:
            cells = [c for c in overload if c["max_wait_ms"] == wait]
            axes[row][0].plot(
                [c["max_batch"] for c in cells],
                [c.get("throughput_fps", 0) for c in cells],
                marker="o",
                label="max_wait %g ms" % wait,
            )
            cells = [c for c in paced if c["max_wait_ms"] == wait]
            axes[row][1].plot(
                [c["max_batch"] for c in cells],
                [c.get("latency_ms", {}).get("p99", 0) for c in cells],
                marker="o",
                label="max_wait %g ms" % wait,
            )
        axes[row][0].set_title(
            "%s: throughput at overload (%.0f fps offered)" % (backend, result["overload"]["offered_hz"])
        )
        axes[row][0].set_xlabel("max_batch")
        axes[row][0].set_ylabel("frames/s")
        axes[row][1].set_title(
            "%s: p99 latency, paced at %.0f fps" % (backend, result["paced"]["offered_hz"])
        )
        axes[row][1].set_xlabel("max_batch")
        axes[row][1].set_ylabel("ms")
        axes[row][0].legend()
        axes[row][1].legend()
    fig.tight_layout()
    return fig


def _memory(plt: Any, section: Dict[str, Any]) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(FIGSIZE[0] * 1.4, FIGSIZE[1]))
    for backend, result in section["backends"].items():
        samples = result["frames"]["samples"]
        axes[0].plot(
            samples["frames"],
            samples["rss_mb"],
            label="%s (%s MB/10k frames)"
            % (backend, format_value("{:+.3f}", result["frames"]["rss_mb_per_10k_frames"])),
        )
        axes[1].plot(
            range(len(result["swaps"]["rss_mb"])), result["swaps"]["rss_mb"], marker="o", label=backend
        )
    axes[0].set_xlabel("frames")
    axes[0].set_ylabel("RSS MB")
    axes[0].set_title("RSS over frames")
    axes[1].set_xlabel("load/infer/close cycles")
    axes[1].set_ylabel("RSS MB")
    axes[1].set_title("RSS over model swaps")
    axes[0].legend()
    axes[1].legend()
    fig.tight_layout()
    return fig


def _mqtt(plt: Any, section: Dict[str, Any]) -> Any:
    live = section["live"]
    replay = section["outbox_replay"]
    names = ["agent publisher", "raw paho", "outbox store (offline)", "outbox replay"]
    values = [
        live["agent_msgs_per_s"]["median"],
        live["paho_msgs_per_s"]["median"],
        replay["offline_store_msgs_per_s"],
        replay["replay_msgs_per_s"] or 0.0,
    ]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    ax.bar(names, values)
    ax.set_ylabel("messages per second")
    ax.set_title(
        "MQTT results to a local Mosquitto, QoS 1 (ratio agent/paho %.2f)" % section["ratio_to_paho"]
    )
    return fig


def _pipeline(plt: Any, section: Dict[str, Any]) -> Any:
    labels: List[str] = []
    stages: Dict[str, List[float]] = {"backend": [], "preprocess": [], "postprocess": [], "glue": []}
    for backend, result in section["backends"].items():
        for batch in ("b1", "b8"):
            if batch not in result:
                continue
            labels.append("%s %s" % (backend, batch))
            for stage in stages:
                stages[stage].append(result[batch]["per_frame_ms"][stage]["median"])
    fig, ax = plt.subplots(figsize=FIGSIZE)
    bottom = [0.0] * len(labels)
    for stage, values in stages.items():
        ax.bar(labels, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per frame (median)")
    ax.set_title("Where a frame's time goes (%s)" % section["bundle"])
    ax.legend()
    return fig


PLOTTERS: Dict[str, Callable[[Any, Dict[str, Any]], Any]] = {
    "preprocess": _preprocess,
    "postprocess": _postprocess,
    "pipeline": _pipeline,
    "batching": _batching,
    "mqtt": _mqtt,
    "memory": _memory,
}


def write_plots(data: Dict[str, Any], directory: str) -> List[str]:
    """One PNG per section present in ``data``; returns the paths written."""
    plt = _pyplot()
    os.makedirs(directory, exist_ok=True)
    written = []
    for name, plotter in PLOTTERS.items():
        section = data.get(name)
        if not isinstance(section, dict):
            continue
        fig = plotter(plt, section)
        path = os.path.join(directory, "%s.png" % name)
        fig.savefig(path, dpi=DPI)
        plt.close(fig)
        written.append(path)
        log.info("plot written: %s", path)
    return written
