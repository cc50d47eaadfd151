"""`atlas-edge demo` (what `make demo` runs): it finishes after --frames and prints results it read back."""

import os
import re
import subprocess
import sys

import pytest

from agent.cli.demo import DEMO_BUNDLE

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_BUNDLE, "manifest.json")),
                                reason="examples/demo-bundle is missing (make demo-bundle)")


def run_demo(*args):
    return subprocess.run([sys.executable, "-m", "agent", "demo", *args], capture_output=True, text=True,
                          timeout=300)


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


def test_demo_against_an_external_broker_with_the_opencv_backend(mosquitto):
    result = run_demo("--frames", "4", "--broker", mosquitto.url, "--backend", "opencv", "--device-id", "demo-x")
    check_output(result, 4)
    assert "embedded broker" not in result.stdout


def test_demo_rejects_a_bad_broker_url():
    result = run_demo("--frames", "1", "--broker", "http://nope")
    assert result.returncode != 0 and "--broker must look like mqtt://HOST:PORT" in result.stderr
