"""Device configs: what a box kind is (SoC, backend, artifact format, memory budget, batching defaults).

One YAML file per box kind under ``device_configs/``, named by its stem everywhere (``--device atlas-200dk``).
The converters read the SoC and precision from here; the agent reads the backend, the memory budget and
batching defaults, and refuses a bundle whose artifacts do not match.

The files are package data: ``agent/config/device_configs`` is a link to the repository's top-level
``device_configs/`` (the documented place to edit them), and building the wheel copies them into the package,
so an installed box reads them next to this module, never from a checkout.
"""

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from agent.config.schema import ConfigError, FieldError, load_yaml, setting

# next to this module (importlib.resources.files() would need Python 3.9; the box has 3.7)
DEVICE_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_configs")

# backend -> artifact formats it reads: the one list of backend names (the registry in agent.pipeline.backends
# imports ``agent.pipeline.backends.<name>_backend`` for each; configs and CLIs take their choices from here)
BACKEND_FORMATS = {"mindspore": ("mindir",), "onnxruntime": ("onnx",), "opencv": ("onnx",), "mslite": ("ms", "mindir"),
                   "acl": ("om",)}
# Backends that run int8 artifacts as real integer kernels, so `model.precision: auto` serves int8 on them:
# onnxruntime (QDQ ONNX: 0.53-0.58x float on the demo detector, issue 28) and pyACL (an int8 .om on the NPU). Not
# OpenCV (cv2.dnn simulates QDQ in float) nor MindSpore Lite on x86 (Lite 2.0's generic int8 kernels ran 21-27x
# slower than float); an explicit `model.precision: int8` still serves their int8 artifacts.
INT8_BACKENDS = ("onnxruntime", "acl")
MODEL_PRECISIONS = ("auto", "int8", "float")  # the daemon config's model.precision (agent/pipeline/artifacts.py)
# ATC / device-config precision names -> MindSpore Lite's, as mindspore_lite.Context's own docstring pairs them
# (mindspore/lite/python/api/context.py: "enforce_fp16: ACL option is force_fp16", ...)
PRECISION_MODES: Dict[str, str] = {
    "force_fp32": "enforce_fp32",
    "allow_fp32_to_fp16": "preferred_fp32",
    "force_fp16": "enforce_fp16",
    "must_keep_origin_dtype": "enforce_origin",
    "allow_mix_precision": "preferred_optimal",
}
LITE_PRECISION_MODES = tuple(PRECISION_MODES.values())
ARCHES = ("x86_64", "aarch64")  # ATC --host_env_cpu values for the boxes we know
ARTIFACT_FORMATS = tuple(sorted({fmt for formats in BACKEND_FORMATS.values() for fmt in formats}))
SOC_VERSIONS = ("Ascend310", "Ascend310B1", "Ascend310B4", "Ascend310P1", "Ascend310P3")


@dataclass(frozen=True)
class OnnxRuntimeSettings:
    """onnxruntime SessionOptions for the box (docs/backends.md); intra-op threads are the device's cpu_threads.

    The defaults are what measured best on a 2-core box: one model runs its ops in order on cpu_threads, and
    idle workers sleep instead of spinning (spinning makes 2 threads pay for a small int8 model, 1.08 vs 1.41 ms,
    but doubles float time when the letterbox and decode compete for the cores).
    """

    inter_op_threads: int = setting(1, ge=1, le=256, doc="threads across independent ops (parallel mode only)")
    execution_mode: str = setting("sequential", choices=("sequential", "parallel"), doc="ORT ExecutionMode")
    graph_optimization: str = setting("all", choices=("disable", "basic", "extended", "all"),
                                      doc="ORT GraphOptimizationLevel (ORT_ENABLE_ALL = all)")
    allow_spinning: bool = setting(False, doc="session.intra_op.allow_spinning: busy-wait between ops")


def lite_precision_mode(mode: str) -> str:
    """``force_fp16`` (ATC spelling, as in device configs) or ``enforce_fp16`` -> ``enforce_fp16``."""
    if mode in LITE_PRECISION_MODES:
        return mode
    if mode in PRECISION_MODES:
        return PRECISION_MODES[mode]
    raise ValueError("precision_mode %r is not one of %s" % (mode, sorted(PRECISION_MODES) + sorted(
        LITE_PRECISION_MODES)))


