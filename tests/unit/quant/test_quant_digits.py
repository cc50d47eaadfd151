"""A reduced-epoch ``atlas-edge qat`` run on scikit-learn's digits, end to end, checked from the outside.

CI thresholds are reduced because the run is short (3 float epochs, 1 QAT epoch instead of 15 and 2):
float top-1 >= 85 % (full run: >= 95 %), QAT within 3 points of float (full run: 1 point). Not reduced: the
simulated-quant MindIR must agree with the QAT network on >= 99.5 % of the held-out split, the deploy MindIR
must carry the trained ranges, and the golden set must be reproduced by the artifacts' own runtimes.
"""

import dataclasses
import json
import os

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
pytest.importorskip("mindspore_gs")

from agent.bundle.verify import verify_bundle  # noqa: E402
from agent.pipeline.input_batch import BatchPreprocessor  # noqa: E402
from agent.pipeline.preprocess import PreprocessSpec  # noqa: E402
from converters.runtimes import run_on_host  # noqa: E402
from quant.config import load_config  # noqa: E402
from quant.export import read_fake_quant_params  # noqa: E402
from quant.pipeline import QatRun, RunOptions  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FLOAT_EPOCHS = 3
QAT_EPOCHS = 1
MIN_FLOAT_TOP1 = 0.85
MAX_QAT_DROP = 0.03
MIN_SIM_AGREEMENT = 0.995


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("digits")
    config = load_config(os.path.join(REPO, "quant", "examples", "digits.yaml"))
    config = dataclasses.replace(config, calibration=dataclasses.replace(config.calibration, count=8))
    options = RunOptions(
        out_dir=str(base / "bundle"), epochs=FLOAT_EPOCHS, qat_epochs=QAT_EPOCHS, work_dir=str(base / "work")
    )
    report = QatRun(config, options).run()
    return {"config": config, "report": report, "bundle": str(base / "bundle"), "work": str(base / "work")}


def test_report_meets_the_reduced_thresholds(run):
    report = run["report"]
    assert report["task"] == "classify"
    assert report["float"]["top1"] >= MIN_FLOAT_TOP1
    assert report["qat"]["top1"] >= report["float"]["top1"] - MAX_QAT_DROP
    assert report["checks"]["int8sim_test_split"]["top1_agreement"] >= MIN_SIM_AGREEMENT
    with open(os.path.join(run["bundle"], "report.json"), encoding="utf-8") as handle:
        on_disk = json.load(handle)
    assert on_disk["float"]["top1"] == report["float"]["top1"]
    assert set(on_disk["artifacts"]) == {
        "model_32x32.mindir",
        "model_32x32.onnx",
        "model_32x32.int8sim.mindir",
        "model_32x32.deploy.mindir",
    }
    assert all(size > 10000 for size in on_disk["artifacts"].values())
    text = open(os.path.join(run["bundle"], "report.txt"), encoding="utf-8").read()
    assert "top-1" in text
    # the int8 ONNX covers convolution networks; the classifier's quantized Dense layer is named as the reason
    assert "a quantized Dense" in on_disk["checks"]["int8_onnx"]["skipped"]
    assert "int8 ONNX not written: " in text


def test_simulated_quant_mindir_reproduces_qat_accuracy_on_the_whole_test_split(run):
    """Run the bundle's int8-sim MindIR (mindspore.load + GraphCell) on every held-out image ourselves."""
    from quant.datasets import load_digits, network_input

    spec = PreprocessSpec()
    data = load_digits((32, 32), spec, run["config"].data.test_fraction, run["config"].data.seed)
    graph = ms.nn.GraphCell(ms.load(os.path.join(run["bundle"], "model_32x32.int8sim.mindir")))
    predictions = np.array(
        [
            int(graph(ms.Tensor(network_input(data.test.images[i : i + 1], spec))).asnumpy().argmax())
            for i in range(len(data.test))
        ]
    )
    top1 = float(np.mean(predictions == data.test.labels))
    # >= 99.5 % agreement with the QAT network bounds the accuracy difference by 0.5 points.
    assert abs(top1 - run["report"]["qat"]["top1"]) <= 1 - MIN_SIM_AGREEMENT


