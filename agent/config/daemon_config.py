"""The daemon's configuration: one schema, validated whole before anything is applied.

``atlas-edge validate FILE``, ``atlas-edge run --config FILE``, the ``validate``/``set-config`` MQTT verbs and
SIGHUP reloads all go through :func:`load_daemon_config` / :func:`parse_daemon_config`, so a file that passes
one passes them all. Secrets (MQTT password, TLS key) may come from the environment or from systemd
credentials (``$CREDENTIALS_DIRECTORY``) instead of the file: see :mod:`agent.config.secrets`.
"""

import importlib.util
import ipaddress
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from agent.config.device_config import BACKEND_FORMATS, MODEL_PRECISIONS, device_config_path, unknown_device
from agent.config.mqtt_config import MqttConfig, is_loopback, parse_host_port
from agent.config.names import name_problem
from agent.config.remote_policy import pattern_problems, remote_sources
from agent.config.schema import ConfigError, FieldError, parse, setting, to_dict

DEFAULT_MAX_WAIT_MS = 10.0  # the seeds' server: flush a batch of 8 or after 10 ms, whichever comes first
DEFAULT_LEAK_MIN_SAMPLES = 12  # one minute at the default 5 s interval before any leak trend is trusted
MIN_LEAK_SAMPLES = 6  # each half of the leak window needs >= 3 points for its own slope
# User and topic names the broker setup gives a meaning (systemd/mosquitto-acl.example): never a device id.
RESERVED_NAMES = ("operator", "group")
OPERATOR_PREFIX = "operator-"  # operators' accounts are operator-<name> (systemd/make-mosquitto-passwd.sh)
# One reader thread and one decoder per source: a 310 box serves a handful of cameras, not hundreds.
MAX_SOURCES = 16
# A camera that sends no new picture for this long is stalled: seconds, where OpenCV's own read timeout (30 s,
# three times over before the old reader gave up) let a stall go unseen for 90 s.
DEFAULT_STALL_TIMEOUT_S = 5.0
# Stream decoders: OpenCV's FFmpeg, or Ascend's DVPP through pyACL (docs/sources.md: tested at its boundary only).
DECODERS = ("opencv", "dvpp")


def _account_problem(device_id: str) -> Optional[str]:
    """Why a device id cannot be a broker user name (None when it can): the ACL and passwd file's rules."""
    if device_id.startswith("$") or ":" in device_id or any(c.isspace() or ord(c) < 32 for c in device_id):
        return "must not start with '$' nor hold ':' or spaces: it is the box's broker user name (got %r)" % (
            device_id,)
    if device_id in RESERVED_NAMES or device_id.startswith(OPERATOR_PREFIX):
        # a box named so would get an operator's password and rights, or the write rule over group topics
        return "%r is reserved for the broker setup (%s, %s<name>)" % (device_id, ", ".join(RESERVED_NAMES),
                                                                       OPERATOR_PREFIX)
    return None


@dataclass(frozen=True)
class SourceConfig:
    name: str = setting(doc="source id, used in the results topic")
    uri: str = setting(doc="image folder or video file (relative to the config file), rtsp(s):// or http(s):// URL, "
                           "or 'camera:N' for a USB camera; a stream's password may be 'env:VAR' or 'cred:NAME' "
                           "(docs/sources.md)")
    max_fps: float = setting(0.0, ge=0, le=1000,
                             doc="frame-rate limit; 0 = as fast as frames come (live: frames skipped)")
    loop: bool = setting(False, doc="restart a folder or file at its end (demo and soak runs)")
    reopen_min_s: float = setting(0.5, ge=0.01, le=3600,
                                  doc="first reopen delay after a lost stream; doubles per failure")
    reopen_max_s: float = setting(30.0, ge=0.01, le=86400,
                                  doc="longest reopen delay (and the delay after an auth failure)")
    transport: str = setting("tcp", choices=("tcp", "udp"), doc="RTSP transport (udp loses packets on busy links)")
    open_timeout_s: float = setting(5.0, gt=0, le=600, doc="a stream that does not open within this is down")
    read_timeout_s: float = setting(5.0, gt=0, le=600, doc="a blocked read of a stream gives up after this")
    stall_timeout_s: float = setting(DEFAULT_STALL_TIMEOUT_S, gt=0, le=600,
                                     doc="no new picture for this long: stalled, alerted and reopened")
    input_options: Dict[str, str] = setting(factory=dict, doc="extra FFmpeg input options of this stream only")
    decoder: str = setting("opencv", choices=DECODERS, doc="video decoder of a stream (docs/sources.md)")

    def check(self) -> List[Tuple[str, str]]:
        from agent.config.source_uri import source_kind

        problem = name_problem(self.name)
        problems = [("name", problem)] if problem else []
        try:
            source_kind(self.uri)
        except ValueError as exc:
            problems.append(("uri", str(exc)))
        if self.reopen_max_s < self.reopen_min_s:
            problems.append(("reopen_max_s", "must be >= reopen_min_s"))
        return problems


