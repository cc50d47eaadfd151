"""Precision in the manifest and on the box: ``model.precision`` (auto|int8|float) picks each tier's artifact
(:func:`agent.pipeline.artifacts.select_artifacts`), and ``normalize_on: model`` artifacts take uint8.
No runtime is loaded here: the choice is made from the manifest alone.
"""

import pytest

from agent.bundle.manifest import BundleError
from agent.bundle.verify import verify_bundle, write_manifest
from agent.config.daemon_config import ModelConfig
from agent.config.device_config import INT8_BACKENDS, load_device_config
from agent.config.schema import ConfigError, parse
from agent.pipeline.artifacts import precision_order, select_artifacts
from tests.support import lifecycle_support as lifecycle
from tests.support.bundle_support import artifact, fields, make_bundle
from tests.support.lifecycle_support import (
    Harness,
    assert_unchanged,
    deploy_request,
    new_version,
    no_progress,
    snapshot,
)

CPU = load_device_config("cpu-dev")


def chosen(tmp_path, artifacts, backend, precision, tiers=((32, 32),)):
    root = tmp_path / "b"
    make_bundle(root, artifacts, tiers=tiers)
    picked = select_artifacts(verify_bundle(str(root)), CPU, backend, precision=precision)
    return {tier: art.file for tier, art in picked.items()}


FLOAT_AND_INT8 = [artifact("m.onnx"), artifact("m.int8.onnx", precision="int8"),
                  artifact("m.mindir", format="mindir"),
                  artifact("m.int8sim.mindir", format="mindir", precision="int8-sim")]


@pytest.mark.parametrize("backend,precision,file", [
    ("onnxruntime", "auto", "m.int8.onnx"),  # runs int8 as integer kernels: auto takes it
    ("opencv", "auto", "m.onnx"),  # cv2.dnn simulates QDQ in float: auto stays float
    ("onnxruntime", "float", "m.onnx"),
    ("opencv", "int8", "m.int8.onnx"),  # asked for explicitly: served though not faster
    ("mindspore", "auto", "m.mindir"),  # int8-sim never before a real float artifact
])
def test_model_precision_picks_the_artifact(tmp_path, backend: str, precision: str, file: str) -> None:
    assert chosen(tmp_path, FLOAT_AND_INT8, backend, precision) == {(32, 32): file}


def test_auto_serves_what_a_tier_has_when_its_preferred_precision_is_missing(tmp_path) -> None:
    tiers = ((32, 32), (32, 64))
    arts = [artifact("a.onnx"), artifact("a.int8.onnx", precision="int8"),
            artifact("b.onnx", tier=[32, 64])]  # tier b has no int8
    assert chosen(tmp_path, arts, "onnxruntime", "auto", tiers) == {(32, 32): "a.int8.onnx", (32, 64): "b.onnx"}
    only_int8 = [artifact("q.int8.onnx", precision="int8")]
    assert chosen(tmp_path / "2", only_int8, "opencv", "auto") == {(32, 32): "q.int8.onnx"}


def test_int8_asked_of_a_bundle_without_it_names_model_precision_and_the_tier(tmp_path) -> None:
    root = tmp_path / "b"
    make_bundle(root, [artifact("m.onnx"), artifact("m.int8sim.onnx", precision="int8-sim")])
    bundle = verify_bundle(str(root))
    with pytest.raises(BundleError) as info:
        select_artifacts(bundle, CPU, "onnxruntime", precision="int8")
    assert fields(info.value) == ["model.precision"]
    text = str(info.value)
    assert "no int8 serve artifact for backend onnxruntime" in text and "32x32 has float32/int8-sim" in text
    assert "set model.precision to auto" in text
    # float on an int8-only bundle: the same refusal, the other way round
    make_bundle(tmp_path / "q", [artifact("q.int8.onnx", precision="int8")])
    with pytest.raises(BundleError, match="float: the bundle has no float32/float16 serve artifact"):
        select_artifacts(verify_bundle(str(tmp_path / "q")), CPU, "onnxruntime", precision="float")


def test_precision_order_is_one_table_and_refuses_unknown_values() -> None:
    assert precision_order("auto", "onnxruntime")[0] == "int8"
    assert precision_order("auto", "opencv")[:2] == ("float32", "float16")
    assert set(INT8_BACKENDS) == {"onnxruntime", "acl"}
    with pytest.raises(ValueError, match="model.precision must be one of"):
        precision_order("int4", "onnxruntime")


def test_the_daemon_config_refuses_an_unknown_precision_naming_the_field() -> None:
    assert parse(ModelConfig, {"bundle": "b"}).precision == "auto"
    assert parse(ModelConfig, {"bundle": "b", "precision": "int8"}).precision == "int8"
    with pytest.raises(ConfigError) as info:
        parse(ModelConfig, {"bundle": "b", "precision": "int4"})
    assert [e.path for e in info.value.errors] == ["precision"]


def test_normalize_on_model_means_uint8_in(tmp_path) -> None:
    root = tmp_path / "b"
    data = make_bundle(root, [artifact("m.onnx", normalize_on="model", input_dtype="uint8", input_layout="NHWC",
                                       input_color="bgr")])
    art = verify_bundle(str(root)).manifest.artifacts[0]
    assert (art.normalize_on, art.input_dtype, art.input_layout) == ("model", "uint8", "NHWC")
    data["artifacts"][0]["input_dtype"] = "float32"
    with pytest.raises(BundleError) as info:
        write_manifest(str(root), data)
    assert fields(info.value) == ["artifacts[0].input_dtype"]
    assert "must be uint8 when normalize_on is model" in str(info.value)


base_bundle = lifecycle.base_bundle  # fixture: a copy of the committed tiny bundle (float32 ONNX and MindIR)


def test_a_deploy_without_the_configured_precision_is_refused_before_loading(base_bundle, tmp_path) -> None:
    h = Harness(tmp_path, base_bundle, precision="float")
    try:
        assert h.manager.start().precision == "float32"

        def int8_only(data, _root):
            for art in data["artifacts"]:
                art["precision"] = "int8"

        sha = new_version(base_bundle, h.incoming("tiny-int8"), "2.0.0", int8_only)
        before = snapshot(h)
        with pytest.raises(BundleError) as info:
            h.manager.deploy(deploy_request({"bundle": "incoming/tiny-int8", "sha256": sha}), no_progress)
        assert fields(info.value) == ["model.precision"]
        assert "float: the bundle has no float32/float16 serve artifact for backend opencv" in str(info.value)
        assert_unchanged(h, before)
    finally:
        h.manager.close()
