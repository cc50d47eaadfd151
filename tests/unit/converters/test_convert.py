"""The run path of ``atlas-edge convert`` on a real (tiny) MindSpore-exported bundle, with the test stand-ins
of ``atc`` and ``converter_lite`` (tests/standins: they validate arguments with the documented grammar and
fake the output; they are not the real tools). Tests that need the real tools skip, naming the tool.

Every failing mode is checked to leave the bundle byte for byte as it was (the whole tree is hashed).
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from agent.bundle.verify import verify_bundle, write_manifest
from converters import cli, toolrun
from converters.convert import (
    DEFAULT_TIMEOUT_S,
    ConvertError,
    ConvertRequest,
    bundle_accepts_input_color,
    execute,
    plan_conversion,
)
from tests.support.bundle_support import manifest_of, tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STANDINS = os.path.join(REPO, "tests", "standins")
PYTHON_DIR = os.path.dirname(sys.executable)  # the stand-ins' `#!/usr/bin/env python3` must find a python3
TIERS = [(32, 32), (32, 48)]
CALIBRATION_COUNT = 4
STANDIN_TIMEOUT_S = 60.0  # generous: a stand-in call takes well under a second
SLEEP_TIMEOUT_S = 2.0  # the sleeping stand-in must be killed after this


@pytest.fixture(scope="module")
def exported_models(tmp_path_factory):
    """A tiny conv net exported by MindSpore to ONNX and MINDIR at each tier (once per module)."""
    ms = pytest.importorskip("mindspore", reason="needs MindSpore to export the test network")
    from mindspore import nn

    class Tiny(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, pad_mode="same", has_bias=True)
            self.fc = nn.Dense(4, 2)

        def construct(self, images):
            return self.fc(self.conv(images).mean(axis=(2, 3)))

    ms.set_seed(0)
    net = Tiny()
    folder = tmp_path_factory.mktemp("exported")
    for height, width in TIERS:
        dummy = ms.Tensor(np.zeros((1, 3, height, width), np.float32))
        for fmt, suffix in (("ONNX", ".onnx"), ("MINDIR", ".mindir")):
            ms.export(net, dummy, file_name=str(folder / ("tiny_%dx%d" % (height, width))), file_format=fmt)
            assert (folder / ("tiny_%dx%d%s" % (height, width, suffix))).stat().st_size > 0
    return folder


@pytest.fixture
def bundle(tmp_path, exported_models):
    root = tmp_path / "bundle"
    (root / "calibration").mkdir(parents=True)
    artifacts = []
    for height, width in TIERS:
        for fmt in ("onnx", "mindir"):
            name = "tiny_%dx%d.%s" % (height, width, fmt)
            shutil.copy(exported_models / name, root / name)
            artifacts.append({"file": name, "format": fmt, "target": "cpu", "tier": [height, width],
                              "sha256": "", "size": 0, "role": "convert" if fmt == "onnx" else "serve"})
    rng = np.random.default_rng(0)
    for i in range(CALIBRATION_COUNT):
        rng.random((1, 32, 32, 3), dtype=np.float32).tofile(str(root / "calibration" / ("%03d.bin" % i)))
    write_manifest(str(root), {
        "schema": 1, "name": "tiny", "version": "0.1.0", "created": "2026-11-29T00:00:00Z",
        "task": "classify", "labels": ["a", "b"],
        "input": {"name": "images", "tiers": [list(t) for t in TIERS]},
        "preprocessing": {"color": "rgb", "mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375]},
        "artifacts": artifacts,
        "calibration": {"dir": "calibration", "layout": "NHWC", "dtype": "float32", "tier": [32, 32],
                        "count": CALIBRATION_COUNT},
    })
    return str(root)


def env_with(tmp_path, *path_dirs, **variables):
    """A clean environment: PATH of ``path_dirs`` plus python3's folder; stand-in calls recorded to a file."""
    env = {"PATH": os.pathsep.join(list(path_dirs) + [PYTHON_DIR]),
           "ATLAS_EDGE_STANDIN_RECORD": str(tmp_path / "calls.jsonl")}
    env.update(variables)
    return env


def calls(tmp_path):
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def args_for(bundle, device, to, **options):
    namespace = argparse.Namespace(bundle=bundle, device=device, to=to, tiers=None, ptq=False, dry_run=False,
                                   timeout=STANDIN_TIMEOUT_S, input_format=None)
    for key, value in options.items():
        setattr(namespace, key, value)
    return namespace


