"""What the Prometheus endpoint costs the serving process (issue 32: at most 2 % of serving throughput).

The same 1080p frames go through the real :class:`agent.pipeline.serving.ServingLoop` (as in
:mod:`benchmarks.throughput`) with the endpoint off and on, in pairs whose order alternates (off-on, on-off, ...),
in one run. "On" is the daemon's endpoint (:class:`agent.ops.metrics.MetricsServer` with its
:class:`~agent.ops.metrics.BoxCollector` over the loop's status, asked for as the daemon asks, and its histograms,
with what the daemon's status adds: four cameras' health, transport, memory, watchdog and NPU) on a loopback
port, scraped over HTTP every :data:`SCRAPE_INTERVAL_S` by a thread playing Prometheus from before the loop's
first frame to after its last. The backend is a CPU one (OpenCV's DNN by default): the scrape competes with the
letterbox, decode and the backend for the same cores, the worst case for the endpoint.

Why CPU time, not frames per second: a box whose cores are the bottleneck serves ``cores / CPU per frame`` frames
a second, so the share of the serving process's CPU that goes to the endpoint is the share of throughput it
takes (a box bound by the GIL instead loses at most the time a scrape holds the GIL, which is at most its CPU
time). Every figure is read over the serving window (where the loop's clock starts and stops); the scraper
thread's own CPU (its thread clock) is taken out, since Prometheus runs on another machine.

``cost``, the acceptance figure: the median over the on-runs of the endpoint's CPU (:meth:`MetricsServer.cpu_s`:
every request thread's CPU, reading, collecting, writing, plus the listening thread's clock) over the process's
CPU (``time.process_time``: serving loop, backend threads, endpoint). It resolves the bound because it is a
small quantity measured directly, so a neighbour's load moves it by a small fraction of itself (``cost_ci95``, a
bootstrap 95 % interval, says how much in this run).

Side by side with the endpoint off, the check that nothing else moves (the serving threads slowed by the scrape's
locks or caches): ``paired_cpu_cost``, 1 minus the median over the pairs of frames per CPU-second on over off,
and ``wall_cost`` from frames per second alike (``cpu_ratio_on_to_off``, ``wall_ratio_on_to_off``). On the
shared 2-core CI machine even CPU per frame moves by a fifth from one 3 s run to the next (a neighbour's use of
the caches and hyperthreads, steal; its VM has no instruction counters): in three full runs the pairs spread
0.70-1.26 in CPU and 0.70-1.46 in wall time, and their 95 % intervals (``paired_cpu_cost_ci95``) were 5-15 %
wide. They bound a hidden cost to within that; they cannot resolve 2 % by themselves (docs/metrics.md, "Cost").

Scrape interval: the shipped deploy/monitoring/prometheus.yml scrapes every 15 s (Prometheus' default); the bench
scrapes every second, 15 times as often, so its figure bounds the shipped setup's from above. ``scrapes_per_s``
is the rate reached inside the serving windows, ``endpoint_cpu_ms_per_scrape`` what each cost.

Load-independent per exposition: ``scrape_cpu_ms``, the thread CPU time of building the whole exposition
(collector and text, without HTTP) over a loop that has just served a run, and ``scrape_cpu_fraction``, that
cost at one scrape per second as a fraction of one core.
"""

import functools
import logging
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from benchmarks import throughput
from benchmarks.harness import RunContext, summarize, target
from benchmarks.workload import backend_available, bench_device, camera_frames, load_bundle, open_model

log = logging.getLogger(__name__)

