"""The metrics endpoint's parts without a daemon: the ``metrics`` config section (bind rules, the missing package
refused by name), the collector's series from a status answer (names, labels, no URI, bounded verbs), the
cumulative histograms it reads, and the HTTP server on loopback. Both interpreters (agent/ runs on 3.7)."""

import importlib.util
import os
import re
import urllib.request

import pytest

from agent.config.daemon_config import parse_daemon_config
from agent.config.schema import ConfigError
from agent.pipeline.stats import LATENCY_BUCKETS_MS, StageStats
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None,
                                reason="needs prometheus_client (pip install 'atlas-edge[metrics]')")

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "metrics.md")
SECRET = "s3cret-pass"


def config(**metrics):
    return parse_daemon_config({"device_id": "box-1", "model": {"bundle": "b"}, "metrics": metrics})


@pytest.mark.parametrize("listen, address", [
    (None, None), ("9464", ("127.0.0.1", 9464)), (9464, ("127.0.0.1", 9464)), ("127.0.0.1:9100", ("127.0.0.1", 9100)),
    ("[::1]:9100", ("::1", 9100)), ("localhost:9100", ("localhost", 9100)), ("127.0.0.2:80", ("127.0.0.2", 80))])
def test_listen_binds_exactly_what_is_written_and_a_bare_port_is_loopback(listen, address):
    assert config(listen=listen).metrics.address() == address


def test_the_endpoint_is_off_by_default():
    assert parse_daemon_config({"device_id": "box-1", "model": {"bundle": "b"}}).metrics.address() is None


@pytest.mark.parametrize("listen, words", [
    ("0.0.0.0:9464", "not loopback"), ("192.0.2.7:9464", "not loopback"), ("[::]:9464", "not loopback"),
    ("box.example:9464", "IP address or localhost"), ("127.0.0.1:0", "1-65535"), ("127.0.0.1:70000", "1-65535"),
    ("", "")])
def test_a_listen_that_is_not_loopback_or_not_an_address_is_refused_naming_the_field(listen, words):
    with pytest.raises(ConfigError) as error:
        config(listen=listen)
    assert "metrics.listen" in str(error.value) and words in str(error.value)


def test_a_remote_listen_is_accepted_only_when_allowed_explicitly():
    assert config(listen="0.0.0.0:9464", allow_remote=True).metrics.address() == ("0.0.0.0", 9464)


def test_a_listen_without_prometheus_client_is_refused_naming_the_package_and_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client"
                        else real(name, *a))
    with pytest.raises(ConfigError) as error:
        config(listen="9464")
    assert "prometheus_client" in str(error.value) and "atlas-edge[metrics]" in str(error.value)
    assert config().metrics.address() is None  # a box without it and without the endpoint is fine


def test_stage_histograms_are_cumulative_with_every_sample_counted_once():
    stats = StageStats(window=4)  # the ring forgets; the histogram must not
    for value in (0.2, 3.0, 3.0, 40.0, 20000.0, 7.0):
        stats.add({"infer": value})
    stats.frame_done(2)
    stats.frame_done(1)
    snapshot = stats.histograms()
    infer = snapshot["stages_ms"]["infer"]
    assert infer["count"] == 6 and infer["sum"] == pytest.approx(20053.2)
    bounds = [b for b, _ in infer["buckets"]]
    assert bounds == list(LATENCY_BUCKETS_MS) + [float("inf")]
    cumulative = dict(infer["buckets"])
    assert (cumulative[0.5], cumulative[5], cumulative[10], cumulative[50], cumulative[10000]) == (1, 3, 4, 5, 5)
    assert cumulative[float("inf")] == 6
    assert snapshot["batch"]["count"] == 2 and snapshot["batch"]["sum"] == 3
    assert len(stats.percentiles()["infer"]) == 3 and stats.median("infer") == pytest.approx(23.5)  # the last 4