# --- success paths ------------------------------------------------------------------------------------------

def test_atc_found_on_path_converts_every_tier_into_the_bundle(bundle, tmp_path, capsys):
    before = manifest_of(bundle)
    before_tree = tree(bundle)
    plan = plan_conversion(ConvertRequest(bundle=bundle, device="atlas-200dk", to="om"))

    assert cli.run(args_for(bundle, "atlas-200dk", "om"), env=env_with(tmp_path, STANDINS)) == cli.EXIT_OK

    after = manifest_of(bundle)
    assert after["artifacts"][:len(before["artifacts"])] == before["artifacts"]  # others untouched, in order
    added = after["artifacts"][len(before["artifacts"]):]
    assert [a["file"] for a in added] == ["tiny_32x32_Ascend310.om", "tiny_32x48_Ascend310.om"]
    for art, tier in zip(added, TIERS):
        with open(os.path.join(bundle, art["file"]), "rb") as handle:
            data = handle.read()
        assert art["sha256"] == hashlib.sha256(data).hexdigest() and art["size"] == len(data) > 0
        assert art["tier"] == list(tier) and art["soc_version"] == "Ascend310" and art["target"] == "ascend"
        assert (art["input_dtype"], art["input_layout"], art["normalize_on"], art["input_color"]) == (
            "uint8", "NHWC", "aipp", "bgr")
        assert art["precision"] == "float16" and art["role"] == "serve"
        # no version.cfg beside tests/standins; the 200 DK's CPU recorded, as ATC was told to build for it
        assert art["toolchain"] == {"converter": "atc", "cann": "unknown", "arch": "aarch64"}
        assert art["config_files"] == ["convert/aipp_%dx%d_bgr.cfg" % tier]
    after_tree = tree(bundle)
    for path, digest in before_tree.items():  # every earlier file is byte for byte the same
        if path != "manifest.json":
            assert after_tree[path] == digest, path
    for job in plan.jobs:
        with open(os.path.join(bundle, job.files[0].path), encoding="utf-8") as handle:
            assert handle.read() == job.files[0].text
        with open(os.path.join(bundle, "logs", job.output + ".log"), encoding="utf-8") as handle:
            log = handle.read()
        assert log.startswith("$ ") and "--soc_version=Ascend310" in log.splitlines()[0]
        assert "ATC run success" in log
    assert set(after_tree) - set(before_tree) == {
        "convert", "logs", "convert/aipp_32x32_bgr.cfg", "convert/aipp_32x48_bgr.cfg",
        "logs/tiny_32x32_Ascend310.om.log", "logs/tiny_32x48_Ascend310.om.log",
        "tiny_32x32_Ascend310.om", "tiny_32x48_Ascend310.om"}
    verify_bundle(bundle)  # every file hashed and listed
    recorded = calls(tmp_path)
    assert len(recorded) == 2 and all(c["tool"] == "atc" for c in recorded)
    assert all(not c["cwd"].startswith(bundle) for c in recorded)  # ran in a scratch directory
    out = capsys.readouterr().out
    assert "added tiny_32x32_Ascend310.om" in out and "added tiny_32x48_Ascend310.om" in out


def test_atc_found_through_ascend_toolkit_home_records_the_cann_version(bundle, tmp_path):
    latest = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    (latest / "bin").mkdir(parents=True)
    os.symlink(os.path.join(STANDINS, "atc"), str(latest / "bin" / "atc"))
    (latest / "version.cfg").write_text("# version: 1.0\nruntime_running_version=[7.6.0.1.220:8.0.0]\n"
                                        "compiler_running_version=[7.6.0.1.220:8.0.0]\n")
    env = env_with(tmp_path, ASCEND_TOOLKIT_HOME=str(latest))  # PATH has no atc
    status = cli.run(args_for(bundle, "atlas-200i-dk-a2", "om", tiers=[(32, 48)]), env=env)
    assert status == cli.EXIT_OK
    (added,) = [a for a in manifest_of(bundle)["artifacts"] if a["format"] == "om"]
    assert added["file"] == "tiny_32x48_Ascend310B4.om" and added["soc_version"] == "Ascend310B4"
    assert added["toolchain"] == {"converter": "atc", "cann": "8.0.0", "arch": "aarch64"}
    (call,) = calls(tmp_path)
    assert "--input_shape=images:1,3,32,48" in call["args"]
    verify_bundle(bundle)