TARGET_COST = 0.02  # the bound: the endpoint costs at most 2 % of serving throughput
# 15 times as often as the shipped deploy/monitoring/prometheus.yml (scrape_interval: 15s), as the acceptance test
SCRAPE_INTERVAL_S = 1.0
ROUNDS = {"quick": 8, "full": 20}  # pairs of on/off runs: many short ones, the median resists a neighbour's burst
ROUND_S = {"quick": 2.0, "full": 3.0}  # serving time per run: two or three scrapes each
CPU_SAMPLES = 20  # expositions timed after each run with the endpoint on
FRAME_POOL = 8
BACKEND_ORDER = ("opencv", "onnxruntime", "mindspore")  # CPU backends, the first that runs here
WARM_S = 1.0  # the warm-up run that sizes the rounds
CAMERAS = 4  # sources in the status the endpoint exports: 13 series each (frames, drops, states, age)
# What the daemon's status adds to the loop's (agent/daemon.py _telemetry_extras), as fixed figures: the series
# of the transport, memory, watchdog and NPU are in the exposition, as on a box
DAEMON_FIGURES: Dict[str, Any] = {
    "mqtt": {"outbox_messages": 0, "outbox_bytes": 0, "outbox_oldest_age_s": 0.0, "connected": True,
             "broker": ["10.0.0.2", 1883], "dropped_by_reason": {"dropped_oldest": 0, "expired": 0}},
    "rss_mb": 180.0, "workers_rss_mb": {"cam%d" % i: 60.0 for i in range(CAMERAS)},
    "watchdog": {"rss_slope_mb_per_hour": 0.1, "restart_requested": None, "no_input": False},
    "npu_chip": {"id": 0, "utilization": 40.0, "temperature": 55.0, "power": 12.0},
    "npu_memory_mb": {"used": 900.0, "total": 8192.0},
}
BOOTSTRAP = 2000  # resamples of the pairs for cost_ci95
BOOTSTRAP_SEED = 32


def _thread_cpu_s(thread: Optional[threading.Thread]) -> float:
    """CPU seconds ``thread`` has used so far (its own clock; Linux); 0 for no thread."""
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class _Run:
    """``attach`` for :func:`throughput.serve_frames`: the endpoint and its scraper when ``endpoint``; either
    way the serving window's process CPU time (less the scraper's) and wall time, read where the loop's clock
    starts and stops. After a run with the endpoint, the thread CPU time of :data:`CPU_SAMPLES` expositions
    goes to ``expositions_ms``."""

    def __init__(self, model: Any, endpoint: bool, expositions_ms: List[float]) -> None:
        self.model, self.endpoint, self.expositions_ms = model, endpoint, expositions_ms
        self.cpu_s = self.wall_s = self.endpoint_cpu_s = 0.0
        self.scrapes = 0  # completed inside the window
        self.exposition_bytes = 0
        self._done = 0  # completed by the scraper thread so far

    def attach(self, loop: Any) -> Callable[[], None]:
        server = scraper = None
        stop = threading.Event()
        if self.endpoint:
            server = _start_endpoint(loop, self.model)
            url = "http://127.0.0.1:%d/metrics" % server.address[1]
            scraper = threading.Thread(target=self._scrape, args=(url, stop), name="bench-scraper", daemon=True)
            scraper.start()
        begin = self._clocks(scraper, server)

        def detach() -> None:
            end = self._clocks(scraper, server)
            stop.set()
            if scraper is not None:
                scraper.join(30)
            if server is not None:
                server.stop()
                self._time_expositions(server)
            self.cpu_s = (end[0] - begin[0]) - (end[1] - begin[1])
            self.wall_s, self.scrapes, self.endpoint_cpu_s = end[2] - begin[2], end[3] - begin[3], end[4] - begin[4]

        return detach

    def _clocks(self, scraper: Optional[threading.Thread], server: Any) -> Tuple[float, float, float, int, float]:
        """Process CPU, the scraper's CPU, wall clock, scrapes done, the endpoint's CPU."""
        endpoint = 0.0 if server is None else server.cpu_s()
        return time.process_time(), _thread_cpu_s(scraper), time.perf_counter(), self._done, endpoint

    def _scrape(self, url: str, stop: threading.Event) -> None:
        while True:
            with urllib.request.urlopen(url, timeout=10) as answer:
                answer.read()
            self._done += 1
            if stop.wait(SCRAPE_INTERVAL_S):
                return

    def _time_expositions(self, server: Any) -> None:
        from prometheus_client import generate_latest

        for _ in range(CPU_SAMPLES):
            started = time.thread_time()
            self.exposition_bytes = len(generate_latest(server.registry))
            self.expositions_ms.append((time.thread_time() - started) * 1e3)