def status_answer():
    source = {"uri": "rtsp://viewer:***@10.0.0.5/live", "state": "up", "frames": 12, "served": 10, "skipped": 1,
              "stale_dropped": 0, "decode_errors": 0, "dropped_queue_full": 2, "reopens": 3,
              "frame_age_ms": {"p50": 250.0, "max": 900.0}}
    return {
        "published": 9, "publish_errors": 1, "backend": "onnxruntime", "backend_busy_fraction": 0.25,
        "sources": {"gate": source},
        "model": "shapes-det 1.0.0",
        "model_info": {"name": "shapes-det", "version": "1.0.0", "backend": "onnxruntime", "precision": "int8",
                       "artifacts": {"256x256": "model_256x256.int8.onnx"}},
        "slots": {"serving": "a"},
        "mqtt": {"outbox_messages": 4, "outbox_bytes": 512, "outbox_oldest_age_s": 42.5, "connected": True,
                 "broker": ["10.0.0.9", 1883],
                 "dropped_by_reason": {"dropped_oldest": 2}},
        "rss_mb": 100.0, "workers_rss_mb": {"gate": 50.0}, "npu_memory_mb": {"used": 300.0, "total": 8192.0},
        "npu_chip": {"id": 1, "utilization": 37.0, "temperature": 52.0, "power": 14.5},
        "watchdog": {"rss_slope_mb_per_hour": 1.5, "restart_requested": None, "no_input": False},
        "drift": {"gate": {"drifting": True, "judged": True, "score_w1": 0.31, "detections_change": 0.44}},
        "shadow": {"state": "finished", "candidate": {"name": "shapes-det", "version": "1.1.0"},
                   "frames_compared": 40, "dropped_busy": 3, "candidate_errors": 0,
                   "candidate_latency_ms": {"p50": 5.0, "p95": 8.0},
                   "agreement": {"strict": {"f1": 0.97, "precision": 0.96, "recall": 0.98},
                                 "score_aware": {"f1": 0.99, "precision": 0.99, "recall": 0.99},
                                 "score_wasserstein1": 0.01}},
    }


def collect_text(status, acks=None):
    from prometheus_client import CollectorRegistry, generate_latest

    from agent.ops.metrics import BoxCollector, EventCounts

    stats = StageStats()
    stats.add({"infer": 12.0, "wait_backend": 1.0, "total": 30.0, "not_a_stage": 1.0})
    stats.frame_done(1)
    events = EventCounts()
    for kind in ("switched", "switched", "rollback", "confirmed"):
        events.observe({"event": kind})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BoxCollector("box-1", lambda: status, stats.histograms,
                                   lambda: acks or {("status", "succeeded"): 2, ("$bogus#verb", "failed"): 3},
                                   events))
    return generate_latest(registry).decode()


def test_the_collector_exposes_the_box_series_with_device_and_bounded_labels():
    text = collect_text(status_answer())
    assert 'atlas_edge_frames_served_total{device="box-1",source="gate"} 10.0' in text
    assert 'atlas_edge_frames_dropped_total{device="box-1",reason="queue_full",source="gate"} 2.0' in text
    assert 'atlas_edge_frame_age_seconds{device="box-1",source="gate"} 0.25' in text
    assert 'atlas_edge_source_state{device="box-1",source="gate",state="up"} 1.0' in text
    assert 'atlas_edge_stage_seconds_count{device="box-1",stage="wait"} 1.0' in text
    assert 'atlas_edge_stage_seconds_bucket{device="box-1",le="0.025",stage="infer"} 1.0' in text
    assert "not_a_stage" not in text
    assert 'atlas_edge_results_discarded_total{device="box-1",reason="outbox_dropped_oldest"} 2.0' in text
    assert 'atlas_edge_outbox_oldest_age_seconds{device="box-1"} 42.5' in text
    assert 'atlas_edge_broker_connected{broker="10.0.0.9:1883",device="box-1"} 1.0' in text
    assert ('atlas_edge_model_info{artifact="model_256x256.int8.onnx",backend="onnxruntime",device="box-1",'
            'model="shapes-det",precision="int8",slot="a",tier="256x256",version="1.0.0"} 1.0') in text
    assert 'atlas_edge_model_swaps_total{device="box-1"} 2.0' in text
    assert 'atlas_edge_model_rollbacks_total{device="box-1"} 1.0' in text
    assert 'atlas_edge_commands_total{device="box-1",outcome="failed",verb="other"} 3.0' in text
    assert 'atlas_edge_resident_memory_bytes{device="box-1",process="gate"} 5.24288e+07' in text
    assert 'npu_chip_info_used_memory{device="box-1"} 300.0' in text
    assert 'npu_chip_info_temperature{device="box-1",id="1"} 52.0' in text
    assert 'npu_chip_info_utilization{device="box-1",id="1"} 37.0' in text
    assert 'atlas_edge_watchdog_state{device="box-1",state="ok"} 1.0' in text
    assert 'atlas_edge_drift_active{device="box-1",source="gate"} 1.0' in text
    assert 'atlas_edge_drift_score_w1{device="box-1",source="gate"} 0.31' in text
    assert 'atlas_edge_shadow_running{candidate="shapes-det 1.1.0",device="box-1"} 0.0' in text
    assert 'atlas_edge_shadow_f1{candidate="shapes-det 1.1.0",device="box-1",reading="score_aware"} 0.99' in text
    assert 'atlas_edge_shadow_candidate_latency_p95_seconds{candidate="shapes-det 1.1.0",device="box-1"} 0.008' in text
    assert "rtsp" not in text and "viewer" not in text and "bogus" not in text  # no URI, no unknown verb