def test_path_is_searched_before_the_toolkit_variables(tmp_path):
    on_path, toolkit = tmp_path / "on-path", tmp_path / "toolkit"
    (toolkit / "bin").mkdir(parents=True)
    on_path.mkdir()
    for folder in (on_path, toolkit / "bin"):
        os.symlink(os.path.join(STANDINS, "atc"), str(folder / "atc"))
    (tmp_path / "not-executable").mkdir()
    (tmp_path / "not-executable" / "atc").write_text("#!/bin/sh\n")  # mode 644: skipped
    env = {"PATH": os.pathsep.join([str(tmp_path / "not-executable"), str(on_path)]),
           "ASCEND_TOOLKIT_HOME": str(toolkit)}
    assert toolrun.find_tool(toolrun.ATC, env) == str(on_path / "atc")
    env["PATH"] = str(tmp_path / "not-executable")
    assert toolrun.find_tool(toolrun.ATC, env) == str(toolkit / "bin" / "atc")


def test_cann_version_is_read_from_the_toolkit_or_one_level_up(tmp_path):
    new = tmp_path / "new" / "latest"
    (new / "bin").mkdir(parents=True)
    (new / "version.cfg").write_text("toolkit_running_version=[7.5.0.1.129:8.0.RC3]\n")
    assert toolrun.cann_version(str(new / "bin" / "atc")) == "8.0.RC3"
    old = tmp_path / "old" / "latest"
    (old / "atc" / "bin").mkdir(parents=True)
    (old / "version.cfg").write_text("Version=5.1.RC2\n")
    assert toolrun.cann_version(str(old / "atc" / "bin" / "atc")) == "5.1.RC2"
    assert toolrun.cann_version(str(tmp_path / "none" / "bin" / "atc")) == "unknown"


def test_converter_lite_from_mslite_home_gets_its_libraries_for_the_child_only(bundle, tmp_path):
    home = tmp_path / "mindspore-lite-2.5.0-linux-x64"
    tool_dir = home / "tools" / "converter" / "converter"
    tool_dir.mkdir(parents=True)
    (home / "tools" / "converter" / "lib").mkdir()
    os.symlink(os.path.join(STANDINS, "converter_lite"), str(tool_dir / "converter_lite"))
    env = env_with(tmp_path, MSLITE_HOME=str(home))
    parent_library_path = os.environ.get("LD_LIBRARY_PATH")

    assert cli.run(args_for(bundle, "atlas-200i-dk-a2", "ms"), env=env) == cli.EXIT_OK

    assert os.environ.get("LD_LIBRARY_PATH") == parent_library_path
    recorded = calls(tmp_path)
    assert len(recorded) == 2
    assert all(c["ld_library_path"].split(os.pathsep)[0] == str(home / "tools" / "converter" / "lib")
               for c in recorded)
    added = [a for a in manifest_of(bundle)["artifacts"] if a["target"] == "ascend"]
    assert [a["file"] for a in added] == ["tiny_32x32_Ascend310B4.mindir", "tiny_32x48_Ascend310B4.mindir"]
    for art in added:
        assert art["format"] == "mindir" and art["normalize_on"] == "aipp" and art["precision"] == "float16"
        # the version of the tarball folder; the stand-in's own --version output is never asked for
        assert art["toolchain"] == {"converter": "converter_lite", "converter_lite": "2.5.0", "cann": "unknown"}
        assert art["config_files"] == ["convert/aipp_%dx%d_bgr.cfg" % tuple(art["tier"]),
                                       "convert/converter_tiny_%dx%d_Ascend310B4.ini" % tuple(art["tier"])]
    verify_bundle(bundle)