@dataclass(frozen=True)
class BatchingConfig:
    max_batch: int = setting(1, ge=1, le=64, doc="largest batch handed to the backend")
    max_wait_ms: float = setting(DEFAULT_MAX_WAIT_MS, ge=0, le=1000, doc="longest a frame waits for a batch")
    # A 1080p frame is ~6 MB: 1024 waiting frames is already more memory than a small box has.
    queue_size: int = setting(32, ge=1, le=1024, doc="frames waiting for inference before the oldest is dropped")


@dataclass(frozen=True)
class ThresholdsConfig:
    conf: Optional[float] = setting(None, ge=0, le=1, doc="confidence threshold; default from the bundle")
    iou: Optional[float] = setting(None, ge=0, le=1, doc="NMS IoU threshold; default from the bundle")
    max_det: Optional[int] = setting(None, ge=1, le=10000, doc="detections per frame; default from the bundle")
    top_k: Optional[int] = setting(None, ge=1, le=1000, doc="classes per frame (classify); default from the bundle")


@dataclass(frozen=True)
class PublishConfig:
    max_rate_hz: float = setting(0.0, ge=0, le=1000, doc="per-source result rate limit; 0 = every frame")
    telemetry_interval_s: float = setting(10.0, ge=0.5, le=86400, doc="period of telemetry messages")


@dataclass(frozen=True)
class OutboxConfig:
    path: str = setting("outbox.sqlite", doc="SQLite file of unsent messages (relative to state_dir)")
    max_bytes: int = setting(64 * 1024 * 1024, ge=1024, le=64 << 30, doc="byte budget; the oldest are dropped")
    replay_rate_hz: float = setting(200.0, gt=0, le=100000, doc="replay rate after a reconnect")


SHADOW_NICE = 19  # the lowest priority a thread can ask for without privileges (a shadow run's default)


@dataclass(frozen=True)
class ModelConfig:
    bundle: str = setting(doc="bundle directory served at first start (later: the confirmed slot)")
    backend: Optional[str] = setting(None, choices=tuple(BACKEND_FORMATS) + (None,),
                                     doc="inference backend; default from the device")
    precision: str = setting("auto", choices=MODEL_PRECISIONS, doc="artifact precision to serve: auto = int8 when "
                             "the backend runs it as integer kernels and the bundle has it, else float")
    store: str = setting("bundles", doc="bundle store (relative to state_dir); deploy only reads from here")
    observation_s: float = setting(60.0, ge=0, le=7 * 86400, doc="a new model is pending this long before it is "
                                   "confirmed")
    latency_regression: float = setting(2.0, gt=1, le=1e6, doc="roll back when pending p50 latency exceeds this "
                                        "factor")
    max_error_rate: float = setting(0.05, ge=0, le=1, doc="roll back when pending inference errors exceed this")
    shadow_nice: int = setting(SHADOW_NICE, ge=0, le=19, doc="CPU priority (nice) of a shadow run's candidate "
                               "thread: 19 takes only what serving and everything else leave; lower takes more of "
                               "a busy CPU, at their expense")
    public_key: Optional[str] = setting(None, doc="Ed25519 public key (hex or PEM file): deploys must be signed")


@dataclass(frozen=True)
class FetchConfig:
    """Where a deploy may download from: local policy, never changed over MQTT (not a live section)."""

    schemes: List[str] = setting(factory=lambda: ["https"], doc="URL schemes deploys may use: https; http "
                                 "only if listed (anyone on the path can then swap the bytes before the pin check)")
    hosts: List[str] = setting(factory=list, doc="hosts deploys may download from: a name, '*.domain', an IP "
                               "or a CIDR network; empty: any public host. Loopback, private and link-local "
                               "addresses are refused unless their name, address or network is listed here")
    ports: List[int] = setting(factory=list, doc="ports deploys may download from, on every allowed host and "
                               "through redirects; empty: only the scheme's own (443 for https, 80 for http)")
    max_bytes: int = setting(1 << 30, ge=1 << 20, le=16 << 30, doc="largest bundle download and unpack")
    timeout_s: float = setting(30.0, ge=1, le=600, doc="socket timeout of a download's connect and of each read; "
                               "the response headers must also arrive within it")
    deadline_s: float = setting(600.0, ge=1, le=7200, doc="a whole download must finish within this (enforced "
                                "on the socket, however slowly the server sends)")
    unpack_deadline_s: float = setting(120.0, ge=1, le=3600, doc="each unpack (both passes over the archive, "
                                       "gunzip included) must finish within this")

    def check(self) -> List[Tuple[str, str]]:
        bad = [s for s in self.schemes if s not in ("http", "https")]
        problems = [("schemes", "only http and https can be allowed (got %s)" % bad)] if bad else []
        ports = [p for p in self.ports if not 0 < p < 65536]
        return problems + ([("ports", "ports are 1-65535 (got %s)" % ports)] if ports else [])


