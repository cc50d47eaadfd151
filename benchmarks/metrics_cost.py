"""What the Prometheus endpoint costs the serving loop (issue 32: at most 2 % of serving throughput).

The same 1080p frames go through the real :class:`agent.pipeline.serving.ServingLoop` (as in
:mod:`benchmarks.throughput`) with the endpoint off and on, alternating which goes first, in one run. "On" is the
daemon's endpoint (:class:`agent.ops.metrics.MetricsServer` with its :class:`~agent.ops.metrics.BoxCollector` over
the loop's status and histograms) on a loopback port, scraped over HTTP every second by a thread playing
Prometheus, from the loop's first frame to its last. The backend is a CPU one (OpenCV's DNN by default): the
scrape competes with the letterbox, decode and the backend for the same cores, the worst case for the endpoint
(an NPU backend leaves the cores to it).

``cost`` is 1 minus the median of the per-round ratios of frames per second on over off. On a machine shared
with other work that ratio is noisy (each run's spread is in ``ratio_on_to_off``), so the section also reports
what one scrape costs in CPU, load-independent: ``scrape_cpu_ms``, the thread CPU time of building the whole
exposition (collector and text) over a loop that has just served a run, and ``scrape_cpu_fraction``, that cost
at one scrape per second as a fraction of one core: the endpoint's share of the box whatever else runs.
"""

import logging
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, List

from benchmarks import throughput
from benchmarks.harness import RunContext, summarize, target
from benchmarks.workload import backend_available, bench_device, camera_frames, load_bundle, open_model

log = logging.getLogger(__name__)

TARGET_COST = 0.02  # the bound: the endpoint costs at most 2 % of serving throughput
SCRAPE_INTERVAL_S = 1.0  # the acceptance test's Prometheus scrape interval
ROUNDS = {"quick": 8, "full": 20}  # pairs of on/off runs: many short ones, the median resists a neighbour's burst
ROUND_S = {"quick": 2.0, "full": 3.0}  # serving time per run: two or three scrapes each
CPU_SAMPLES = 20  # expositions timed after each run with the endpoint on
FRAME_POOL = 8
BACKEND_ORDER = ("opencv", "onnxruntime", "mindspore")  # CPU backends, the first that runs here


def _endpoint(model: Any, scrapes: List[int], cpu_ms: List[float]) -> Callable[[Any], Callable[[], None]]:
    """``attach`` for :func:`throughput.serve_frames`: the endpoint over ``loop`` and a 1 s scraper; after the
    run, the thread CPU time of :data:`CPU_SAMPLES` expositions goes to ``cpu_ms``."""
    from prometheus_client import generate_latest

    from agent.devtools.broker import free_port
    from agent.ops.metrics import BoxCollector, EventCounts, MetricsServer

    def attach(loop: Any) -> Callable[[], None]:
        def status() -> Dict[str, Any]:  # what the daemon's status answer holds of the loop and the model
            return dict(loop.status(), backend=model.backend_name, model=model.describe(), slots={"serving": "a"})

        server = MetricsServer(("127.0.0.1", free_port()), BoxCollector("bench", status, loop.stats.histograms,
                                                                         dict, EventCounts()))
        server.start()
        stop = threading.Event()
        url = "http://127.0.0.1:%d/metrics" % server.address[1]

        def scrape() -> None:
            while True:
                with urllib.request.urlopen(url, timeout=10) as answer:
                    answer.read()
                scrapes[0] += 1
                if stop.wait(SCRAPE_INTERVAL_S):
                    return

        scraper = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
        scraper.start()

        def detach() -> None:
            stop.set()
            scraper.join(30)
            server.stop()
            for _ in range(CPU_SAMPLES):
                started = time.thread_time()
                generate_latest(server.registry)
                cpu_ms.append((time.thread_time() - started) * 1e3)

        return detach

    return attach


def measure(model: Any, frames: List[Any], count: int, rounds: int) -> Dict[str, Any]:
    ratios: List[float] = []
    on_fps: List[float] = []
    off_fps: List[float] = []
    cpu_ms: List[float] = []
    scrapes = [0]  # the scraper thread counts here
    attach = _endpoint(model, scrapes, cpu_ms)
    for index in range(rounds):
        if index % 2:
            on = throughput.serve_frames(model, frames, count, attach=attach)["fps"]
            off = throughput.serve_frames(model, frames, count)["fps"]
        else:
            off = throughput.serve_frames(model, frames, count)["fps"]
            on = throughput.serve_frames(model, frames, count, attach=attach)["fps"]
        ratios.append(on / off)
        on_fps.append(on)
        off_fps.append(off)
    ratio, cpu = summarize(ratios), summarize(cpu_ms)
    return {"cost": 1.0 - ratio["median"], "ratio_on_to_off": ratio, "scrape_cpu_ms": cpu,
            "scrape_cpu_fraction": cpu["median"] / 1e3 / SCRAPE_INTERVAL_S, "fps_on": summarize(on_fps),
            "fps_off": summarize(off_fps), "scrapes": scrapes[0], "frames_per_run": count, "rounds": rounds}


def run(context: RunContext) -> Dict[str, Any]:
    profile = context.profile.name
    backend = next((b for b in BACKEND_ORDER if backend_available(b) is None), None)
    if backend is None:
        return {"skipped": "no CPU backend runs here (%s)" % ", ".join(BACKEND_ORDER)}
    bundle = load_bundle(context.bundle_dir)
    frames = camera_frames(FRAME_POOL)
    model = open_model(bundle, bench_device(context.threads, context.device), backend, 1)
    try:
        started = time.perf_counter()
        warm = throughput.serve_frames(model, frames, 20)["fps"]
        log.debug("metrics warm-up: %.1f fps in %.1f s", warm, time.perf_counter() - started)
        count = max(20, int(warm * ROUND_S[profile]))
        result = measure(model, frames, count, ROUNDS[profile])
    finally:
        model.close()
    result.update(backend=backend, scrape_interval_s=SCRAPE_INTERVAL_S, bundle=bundle.label)
    log.info("metrics endpoint on %s: %.1f vs %.1f fps (on/off %.4f, cost %.2f%%, %d scrapes); a scrape %.2f ms "
             "CPU (%.3f%% of a core at 1/s)", backend, result["fps_on"]["median"], result["fps_off"]["median"],
             result["ratio_on_to_off"]["median"], 100 * result["cost"], result["scrapes"],
             result["scrape_cpu_ms"]["median"], 100 * result["scrape_cpu_fraction"])
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    return {"cost": target(section.get("cost"), "<=", TARGET_COST),
            "scrape_cpu_fraction": target(section.get("scrape_cpu_fraction"), "<=", TARGET_COST)}