@functools.lru_cache(maxsize=1)
def _cameras() -> Tuple[Any, ...]:
    """The health of :data:`CAMERAS` sources that are up and have published (the bench's loop has none); made
    once per run of the bench."""
    from agent.pipeline.sources.health import SourceHealth

    cameras = []
    for index in range(CAMERAS):
        health = SourceHealth("cam%d" % index, "rtsp://viewer:secret@10.0.0.%d/live" % (10 + index))
        for age_ms in range(100, 160, 3):
            health.frame_in()
            health.frame_out()
            health.published(float(age_ms))
        cameras.append(health)
    return tuple(cameras)


def _start_endpoint(loop: Any, model: Any) -> Any:
    """The daemon's endpoint over ``loop``: its status as the daemon's collector asks for it (no window figures,
    agent/daemon.py), with what the daemon adds: backend, model and slot, :data:`DAEMON_FIGURES`, and
    :data:`CAMERAS` sources' health (each read at every scrape, as the daemon reads its sources')."""
    from agent.devtools.broker import free_port
    from agent.ops.metrics import BoxCollector, EventCounts, MetricsServer

    cameras = _cameras()

    def status() -> Dict[str, Any]:
        info = dict(loop.status(windows=False), **DAEMON_FIGURES)
        info.update(backend=model.backend_name, model=model.describe(), slots={"serving": "a"},
                    sources={health.name: health.report() for health in cameras})
        return info

    server = MetricsServer(("127.0.0.1", free_port()), BoxCollector("bench", status, loop.stats.histograms, dict,
                                                                    EventCounts()))
    server.start()
    return server


def _serve(model: Any, frames: List[Any], count: int, endpoint: bool, expositions_ms: List[float]) -> _Run:
    run = _Run(model, endpoint, expositions_ms)
    throughput.serve_frames(model, frames, count, attach=run.attach)
    return run


def _ci95(values: List[float], of: Callable[[np.ndarray], np.ndarray]) -> List[float]:
    """Bootstrap 95 % interval of ``of(median of values)``, [low, high]: what the run's own scatter allows."""
    data = np.asarray(values)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    figures = of(np.median(rng.choice(data, (BOOTSTRAP, data.size)), axis=1))
    return [float(v) for v in np.percentile(figures, [2.5, 97.5])]