def test_deploy_mindir_holds_the_trained_quantizer_ranges(run, tmp_path, monkeypatch):
    """Parse FakeQuantParam out of the deploy MindIR and compare with the QAT checkpoint's quantizers."""
    from quant.fake_quant import apply_quantization, build_algorithm, quantizer_ranges
    from quant.networks import SmallClassifier

    monkeypatch.chdir(tmp_path)
    qat = apply_quantization(build_algorithm("cpu"), SmallClassifier(10, width=16), str(tmp_path))
    ms.load_param_into_net(qat, ms.load_checkpoint(os.path.join(run["work"], "qat.ckpt")))
    trained = list(quantizer_ranges(qat).values())
    exported = read_fake_quant_params(os.path.join(run["bundle"], "model_32x32.deploy.mindir"))
    assert len(exported) == len(trained) == 11  # 4 x (conv input + weight) + dense input/output/weight
    assert sum(e["is_per_channel"] for e in exported) == 5  # the weights
    unmatched = list(exported)
    for quantizer in trained:
        match = [
            e
            for e in unmatched
            if len(e["min"]) == len(quantizer["min"])
            and np.allclose(e["min"], quantizer["min"], atol=1e-6)
            and np.allclose(e["max"], quantizer["max"], atol=1e-6)
        ]
        assert match, "no FakeQuantParam with the range of a trained quantizer"
        np.testing.assert_allclose(match[0]["linear_quant_scale"], quantizer["scale"], rtol=1e-6)
        np.testing.assert_allclose(match[0]["linear_quant_zero_point"], quantizer["zero_point"])
        unmatched.remove(match[0])
    # Trained ranges, not Golden Stick's -6/6 initial values.
    assert not any(e["min"] == [-6.0] and e["max"] == [6.0] for e in exported)


def test_bundle_verifies_and_golden_set_is_reproduced_by_each_runtime(run):
    bundle = verify_bundle(run["bundle"])
    manifest = bundle.manifest
    roles = {a.file: (a.role, a.precision) for a in manifest.artifacts}
    assert roles["model_32x32.deploy.mindir"] == ("convert", "int8")
    assert roles["model_32x32.int8sim.mindir"] == ("serve", "int8-sim")
    spec = manifest.preprocessing
    checked = 0
    for case in manifest.golden.cases:
        image = np.load(bundle.path(case.image))
        assert image.dtype == np.uint8 and image.shape == tuple(case.tier) + (3,)
        assert set(case.expected) == {"model_32x32.mindir", "model_32x32.onnx", "model_32x32.int8sim.mindir"}
        for file, expected_file in case.expected.items():
            artifact = manifest.artifact(file)
            batcher = BatchPreprocessor(
                spec,
                tuple(case.tier),
                1,
                input_layout=artifact.input_layout,
                input_color=artifact.input_color,
            )
            batcher.fill_letterboxed(0, image)
            got = run_on_host(bundle.path(file), artifact.format, batcher.batch)
            np.testing.assert_allclose(
                got, np.load(bundle.path(expected_file)), atol=manifest.golden.atol, rtol=manifest.golden.rtol
            )
            checked += 1
    assert checked == 3 * len(manifest.golden.cases) >= 3


def test_calibration_set_is_nhwc_float32_normalised(run):
    calibration = verify_bundle(run["bundle"]).manifest.calibration
    assert (calibration.layout, calibration.dtype, calibration.count) == ("NHWC", "float32", 8)
    files = sorted(os.listdir(os.path.join(run["bundle"], calibration.dir)))
    assert len(files) == 8
    tensor = np.fromfile(os.path.join(run["bundle"], calibration.dir, files[0]), np.float32).reshape(
        32, 32, 3
    )
    assert 0.0 <= tensor.min() and tensor.max() <= 1.0 and tensor.max() > 0.5
    np.testing.assert_allclose(tensor * 255, np.round(tensor * 255), atol=1e-3)  # uint8 pixels / 255


@pytest.mark.slow
def test_full_digits_run_meets_the_acceptance_thresholds(tmp_path):
    """The example config as shipped (15 float epochs, 2 QAT epochs; about 3 minutes on 2 cores)."""
    config = load_config(os.path.join(REPO, "quant", "examples", "digits.yaml"))
    report = QatRun(
        config, RunOptions(out_dir=str(tmp_path / "bundle"), work_dir=str(tmp_path / "work"))
    ).run()
    assert report["float"]["top1"] >= 0.95
    assert report["qat"]["top1"] >= report["float"]["top1"] - 0.01
    assert report["checks"]["int8sim_test_split"]["top1_agreement"] >= MIN_SIM_AGREEMENT
    verify_bundle(str(tmp_path / "bundle"))