@dataclass(frozen=True)
class RemoteConfigPolicy:
    """What a remote set-config may do beyond the live fields: local policy, never changed over MQTT
    (:mod:`agent.config.remote_policy` applies it)."""

    source_uris: List[str] = setting(factory=list, doc="patterns a remote set-config may point a source at, "
                                     "matched per part (scheme, host, port, path, query), e.g. "
                                     "'rtsp://10.1.2.*/stream1'; such a URI may carry no user or password, "
                                     "and never reaches loopback or the box; empty: sources' URIs and the set "
                                     "of sources change only in this file")
    credentials: Dict[str, str] = setting(factory=dict, doc="pattern of source_uris -> 'USER:cred:NAME' or "
                                          "'USER:env:VAR': the only credentials a remotely set source gets")

    def check(self) -> List[Tuple[str, str]]:
        return pattern_problems(self.source_uris, self.credentials)


@dataclass(frozen=True)
class CommandsConfig:
    """How fresh a command must be and who may send what: local policy, never changed over MQTT."""

    public_key: Optional[str] = setting(None, doc="Ed25519 public key (hex or PEM file) of the operators' command "
                                        "key: every command must then be signed and dated")
    require_dated: bool = setting(False, doc="refuse commands without issued_at and ttl_s (on with a public_key)")
    max_skew_s: float = setting(30.0, ge=0, le=3600, doc="how far the sender's clock may be from the box's")
    max_ttl_s: float = setting(3600.0, gt=0, le=86400, doc="the longest validity (ttl_s) a command may claim")
    rate_per_s: float = setting(10.0, gt=0, le=1000, doc="sustained commands per second; more are refused")
    burst: int = setting(20, ge=1, le=10000, doc="commands accepted at once before the rate applies")
    # The verbs are the protocol's (agent/protocol/verbs.py, a layer above this one): checked there, by
    # `validate` and at start (check_group_verbs); unset means the verb table's group-safe ones.
    group_verbs: Optional[List[str]] = setting(None, doc="verbs a group topic may carry (one publish reaches every "
                                               "box of a group); default: status, pause, resume, cancel")


# What the metrics endpoint needs (agent/ops/metrics.py), named in every refusal for its absence.
METRICS_PACKAGE = "prometheus_client (pip install 'atlas-edge[metrics]')"
DEFAULT_METRICS_HOST = "127.0.0.1"  # a bare port binds loopback: the endpoint is for a local scraper or a tunnel


