"""``atlas-edge convert``: plan a conversion (dry run), then run it and add the outputs to the bundle.

The plan is computed from the bundle's manifest and the device config alone and touches nothing, so
``--dry-run`` and the "tool missing" message can show exactly what would run. Execution is all or nothing:
every tier is converted in one staging directory first; only when all succeeded are the outputs, the
generated configs and the tool logs copied into the bundle and the manifest rewritten, and any failure in
that last step restores the bundle byte for byte.

Paths in commands and configs are relative to the working directory, which mirrors the bundle root
(inputs are symlinked into the staging directory), so the printed commands also work when run by hand from
the bundle directory, and the configs kept in the bundle stay meaningful after it moves.
"""

import json
import logging
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from converters import aipp, grammar, lite_config, mindir, toolrun
from converters.tools import TOOLS

log = logging.getLogger(__name__)

Tier = Tuple[int, int]  # (h, w)

DEFAULT_TIMEOUT_S = 1800.0  # ATC on a YOLO-sized model takes minutes; PTQ with 500 calibration inputs longer
CONVERT_DIR = "convert"  # bundle folder of generated AIPP / converter configs
LOGS_DIR = "logs"  # bundle folder of tool logs (kept only for successful conversions)
# ATC precision modes that leave float16 somewhere in the graph; the artifact is labelled by its weakest part.
FLOAT16_MODES = ("force_fp16", "allow_fp32_to_fp16", "allow_mix_precision")


class ConvertError(ValueError):
    """Bad input (bundle, device, options): every problem, each naming its field, option or file."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class ConvertRequest:
    bundle: str
    device: str
    to: str  # "om" (ATC) | "ms" (converter_lite: .ms on CPU boxes, Ascend MindIR on NPU boxes)
    tiers: Optional[List[Tier]] = None  # None: every tier of the bundle
    ptq: bool = False
    input_format: Optional[str] = None  # None: bgr where AIPP is used
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class GeneratedFile:
    path: str  # relative to the bundle root
    text: str


@dataclass(frozen=True)
class Job:
    """One tool run: one tier in, one artifact out."""

    tier: Tier
    source: str  # the bundle artifact the tool reads
    output: str  # the file the tool writes, relative to the working directory (= its bundle path)
    cmd: List[str]  # program name first; replaced by the resolved path at run time
    files: List[GeneratedFile]
    artifact: Dict[str, Any]  # the manifest entry to add (sha256/size/toolchain filled in at commit)
    toolchain: Dict[str, str] = field(default_factory=dict)  # what this job adds to it (the target arch)

    @property
    def log(self) -> str:
        return "%s/%s.log" % (LOGS_DIR, self.output)


@dataclass(frozen=True)
class Relayout:
    """The calibration BINs are stored in one layout and the converter feeds them as the model's input in
    another: the staging copy gets transposed files (the bundle keeps its own)."""

    directory: str  # bundle path of the calibration folder
    stored: str  # calibration.layout
    wanted: str  # the model's input layout (what --inputDataFormat / the graph says)
    shape: Tuple[int, int, int, int]  # one file's tensor in the stored layout
    dtype: str

    def write(self, source: str, destination: str) -> None:
        """Transpose every file of ``source`` into ``destination``; a file of the wrong size is named."""
        import numpy as np

        order = (0, 3, 1, 2) if (self.stored, self.wanted) == ("NHWC", "NCHW") else (0, 2, 3, 1)
        os.makedirs(destination, exist_ok=True)
        for name in sorted(os.listdir(source)):
            data = np.fromfile(os.path.join(source, name), dtype=self.dtype)
            if data.size != int(np.prod(self.shape)):
                raise ConvertError(["%s/%s: %d %s values, expected %s %s (calibration.layout %s)" % (
                    self.directory, name, data.size, self.dtype, "x".join(map(str, self.shape)), self.dtype,
                    self.stored)])
            np.ascontiguousarray(data.reshape(self.shape).transpose(order)).tofile(
                os.path.join(destination, name))


@dataclass(frozen=True)
class ConvertPlan:
    bundle: str  # absolute
    label: str  # "name version"
    device_name: str
    soc_version: Optional[str]
    tool: toolrun.ToolInfo
    jobs: List[Job]
    inputs: List[str]  # bundle paths the commands read: source artifacts, the calibration folder
    warnings: List[str] = field(default_factory=list)
    input_format: Optional[str] = None  # what the box sends when AIPP is used
    request: Optional[ConvertRequest] = None  # to plan again once the converter's MindIR limit is known
    relayout: Optional["Relayout"] = None  # calibration tensors to transpose into the model's input layout

    def render(self) -> str:
        """The dry-run text: every generated file's contents and every command, exactly as they would run."""
        lines = [
            "# atlas-edge convert plan: bundle %s (%s), device %s (%s), tool %s" % (
                self.bundle, self.label, self.device_name, self.soc_version or "cpu", self.tool.name),
            "# Run the commands in the bundle directory after saving each file below at its path;",
            "# atlas-edge convert itself runs them in a staging copy and then updates manifest.json.",
            "cd %s" % shlex.quote(self.bundle),
        ]
        lines += ["# warning: " + w for w in self.warnings]
        for job in self.jobs:
            lines.append("")
            lines.append("# == tier %dx%d: %s -> %s" % (job.tier[0], job.tier[1], job.source, job.output))
            for generated in job.files:
                lines.append("# --- %s" % generated.path)
                lines.append(generated.text.rstrip("\n"))
                lines.append("# --- end of %s" % generated.path)
            lines.append(toolrun.join_command(job.cmd))
        return "\n".join(lines) + "\n"