@dataclass(frozen=True)
class DeviceConfig:
    name: str = setting(doc="box kind, equal to the file's stem")
    target: str = setting(choices=("cpu", "ascend"), doc="where inference runs")
    backend: str = setting(choices=tuple(BACKEND_FORMATS), doc="preferred inference backend")
    artifact_format: str = setting(choices=ARTIFACT_FORMATS, doc="artifact format to serve")
    memory_budget_mb: int = setting(ge=64, doc="host RSS budget for the daemon (watchdog soft limit)")
    description: str = setting("", doc="one line for humans")
    soc_version: Optional[str] = setting(None, choices=SOC_VERSIONS + (None,), doc="ATC/converter --soc_version")
    fallback_backends: List[str] = setting(factory=list, doc="tried in order when the preferred one is missing")
    device_id: int = setting(0, ge=0, doc="NPU index (acl / mslite ascend)")
    cpu_threads: int = setting(2, ge=1, le=256, doc="inference threads on CPU backends")
    precision_mode: str = setting("force_fp16", choices=tuple(PRECISION_MODES), doc="ATC --precision_mode")
    npu_memory_budget_mb: Optional[int] = setting(None, ge=64, doc="NPU memory budget, when the box has one")
    max_batch: int = setting(1, ge=1, le=64, doc="default batching.max_batch")
    max_wait_ms: float = setting(10.0, ge=0, le=1000, doc="default batching.max_wait_ms")
    input_tiers: List[Tuple[int, int]] = setting(factory=list, doc="tiers [h, w] this box serves; empty = all")
    arch: Optional[str] = setting(None, choices=ARCHES + (None,),
                                  doc="the box's CPU (ATC --host_env_cpu); None when it varies, e.g. a PCIe card")
    serve_formats: Dict[str, List[str]] = setting(
        factory=dict, doc="backend -> the formats it serves on this box, when fewer than it reads (cpu-dev: "
        "mslite only .ms, Lite 2.0 cannot read MindSpore 2.7's MindIR)")
    onnxruntime: OnnxRuntimeSettings = setting(factory=OnnxRuntimeSettings, doc="onnxruntime session options")

    def check(self) -> List[Tuple[str, str]]:
        problems = []
        if self.target == "ascend" and self.soc_version is None:
            problems.append(("soc_version", "required when target is ascend"))
        if self.target == "cpu" and self.soc_version is not None:
            problems.append(("soc_version", "must be null on a cpu box (got %s)" % self.soc_version))
        if self.artifact_format not in BACKEND_FORMATS[self.backend]:
            problems.append(("artifact_format", "backend %s reads %s, not %s" % (
                self.backend, "/".join(BACKEND_FORMATS[self.backend]), self.artifact_format)))
        for name in self.fallback_backends:
            if name not in BACKEND_FORMATS:
                problems.append(("fallback_backends", "unknown backend %r" % name))
        for name, formats in self.serve_formats.items():
            if name not in BACKEND_FORMATS:
                problems.append(("serve_formats", "unknown backend %r" % name))
            elif not formats or set(formats) - set(BACKEND_FORMATS[name]):
                problems.append(("serve_formats", "backend %s reads %s, not %s" % (
                    name, "/".join(BACKEND_FORMATS[name]), "/".join(formats) or "nothing")))
        return problems

    def backend_formats(self, backend: str) -> Tuple[str, ...]:
        """The formats ``backend`` serves on this box, in its own order of preference."""
        narrowed = self.serve_formats.get(backend)
        return tuple(f for f in BACKEND_FORMATS[backend] if narrowed is None or f in narrowed)

    def formats(self) -> List[str]:
        """Artifact formats this box can serve, preferred first."""
        result = [self.artifact_format]
        for backend in [self.backend] + self.fallback_backends:
            result += [f for f in self.backend_formats(backend) if f not in result]
        return result


def device_config_path(name_or_path: str) -> str:
    """``atlas-200dk`` -> ``device_configs/atlas-200dk.yaml``; an existing path is used as it is."""
    if os.path.sep in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return name_or_path
    return os.path.join(DEVICE_CONFIG_DIR, name_or_path + ".yaml")


def known_devices() -> List[str]:
    return sorted(f[:-5] for f in os.listdir(DEVICE_CONFIG_DIR) if f.endswith(".yaml"))


def unknown_device(name_or_path: str) -> Optional[str]:
    """Why ``name_or_path`` names no device config (listing the known names), or None when it does."""
    if os.path.exists(device_config_path(name_or_path)):
        return None
    return "no device config %r (known: %s)" % (name_or_path, ", ".join(known_devices()))


def load_device_config(name_or_path: str) -> DeviceConfig:
    path = device_config_path(name_or_path)
    problem = unknown_device(name_or_path)
    if problem:
        raise ConfigError([FieldError("device", problem)], name_or_path)
    config = load_yaml(DeviceConfig, path)
    stem = os.path.splitext(os.path.basename(path))[0]
    if config.name != stem:
        raise ConfigError([FieldError("name", "must equal the file's stem %r (got %r)" % (stem, config.name))],
                          path)
    return config