def test_ptq_on_cpu_uses_the_calibration_set(bundle, tmp_path):
    status = cli.run(args_for(bundle, "cpu-dev", "ms", ptq=True, tiers=[(32, 32)]),
                     env=env_with(tmp_path, STANDINS))
    assert status == cli.EXIT_OK
    (call,) = calls(tmp_path)
    assert "--configFile=convert/converter_tiny_32x32_cpu_int8.ini" in call["args"]
    (added,) = [a for a in manifest_of(bundle)["artifacts"] if a["format"] == "ms"]
    assert added["file"] == "tiny_32x32_cpu_int8.ms" and added["precision"] == "int8"
    assert (added["input_dtype"], added["normalize_on"], added["input_color"]) == ("float32", "host", "rgb")
    ini = os.path.join(bundle, "convert", "converter_tiny_32x32_cpu_int8.ini")
    with open(ini, encoding="utf-8") as handle:
        assert "calibrate_path=images:calibration\ncalibrate_size=4\n" in handle.read()
    verify_bundle(bundle)


def test_converting_again_replaces_the_same_entry(bundle, tmp_path):
    env = env_with(tmp_path, STANDINS)
    assert cli.run(args_for(bundle, "atlas-300i-pro", "om"), env=env) == cli.EXIT_OK
    first = manifest_of(bundle)["artifacts"]
    assert cli.run(args_for(bundle, "atlas-300i-pro", "om"), env=env) == cli.EXIT_OK
    second = manifest_of(bundle)["artifacts"]
    assert [a["file"] for a in second] == [a["file"] for a in first]
    verify_bundle(bundle)


def test_yuv420sp_run_is_recorded_or_refused_per_bundle_schema(bundle, tmp_path, capsys):
    before = tree(bundle)
    status = cli.run(args_for(bundle, "atlas-200dk", "om", input_format="yuv420sp"),
                     env=env_with(tmp_path, STANDINS))
    if bundle_accepts_input_color("yuv420sp"):
        assert status == cli.EXIT_OK
        added = [a for a in manifest_of(bundle)["artifacts"] if a["format"] == "om"]
        assert {a["input_color"] for a in added} == {"yuv420sp"}
    else:  # agent/bundle/manifest.py's Artifact.input_color is rgb|bgr: refuse before running, bundle unchanged
        assert status == cli.EXIT_BAD_INPUT
        assert "input_color" in capsys.readouterr().err
        assert tree(bundle) == before and calls(tmp_path) == []


# --- dry run, printed commands ------------------------------------------------------------------------------

def test_dry_run_prints_every_file_and_command_and_changes_nothing(bundle, tmp_path, capsys):
    before = tree(bundle)
    env = env_with(tmp_path, STANDINS)
    status = cli.run(args_for(bundle, "atlas-200i-dk-a2", "ms", dry_run=True), env=env)
    assert status == cli.EXIT_OK
    out = capsys.readouterr().out
    plan = plan_conversion(ConvertRequest(bundle=bundle, device="atlas-200i-dk-a2", to="ms"))
    for job in plan.jobs:
        assert " ".join(job.cmd) in out  # shlex.join of these plain arguments is the space-joined list
        for generated in job.files:
            assert "# --- %s\n%s" % (generated.path, generated.text) in out
    assert tree(bundle) == before and calls(tmp_path) == []


