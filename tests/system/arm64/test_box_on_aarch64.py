"""The box on its own CPU: installed offline from the aarch64 wheelhouse, the real daemon serving the demo bundle
(int8 and float) and the YOLOv8-shaped stand-in's int8 bundle on onnxruntime under two emulated Arm cores, each
result compared with the x86 daemon's on the same frames; and the box's own tests on aarch64. ``make test-arm64``.
"""

import re

import pytest

from tests.support.golden_damage import DAMAGES, INTACT
from tests.system.arm64 import compare as comparing
from tests.system.arm64.compare import record
from tests.system.arm64.conftest import CONF, CPUS, DAMAGE_JUDGED, DAMAGED, QEMU_X86, RUNS, VENV


def test_the_box_installs_from_its_wheelhouse_with_no_network(lane):
    output = lane.install_output
    assert "no network:" in output and "NETWORK REACHABLE" not in output, output[-2000:]
    assert "atlas-edge installed in %s (offline" % VENV in output, output[-3000:]
    installed = dict(line.split("==", 1) for line in output.splitlines() if re.match(r"^[A-Za-z0-9_.-]+==", line))
    assert installed.get("onnxruntime") == "1.19.2" and "atlas-edge" in installed, installed


@pytest.mark.parametrize("name,precision", [(n, p) for n, _b, p in RUNS], ids=["-".join((n, p)) for n, _b, p in RUNS])
@pytest.mark.parametrize("cpu", CPUS)
def test_the_daemon_on_arm_detects_what_it_detects_on_x86(lane, cpu, name, precision):
    x86 = lane.x86[(name, precision)]
    arm = lane.arm[(cpu, name, precision)]
    features = " ".join(arm["cpu"].get("features", [])) + " -> int8 kernels: %s" % arm["cpu"].get("int8_kernels")
    print("%s %s %s: onnxruntime %s on %s" % (cpu, name, precision, arm.get("onnxruntime"), features))
    assert x86["served"], "x86 did not serve %s %s: %s" % (name, precision, x86["output_tail"][-3000:])
    if not arm["served"]:
        golden = [line.strip() for line in arm.get("golden", []) if "golden:" in line or "golden set" in line]
        stopped = [line.split("agent.daemon: ", 1)[1] for line in arm["output_tail"].splitlines()
                   if "agent.daemon: stopping:" in line]
        why = "; ".join(stopped) or "; ".join(golden) or "exit %s" % arm["exit"]
        record(cpu, name, precision, "NOT SERVED (%s)" % why, features)
        pytest.fail("%s %s not served on %s (exit %s: %s); its golden self-test: %s\n%s" % (
            name, precision, cpu, arm["exit"], "; ".join(stopped) or "-", "; ".join(golden) or "-",
            arm["output_tail"][-2500:]))
    report = comparing.compare(x86["results"], arm["results"], CONF)
    frames, detections = comparing.counts(arm["results"])
    line = "%d frames, %d detections (x86 %d); %s; %.0f s" % (frames, detections, comparing.counts(x86["results"])[1],
                                                             comparing.summary(report), arm["seconds"])
    record(cpu, name, precision, ("DIFFERS: " if report["problems"] else "") + line, features)
    print(line)
    for note in report["marginal_notes"]:
        print("  marginal: %s" % note)
    assert report["confident"] > 0, "no confident detection to compare: %s" % line
    assert report["problems"] == [], "\n".join(report["problems"][:20])


@pytest.mark.parametrize("cpu,name", [(cpu, name) for name, _b in DAMAGED for cpu in DAMAGE_JUDGED[name]])
def test_a_wrong_int8_model_is_refused_on_both_architectures(lane, cpu, name):
    """The golden self-test that lets Arm's int8 through still refuses an int8 model with its activation scales
    off or its weights damaged (tests/support/golden_damage.py), on x86 and on the emulated Arm CPUs of
    DAMAGE_JUDGED; the intact one passes on all of them (on Arm in the daemon that served it on that CPU model:
    a daemon whose golden self-test fails serves nothing)."""
    exit_code, report = lane.damage[(cpu, name)]
    print(report)
    verdicts = dict(re.findall(r"^(\S+)\s+(passed|refused)\s", report, re.M))
    expected = dict.fromkeys(DAMAGES, "refused")
    if cpu in CPUS:
        served = lane.arm[(cpu, name, "int8")]
        passed = [line.strip() for line in served["golden"] if "golden set:" in line]
        assert served["served"] and passed, "the intact %s int8 bundle did not serve on %s: %s" % (
            name, cpu, served["output_tail"][-2500:])
        print("%-16s passed in the daemon that served it: %s" % (INTACT, passed[-1]))
    else:
        expected[INTACT] = "passed"
    assert verdicts == expected, report[-3000:]
    assert exit_code == 0 and "WRONG" not in report, report[-3000:]
    if cpu in CPUS:
        record(cpu, name, "int8 damaged", "intact passed (serving), %d of %d damaged refused" % (
            len(DAMAGES), len(DAMAGES)))


@pytest.mark.parametrize("bundle,exact", [("demo-bundle", False), ("standin-bundle", True)])
def test_an_x86_without_vnni_computes_the_int8_golden_outputs(lane, bundle, exact):
    """Under qemu-x86_64's Haswell (AVX2, no VNNI: onnxruntime's u8s8 kernels add two products in 16 bits) the
    int8 artifacts give the golden outputs this machine wrote: ``bundle create --int8``'s 7-bit weights cannot
    saturate that sum, so the stand-in's are the same integers (up to the float decode after them); the demo's
    QAT weights keep 8 bits and must pass the golden self-test's quantized rule."""
    if QEMU_X86 is None:
        pytest.skip("no qemu-x86_64 (Debian's qemu-user-static) to emulate an x86 without VNNI")
    import os

    import numpy as np

    from agent.bundle.verify import verify_bundle
    from agent.pipeline.golden import judge_quantized

    exit_code, output, folder = lane.no_vnni[bundle]
    print(output)
    assert exit_code == 0, output
    verified = verify_bundle(os.path.join(lane.share, bundle))
    manifest, golden = verified.manifest, verified.manifest.golden
    judged = 0
    for index, case in enumerate(golden.cases):
        floats = [f for f in case.expected if ".int8." not in f]
        for file in [f for f in case.expected if ".int8." in f]:
            got = np.load(os.path.join(folder, "case%d.%s.npy" % (index, file)))
            expected, reference = (np.load(verified.path(case.expected[f])) for f in (file, floats[0]))
            verdict = judge_quantized(got, expected, reference, manifest.task, golden.quantized.rms_ratio,
                                      golden.quantized.max_ratio, golden.atol)
            print("%s case %d %s: max abs diff %.3g, worst RMS ratio %.3g" % (
                bundle, index, file, verdict.max_abs_diff, verdict.rms_ratio))
            assert verdict.failure is None, verdict.failure
            if exact:
                assert verdict.max_abs_diff <= golden.atol, verdict
            judged += 1
    assert judged > 0


def test_the_box_tests_pass_on_aarch64(lane):
    """The box's own tests (marker ``box``, by folder: tests/conftest.py) on the box's CPU and Python."""
    summaries = []
    assert len(lane.box_tests) == 2, lane.box_tests
    for _index, done in sorted(lane.box_tests.items()):
        summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
        summaries.append(summary)
        print(done.stdout[-2500:])
        assert done.returncode == 0, done.stdout[-6000:]
        assert re.search(r"\d+ passed", summary), summary
    record(CPUS[0], "box-tests", "", " + ".join(summaries))