# --- planning -----------------------------------------------------------------------------------------------

def _load_inputs(request: ConvertRequest, errors: List[str]) -> Tuple[Any, Any]:
    from agent.bundle.manifest import BundleError, load_manifest
    from agent.config.device_config import load_device_config
    from agent.config.schema import ConfigError

    manifest = device = None
    try:
        manifest = load_manifest(request.bundle)
    except BundleError as exc:
        errors += ["bundle %s: %s" % (request.bundle, e) for e in exc.errors]
    try:
        device = load_device_config(request.device)
    except ConfigError as exc:
        errors += ["device %s: %s" % (request.device, e) for e in exc.errors]
    return manifest, device


def _pick_tiers(request: ConvertRequest, manifest: Any, device: Any, errors: List[str]) -> List[Tier]:
    known = [tuple(t) for t in manifest.input.tiers]
    if request.tiers is None:
        wanted = [t for t in known if not device.input_tiers or t in [tuple(d) for d in device.input_tiers]]
        return wanted or known
    tiers = []
    for tier in request.tiers:
        if tuple(tier) not in known:
            errors.append("--tiers: %dx%d is not one of the bundle's input.tiers (%s)" % (
                tier[0], tier[1], ", ".join("%dx%d" % t for t in known)))
        elif tuple(tier) not in tiers:
            tiers.append(tuple(tier))
    return tiers


@dataclass(frozen=True)
class MindIrLimit:
    """The newest MindIR version the converter that will run reads (converters/mindir.py)."""

    converter: str  # "MindSpore Lite 2.0.0", for messages
    max_version: int


def _mindir_too_new(bundle: str, art: Any, limit: Optional[MindIrLimit]) -> Optional[str]:
    """Why ``art`` (a MindIR) cannot be read by the converter, or None when it can (or nobody knows)."""
    if limit is None or art.format != "mindir":
        return None
    try:
        version, producer = mindir.read_header(os.path.join(bundle, art.file))
    except (OSError, mindir.MindIrError):
        return None  # the converter reports an unreadable file itself, with its own words
    if version <= limit.max_version:
        return None
    return "%s is MindIR version %d (MindSpore %s); %s reads MindIR versions up to %d" % (
        art.file, version, producer or "unknown", limit.converter, limit.max_version)