def test_printed_commands_run_by_hand_in_the_bundle_directory(bundle, tmp_path):
    """What --dry-run shows works as printed: saved files and relative paths resolve from the bundle root."""
    copy = str(tmp_path / "by-hand")
    shutil.copytree(bundle, copy)
    plan = plan_conversion(ConvertRequest(bundle=copy, device="atlas-200i-dk-a2", to="ms", ptq=True,
                                          tiers=[(32, 32)]))
    env = env_with(tmp_path, STANDINS)
    for job in plan.jobs:
        for generated in job.files:
            os.makedirs(os.path.join(copy, os.path.dirname(generated.path)), exist_ok=True)
            with open(os.path.join(copy, generated.path), "w", encoding="utf-8") as handle:
                handle.write(generated.text)
        done = subprocess.run(job.cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert toolrun.CONVERTER_LITE.success_line in done.stdout
        assert os.path.getsize(os.path.join(copy, job.output)) > 0


# --- failures leave the bundle byte for byte unchanged ------------------------------------------------------

@pytest.mark.parametrize("mode, reason", [
    ("fail", "exited with status 1"),
    ("no-success-line", "exited 0 but never printed 'ATC run success'"),
    ("no-output", "printed 'ATC run success' but wrote no tiny_32x32_Ascend310.om"),
    ("sleep", "did not finish within 2 s and was killed"),
])
def test_failing_tool_leaves_the_bundle_unchanged(bundle, tmp_path, capsys, mode, reason):
    before = tree(bundle)
    env = env_with(tmp_path, STANDINS, ATLAS_EDGE_STANDIN_MODE=mode)
    status = cli.run(args_for(bundle, "atlas-200dk", "om", timeout=SLEEP_TIMEOUT_S), env=env)
    assert status == cli.EXIT_TOOL_FAILED
    err = capsys.readouterr().err
    assert "atc " + reason in err and "the bundle is unchanged" in err
    assert "--- last lines of the atc log ---" in err and "stand-in" in err
    if mode == "fail":
        assert "E19999" in err
    assert tree(bundle) == before
    (call,) = calls(tmp_path)  # the first tier failed; the second never ran
    if mode == "sleep":
        with pytest.raises(ProcessLookupError):
            os.kill(call["pid"], 0)  # killed, and reaped


def test_failure_of_a_later_tier_undoes_the_earlier_ones(bundle, tmp_path):
    before = tree(bundle)
    env = env_with(tmp_path, STANDINS, ATLAS_EDGE_STANDIN_FAIL_MATCH="images:1,3,32,48")
    assert cli.run(args_for(bundle, "atlas-200dk", "om"), env=env) == cli.EXIT_TOOL_FAILED
    assert len(calls(tmp_path)) == 2
    assert tree(bundle) == before


def test_failure_while_writing_the_manifest_restores_every_byte(bundle, tmp_path, monkeypatch):
    env = env_with(tmp_path, STANDINS)
    assert cli.run(args_for(bundle, "atlas-200dk", "om", tiers=[(32, 32)]), env=env) == cli.EXIT_OK
    before = tree(bundle)  # now holds a converted .om, its AIPP file and log: these get overwritten below

    def broken_write_manifest(root, manifest):
        with open(os.path.join(root, "manifest.json"), "w", encoding="utf-8") as handle:
            handle.write("{half a manifest")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("agent.bundle.verify.write_manifest", broken_write_manifest)
    plan = plan_conversion(ConvertRequest(bundle=bundle, device="atlas-200dk", to="om"))
    with pytest.raises(OSError):
        execute(plan, dict(env, ATLAS_EDGE_STANDIN_RECORD=str(tmp_path / "second.jsonl")), STANDIN_TIMEOUT_S,
                echo=lambda line: None)
    assert tree(bundle) == before


def test_missing_atc_names_the_tool_every_place_and_the_package(bundle, tmp_path, capsys):
    if os.path.exists(os.path.join(toolrun.DEFAULT_TOOLKIT_BIN, "atc")):
        pytest.skip("this host has CANN atc at %s" % toolrun.DEFAULT_TOOLKIT_BIN)
    before = tree(bundle)
    assert cli.run(args_for(bundle, "atlas-200dk", "om"), env=env_with(tmp_path)) == cli.EXIT_TOOL_MISSING
    err = capsys.readouterr().err
    for expected in ("atc not found", "PATH entry %s" % PYTHON_DIR,
                     "$ASCEND_TOOLKIT_HOME/bin (ASCEND_TOOLKIT_HOME is not set)",
                     "$ASCEND_HOME/latest/bin (ASCEND_HOME is not set)", toolrun.DEFAULT_TOOLKIT_BIN,
                     "CANN toolkit", "the bundle is unchanged", "atc --model=tiny_32x32.onnx", "aipp_op {"):
        assert expected.lower() in err.lower(), expected
    assert tree(bundle) == before


def test_missing_converter_lite_names_the_tarball(bundle, tmp_path, capsys):
    before = tree(bundle)
    no_python = str(tmp_path / "nowhere" / "python")
    env = env_with(tmp_path, MSLITE_HOME=str(tmp_path / "nowhere"), ATLAS_EDGE_MSLITE_PYTHON=no_python)
    assert cli.run(args_for(bundle, "cpu-dev", "ms"), env=env) == cli.EXIT_TOOL_MISSING
    err = capsys.readouterr().err
    looked_at = tmp_path / "nowhere" / "tools" / "converter" / "converter"
    for expected in ("converter_lite not found", "$MSLITE_HOME/tools/converter/converter (%s)" % looked_at,
                     "a Python with mindspore_lite: $ATLAS_EDGE_MSLITE_PYTHON (%s): no such executable" % no_python,
                     "MindSpore Lite release tarball", "converter_lite --fmk=MINDIR"):
        assert expected in err, expected
    assert tree(bundle) == before


def test_bad_input_exits_2_naming_the_problem_and_changes_nothing(bundle, tmp_path, capsys):
    before = tree(bundle)
    env = env_with(tmp_path, STANDINS)
    assert cli.run(args_for(bundle, "atlas-9000", "om"), env=env) == cli.EXIT_BAD_INPUT
    assert "atlas-9000" in capsys.readouterr().err
    assert cli.run(args_for(bundle, "cpu-dev", "om"), env=env) == cli.EXIT_BAD_INPUT
    assert "--to om" in capsys.readouterr().err
    assert cli.run(args_for(str(tmp_path / "nope"), "cpu-dev", "ms"), env=env) == cli.EXIT_BAD_INPUT
    assert "not a directory" in capsys.readouterr().err
    assert tree(bundle) == before and calls(tmp_path) == []


def test_plan_refuses_a_bundle_without_a_source_for_the_tier(bundle):
    manifest = manifest_of(bundle)
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["file"] != "tiny_32x48.onnx"]
    os.remove(os.path.join(bundle, "tiny_32x48.onnx"))
    write_manifest(bundle, manifest)
    with pytest.raises(ConvertError) as info:
        plan_conversion(ConvertRequest(bundle=bundle, device="atlas-200dk", to="om"))
    assert "no float32 onnx artifact for tier 32x48" in str(info.value)