def measure(model: Any, frames: List[Any], count: int, rounds: int) -> Dict[str, Any]:
    """``rounds`` pairs, off-on then on-off: the endpoint's share of each on-run's CPU, and per pair the ratios
    on/off of frames per CPU-second and of frames per second."""
    cpu_ratios: List[float] = []
    wall_ratios: List[float] = []
    runs: Dict[bool, List[_Run]] = {False: [], True: []}
    expositions_ms: List[float] = []
    for index in range(rounds):
        pair = {}
        for endpoint in ((True, False) if index % 2 else (False, True)):
            pair[endpoint] = run = _serve(model, frames, count, endpoint, expositions_ms)
            runs[endpoint].append(run)
        cpu_ratios.append(pair[False].cpu_s / pair[True].cpu_s)  # same frames: frames per CPU-second on / off
        wall_ratios.append(pair[False].wall_s / pair[True].wall_s)
    on_runs, off_runs = runs[True], runs[False]
    shares = [r.endpoint_cpu_s / r.cpu_s for r in on_runs]
    share, cpu, wall, exposition = (summarize(v) for v in (shares, cpu_ratios, wall_ratios, expositions_ms))
    scrapes = sum(r.scrapes for r in on_runs)
    return {
        "cost": share["median"], "cost_ci95": _ci95(shares, lambda m: m), "endpoint_cpu_share": share,
        "paired_cpu_cost": 1.0 - cpu["median"], "paired_cpu_cost_ci95": _ci95(cpu_ratios, lambda m: 1.0 - m),
        "cpu_ratio_on_to_off": cpu, "wall_cost": 1.0 - wall["median"], "wall_ratio_on_to_off": wall,
        "cpu_ms_per_frame_on": summarize([1e3 * r.cpu_s / count for r in on_runs]),
        "cpu_ms_per_frame_off": summarize([1e3 * r.cpu_s / count for r in off_runs]),
        "cores_busy_off": summarize([r.cpu_s / r.wall_s for r in off_runs]),  # 1.0 = one core's worth of CPU
        "fps_on": summarize([count / r.wall_s for r in on_runs]),
        "fps_off": summarize([count / r.wall_s for r in off_runs]),
        "scrapes": scrapes, "scrapes_per_s": scrapes / sum(r.wall_s for r in on_runs),
        "endpoint_cpu_ms_per_scrape": 1e3 * sum(r.endpoint_cpu_s for r in on_runs) / max(scrapes, 1),
        "exposition_bytes": on_runs[-1].exposition_bytes, "scrape_cpu_ms": exposition,
        "scrape_cpu_fraction": exposition["median"] / 1e3 / SCRAPE_INTERVAL_S,
        "frames_per_run": count, "rounds": rounds,
    }


def run(context: RunContext) -> Dict[str, Any]:
    profile = context.profile.name
    backend = next((b for b in BACKEND_ORDER if backend_available(b) is None), None)
    if backend is None:
        return {"skipped": "no CPU backend runs here (%s)" % ", ".join(BACKEND_ORDER)}
    bundle = load_bundle(context.bundle_dir)
    frames = camera_frames(FRAME_POOL)
    model = open_model(bundle, bench_device(context.threads, context.device), backend, 1)
    try:
        cold = throughput.serve_frames(model, frames, 20)["fps"]  # the first frames are slow: size on a warm run
        warm = throughput.serve_frames(model, frames, max(20, int(cold * WARM_S)))["fps"]
        log.debug("metrics warm-up: %.1f fps cold, %.1f warm", cold, warm)
        count = max(20, int(warm * ROUND_S[profile]))
        result = measure(model, frames, count, ROUNDS[profile])
    finally:
        model.close()
    result.update(backend=backend, scrape_interval_s=SCRAPE_INTERVAL_S, bundle=bundle.label)
    log.info("metrics endpoint on %s: %.3f%% of the serving CPU (95%% CI %.3f..%.3f%%, %.2f ms a scrape, %d "
             "scrapes, %.2f/s); side by side: CPU per frame %.2f vs %.2f ms (paired cost %.2f%%, 95%% CI "
             "%.2f..%.2f%%), %.1f vs %.1f fps (wall cost %.2f%%); an exposition %.2f ms CPU", backend,
             100 * result["cost"], 100 * result["cost_ci95"][0], 100 * result["cost_ci95"][1],
             result["endpoint_cpu_ms_per_scrape"], result["scrapes"], result["scrapes_per_s"],
             result["cpu_ms_per_frame_on"]["median"], result["cpu_ms_per_frame_off"]["median"],
             100 * result["paired_cpu_cost"], 100 * result["paired_cpu_cost_ci95"][0],
             100 * result["paired_cpu_cost_ci95"][1], result["fps_on"]["median"], result["fps_off"]["median"],
             100 * result["wall_cost"], result["scrape_cpu_ms"]["median"])
    return result


def targets(section: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    if "skipped" in section:
        return {}
    return {"cost": target(section.get("cost"), "<=", TARGET_COST),
            "scrape_cpu_fraction": target(section.get("scrape_cpu_fraction"), "<=", TARGET_COST)}