def _pick_source(manifest: Any, tier: Tier, formats: Sequence[str], errors: List[str], bundle: str = "",
                 limit: Optional[MindIrLimit] = None, warnings: Optional[List[str]] = None) -> Optional[Any]:
    """The float32 artifact of ``tier`` in the first of ``formats`` that has one (the converter's input);
    a MindIR newer than ``limit`` is passed over for the ONNX, saying so, or refused naming both versions."""
    too_new: List[str] = []
    for fmt in formats:
        for art in manifest.artifacts:
            if art.format == fmt and tuple(art.tier) == tier and art.precision == "float32" \
                    and art.normalize_on == "host":
                why = _mindir_too_new(bundle, art, limit)
                if why:
                    too_new.append(why)
                    continue
                if too_new and warnings is not None:
                    warnings.append("%s: converting from %s instead" % (too_new[0], art.file))
                return art
    if too_new:
        errors.append("%s, and the bundle has no ONNX of tier %dx%d to convert instead (export one, or convert "
                      "with a converter that reads it)" % (too_new[0], tier[0], tier[1]))
        return None
    errors.append("artifacts: no float32 %s artifact for tier %dx%d to convert from" % (
        " or ".join(formats), tier[0], tier[1]))
    return None


def _check_calibration(request: ConvertRequest, manifest: Any, tiers: List[Tier], errors: List[str]
                       ) -> Optional[Any]:
    calibration = manifest.calibration
    if calibration is None:
        errors.append("--ptq: the bundle has no calibration set (manifest 'calibration')")
        return None
    for tier in tiers:
        if tier != tuple(calibration.tier):
            errors.append("--ptq: calibration.tier is %dx%d; the calibration set cannot calibrate tier %dx%d "
                          "(convert that tier without --ptq, or pass --tiers %dx%d)" % (
                              calibration.tier[0], calibration.tier[1], tier[0], tier[1],
                              calibration.tier[0], calibration.tier[1]))
    directory = os.path.join(request.bundle, calibration.dir)
    if not os.path.isdir(directory):
        errors.append("calibration.dir: %s is not a folder in the bundle" % calibration.dir)
        return None
    found = len([n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n))])
    if found < calibration.count:
        errors.append("calibration.count: %d, but %s holds %d files" % (
            calibration.count, calibration.dir, found))
    return calibration


# Lite 2.0 has only generic C int8 kernels on x86 (issue 28: FULL_QUANT ran 21-27x slower than float there); the
# int8 that pays on a CPU box is an ONNX on onnxruntime (docs/quant.md, docs/converters.md).
LITE_CPU_INT8_WARNING = (
    "--ptq for a CPU target: MindSpore Lite 2.0's int8 kernels on x86 are generic C, so this .ms runs slower than "
    "the float one (21-27x measured); for int8 that pays on a CPU box use the bundle's int8 ONNX on onnxruntime "
    "(qat writes model_<tier>.int8.onnx; for a brought model: atlas-edge bundle create --int8 --images DIR)")


def _precision(device: Any, ptq: bool) -> str:
    if ptq:
        return "int8"
    if device.target == "ascend" and device.precision_mode in FLOAT16_MODES:
        return "float16"
    return "float32"


def _shape(manifest: Any, batch: int, tier: Tier) -> Tuple[int, int, int, int]:
    height, width = tier
    return (batch, 3, height, width) if manifest.input.layout == "NCHW" else (batch, height, width, 3)