# --- the command line ---------------------------------------------------------------------------------------

def test_help_explains_targets_aipp_and_exit_status():
    done = subprocess.run([sys.executable, "-m", "converters.cli", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0
    for expected in ("--to {om,ms}", "--dry-run", "--tiers", "--ptq", "--input-format", "AIPP", "ATC",
                     "converter_lite", "$ASCEND_TOOLKIT_HOME/bin", "$MSLITE_HOME", "exit status"):
        assert expected in done.stdout, expected


@pytest.mark.parametrize("text, tiers", [
    ("256,320", [(256, 256), (320, 320)]),
    ("256x256,192x320", [(256, 256), (192, 320)]),
    ("640, 384X640", [(640, 640), (384, 640)]),
])
def test_tiers_option(text, tiers):
    assert cli.parse_tiers(text) == tiers


@pytest.mark.parametrize("text", ["", "256x", "0", "a,b", "256x256x3"])
def test_bad_tiers_option(text):
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_tiers(text)


# --- the real tools, where they exist -----------------------------------------------------------------------

def _real_tool(name):
    path = shutil.which(name)
    return path if path and not os.path.realpath(path).startswith(STANDINS) else None


@pytest.mark.skipif(_real_tool("atc") is None, reason="CANN atc is not on PATH (needs the CANN toolkit)")
def test_real_atc_conversion(bundle):
    device = os.environ.get("ATLAS_EDGE_CONVERT_DEVICE", "atlas-200i-dk-a2")  # the host's SoC
    args = args_for(bundle, device, "om", tiers=[(32, 32)], timeout=DEFAULT_TIMEOUT_S)
    assert cli.run(args) == cli.EXIT_OK
    verify_bundle(bundle)


@pytest.mark.skipif(_real_tool("converter_lite") is None,
                    reason="MindSpore Lite converter_lite is not on PATH (needs the MindSpore Lite tarball)")
def test_real_converter_lite_conversion_for_cpu(bundle):
    args = args_for(bundle, "cpu-dev", "ms", tiers=[(32, 32)], timeout=DEFAULT_TIMEOUT_S)
    assert cli.run(args) == cli.EXIT_OK
    verify_bundle(bundle)


DEMO_BUNDLE = os.path.join(REPO, "examples", "demo-bundle")


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                    reason="examples/demo-bundle is not built (make demo-bundle)")
@pytest.mark.parametrize("device, to", [("atlas-200dk", "om"), ("atlas-200i-dk-a2", "ms"), ("cpu-dev", "ms")])
def test_demo_bundle_plans_for_each_box_kind(device, to):
    before = tree(DEMO_BUNDLE)
    plan = plan_conversion(ConvertRequest(bundle=DEMO_BUNDLE, device=device, to=to))
    assert plan.jobs and all(job.output not in before for job in plan.jobs)
    assert tree(DEMO_BUNDLE) == before


# --- issue 12 on the run path ---------------------------------------------------------------------------

def test_atc_output_named_for_the_host_os_and_arch_is_kept_under_the_planned_name(bundle, tmp_path, capsys):
    """atlas-300i-pro names no arch, so no --host_env_*: the stand-in then writes <stem>_linux_<arch>.om."""
    assert cli.run(args_for(bundle, "atlas-300i-pro", "om", tiers=[(32, 32)]), env=env_with(tmp_path, STANDINS)) \
        == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "atc wrote tiny_32x32_Ascend310P3_linux_" in out and "kept as tiny_32x32_Ascend310P3.om" in out
    (added,) = [a for a in manifest_of(bundle)["artifacts"] if a["format"] == "om"]
    assert added["file"] == "tiny_32x32_Ascend310P3.om" and "arch" not in added["toolchain"]
    assert not [n for n in os.listdir(bundle) if n.endswith(".om") and n != added["file"]]
    verify_bundle(bundle)


def test_converter_lite_version_comes_from_version_txt_never_from_a_timestamp(tmp_path):
    home = tmp_path / "lite" / "tools" / "converter" / "converter"
    home.mkdir(parents=True)
    tool = home / "converter_lite"
    tool.write_text("#!/bin/sh\necho 2026-11-30-23:55:37.869 1.2.3\n")  # would be misread if it were asked
    tool.chmod(0o755)
    assert toolrun.converter_version(str(tool)) == "unknown"
    (tmp_path / "lite" / "version.txt").write_text("2026-11-30-23:55:37\n")
    assert toolrun.converter_version(str(tool)) == "unknown"  # a timestamp is not a version
    (tmp_path / "lite" / "version.txt").write_text("2.3.1\n")
    assert toolrun.converter_version(str(tool)) == "2.3.1"


def test_calibration_bins_are_transposed_into_the_models_layout_in_staging_only(bundle, tmp_path):
    from converters.convert import Relayout

    source = os.path.join(bundle, "calibration")
    staged = str(tmp_path / "staged")
    Relayout("calibration", "NHWC", "NCHW", (1, 32, 32, 3), "float32").write(source, staged)
    for name in os.listdir(source):
        nhwc = np.fromfile(os.path.join(source, name), np.float32).reshape(1, 32, 32, 3)
        nchw = np.fromfile(os.path.join(staged, name), np.float32).reshape(1, 3, 32, 32)
        np.testing.assert_array_equal(nchw, nhwc.transpose(0, 3, 1, 2))
    with pytest.raises(ConvertError, match=r"calibration/000.bin: 3072 float32 values, expected 1x64x64x3"):
        Relayout("calibration", "NHWC", "NCHW", (1, 64, 64, 3), "float32").write(source, str(tmp_path / "x"))
    plan = plan_conversion(ConvertRequest(bundle=bundle, device="cpu-dev", to="ms", ptq=True, tiers=[(32, 32)]))
    assert plan.relayout is not None and any("staging copy is transposed" in w for w in plan.warnings)


def test_ptq_for_a_cpu_target_says_lite_int8_is_slower_and_points_to_onnxruntime(bundle):
    """Lite 2.0's int8 runs on generic C kernels on x86 (21-27x slower than float, issue 28): --ptq for a CPU
    target says so and names the int8 that pays there; an Ascend target, where the NPU runs int8, is not told."""
    from converters.convert import LITE_CPU_INT8_WARNING

    cpu = plan_conversion(ConvertRequest(bundle=bundle, device="cpu-dev", to="ms", ptq=True, tiers=[(32, 32)]))
    assert LITE_CPU_INT8_WARNING in cpu.warnings
    assert "slower than the float" in LITE_CPU_INT8_WARNING and "onnxruntime" in LITE_CPU_INT8_WARNING
    assert "# warning: " + LITE_CPU_INT8_WARNING in cpu.render()  # the line --dry-run and a real run print
    ascend = plan_conversion(ConvertRequest(bundle=bundle, device="atlas-200i-dk-a2", to="ms", ptq=True,
                                            tiers=[(32, 32)]))
    assert LITE_CPU_INT8_WARNING not in ascend.warnings
    float_cpu = plan_conversion(ConvertRequest(bundle=bundle, device="cpu-dev", to="ms", tiers=[(32, 32)]))
    assert LITE_CPU_INT8_WARNING not in float_cpu.warnings