def test_every_series_the_collector_exposes_is_in_docs_metrics_and_every_documented_one_is_exposed():
    box_section = open(DOCS).read().split("## The series", 1)[1].split("\n## ", 1)[0]  # not the fleet bridge's
    documented = set(re.findall(r"^\| `([a-z0-9_]+)` \|", box_section, re.M))
    assert len(documented) >= 20
    exposed = set(re.findall(r"^# TYPE (\S+) ", collect_text(status_answer()), re.M))
    # the client names a counter family without _total in # TYPE
    exposed = {name + "_total" if name + "_total" in documented else name for name in exposed}
    assert exposed == documented


def test_npu_figures_npu_smi_did_not_report_are_absent_not_zero():
    status = status_answer()
    status["npu_chip"] = {"id": 0, "temperature": 53.0}  # power and AICore printed NA
    text = collect_text(status)
    assert 'npu_chip_info_temperature{device="box-1",id="0"} 53.0' in text
    assert "npu_chip_info_power{" not in text and "npu_chip_info_utilization{" not in text
    status["npu_chip"] = None  # no npu-smi (not an Ascend box, or the tool is missing)
    assert "npu_chip_info_temperature{" not in collect_text(status)


def test_a_source_state_beyond_the_known_ones_is_still_exported_as_the_current_one():
    status = status_answer()
    status["sources"]["gate"]["state"] = "degraded"
    text = collect_text(status)
    assert 'atlas_edge_source_state{device="box-1",source="gate",state="degraded"} 1.0' in text
    assert 'atlas_edge_source_state{device="box-1",source="gate",state="up"} 0.0' in text


def test_a_failing_figure_costs_the_scrape_its_series_not_the_daemon():
    status = status_answer()
    status["sources"] = {"gate": None}  # not a mapping: reading it raises inside the collector
    text = collect_text(status)
    assert 'atlas_edge_collect_ok{device="box-1"} 0.0' in text
    assert "atlas_edge_frames_read_total" not in text


def test_the_server_answers_on_loopback_and_stops():
    from agent.devtools.broker import free_port
    from agent.ops.metrics import BoxCollector, EventCounts, MetricsServer

    stats = StageStats()
    collector = BoxCollector("box-1", status_answer, stats.histograms, dict, EventCounts())
    server = MetricsServer(config(listen=str(free_port())).metrics.address(), collector)
    server.start()
    try:
        host, port = server.address
        assert host == "127.0.0.1"
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as answer:
            body = answer.read().decode()
        assert 'atlas_edge_outbox_messages{device="box-1"} 4.0' in body and SECRET not in body
    finally:
        server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=2)


def test_the_collector_reads_no_window_figure_so_a_scrape_need_not_compute_one():
    """The daemon's scrape asks for its status without ``fps`` and ``latency_ms`` (sorting each stage's recent
    samples was a third of a scrape's CPU): the exposition must not change for their absence."""
    windowed = dict(status_answer(), fps=24.5, latency_ms={"infer": {"p50": 12.0, "p90": 14.0, "p99": 20.0}})
    assert collect_text(windowed) == collect_text(status_answer())


def test_the_loop_status_without_windows_sorts_no_samples_and_keeps_every_counter():
    import queue

    from tests.support.serving_support import Models, Sink, make_loop

    loop = make_loop(Models(None), queue.Queue(), Sink())
    loop.stats.add({"infer": 12.0})
    full = loop.status()
    assert full["latency_ms"]["infer"]["p50"] == 12.0 and "fps" in full

    def no_sorting(*args, **kwargs):
        raise AssertionError("a status without windows computed percentiles")

    loop.stats.percentiles = no_sorting
    lean = loop.status(windows=False)
    assert "latency_ms" not in lean and "fps" not in lean
    assert set(full) - set(lean) == {"fps", "latency_ms"}


def test_the_server_counts_the_cpu_its_answers_cost():
    """``cpu_s`` (what benchmarks/metrics_cost.py charges the endpoint) holds each request thread's CPU: here a
    status that burns at least 30 ms of its thread's CPU per scrape."""
    import time

    from agent.devtools.broker import free_port
    from agent.ops.metrics import BoxCollector, EventCounts, MetricsServer

    burn_s = 0.03

    def costly_status():
        started = time.thread_time()
        while time.thread_time() - started < burn_s:
            pass
        return status_answer()

    server = MetricsServer(("127.0.0.1", free_port()), BoxCollector("box-1", costly_status, StageStats().histograms,
                                                                    dict, EventCounts()))
    server.start()
    try:
        before = server.cpu_s()
        for _ in range(2):
            with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % server.address[1], timeout=10) as answer:
                assert b"atlas_edge_outbox_messages" in answer.read()
        # the request thread adds its share after the answer's last byte: wait for it, never sleep
        assert wait_for(lambda: server.cpu_s() - before >= 2 * burn_s), "the answers' CPU was not counted"
    finally:
        server.stop()
    assert server.cpu_s() >= 2 * burn_s  # the answers' share outlives the listening thread