def _artifact_entry(output: str, fmt: str, device: Any, tier: Tier, batch: int, precision: str,
                    input_format: Optional[str], color: str, config_files: List[str]) -> Dict[str, Any]:
    """A manifest artifact in docs/bundle.md's key order (sha256/size are filled by write_manifest)."""
    on_npu = device.target == "ascend"
    return {
        "file": output,
        "format": fmt,
        "target": device.target,
        "soc_version": device.soc_version if on_npu else None,
        "tier": [tier[0], tier[1]],
        "batch": batch,
        "precision": precision,
        "role": "serve",
        # With AIPP the box sends letterboxed uint8 pixels as they come; otherwise the agent normalises.
        "input_dtype": "uint8" if input_format else "float32",
        "input_layout": "NHWC" if input_format else "NCHW",
        "normalize_on": "aipp" if input_format else "host",
        "input_color": input_format or color,
        "sha256": "",
        "size": 0,
        "config_files": config_files,
        "toolchain": {},
    }


def _self_check(job_cmd: List[str], files: List[GeneratedFile], tool: Any) -> None:
    """Generated text must pass the documented grammar; a failure here is a bug in this package."""
    try:
        for generated in files:
            if generated.path.endswith(".cfg"):
                grammar.check_aipp(generated.text)
            else:
                grammar.check_lite_config(generated.text)
        tool.check_args(job_cmd[1:])
    except grammar.GrammarError as exc:
        raise ConvertError(["internal error, generated %s breaks the documented grammar: %s" % (
            exc.what, "; ".join(exc.errors))]) from None


def plan_conversion(request: ConvertRequest, mindir_limit: Optional[MindIrLimit] = None) -> ConvertPlan:
    """Check the request against the bundle and device config and build every file and command.

    Reads only; raises :class:`ConvertError` listing every problem found. ``mindir_limit`` (known once the
    converter is found) makes a MindIR source it cannot read give way to the tier's ONNX.
    """
    errors: List[str] = []
    if request.to not in TOOLS:
        errors.append("--to: must be %s (got %r)" % (" or ".join(TOOLS), request.to))
    if request.input_format is not None and request.input_format not in aipp.INPUT_FORMATS:
        errors.append("--input-format: must be one of %s (got %r)" % ("|".join(aipp.INPUT_FORMATS),
                                                                      request.input_format))
    if not request.timeout_s > 0:
        errors.append("--timeout: must be > 0 seconds (got %s)" % request.timeout_s)
    manifest, device = _load_inputs(request, errors)
    if manifest is None or device is None or errors:
        raise ConvertError(errors)

    warnings: List[str] = []
    uses_aipp = device.target == "ascend"
    tool = TOOLS[request.to]
    errors.extend(tool.refusals(device, request.ptq))
    if request.input_format is not None and not uses_aipp:
        errors.append("--input-format: applies to AIPP on Ascend targets only; device %s is %s" % (
            device.name, device.target))
    input_format = (request.input_format or aipp.DEFAULT_INPUT_FORMAT) if uses_aipp else None
    tiers = _pick_tiers(request, manifest, device, errors)
    calibration = _check_calibration(request, manifest, tiers, errors) if request.ptq else None
    if errors:
        raise ConvertError(errors)

    out_format = tool.out_format(device)
    if out_format not in device.formats():
        warnings.append("device %s serves %s, not %s: the artifact suits only boxes that read %s" % (
            device.name, "/".join(device.formats()), out_format, out_format))
    low, high = lite_config.RECOMMENDED_CALIBRATION
    if calibration is not None and not low <= calibration.count <= high:
        warnings.append("calibration.count %d is outside the documented %d-%d: int8 ranges may be noisy" % (
            calibration.count, low, high))
    if request.ptq and device.target == "cpu":
        warnings.append(LITE_CPU_INT8_WARNING)
    if os.path.exists(os.path.join(request.bundle, "manifest.sig")):
        warnings.append("the bundle is signed; converting rewrites manifest.json and removes manifest.sig "
                        "(sign it again)")

    prep = manifest.preprocessing
    tag = device.soc_version if device.target == "ascend" else "cpu"
    jobs: List[Job] = []
    inputs: List[str] = []
    for tier in tiers:
        source = _pick_source(manifest, tier, tool.source_formats, errors, request.bundle, mindir_limit, warnings)
        if source is None:
            continue
        stem = "%s_%dx%d_%s%s" % (manifest.name, tier[0], tier[1], tag, "_int8" if request.ptq else "")
        shape = _shape(manifest, source.batch, tier)
        files: List[GeneratedFile] = []
        aipp_path = None
        if input_format is not None:
            try:
                params = aipp.aipp_params(prep.color, prep.mean, prep.std, tier, input_format)
            except aipp.AippError as exc:
                errors.append(str(exc))
                continue
            aipp_path = "%s/aipp_%dx%d_%s.cfg" % (CONVERT_DIR, tier[0], tier[1], input_format)
            files.append(GeneratedFile(aipp_path, aipp.render_aipp(
                params, aipp.describe(prep.color, prep.mean, prep.std, input_format))))
        lite_calibration = None
        if calibration is not None:
            lite_calibration = lite_config.Calibration(manifest.input.name, calibration.dir, calibration.count)
        planned = tool.command(manifest, device, source, stem, shape, aipp_path, lite_calibration, CONVERT_DIR,
                               errors)
        if planned is None:
            continue
        output, cmd, generated = planned
        files.extend(GeneratedFile(path, text) for path, text in generated)
        _self_check(cmd, files, tool)
        entry = _artifact_entry(output, out_format, device, tier, source.batch,
                                _precision(device, request.ptq), input_format, prep.color,
                                [f.path for f in files])
        jobs.append(Job(tier=tier, source=source.file, output=output, cmd=cmd, files=files, artifact=entry,
                        toolchain=tool.toolchain(device)))
        inputs.append(source.file)
    if errors:
        raise ConvertError(errors)
    relayout = None
    if calibration is not None:
        inputs.append(calibration.dir)
        if calibration.layout != manifest.input.layout:
            tier = tuple(calibration.tier)
            shape = (1, tier[0], tier[1], 3) if calibration.layout == "NHWC" else (1, 3, tier[0], tier[1])
            relayout = Relayout(calibration.dir, calibration.layout, manifest.input.layout, shape,
                                calibration.dtype)
            warnings.append("%s holds %s tensors; the converter reads them as the model's %s input, so the "
                            "staging copy is transposed (the bundle keeps its files)" % (
                                calibration.dir, calibration.layout, manifest.input.layout))
    return ConvertPlan(bundle=os.path.abspath(request.bundle),
                       label="%s %s" % (manifest.name, manifest.version), device_name=device.name,
                       soc_version=device.soc_version, tool=tool.info, jobs=jobs,
                       inputs=sorted(set(inputs)), warnings=warnings, input_format=input_format,
                       request=request, relayout=relayout)


