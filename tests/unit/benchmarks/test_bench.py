"""The benchmark suite: structure of its JSON, its statistics, its bound check, its report; never its speed.

The quick CLI run is limited to the in-process sections (preprocess, postprocess) so it takes seconds; the
MQTT harness runs against a real Mosquitto with a few dozen messages; the start-up probe runs the real daemon
on the committed demo bundle when it exists.
"""

import json
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# benchmarks/ is not among the distribution's packages (pyproject lists agent, quant, converters), so the
# editable install does not map it: import it from the checkout.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks import batching, harness, postprocessing, preprocessing, report  # noqa: E402
from benchmarks.cli import REQUIRED_KEYS, missing_required  # noqa: E402

QUICK_SECTIONS = ["preprocess", "postprocess"]
ENVIRONMENT_KEYS = ("date", "cpu_model", "cpu_count", "cpus_usable", "python", "numpy", "opencv", "mindspore",
                    "paho_mqtt", "mosquitto", "threads")
SUMMARY_KEYS = {"median", "q1", "q3", "min", "max", "n"}


def run_bench(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "agent", "bench", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    done = run_bench("--quick", "--only", ",".join(QUICK_SECTIONS), "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with open(out, encoding="utf-8") as handle:
        return json.load(handle), done.stdout


def walk_numbers(value, path=""):
    """Every number in a nested JSON value, with its dotted path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk_numbers(item, "%s.%s" % (path, key) if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from walk_numbers(item, "%s[%d]" % (path, index))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


# --- the quick CLI run ----------------------------------------------------------------------------

def test_quick_run_writes_the_figures_and_environment(quick_json):
    data, stdout = quick_json
    assert data["schema"] == 1
    assert data["profile"] == "quick"
    assert data["sections"] == QUICK_SECTIONS
    assert data["command"] == "atlas-edge bench --quick --only preprocess,postprocess --json %s" % (
        data["command"].split("--json ", 1)[1])
    assert data["errors"] == {} and data["missing_figures"] == []
    for key in ENVIRONMENT_KEYS:
        assert key in data["environment"], key
    assert data["environment"]["threads"]["cv2_num_threads"] == 1
    assert data["environment"]["threads"]["env"]["OMP_NUM_THREADS"] == "1"
    for key in ("preprocess.ratio_to_resize", "postprocess.speedup_vs_naive"):
        value = report.get_path(data, key)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
        goal = data["targets"][key]
        assert goal["value"] == value
        assert goal["met"] == (value <= preprocessing.TARGET_RATIO_TO_RESIZE if key.startswith("preprocess")
                               else value >= postprocessing.TARGET_SPEEDUP)
    assert "`preprocess.ratio_to_resize`" in stdout and "`postprocess.speedup_vs_naive`" in stdout


def test_quick_run_timings_are_finite_and_positive(quick_json):
    data, _ = quick_json
    numbers = list(walk_numbers({name: data[name] for name in QUICK_SECTIONS}))
    assert len(numbers) > 100
    for path, value in numbers:
        if path.endswith("max_abs_diff_vs_straightforward"):
            assert 0 <= value <= preprocessing.AGREEMENT_ATOL, path
            continue
        assert math.isfinite(value) and value > 0, (path, value)


def test_quick_run_covers_every_case_and_agrees_with_the_references(quick_json):
    data, _ = quick_json
    cases = data["preprocess"]["cases"]
    assert sorted(cases) == sorted(name for name, _src, _dst in preprocessing.CASES)
    for case in cases.values():
        assert set(case["ms"]) == {"resize", "fill", "fill_uint8_aipp", "straightforward"}
        for summary in case["ms"].values():
            assert set(summary) == SUMMARY_KEYS and summary["n"] == harness.QUICK.repeat
            assert summary["min"] <= summary["q1"] <= summary["median"] <= summary["q3"] <= summary["max"]
        assert case["outputs_agree"] is True
    assert data["preprocess"]["uint8"]["identical_to_letterbox"] is True
    detect = data["postprocess"]["detect_yolov8"]
    assert detect["outputs_agree"] is True
    assert detect["output_shape"] == [1, 84, 8400]
    assert detect["ms"]["agent"]["n"] == harness.QUICK.postprocess_repeat
    assert sorted(data["postprocess"]["classify_top5"]) == ["batch1", "batch8"]
    assert all(c["outputs_agree"] for c in data["postprocess"]["classify_top5"].values())


def test_unknown_section_is_refused_and_nothing_is_written(tmp_path):
    out = tmp_path / "never.json"
    done = run_bench("--quick", "--only", "preprocess,warp-drive", "--json", str(out), timeout=60)
    assert done.returncode == 2
    assert "warp-drive" in done.stderr
    assert not out.exists()


def test_unknown_device_is_refused_naming_it(tmp_path):
    out = tmp_path / "never.json"
    done = run_bench("--quick", "--only", "preprocess", "--device", "atlas-9000", "--json", str(out))
    assert done.returncode == 2
    assert "no device config 'atlas-9000'" in done.stderr
    assert not out.exists()


def test_bad_bundle_is_refused_naming_the_problem(tmp_path):
    out = tmp_path / "never.json"
    missing = str(tmp_path / "nowhere")
    done = run_bench("--quick", "--only", "pipeline", "--bundle", missing, "--json", str(out))
    assert done.returncode == 2
    assert "not a directory" in done.stderr and "nowhere" in done.stderr
    assert not out.exists()


# --- harness statistics: golden values ------------------------------------------------------------

def test_summarize_golden_values():
    assert harness.summarize([5.0, 1.0, 4.0, 2.0, 3.0]) == {
        "median": 3.0, "q1": 2.0, "q3": 4.0, "min": 1.0, "max": 5.0, "n": 5}
    with pytest.raises(ValueError):
        harness.summarize([])


def test_ratio_summary_pairs_rounds():
    ratio = harness.ratio_summary([2.0, 9.0, 3.0], [1.0, 3.0, 1.0])  # per round: 2, 3, 3
    assert ratio["median"] == 3.0 and ratio["min"] == 2.0 and ratio["n"] == 3
    with pytest.raises(ValueError):
        harness.ratio_summary([1.0], [1.0, 2.0])


def test_linear_slope_recovers_a_known_line():
    xs = list(range(0, 1000, 100))
    fit = harness.linear_slope(xs, [0.004 * x + 250.0 for x in xs])
    assert fit["slope"] == pytest.approx(0.004)
    assert fit["intercept"] == pytest.approx(250.0)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["points"] == 10


def test_compare_calls_each_candidate_exactly_and_rotates():
    calls = {"a": 0, "b": 0, "c": 0}
    order = []

    def make(name):
        def call():
            calls[name] += 1
            order.append(name)
        return call

    times = harness.compare({n: make(n) for n in calls}, warmup=2, repeat=4, number=3)
    assert calls == {"a": 2 + 12, "b": 2 + 12, "c": 2 + 12}
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    timed = order[6:]  # after warm-up: rounds of 9 calls, first candidate rotating a, b, c, a
    assert [timed[i * 9] for i in range(4)] == ["a", "b", "c", "a"]


def test_target_judges_and_never_counts_a_missing_value():
    assert harness.target(1.2, "<=", 1.5) == {"value": 1.2, "target": "<= 1.5", "met": True}
    assert harness.target(1.6, "<=", 1.5)["met"] is False
    assert harness.target(3.0, ">=", 3)["met"] is True
    assert harness.target(None, ">=", 3)["met"] is False
    assert harness.target(float("nan"), "<", 1)["met"] is False
    with pytest.raises(ValueError):
        harness.target(1.0, "==", 1.0)


# --- the references the figures are measured against ----------------------------------------------

def test_synthetic_yolov8_output_has_clustered_candidates_and_both_decoders_agree():
    output, confident = postprocessing.synthetic_yolov8_output()
    assert output.shape == (1, 84, 8400) and output.dtype == np.float32
    assert confident == 293  # golden: 24 clusters of 6..20 anchors from the fixed seed
    scores = output[0, 4:]
    assert np.mean(scores < 0.05) > 0.99  # nearly every score is tiny
    from agent.pipeline.postprocess import decode_yolov8

    agent = decode_yolov8(output, postprocessing.CONF, postprocessing.IOU, postprocessing.MAX_DET)[0]
    reference = postprocessing.straightforward_decode(output, postprocessing.CONF, postprocessing.IOU,
                                                      postprocessing.MAX_DET)[0]
    assert len(agent) == postprocessing.OBJECTS  # one box per cluster survives NMS
    assert postprocessing.detections_agree(agent, reference)
    assert not postprocessing.detections_agree(agent[:-1], reference)


def test_straightforward_preprocess_matches_the_agent_on_a_720p_frame():
    from agent.pipeline.input_batch import BatchPreprocessor
    from agent.pipeline.preprocess import PreprocessSpec

    frame = preprocessing.camera_frame((720, 1280))
    filler = BatchPreprocessor(PreprocessSpec(), (320, 320), 1)
    filler.fill(0, frame)
    reference = preprocessing.straightforward_preprocess(frame, (320, 320))
    assert reference.shape == (1, 3, 320, 320)
    assert np.max(np.abs(filler.batch - reference)) <= preprocessing.AGREEMENT_ATOL
    assert reference[0, :, 0, 0] == pytest.approx([114 / 255.0] * 3)  # padding row of a 16:9 frame


def test_uint8_figure_times_the_one_copy_fill_against_the_same_resize_and_checks_its_bytes():
    _name, source_hw, input_hw = preprocessing.UINT8_CASE
    section = {"uint8": preprocessing.measure_uint8(preprocessing.camera_frame(source_hw), input_hw, 1, 3)}
    uint8 = section["uint8"]
    assert uint8["identical_to_letterbox"] is True and uint8["source_hw"] == [1080, 1920]
    assert set(uint8["ms"]) == {"resize", "one_copy"} and uint8["ms"]["one_copy"]["n"] == 3
    goal = preprocessing.targets(section)["uint8.ratio_to_resize"]
    assert goal["value"] == uint8["ratio_to_resize"] and goal["target"] == "<= 1.25"


def demo_like_bundle():
    """A parsed manifest shaped like the demo bundle's (no files: only the artifact table is read)."""
    from agent.bundle.manifest import parse_manifest
    from agent.bundle.verify import Bundle

    def art(file, fmt, tier, batch, role="serve"):
        return {"file": file, "format": fmt, "target": "cpu", "tier": list(tier), "batch": batch,
                "role": role, "sha256": "0" * 64, "size": 1}

    artifacts = [
        art("m256_b1.mindir", "mindir", (256, 256), 1), art("m256_b4.mindir", "mindir", (256, 256), 4),
        art("m192_b1.mindir", "mindir", (192, 320), 1), art("m256_b1.onnx", "onnx", (256, 256), 1),
        art("m192_b1.onnx", "onnx", (192, 320), 1), art("m256_b8.onnx", "onnx", (256, 256), 8, "convert"),
    ]
    manifest = parse_manifest({"name": "shapes-det", "version": "1", "created": "2026-01-01T00:00:00Z",
                               "task": "detect-yolov8", "labels": ["a"], "artifacts": artifacts,
                               "input": {"name": "images", "tiers": [[256, 256], [192, 320]]}})
    return Bundle(root="/nonexistent", manifest=manifest, manifest_sha256="0" * 64, signed=False)


def test_batch_and_tier_choice_follow_the_artifact_table():
    from benchmarks import workload

    bundle = demo_like_bundle()
    assert workload.serve_batch_at_most(bundle, "mindspore", 8) == 4
    assert workload.serve_batch_at_most(bundle, "mindspore", 3) == 1
    assert workload.serve_batch_at_most(bundle, "opencv", 8) == 1  # the batch-8 ONNX is converter input only
    assert workload.largest_batch_tier(bundle, "mindspore") == (256, 256)
    assert workload.largest_batch_tier(bundle, "opencv") == (256, 256)  # tie on batch 1: the larger tier
    assert workload.frame_hw_for_tier((192, 320)) == (1080, 1800)
    with pytest.raises(ValueError, match="no serve artifact"):
        workload.largest_batch_tier(bundle, "acl")


# --- batching: the bound check and the feeder -----------------------------------------------------

def test_bound_check_counts_exact_violations():
    samples = batching.CellSamples()
    batches = [(0.000, 0.020), (0.030, 0.050)]  # two batches of 20 ms
    for queued, handed in [
        (0.005, 0.020),  # arrived during batch 1 (20 ms): waited 15 ms <= 10 + 20
        (0.021, 0.032),  # idle loop: waited 11 ms > 10 ms by 1 ms
        (0.035, 0.081),  # during batch 2 (20 ms): waited 46 ms > 30 ms by 16 ms
    ]:
        running = batching._in_flight(batches, queued)
        samples.excess_ms.append((handed - queued) * 1e3 - (10.0 + (running or 0.0) * 1e3))
    bound = batching._bound_report(samples.excess_ms, [120.0, 80.0], slack_ms=2.0)
    assert bound["frames_checked"] == 3
    assert bound["frames_behind_backlog"] == 2 and bound["backlog_worst_wait_ms"] == 120.0
    assert bound["violations"] == 2
    assert bound["violations_beyond_slack"] == 1
    assert bound["worst_excess_ms"] == pytest.approx(16.0)
    assert bound["largest_excesses_ms"] == [pytest.approx(16.0), pytest.approx(1.0)]


class StandInModel:
    """A stand-in for LoadedModel in the feeder test: sleeps a fixed time per call, records batch sizes."""

    def __init__(self, seconds_per_call):
        self.seconds_per_call = seconds_per_call
        self.sizes = []
        self.lock = threading.Lock()

    def infer_frames(self, images):
        with self.lock:
            self.sizes.append(len(images))
        time.sleep(self.seconds_per_call)
        return [None] * len(images)


def test_run_cell_accounts_for_every_frame_and_respects_max_batch():
    model = StandInModel(0.002)
    frames = [np.zeros((4, 4, 3), np.uint8)]
    cell = batching.run_cell(model, frames, max_batch=4, max_wait_ms=5.0, rate_hz=400.0, count=40,
                             slack_ms=1.0)
    assert cell["served"] + cell["dropped"] == 40
    assert cell["served"] == sum(model.sizes)
    assert max(model.sizes) <= 4
    assert cell["stalled"] is False
    # Every served frame is judged: checked against the bound, or counted as arrived behind a backlog (a slow
    # spell of the shared machine puts max_batch frames ahead of it, and the bound no longer promises anything).
    bound = cell["bound"]
    assert bound["frames_checked"] + bound["frames_behind_backlog"] == cell["served"]
    assert bound["frames_checked"] > 0
    assert cell["latency_ms"]["p50"] <= cell["latency_ms"]["p99"] <= cell["latency_ms"]["max"]


def test_run_grid_splits_every_cell_into_rounds():
    models = {1: StandInModel(0.001), 4: StandInModel(0.001)}
    for model in models.values():
        model.artifacts = {(4, 4): type("Art", (), {"batch": 1})()}
        model.tier_for = lambda hw: (4, 4)
    grid = [(1, 0.0), (1, 5.0), (4, 0.0), (4, 5.0)]
    frames = [np.zeros((4, 4, 3), np.uint8)]
    cells = batching.run_grid(models, frames, grid, rate_hz=500.0, count=10, rounds=3, slack_ms=None)
    assert [(c["max_batch"], c["max_wait_ms"]) for c in cells] == grid
    for cell in cells:
        assert cell["frames"] == 10 and cell["served"] + cell["dropped"] == 10
        assert "bound" not in cell and cell["artifact_batch"] == 1
    for max_batch, model in models.items():
        assert sum(model.sizes) == sum(c["served"] for c in cells if c["max_batch"] == max_batch)
        assert max(model.sizes) <= max_batch


# --- report and JSON ------------------------------------------------------------------------------

def test_missing_required_names_only_selected_sections():
    data = {"preprocess": {"ratio_to_resize": 1.2}, "postprocess": {}}
    assert missing_required(data, ["preprocess", "postprocess"]) == ["postprocess.speedup_vs_naive"]
    assert missing_required(data, ["preprocess"]) == []
    # nine of the first issue, four of the quant section (issue 28), the metrics endpoint's cost (issue 32), the
    # shadow run's cost to serving and its comparison rate, and the drift alerts of a steady stream (issue 39)
    assert len(REQUIRED_KEYS) == 20
    assert {"shadow.serving_p95_ratio", "shadow.frames_compared_per_s", "drift.alerts", "console.rss_mib",
            "console.fleet_first_paint_s", "console.box_first_paint_s"} <= set(REQUIRED_KEYS)


def test_write_json_makes_numpy_and_nan_plain(tmp_path):
    path = tmp_path / "out" / "r.json"
    report.write_json({"a": np.float32(1.5), "b": [np.int64(3), float("nan")], "c": {"d": np.bool_(True)}},
                      str(path))
    assert json.loads(path.read_text()) == {"a": 1.5, "b": [3, None], "c": {"d": True}}


def test_update_readme_rewrites_only_between_markers(tmp_path, quick_json):
    data, _ = quick_json
    readme = tmp_path / "README.md"
    readme.write_text("intro\n%s\nold table\n%s\noutro\n" % (report.README_BEGIN, report.README_END))
    report.update_readme(data, str(readme))
    text = readme.read_text()
    assert text.startswith("intro\n%s\n" % report.README_BEGIN)
    assert text.endswith("%s\noutro\n" % report.README_END)
    assert "old table" not in text
    assert "`preprocess.ratio_to_resize`" in text and data["command"] in text
    unmarked = tmp_path / "plain.md"
    unmarked.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(data, str(unmarked))
    assert unmarked.read_text() == "no markers here\n"


def test_plots_are_written_for_the_sections_present(tmp_path, quick_json):
    pytest.importorskip("matplotlib", reason="matplotlib (the 'dev' extra) draws the plots")
    from benchmarks.plots import write_plots

    data, _ = quick_json
    paths = write_plots(data, str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["postprocess.png", "preprocess.png"]
    for path in paths:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


# --- real Mosquitto, real daemon ------------------------------------------------------------------

@pytest.fixture()
def broker():
    from agent.devtools.broker import BrokerError, EmbeddedBroker

    try:
        instance = EmbeddedBroker()
    except BrokerError as exc:
        pytest.skip("mosquitto is needed: %s" % exc)
    instance.start()
    yield instance
    instance.close()


def test_mqtt_harness_publishes_every_message_and_replays_the_outbox(broker, tmp_path):
    from benchmarks import mqtt_publish

    live = mqtt_publish.measure_throughput(broker.host, broker.port, str(tmp_path), count=60, rounds=2)
    assert live["messages_per_round"] == 60
    assert live["agent_outboxed_while_connected"] == 0
    for key in ("agent_msgs_per_s", "paho_msgs_per_s", "ratio_to_paho"):
        assert live[key]["n"] == 2 and math.isfinite(live[key]["median"]) and live[key]["median"] > 0
    replay = mqtt_publish.measure_replay(broker, str(tmp_path), count=40)
    assert replay["parked_in_outbox"] == 40
    assert replay["replayed"] == 40
    assert replay["replay_msgs_per_s"] > 0


DEMO_BUNDLE = os.path.join(REPO_ROOT, "examples", "demo-bundle")


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                    reason="examples/demo-bundle is missing (make demo-bundle)")
def test_startup_probe_sees_ready_from_the_real_daemon(broker, tmp_path):
    from benchmarks import startup

    config = startup._write_configs(str(tmp_path), DEMO_BUNDLE, "opencv", broker, threads=1)
    result = startup.time_to_ready(config, REPO_ROOT, str(tmp_path))
    assert 0 < result["seconds_to_ready"] < startup.READY_TIMEOUT_S
    assert result["exit_code_after_sigterm"] == 0


def test_pipeline_throughput_targets_judge_the_paced_headline():
    from benchmarks import pipeline

    section = {"overhead_fraction_b1": 0.05, "throughput_ratio_to_backend": 0.95, "backend_busy_fraction": 0.85,
               "throughput": {"paced_standin_3ms": {}}, "backends": {}}
    goals = pipeline.targets(section)
    assert goals["throughput_ratio_to_backend"]["met"] is True
    assert goals["backend_busy_fraction"]["met"] is False
    assert "throughput_ratio_to_backend" not in pipeline.targets(dict(section, throughput={}))


@pytest.mark.skipif(not os.path.exists(os.path.join(REPO_ROOT, "examples", "demo-bundle", "manifest.json")),
                    reason="examples/demo-bundle is missing (make demo-bundle)")
def test_throughput_measure_serves_every_frame_on_the_paced_standin():
    from agent.pipeline.model import LoadedModel
    from benchmarks.paced_backend import freeze, paced_factory
    from benchmarks.throughput import measure
    from benchmarks.workload import DEMO_BUNDLE, bench_device, camera_frames, load_bundle

    made = []
    model = LoadedModel(load_bundle(DEMO_BUNDLE), bench_device(1), "opencv", 1,
                        backend_factory=paced_factory(0.001, made))
    model.load()
    try:
        images = camera_frames(2)
        model.infer_frames([images[0]])
        freeze(made)
        assert all(not out.flags.writeable for backend in made for out in backend.frozen)
        result = measure(model, images, frames_per_round=12, rounds=2)
    finally:
        model.close()
    assert result["rounds"] == 2 and result["ratio_to_backend"]["n"] == 2
    assert 0 < result["ratio_to_backend"]["median"] and 0 < result["backend_busy_fraction"]["max"] <= 1.0