def parse_listen(text: str) -> Tuple[str, int]:
    """The metrics endpoint's ``HOST:PORT`` (or ``[v6]:PORT``), or a bare ``PORT`` on 127.0.0.1; HOST must be an IP
    address or ``localhost``, since it is bound exactly as written. ValueError says what is wrong."""
    text = str(text).strip()
    if text.isdigit():
        text = "%s:%s" % (DEFAULT_METRICS_HOST, text)
    host, port = parse_host_port(text, 0)
    if port == 0 or text.rpartition(":")[2] != str(port):
        raise ValueError("expected HOST:PORT or PORT, got %r" % text)
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError("HOST must be an IP address or localhost (it is bound as written), got %r"
                             % host) from None
    return host, port


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint (docs/metrics.md): off unless ``listen`` is set; needs prometheus_client."""

    listen: Optional[Union[str, int]] = setting(None, doc="HOST:PORT (or PORT: 127.0.0.1) of the Prometheus "
                                                "metrics endpoint; unset: no endpoint. Needs the 'metrics' extra "
                                                "(prometheus_client)")
    allow_remote: bool = setting(False, doc="let listen bind an address that is not loopback (0.0.0.0, a LAN "
                                 "address): the series name sources and the model; firewall it (IPAddressAllow)")

    def check(self) -> List[Tuple[str, str]]:
        if self.listen is None:
            return []
        try:
            host, _port = parse_listen(self.listen)
        except ValueError as exc:
            return [("listen", str(exc))]
        if not is_loopback(host) and not self.allow_remote:
            return [("listen", "%s is not loopback: anyone who reaches it reads the box's figures; set "
                     "metrics.allow_remote: true to bind it anyway" % host)]
        if importlib.util.find_spec("prometheus_client") is None:  # found, not imported: the box never loads it idle
            return [("listen", "the metrics endpoint needs %s, which is not installed" % METRICS_PACKAGE)]
        return []

    def address(self) -> Optional[Tuple[str, int]]:
        """(host, port) to bind, or None when the endpoint is off."""
        return None if self.listen is None else parse_listen(self.listen)


# A camera worker measured 56 MiB RSS decoding 640x360 H.264 (issue 31): a worker several times that is leaking
# or holding a backlog, and is recycled before it costs the box its MemoryMax.
DEFAULT_WORKER_MAX_RSS_MB = 256.0


@dataclass(frozen=True)
class WatchdogConfig:
    interval_s: float = setting(5.0, ge=0.05, le=3600, doc="memory sampling period")
    window_s: float = setting(300.0, gt=0, le=7 * 86400, doc="sliding window for the leak trend")
    leak_mb_per_hour: float = setting(50.0, gt=0, le=1e6, doc="steady RSS growth above this is a leak")
    soft_limit_mb: Optional[float] = setting(None, gt=0, le=1 << 24, doc="restart above this RSS; default 90% of "
                                             "memory.max")
    inference_deadline_s: float = setting(10.0, gt=0, le=3600, doc="an inference call longer than this is a hang")
    shutdown_timeout_s: float = setting(10.0, gt=0, le=600, doc="bound on drain + flush at shutdown")
    leak_min_samples: int = setting(DEFAULT_LEAK_MIN_SAMPLES, ge=MIN_LEAK_SAMPLES, le=100000,
                                    doc="samples in the window before a leak trend is trusted")
    restart_on_leak: bool = setting(True, doc="a host RSS leak restarts the daemon (false: alert only)")
    worker_max_rss_mb: float = setting(DEFAULT_WORKER_MAX_RSS_MB, gt=0, le=1 << 24,
                                       doc="a camera worker above this RSS is recycled alone (cause memory)")


@dataclass(frozen=True)
class DriftConfig:
    """Drift per source (agent/pipeline/drift.py, docs/shadow.md "Drift"): the serving model's scores and
    detections per frame over a sliding window against a reference learnt after its confirmation."""

    enabled: bool = setting(True, doc="watch every source for drift")
    window_s: float = setting(30.0, gt=0, le=86400, doc="the sliding window the figures are taken over")
    reference_frames: int = setting(200, ge=10, le=100000, doc="results of a source the reference is learnt from")
    min_frames: int = setting(20, ge=1, le=100000, doc="a window with fewer results is not judged")
    score_w1_bound: float = setting(0.10, gt=0, le=1, doc="Wasserstein-1 between the window's scores and the "
                                    "reference's above which a source drifts")
    detections_change_bound: float = setting(0.5, gt=0, le=100, doc="relative change in detections per frame "
                                             "above which a source drifts")
    raise_after_s: float = setting(20.0, ge=0, le=86400, doc="a figure above its bound this long raises drift")
    clear_after_s: float = setting(20.0, ge=0, le=86400, doc="both under clear_ratio x bound this long clear it")
    clear_ratio: float = setting(0.7, gt=0, le=1, doc="the hysteresis: the share of a bound under which a figure "
                                 "counts towards clearing")


@dataclass(frozen=True)
class DaemonConfig:
    device_id: str = setting(doc="this box's id in topics")
    model: ModelConfig = setting(doc="the model to serve")
    device: str = setting("cpu-dev", doc="device config name (device_configs/<name>.yaml) or path")
    state_dir: str = setting("/var/lib/atlas-edge", doc="writable directory: slots, outbox, bundle store")
    sources: List[SourceConfig] = setting(factory=list, doc="frame sources")
    mqtt: MqttConfig = setting(factory=MqttConfig, doc="broker connection")
    batching: BatchingConfig = setting(factory=BatchingConfig, doc="dynamic batching")
    thresholds: ThresholdsConfig = setting(factory=ThresholdsConfig, doc="post-processing overrides")
    publish: PublishConfig = setting(factory=PublishConfig, doc="result and telemetry publishing")
    outbox: OutboxConfig = setting(factory=OutboxConfig, doc="durable queue for the broker's absence")
    watchdog: WatchdogConfig = setting(factory=WatchdogConfig, doc="memory and liveness checks")
    drift: DriftConfig = setting(factory=DriftConfig, doc="drift per source of the serving model's figures")
    fetch: FetchConfig = setting(factory=FetchConfig, doc="where deploys may download bundles from")
    commands: CommandsConfig = setting(factory=CommandsConfig, doc="command freshness, signing and group verbs")
    remote_config: RemoteConfigPolicy = setting(factory=RemoteConfigPolicy,
                                                doc="what remote set-config may change beyond live fields")
    metrics: MetricsConfig = setting(factory=MetricsConfig, doc="Prometheus metrics endpoint (off by default)")
    log_level: str = setting("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), doc="log level")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        problem = name_problem(self.device_id) or _account_problem(self.device_id)
        if problem:
            problems.append(("device_id", problem))
        if self.mqtt.username is not None and self.mqtt.username != self.device_id:
            # The broker ACL (systemd/mosquitto-acl.example) grants a box its topics by username.
            problems.append(("mqtt.username", "must equal device_id %r for the per-device ACL" % self.device_id))
        if device_config_path(self.device) != self.device:  # a name: judged here; a path when it is loaded
            problem = unknown_device(self.device)
            if problem:
                problems.append(("device", problem))
        names = [s.name for s in self.sources]
        if len(names) > MAX_SOURCES:
            problems.append(("sources", "at most %d sources (got %d)" % (MAX_SOURCES, len(names))))
        if len(set(names)) != len(names):
            problems.append(("sources", "source names must be unique (got %s)" % names))
        return problems

    def state_path(self, relative: str) -> str:
        return relative if os.path.isabs(relative) else os.path.join(self.state_dir, relative)


# Fields that `set-config` may change on a running daemon; anything else needs a restart.
LIVE_SECTIONS = ("thresholds", "batching", "publish", "sources")


def parse_daemon_config(data: Mapping[str, Any], source: str = "") -> DaemonConfig:
    return parse(DaemonConfig, data, source)


def load_daemon_config(path: str) -> DaemonConfig:
    from agent.config.schema import load_yaml
    from agent.config.source_uri import is_local_path

    config = load_yaml(DaemonConfig, path)
    base = os.path.dirname(os.path.abspath(path))
    # Relative paths in a file are relative to that file, so `run --config examples/x.yaml` works from anywhere.
    model = replace(config.model, bundle=os.path.join(base, config.model.bundle),
                    public_key=_key_beside(base, config.model.public_key))
    commands = replace(config.commands, public_key=_key_beside(base, config.commands.public_key))
    sources = [replace(s, uri=os.path.join(base, s.uri)) if is_local_path(s.uri) else s for s in config.sources]
    return replace(config, state_dir=os.path.join(base, config.state_dir), sources=sources, model=model,
                   commands=commands)


def _key_beside(base: str, key: Optional[str]) -> Optional[str]:
    """A public key is hex or a PEM file: a file named relative to the config file resolves beside it."""
    if key and os.path.isfile(os.path.join(base, key)):
        return os.path.join(base, key)
    return key


def merge_config(config: DaemonConfig, changes: Mapping[str, Any]) -> DaemonConfig:
    """Apply a partial change (``{"thresholds": {"conf": 0.4}}``) and validate the result whole.

    Only :data:`LIVE_SECTIONS` may change at run time; the whole merged config is re-parsed so cross-field
    rules hold for the result, and a failure leaves ``config`` untouched (it is immutable). Every change here
    comes from the broker (set-config, validate, the overrides file they wrote), so its sources pass the local
    ``remote_config`` policy (:func:`agent.config.remote_policy.remote_sources`: URIs, credentials, options).
    """
    errors = [FieldError(k, "cannot change while running (allowed: %s)" % ", ".join(LIVE_SECTIONS))
              for k in changes if k not in LIVE_SECTIONS]
    if errors:
        raise ConfigError(errors)
    merged = parse_daemon_config(merge_sections(to_dict(config), changes))
    sources, errors = remote_sources(config.sources, merged.sources, config.remote_config)
    if errors:
        raise ConfigError(errors)
    return replace(merged, sources=sources)


def merge_sections(base: Mapping[str, Any], changes: Mapping[str, Any]) -> Dict[str, Any]:
    """``changes`` over ``base``: keys within a mapping section, whole values (the ``sources`` list) otherwise.

    The one merge rule for set-config, SIGHUP and the overrides file, so all three mean the same change.
    """
    out: Dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out