# --- execution ----------------------------------------------------------------------------------------------

def bundle_accepts_input_color(value: str) -> bool:
    """Whether agent/bundle/manifest.py's artifact schema takes ``input_color: value`` (yuv420sp needs a change)."""
    import dataclasses

    from agent.bundle.manifest import Artifact

    for f in dataclasses.fields(Artifact):
        if f.name == "input_color":
            choices = f.metadata.get("choices")
            return choices is None or value in choices
    return False


def _toolchain(plan: ConvertPlan, located: toolrun.LocatedTool, env: Mapping[str, str]) -> Dict[str, str]:
    versions = dict(located.toolchain)
    if TOOLS[plan.request.to].records_host_cann and plan.soc_version:
        versions["cann"] = _cann_near(env)
    return versions


def _cann_near(env: Mapping[str, str]) -> str:
    for root in (env.get("ASCEND_TOOLKIT_HOME"), os.path.join(env.get("ASCEND_HOME", ""), "latest"),
                 os.path.dirname(toolrun.DEFAULT_TOOLKIT_BIN)):
        if root and os.path.isdir(root):
            version = toolrun.cann_version(os.path.join(root, "bin", "atc"))
            if version != toolrun.UNKNOWN_VERSION:
                return version
    return toolrun.UNKNOWN_VERSION


