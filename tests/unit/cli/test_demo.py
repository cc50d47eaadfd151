"""`atlas-edge demo` (what `make demo` runs): it finishes after --frames and prints results it read back."""

import importlib.util
import os
import re
import signal
import subprocess
import sys

import pytest

from agent.cli.demo import DEMO_BUNDLE

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")


def run_demo(*args, tmpdir=None):
    env = dict(os.environ, TMPDIR=str(tmpdir)) if tmpdir is not None else None
    return subprocess.run([sys.executable, "-m", "agent", "demo", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def work_dirs(tmpdir):
    return sorted(p.name for p in tmpdir.iterdir() if p.name.startswith("atlas-edge-demo-"))


def check_output(result, frames):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [ln for ln in result.stdout.splitlines() if re.match(r"#\d+ ", ln)]
    assert len(lines) == frames
    assert any("1920x1080" in ln and " det: " in ln for ln in lines)
    summary = re.search(r"(\d+) results published, (\d+) received over MQTT", result.stdout)
    assert summary and summary.group(1) == summary.group(2) == str(frames)
    assert re.search(r"infer\s+p50\s+[\d.]+ ms", result.stdout)


def test_demo_with_embedded_broker_finishes_after_frames():
    result = run_demo("--frames", "6")
    check_output(result, 6)
    assert "embedded broker: mosquitto on 127.0.0.1:" in result.stdout
    if importlib.util.find_spec("onnxruntime") is not None:  # cpu-dev's first choice, in both lanes: qat's int8
        assert re.search(r"served on onnxruntime at precision int8", result.stdout), result.stdout[-2000:]


def test_demo_against_an_external_broker_with_the_opencv_backend(mosquitto):
    result = run_demo("--frames", "4", "--broker", mosquitto.url, "--backend", "opencv", "--device-id", "demo-x")
    check_output(result, 4)
    assert "served on opencv at precision float32" in result.stdout  # auto on cv2.dnn: float
    assert "embedded broker" not in result.stdout


def test_demo_rejects_a_bad_broker_url():
    result = run_demo("--frames", "1", "--broker", "http://nope")
    assert result.returncode != 0 and "--broker must look like mqtt://HOST:PORT" in result.stderr


def test_demo_removes_its_work_directory_unless_asked_to_keep_it(tmp_path, mosquitto):
    result = run_demo("--frames", "2", "--broker", mosquitto.url, "--backend", "opencv", tmpdir=tmp_path)
    check_output(result, 2)
    assert work_dirs(tmp_path) == []
    kept = run_demo("--frames", "2", "--broker", mosquitto.url, "--backend", "opencv", "--keep", tmpdir=tmp_path)
    check_output(kept, 2)
    (name,) = work_dirs(tmp_path)
    assert "kept the work directory: %s" % (tmp_path / name) in kept.stdout
    assert (tmp_path / name / "frames" / "ground_truth.json").exists()


def test_demo_removes_its_work_directory_after_an_error(tmp_path, mosquitto):
    result = run_demo("--frames", "2", "--broker", mosquitto.url, "--backend", "opencv",
                      "--bundle", str(tmp_path / "no-such-bundle"), tmpdir=tmp_path)
    assert result.returncode != 0 and "no-such-bundle" in result.stderr
    assert work_dirs(tmp_path) == []


def test_demo_removes_its_work_directory_on_ctrl_c(tmp_path, mosquitto):
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "agent", "demo", "--broker", mosquitto.url, "--backend",
                                "opencv"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output = []
        for line in process.stdout:  # serving, until the first result is read back over MQTT
            output.append(line)
            if re.match(r"#1 ", line):
                break
        assert work_dirs(tmp_path), "".join(output)
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, "".join(output) + rest
    assert work_dirs(tmp_path) == []