def _mindir_limit(located: toolrun.LocatedTool) -> Optional[MindIrLimit]:
    version = located.toolchain.get("mindspore_lite") or located.toolchain.get("converter_lite") or ""
    highest = mindir.max_readable(version)
    return None if highest is None else MindIrLimit("MindSpore Lite %s" % version, highest)


def _stage(plan: ConvertPlan, work: str) -> None:
    """Mirror the bundle's inputs into ``work`` (symlinks) and write the generated files there."""
    for relative in plan.inputs:
        link = os.path.join(work, relative)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if plan.relayout is not None and relative == plan.relayout.directory:
            plan.relayout.write(os.path.join(plan.bundle, relative), link)
        else:
            os.symlink(os.path.join(plan.bundle, relative), link)
    os.makedirs(os.path.join(work, LOGS_DIR), exist_ok=True)
    for job in plan.jobs:
        for generated in job.files:
            path = os.path.join(work, generated.path)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(generated.text)


def _replace_file(source: str, destination: str) -> None:
    """Copy bytes and mode; an existing file is removed first (MindSpore writes its exports read-only)."""
    if os.path.lexists(destination):
        os.remove(destination)
    shutil.copy(source, destination)


class BundleTransaction:
    """Copies files into a bundle so that :meth:`rollback` can put back every byte and remove every addition.

    Backups live outside the bundle (the bundle's own file list must not see them).
    """

    PROTECTED = ("manifest.json", "manifest.sig")

    def __init__(self, root: str) -> None:
        self.root = root
        self.backup_dir = tempfile.mkdtemp(prefix="atlas-edge-bundle-backup-")
        self.backups: Dict[str, str] = {}
        self.before = self._tree()
        for name in self.PROTECTED:
            self._backup(name)

    def _tree(self) -> set:
        paths = set()
        for dirpath, dirs, names in os.walk(self.root):
            for name in dirs + names:
                paths.add(os.path.relpath(os.path.join(dirpath, name), self.root))
        return paths

    def _backup(self, relative: str) -> None:
        source = os.path.join(self.root, relative)
        if relative not in self.backups and os.path.isfile(source):
            saved = os.path.join(self.backup_dir, str(len(self.backups)))
            shutil.copy2(source, saved)  # bytes and mode, restored as they were
            self.backups[relative] = saved

    def put(self, source: str, relative: str) -> None:
        """Bytes only: the converter writes 0400 files (MindSpore Lite does), the bundle gets ordinary ones."""
        destination = os.path.join(self.root, relative)
        self._backup(relative)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        if os.path.lexists(destination):
            os.remove(destination)
        shutil.copyfile(source, destination)

    def rollback(self) -> None:
        """Remove what was added (deepest first), then restore every backed-up file."""
        for relative in sorted(self._tree() - self.before, key=lambda p: p.count(os.sep), reverse=True):
            path = os.path.join(self.root, relative)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.remove(path)
        for relative, saved in self.backups.items():
            _replace_file(saved, os.path.join(self.root, relative))
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.backup_dir, ignore_errors=True)


def _share_golden(golden: Optional[Dict[str, Any]], jobs: List[Job]) -> None:
    """A float32 conversion must reproduce its source: its golden cases expect the source's outputs (so
    ``bundle verify --run-golden`` and the box's start-up check hold the converted model to them)."""
    for job in jobs:
        if golden is None or job.artifact["precision"] != "float32":
            continue
        for case in golden.get("cases", []):
            expected = case.get("expected", {})
            if job.source in expected:
                expected[job.output] = expected[job.source]


def _commit(plan: ConvertPlan, work: str, toolchain: Dict[str, str]) -> List[Dict[str, Any]]:
    """Copy outputs, configs and logs into the bundle and rewrite the manifest; all or nothing."""
    from agent.bundle.manifest import MANIFEST
    from agent.bundle.verify import write_manifest

    with open(os.path.join(plan.bundle, MANIFEST), encoding="utf-8") as handle:
        manifest = json.load(handle)  # the raw dict: other entries are written back exactly as they were
    transaction = BundleTransaction(plan.bundle)
    try:
        for job in plan.jobs:
            for relative in [job.output, job.log] + [f.path for f in job.files]:
                transaction.put(os.path.join(work, relative), relative)
        artifacts = list(manifest["artifacts"])
        for job in plan.jobs:
            entry = dict(job.artifact, toolchain=dict(toolchain, **job.toolchain))
            index = next((i for i, a in enumerate(artifacts) if a.get("file") == job.output), None)
            if index is None:
                artifacts.append(entry)
            else:
                artifacts[index] = entry  # re-conversion of the same tier replaces its artifact
        manifest["artifacts"] = artifacts
        _share_golden(manifest.get("golden"), plan.jobs)
        written = write_manifest(plan.bundle, manifest)
    except BaseException:
        transaction.rollback()
        raise
    transaction.close()
    outputs = {job.output for job in plan.jobs}
    return [a for a in written["artifacts"] if a["file"] in outputs]


def execute(plan: ConvertPlan, env: Mapping[str, str], timeout_s: float,
            echo: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run every job of ``plan`` and add the outputs to the bundle; returns the new manifest entries.

    Raises ToolNotFound before anything runs, ToolFailed (log tail included) when a run fails, and
    ConvertError for what the bundle schema cannot hold; the bundle is unchanged in every failing case.
    """
    if plan.input_format and not bundle_accepts_input_color(plan.input_format):
        raise ConvertError(["--input-format %s: the bundle schema (agent/bundle/manifest.py Artifact.input_color) "
                            "does not accept %r yet, so the artifact could not be recorded; --dry-run prints "
                            "the commands" % (plan.input_format, plan.input_format)])
    located = toolrun.locate(plan.tool, env)
    limit = _mindir_limit(located)
    if limit is not None and plan.request is not None:
        shown = set(plan.warnings)
        plan = plan_conversion(plan.request, limit)  # a source the converter cannot read gives way (or fails)
        for warning in plan.warnings:
            if warning not in shown:
                echo("warning: " + warning)
    tool_env = toolrun.child_env(plan.tool, located.path, env)
    toolchain = _toolchain(plan, located, tool_env)
    if plan.soc_version and located.argv[-1] == toolrun.PYCONVERT and toolchain.get("cann") == \
            toolrun.UNKNOWN_VERSION:
        raise ConvertError(["device %s is an Ascend box: MindSpore Lite's converter builds its Ascend MindIR "
                            "with the CANN toolkit of the host it runs on (CANN >= 7.5), and none was found "
                            "($ASCEND_TOOLKIT_HOME, $ASCEND_HOME/latest, %s). Convert on a host with the box's "
                            "SoC and CANN, or use --dry-run for the commands" % (
                                plan.device_name, os.path.dirname(toolrun.DEFAULT_TOOLKIT_BIN))])
    echo("using %s (%s)" % (" ".join(located.argv), ", ".join("%s %s" % kv for kv in sorted(toolchain.items()))))
    with tempfile.TemporaryDirectory(prefix="atlas-edge-convert-") as work:
        _stage(plan, work)
        for job in plan.jobs:
            cmd = located.argv + job.cmd[1:]
            echo("tier %dx%d: %s" % (job.tier[0], job.tier[1], toolrun.join_command(cmd)))
            run = toolrun.run_tool(cmd, cwd=work, env=tool_env, timeout_s=timeout_s,
                                   log_path=os.path.join(work, job.log))
            renamed = TOOLS[plan.request.to].adopt_output(work, job.output)
            if renamed:
                echo("tier %dx%d: %s wrote %s; kept as %s" % (job.tier[0], job.tier[1], plan.tool.name, renamed,
                                                              job.output))
            toolrun.check_run(plan.tool, run, os.path.join(work, job.output), timeout_s)
        return _commit(plan, work, toolchain)
