"""Inference backends: the registry, one contract suite over every backend we can drive here, MindSpore vs
OpenCV on a real exported CNN, and the mslite / acl adapters against stand-ins.

The mslite and acl cases run against FAKES (tests/fakes: FakeMindSporeLite, FakeAcl), never the real
runtimes, and their test ids say so; the tests that need the real tools skip with a reason naming them.
"""

import gc
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest

from agent.config.device_config import BACKEND_FORMATS, load_device_config
from agent.pipeline.backends import BACKENDS, backend_status, create_backend
from agent.pipeline.backends import acl_backend as acl_mod
from agent.pipeline.backends.base import Backend, BackendError, BackendOptions, BackendUnavailable, TensorSpec
from tests.conftest import REPO_ROOT, WAIT_S, wait_for
from tests.fakes import write_toy_model
from tests.fakes.fake_acl import ACL_DEVICE, FakeAcl
from tests.fakes.fake_mslite import FakeMindSporeLite, FakeModelType
from tests.support import lite_support

DEMO_BUNDLE = os.path.join(REPO_ROOT, "examples", "demo-bundle")
PARITY_ATOL = 1e-4  # MindSpore vs OpenCV on the same float32 network; measured ~1e-6 on the test CNN
NET_INPUT = (3, 64, 64)  # (C, H, W) of the exported test network
NET_OUTPUTS = [(6, 16, 16), (8,)]  # per-sample output shapes: sigmoid head, pooled features

# toy networks run by the stand-ins
MSLITE_INPUT = (1, 3, 8, 8)
MSLITE_OUTPUTS = ({"op": "sum_axis1"}, {"op": "mean"})
ACL_INPUT = (1, 8, 8, 3)  # uint8 NHWC, as a static-AIPP .om takes it
ACL_OUTPUTS = ({"op": "sum_last"}, {"op": "mean"})


# -- the real network ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported_net(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, Dict[str, str]]:
    """A small real CNN exported by MindSpore to MINDIR and ONNX at batch 1 and 4: {batch: {fmt: path}}."""
    ms = pytest.importorskip("mindspore", reason="needs MindSpore to build the test network")
    from mindspore import nn, ops

    class TwoHeadNet(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, stride=2, pad_mode="pad", padding=1, has_bias=True)
            self.conv2 = nn.Conv2d(8, 6, 3, stride=2, pad_mode="pad", padding=1, has_bias=True)
            self.relu = nn.ReLU()
            self.sigmoid = nn.Sigmoid()

        def construct(self, x):  # noqa: ANN001, ANN201 - MindSpore graph code
            features = self.relu(self.conv1(x))
            return self.sigmoid(self.conv2(features)), ops.mean(features, (2, 3))

    ms.set_seed(7)
    net = TwoHeadNet()
    out_dir = tmp_path_factory.mktemp("net")
    paths: Dict[int, Dict[str, str]] = {}
    for batch in (1, 4):
        dummy = ms.Tensor(np.zeros((batch,) + NET_INPUT, np.float32))
        stem = str(out_dir / ("net_b%d" % batch))
        ms.export(net, dummy, file_name=stem, file_format="MINDIR")
        ms.export(net, dummy, file_name=stem, file_format="ONNX")
        paths[batch] = {"mindir": stem + ".mindir", "onnx": stem + ".onnx"}
    return paths


def net_spec(batch: int, name: str = "images") -> TensorSpec:
    return TensorSpec(name, (batch,) + NET_INPUT, "float32")


def random_batch(shape: Tuple[int, ...], dtype: str = "float32", seed: int = 0) -> np.ndarray:
    rng = np.random.RandomState(seed)
    if dtype == "uint8":
        return rng.randint(0, 256, size=shape).astype(np.uint8)
    return rng.rand(*shape).astype(dtype)


# -- the contract suite --------------------------------------------------------------------------------------
@dataclass
class Case:
    make: Callable[[], Backend]
    shape: Tuple[int, ...]
    dtype: str
    output_shapes: List[Tuple[int, ...]]
    output_dtypes: List[str]


CASE_IDS = ["mindspore-real", "opencv-real", "onnxruntime-real", "mslite-real", "mslite-FAKE-stand-in",
            "acl-FAKE-stand-in"]
DEMO_ONNX = os.path.join(DEMO_BUNDLE, "model_256x256.onnx")  # the demo detector: (1, 3, 256, 256) -> (1, 7, 1280)


@pytest.fixture(params=CASE_IDS)
def case(request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch) -> Case:
    kind = request.param
    if kind in ("mindspore-real", "opencv-real"):
        net = request.getfixturevalue("exported_net")
        name, fmt = ("mindspore", "mindir") if kind == "mindspore-real" else ("opencv", "onnx")
        return Case(lambda: create_backend(name, net[1][fmt], net_spec(1)), (1,) + NET_INPUT, "float32",
                    [(1,) + s for s in NET_OUTPUTS], ["float32", "float32"])
    if kind == "onnxruntime-real":  # both lanes: onnxruntime 1.14.1 on 3.7, the newest on 3.11
        pytest.importorskip("onnxruntime", reason="needs onnxruntime (pip install 'atlas-edge[ort]')")
        spec = TensorSpec("images", (1, 3, 256, 256), "float32")
        return Case(lambda: create_backend("onnxruntime", DEMO_ONNX, spec), spec.shape, "float32",
                    [(1, 7, 1280)], ["float32"])
    if kind == "mslite-real":
        ms_path = request.getfixturevalue("lite_ms")
        return Case(lambda: create_backend("mslite", ms_path, LITE_SPEC), LITE_SPEC.shape, "float32",
                    [LITE_OUTPUT], ["float32"])
    if kind == "mslite-FAKE-stand-in":
        monkeypatch.setitem(sys.modules, "mindspore_lite", FakeMindSporeLite())
        path = write_toy_model(str(tmp_path / "toy.ms"), "mslite-toy", MSLITE_INPUT, outputs=MSLITE_OUTPUTS)
        return Case(lambda: create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32")),
                    MSLITE_INPUT, "float32", [(1, 8, 8), (1, 1)], ["float32", "float32"])
    monkeypatch.setitem(sys.modules, "acl", FakeAcl())
    path = write_toy_model(str(tmp_path / "toy.om"), "acl-toy", ACL_INPUT, "uint8", outputs=ACL_OUTPUTS)
    return Case(lambda: create_backend("acl", path, TensorSpec("images", ACL_INPUT, "uint8")),
                ACL_INPUT, "uint8", [(1, 8, 8), (1, 1)], ["float32", "float32"])


def test_contract_load_and_infer_give_declared_shapes_and_dtypes(case: Case) -> None:
    backend = case.make()
    assert not backend.loaded
    backend.load()
    backend.load()  # idempotent: heavy work happens once
    outputs = backend.infer(random_batch(case.shape, case.dtype))
    assert [o.shape for o in outputs] == case.output_shapes
    assert [str(o.dtype) for o in outputs] == case.output_dtypes
    backend.close()


def test_contract_repeated_infer_is_identical_and_outputs_belong_to_the_caller(case: Case) -> None:
    with case.make() as backend:
        batch = random_batch(case.shape, case.dtype, seed=1)
        first = backend.infer(batch)
        kept = [o.copy() for o in first]
        for _ in range(3):
            again = backend.infer(batch)
            for a, b in zip(again, kept):
                np.testing.assert_array_equal(a, b)
        other = backend.infer(random_batch(case.shape, case.dtype, seed=2))
        assert any(not np.array_equal(a, b) for a, b in zip(other, kept)), "another batch must change outputs"
        for a, b in zip(first, kept):  # a later run must not overwrite what the caller kept
            np.testing.assert_array_equal(a, b)
        for out in first:
            out[...] = 0  # the caller may scribble on its outputs
        for a, b in zip(backend.infer(batch), kept):
            np.testing.assert_array_equal(a, b)


def test_contract_wrong_batch_shape_names_expected_and_got(case: Case) -> None:
    with case.make() as backend:
        wrong = (case.shape[0] + 1,) + case.shape[1:]
        with pytest.raises(BackendError) as err:
            backend.infer(random_batch(wrong, case.dtype))
        text = str(err.value)
        assert os.path.basename(backend.artifact_path) in text
        assert "expected %s, got %s" % (case.shape, wrong) in text
        assert backend.infer(random_batch(case.shape, case.dtype))  # still serving after the refusal


def test_contract_wrong_dtype_names_expected_and_got(case: Case) -> None:
    with case.make() as backend:
        wrong_dtype = "float64" if case.dtype != "float64" else "float32"
        with pytest.raises(BackendError, match="expected %s, got %s" % (case.dtype, wrong_dtype)):
            backend.infer(np.zeros(case.shape, dtype=wrong_dtype))


def test_contract_close_is_idempotent_and_infer_after_close_raises(case: Case) -> None:
    backend = case.make()
    with pytest.raises(BackendError, match="not loaded"):
        backend.infer(random_batch(case.shape, case.dtype))
    backend.load()
    backend.close()
    backend.close()
    assert backend.closed and not backend.loaded
    with pytest.raises(BackendError, match="closed"):
        backend.infer(random_batch(case.shape, case.dtype))
    with pytest.raises(BackendError, match="closed"):
        backend.load()


# -- registry and shared checks ------------------------------------------------------------------------------
def test_registry_names_and_formats_match_device_config() -> None:
    assert set(BACKENDS) == set(BACKEND_FORMATS)
    for name, cls in BACKENDS.items():
        assert cls.name == name
        assert cls.formats is BACKEND_FORMATS[name]  # the table's own tuple: declared once


def test_a_backend_named_outside_the_table_is_refused_when_defined() -> None:
    with pytest.raises(TypeError, match="'tflite' is not in BACKEND_FORMATS"):
        class TfLiteBackend(Backend):  # noqa: F841 - defining it is the test
            name = "tflite"


def test_backend_status_reports_ok_or_the_missing_module_and_its_provider() -> None:
    status = backend_status()
    assert status["opencv"] == "ok"
    for name, module, word in (("mindspore", "mindspore", "mindspore wheel"),
                               ("onnxruntime", "onnxruntime", "--no-deps"),
                               ("mslite", "mindspore_lite", "MindSpore Lite"), ("acl", "acl", "CANN")):
        if importlib.util.find_spec(module) is not None:
            assert status[name] == "ok"
        else:
            assert repr(module) in status[name] and word in status[name]


def test_importing_the_registry_imports_no_runtime() -> None:
    code = ("import sys, agent.pipeline.backends; "
            "print(sorted(m for m in ('mindspore', 'mindspore_lite', 'acl', 'cv2', 'onnxruntime') "
            "if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name,module,provider_word", [
    ("mindspore", "mindspore", "mindspore"), ("opencv", "cv2", "opencv-python"),
    ("onnxruntime", "onnxruntime", "onnxruntime==1.14.1"),
    ("mslite", "mindspore_lite", "MindSpore Lite"), ("acl", "acl", "CANN"),
])
def test_missing_runtime_raises_backend_unavailable_naming_module_and_package(
        name: str, module: str, provider_word: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = BACKEND_FORMATS[name][0]
    path = tmp_path / ("model." + fmt)
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    backend = create_backend(name, str(path), TensorSpec("images", (1, 3, 8, 8), "float32"))
    with pytest.raises(BackendUnavailable) as err:
        backend.load()
    assert repr(module) in str(err.value) and provider_word in str(err.value)
    assert not backend.loaded


def test_create_backend_refuses_unknown_names_and_wrong_formats(tmp_path) -> None:
    spec = TensorSpec("images", (1, 3, 8, 8), "float32")
    with pytest.raises(ValueError, match="unknown backend 'tensorrt'.*acl, mindspore, mslite, onnxruntime, opencv"):
        create_backend("tensorrt", "m.onnx", spec)
    with pytest.raises(BackendError, match=r"model\.mindir: backend opencv reads onnx artifacts, not mindir"):
        create_backend("opencv", str(tmp_path / "model.mindir"), spec)
    with pytest.raises(BackendError, match=r"model\.pt: unknown artifact suffix"):
        create_backend("opencv", str(tmp_path / "model.pt"), spec)


def test_missing_artifact_file_is_named(tmp_path) -> None:
    missing = str(tmp_path / "gone.onnx")
    backend = create_backend("opencv", missing, TensorSpec("images", (1, 3, 8, 8), "float32"))
    with pytest.raises(BackendError, match="gone.onnx: artifact file not found"):
        backend.load()


def test_options_and_spec_reject_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="cpu_threads"):
        BackendOptions(cpu_threads=0)
    with pytest.raises(ValueError, match="target"):
        BackendOptions(target="gpu")
    with pytest.raises(ValueError, match="device_id"):
        BackendOptions(device_id=-1)
    with pytest.raises(ValueError, match="shape"):
        TensorSpec("images", (1, 3, -1, 64), "float32")
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("images", (1, 3, 8, 8), "int64")
    assert TensorSpec("images", [1, 3, 8, 8], "uint8").nbytes == 192


def test_options_for_device_take_the_device_config() -> None:
    device = load_device_config("atlas-200i-dk-a2")
    options = BackendOptions.for_device(device)
    assert options == BackendOptions(device_id=0, cpu_threads=2, precision_mode="force_fp16", target="ascend",
                                     onnxruntime=device.onnxruntime)
    assert BackendOptions.for_device(device, target="cpu").target == "cpu"


# -- MindSpore and OpenCV, real ------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 4])
def test_mindspore_and_opencv_agree_on_the_exported_network(exported_net, batch: int) -> None:
    data = random_batch((batch,) + NET_INPUT, seed=batch)
    with create_backend("mindspore", exported_net[batch]["mindir"], net_spec(batch)) as ms_backend, \
            create_backend("opencv", exported_net[batch]["onnx"], net_spec(batch)) as cv_backend:
        ms_out = ms_backend.infer(data)
        cv_out = cv_backend.infer(data)
    assert [o.shape for o in ms_out] == [(batch,) + s for s in NET_OUTPUTS]
    assert [o.shape for o in cv_out] == [o.shape for o in ms_out]
    for a, b in zip(ms_out, cv_out):
        assert float(np.abs(a - b).max()) < PARITY_ATOL
    # the pooled head is the spatial mean of positive features: an independent sanity bound
    assert (ms_out[1] >= 0).all() and ((ms_out[0] > 0) & (ms_out[0] < 1)).all()


DEMO_RTOL = 1e-5  # demo outputs carry box coordinates in input pixels (up to 320): float32 rounding scales


def _demo_pairs() -> List[Tuple[dict, dict, dict]]:
    """(manifest, float32 MindIR, ONNX) of one tier; the MindIR's batch is 1 or the ONNX's."""
    with open(os.path.join(DEMO_BUNDLE, "manifest.json")) as f:
        manifest = json.load(f)
    float_arts = [a for a in manifest["artifacts"] if a.get("input_dtype", "float32") == "float32"
                  and a.get("precision", "float32") == "float32" and a.get("input_layout", "NCHW") == "NCHW"]
    pairs = []
    for onnx in (a for a in float_arts if a["format"] == "onnx"):
        for mindir in (a for a in float_arts if a["format"] == "mindir" and a["tier"] == onnx["tier"]):
            if mindir["batch"] in (1, onnx["batch"]):
                pairs.append((manifest, mindir, onnx))
    return pairs


@pytest.mark.skipif(not os.path.isfile(os.path.join(DEMO_BUNDLE, "manifest.json")),
                    reason="examples/demo-bundle is not there yet (made by the demo bundle helper)")
def test_mindspore_and_opencv_agree_on_the_demo_bundle() -> None:
    pytest.importorskip("mindspore", reason="needs MindSpore to run the demo bundle's MindIR")
    pairs = _demo_pairs()
    if not pairs:
        pytest.skip("examples/demo-bundle has no float32 MindIR/ONNX artifacts of the same tier")
    for manifest, mindir, onnx in pairs:
        h, w = onnx["tier"]
        name = manifest["input"]["name"]
        cv_spec = TensorSpec(name, (onnx["batch"], 3, h, w), "float32")
        ms_spec = TensorSpec(name, (mindir["batch"], 3, h, w), "float32")
        data = random_batch(cv_spec.shape, seed=5)
        with create_backend("mindspore", os.path.join(DEMO_BUNDLE, mindir["file"]), ms_spec) as ms_backend, \
                create_backend("opencv", os.path.join(DEMO_BUNDLE, onnx["file"]), cv_spec) as cv_backend:
            cv_out = cv_backend.infer(data)
            # a batch-4 ONNX against the batch-1 MindIR run sample by sample
            step = mindir["batch"]
            runs = [ms_backend.infer(data[i:i + step]) for i in range(0, onnx["batch"], step)]
            ms_out = [np.concatenate(parts) for parts in zip(*runs)]
        assert [o.shape for o in ms_out] == [o.shape for o in cv_out]
        for a, b in zip(ms_out, cv_out):
            np.testing.assert_allclose(b, a, rtol=DEMO_RTOL, atol=PARITY_ATOL, err_msg="%s vs %s" % (
                mindir["file"], onnx["file"]))


def test_mindspore_reuses_compiled_graphs_across_swaps(exported_net, monkeypatch: pytest.MonkeyPatch) -> None:
    import mindspore

    from agent.pipeline.backends import mindspore_backend

    loads: List[str] = []
    real_load = mindspore.load
    monkeypatch.setattr(mindspore, "load", lambda path, **kw: loads.append(path) or real_load(path, **kw))
    mindspore_backend.release_compiled_graphs()
    data = random_batch((1,) + NET_INPUT, seed=3)
    reference: Optional[List[np.ndarray]] = None
    for cycle in range(6):  # an A/B swap back and forth: B1 -> B4 -> B1 -> ...
        batch = 1 if cycle % 2 == 0 else 4
        with create_backend("mindspore", exported_net[batch]["mindir"], net_spec(batch)) as backend:
            if batch == 1:
                out = backend.infer(data)
                reference = reference or out
                for a, b in zip(out, reference):
                    np.testing.assert_array_equal(a, b)
    assert loads == [exported_net[1]["mindir"], exported_net[4]["mindir"]]  # compiled once each
    assert mindspore_backend.compiled_graph_count() == 2
    assert mindspore_backend.release_compiled_graphs() == 2
    with create_backend("mindspore", exported_net[1]["mindir"], net_spec(1)):
        pass
    assert len(loads) == 3  # released: compiled again


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0 ** 20


# allocator noise; measured 0.0 MB with the compiled-graph cache, 11.5 MB without it for this network
RSS_MARGIN_MB = 6.0


def test_mindspore_swap_cycles_keep_rss_flat(exported_net) -> None:
    data = {b: random_batch((b,) + NET_INPUT) for b in (1, 4)}
    for batch in (1, 4):  # warm both compiled graphs first
        with create_backend("mindspore", exported_net[batch]["mindir"], net_spec(batch)) as backend:
            backend.infer(data[batch])
    gc.collect()
    before = _rss_mb()
    for cycle in range(20):
        batch = 1 if cycle % 2 == 0 else 4
        with create_backend("mindspore", exported_net[batch]["mindir"], net_spec(batch)) as backend:
            backend.infer(data[batch])
    gc.collect()
    assert _rss_mb() - before < RSS_MARGIN_MB


def test_mindspore_thread_count_is_fixed_per_process_and_a_change_is_warned(
        exported_net, caplog: pytest.LogCaptureFixture) -> None:
    from agent.pipeline.backends import mindspore_backend

    with create_backend("mindspore", exported_net[1]["mindir"], net_spec(1)):
        pass
    fixed = mindspore_backend._process_threads
    assert fixed is not None
    with caplog.at_level(logging.WARNING, logger="agent.pipeline.backends.mindspore_backend"):
        with create_backend("mindspore", exported_net[1]["mindir"], net_spec(1),
                            BackendOptions(cpu_threads=fixed + 1)):
            pass
    assert "fixed per process at %d; ignoring %d" % (fixed, fixed + 1) in caplog.text


def test_mindspore_compiles_while_another_thread_infers(exported_net) -> None:
    """A deploy compiles the new model while the current one serves: MindSpore 2.7 alone fails that."""
    from agent.pipeline.backends import mindspore_backend

    serving = create_backend("mindspore", exported_net[1]["mindir"], net_spec(1))
    serving.load()
    stop = threading.Event()
    errors: List[str] = []
    served = [0]

    def serve() -> None:
        data = random_batch((1,) + NET_INPUT)
        while not stop.is_set():
            try:
                serving.infer(data)
                served[0] += 1
            except Exception as err:  # noqa: BLE001 - collected and asserted below
                errors.append(repr(err))

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    try:
        for _ in range(3):
            mark = served[0]  # each compile begins with the other thread inferring, not merely started
            assert wait_for(lambda mark=mark: served[0] > mark or bool(errors), timeout=WAIT_S), errors
            mindspore_backend.release_compiled_graphs()  # force a real compile each time
            with create_backend("mindspore", exported_net[4]["mindir"], net_spec(4)) as pending:
                assert len(pending.infer(random_batch((4,) + NET_INPUT))) == 2
    finally:
        stop.set()
        worker.join(timeout=60)
    serving.close()
    assert not worker.is_alive() and errors == []


def test_mindspore_rejects_a_spec_the_graph_cannot_take(exported_net) -> None:
    spec = TensorSpec("images", (1, 3, 32, 32), "float32")
    backend = create_backend("mindspore", exported_net[1]["mindir"], spec)
    with pytest.raises(BackendError, match=r"net_b1\.mindir: input shape mismatch for 'images': expected "
                                           r"\(1, 3, 32, 32\), got \(1, 3, 64, 64\) from the MindIR"):
        backend.load()
    assert not backend.loaded


def test_opencv_feeds_the_named_input_or_the_first_one_and_sets_threads(exported_net) -> None:
    import cv2

    before = cv2.getNumThreads()
    try:
        # MindSpore names the ONNX input after construct's argument ("x"); a spec named "images" still works
        for name in ("x", "images"):
            with create_backend("opencv", exported_net[1]["onnx"], net_spec(1, name=name),
                                BackendOptions(cpu_threads=1)) as backend:
                assert backend._input_name == ("x" if name == "x" else "")
                assert len(backend.infer(random_batch((1,) + NET_INPUT))) == 2
                assert cv2.getNumThreads() == 1
    finally:
        cv2.setNumThreads(before)


def test_opencv_reports_a_broken_artifact_by_name(tmp_path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"not an onnx file")
    backend = create_backend("opencv", str(path), TensorSpec("images", (1, 3, 8, 8), "float32"))
    with pytest.raises(BackendError, match="broken.onnx: cv2.dnn.readNetFromONNX failed"):
        backend.load()


# -- MindSpore Lite against the FAKE stand-in ----------------------------------------------------------------
@pytest.fixture
def fake_mslite(monkeypatch: pytest.MonkeyPatch) -> FakeMindSporeLite:
    """FAKE mindspore_lite (tests/fakes/fake_mslite.py), not MindSpore Lite."""
    fake = FakeMindSporeLite()
    monkeypatch.setitem(sys.modules, "mindspore_lite", fake)
    return fake


def test_mslite_fake_builds_once_and_feeds_the_prebuilt_inputs(fake_mslite: FakeMindSporeLite,
                                                               tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT, outputs=MSLITE_OUTPUTS)
    batch = random_batch(MSLITE_INPUT)
    with create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32")) as backend:
        assert fake_mslite.calls == [
            ("Context()",), ("Context.target", ["cpu"]), ("Context.cpu.thread_num", 2), ("Model()",),
            ("Model.build_from_file", path, FakeModelType.MINDIR_LITE, ["cpu"]), ("Model.get_inputs",)]
        for _ in range(50):
            outputs = backend.infer(batch)
    np.testing.assert_allclose(outputs[0], batch.sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(outputs[1], batch.reshape(1, -1).mean(axis=1, keepdims=True), rtol=1e-6)
    names = fake_mslite.names()
    assert names.count("Model.build_from_file") == 1 and names.count("Model.get_inputs") == 1
    assert names.count("Model()") == 1 and names.count("Model.resize") == 0
    assert names.count("Model.predict") == 50 and names.count("Tensor.set_data_from_numpy") == 50
    feeds = [c for c in fake_mslite.calls if c[0] == "Tensor.set_data_from_numpy"]
    assert set(feeds) == {("Tensor.set_data_from_numpy", "images", MSLITE_INPUT, "float32", batch.nbytes)}


def test_mslite_fake_ascend_context_maps_device_and_precision(fake_mslite: FakeMindSporeLite,
                                                              tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.mindir"), "mslite-toy", MSLITE_INPUT)
    options = BackendOptions(device_id=1, cpu_threads=3, precision_mode="force_fp16", target="ascend")
    with create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32"), options):
        pass
    assert ("Context.target", ["ascend"]) in fake_mslite.calls
    assert ("Context.ascend.device_id", 1) in fake_mslite.calls
    assert ("Context.ascend.precision_mode", "enforce_fp16") in fake_mslite.calls
    assert ("Context.cpu.thread_num", 3) in fake_mslite.calls  # cpu is the backup target
    assert ("Model.build_from_file", path, FakeModelType.MINDIR, ["ascend"]) in fake_mslite.calls


def test_mslite_fake_bad_precision_mode_is_named(fake_mslite: FakeMindSporeLite, tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT)
    options = BackendOptions(precision_mode="fastest", target="ascend")
    backend = create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32"), options)
    with pytest.raises(BackendError, match="m.ms: options.precision_mode: precision_mode 'fastest' is not"):
        backend.load()
    assert "Model.build_from_file" not in fake_mslite.names()


def test_mslite_fake_resizes_only_when_the_model_shape_differs(fake_mslite: FakeMindSporeLite,
                                                               tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", (1, 3, 16, 16))
    with create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32")) as backend:
        assert backend.infer(random_batch(MSLITE_INPUT))[0].shape == (1, 8, 8)
    resizes = [c for c in fake_mslite.calls if c[0] == "Model.resize"]
    assert resizes == [("Model.resize", [list(MSLITE_INPUT)])]


def test_mslite_fake_dtype_mismatch_at_load_names_expected_and_got(fake_mslite, tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT, input_dtype="uint8")
    backend = create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32"))
    with pytest.raises(BackendError, match="m.ms: input dtype mismatch for 'images': expected float32, "
                                           "got uint8"):
        backend.load()
    assert not backend.loaded


def test_mslite_fake_per_call_size_checks_name_expected_and_got(fake_mslite, tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT)
    batch = random_batch(MSLITE_INPUT)
    with create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32")) as backend:
        backend._inputs[0]._shape = [1, 3, 8, 4]  # the runtime's tensor shrank: its own check refuses
        with pytest.raises(BackendError, match="m.ms: mslite inference failed: data size not equal! "
                                               "Numpy size: 768, Tensor size: 384"):
            backend.infer(batch)
        backend._input_nbytes = 384  # and our check refuses before calling the runtime
        with pytest.raises(BackendError, match="m.ms: input size mismatch for 'images': expected 384 bytes, "
                                               "got 768"):
            backend.infer(batch)


def test_mslite_fake_build_failure_names_the_file(fake_mslite: FakeMindSporeLite, tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT)
    fake_mslite.fail("Model.build_from_file", RuntimeError("build_from_file failed! Error is Ascend oom"))
    backend = create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32"))
    with pytest.raises(BackendError, match="m.ms: mindspore_lite build_from_file .* failed: .*Ascend oom"):
        backend.load()
    assert backend._model is None and backend._inputs == []


def test_mslite_pre_2_api_is_refused_as_unavailable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "mindspore_lite", FakeMindSporeLite(api="1.x"))
    path = write_toy_model(str(tmp_path / "m.ms"), "mslite-toy", MSLITE_INPUT)
    backend = create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32"))
    with pytest.raises(BackendUnavailable, match=r"MindSpore Lite >= 2.0 .*found 1.9.0"):
        backend.load()


# -- the REAL MindSpore Lite 2.0.0 (the Lite lane: Python 3.7) on the demo model converted from its ONNX ------
LITE_SPEC = TensorSpec("images", (1, 3, 256, 256), "float32")
LITE_OUTPUT = (1, 7, 1280)  # YOLOv8-style head of the demo model: 4 box + 3 class rows, 1280 anchors
LITE_BOX_ATOL = 1e-3  # box pixels, Lite vs OpenCV on the same ONNX (measured up to ~4e-4 on raw outputs)
LITE_SCORE_ATOL = 1e-5
LITE_RSS_CYCLES = 20
needs_mslite = pytest.mark.skipif(not lite_support.HAS_MSLITE, reason=lite_support.NO_MSLITE)


@pytest.fixture(scope="module")
def lite_bundle(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo bundle converted for cpu-dev by the real converter (ONNX -> .ms, both tiers)."""
    if not lite_support.HAS_MSLITE:
        pytest.skip(lite_support.NO_MSLITE)
    if not lite_support.has_demo():
        pytest.skip(lite_support.NO_DEMO)
    root, status, output = lite_support.convert_demo(str(tmp_path_factory.mktemp("lite") / "bundle"),
                                                     sys.executable)
    assert status == 0, output
    return root


@pytest.fixture(scope="module")
def lite_ms(lite_bundle: str) -> str:
    return os.path.join(lite_bundle, "shapes-det_256x256_cpu.ms")


def _detections(bundle: str, backend: str, images: List[np.ndarray]) -> List[np.ndarray]:
    from agent.bundle.verify import verify_bundle
    from agent.pipeline.model import load_model

    model = load_model(verify_bundle(bundle), load_device_config("cpu-dev"), backend)
    try:
        return [r.detections for r in model.infer_frames(images)]
    finally:
        model.close()


@needs_mslite
def test_mslite_real_matches_opencv_on_the_same_onnx_within_box_and_score_tolerances(lite_bundle: str) -> None:
    from agent.devtools.scenes import generate_scenes

    images = [np.load(os.path.join(lite_bundle, "golden", "case%d.npy" % i)) for i in (0, 1)]
    images += [scene[0] for hw in ((256, 256), (192, 320)) for scene in generate_scenes(11, 4, hw)]
    lite = _detections(lite_bundle, "mslite", images)
    cv = _detections(lite_bundle, "opencv", images)
    assert sum(len(d) for d in cv) >= len(images)  # the comparison is over real detections
    for index, (a, b) in enumerate(zip(lite, cv)):
        assert a.shape == b.shape, "image %d: %s vs %s detections" % (index, a.shape, b.shape)
        np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=0, atol=LITE_BOX_ATOL)
        np.testing.assert_allclose(a[:, 4], b[:, 4], rtol=0, atol=LITE_SCORE_ATOL)
        np.testing.assert_array_equal(a[:, 5], b[:, 5])


@needs_mslite
def test_mslite_real_reproduces_the_bundles_golden_set(lite_bundle: str) -> None:
    from agent.bundle.verify import verify_bundle
    from agent.pipeline.model import LoadedModel

    bundle = verify_bundle(lite_bundle)
    model = LoadedModel(bundle, load_device_config("cpu-dev"), "mslite")
    model.load()
    try:
        report = model.golden_check()
    finally:
        model.close()
    assert report.passed and report.cases == len(bundle.manifest.golden.cases), report


@needs_mslite
def test_mslite_real_refuses_a_corrupt_file_naming_it(tmp_path) -> None:
    path = str(tmp_path / "corrupt.ms")
    with open(path, "wb") as handle:
        handle.write(np.random.RandomState(3).bytes(4096))
    backend = create_backend("mslite", path, LITE_SPEC)
    with pytest.raises(BackendError, match=r"corrupt\.ms: mindspore_lite build_from_file .* failed"):
        backend.load()
    assert not backend.loaded


@needs_mslite
def test_mslite_real_refuses_a_spec_the_model_cannot_take(lite_ms: str) -> None:
    with pytest.raises(BackendError, match="input dtype mismatch for 'images': expected uint8, got float32"):
        create_backend("mslite", lite_ms, TensorSpec("images", LITE_SPEC.shape, "uint8")).load()


@needs_mslite
def test_mslite_real_outputs_are_copies_the_next_predict_does_not_touch(lite_ms: str) -> None:
    """Lite's get_data_to_numpy is a view the next predict overwrites: the backend must hand out copies."""
    with create_backend("mslite", lite_ms, LITE_SPEC) as backend:
        first = backend.infer(random_batch(LITE_SPEC.shape, seed=1))[0]
        kept = first.copy()
        for seed in range(2, 6):
            backend.infer(random_batch(LITE_SPEC.shape, seed=seed))
    np.testing.assert_array_equal(first, kept)


@needs_mslite
def test_mslite_real_close_reload_cycles_keep_rss_flat(lite_ms: str) -> None:
    data = random_batch(LITE_SPEC.shape)
    for _ in range(3):  # the runtime's one-time allocations (thread pool, allocator arenas)
        with create_backend("mslite", lite_ms, LITE_SPEC) as backend:
            backend.infer(data)
    gc.collect()
    before = _rss_mb()
    for _ in range(LITE_RSS_CYCLES):
        with create_backend("mslite", lite_ms, LITE_SPEC) as backend:
            backend.infer(data)
    gc.collect()
    assert _rss_mb() - before < RSS_MARGIN_MB


# -- pyACL against the FAKE stand-in -------------------------------------------------------------------------
@pytest.fixture
def fake_acl(monkeypatch: pytest.MonkeyPatch) -> FakeAcl:
    """FAKE pyACL (tests/fakes/fake_acl.py), not pyACL."""
    fake = FakeAcl()
    monkeypatch.setitem(sys.modules, "acl", fake)
    return fake


def acl_toy(tmp_path, outputs=ACL_OUTPUTS, shape=ACL_INPUT, dtype="uint8") -> str:
    return write_toy_model(str(tmp_path / "toy.om"), "acl-toy", shape, dtype, outputs=outputs)


def acl_spec(shape=ACL_INPUT, dtype="uint8") -> TensorSpec:
    return TensorSpec("images", shape, dtype)


OUTPUT_BINDING = ["acl.mdl.get_output_size_by_index", "acl.mdl.get_output_dims",
                  "acl.mdl.get_output_data_type", "acl.rt.malloc", "acl.util.bytes_to_ptr"]
LOAD_SEQUENCE = [
    "acl.init", "acl.rt.set_device", "acl.rt.create_context", "acl.rt.get_run_mode", "acl.mdl.load_from_file",
    "acl.mdl.create_desc", "acl.mdl.get_desc",
    "acl.mdl.get_num_inputs", "acl.mdl.get_input_size_by_index", "acl.rt.malloc",
    "acl.mdl.create_dataset", "acl.create_data_buffer", "acl.mdl.add_dataset_buffer",
    "acl.mdl.get_num_outputs", *OUTPUT_BINDING, *OUTPUT_BINDING,
    "acl.mdl.create_dataset", "acl.create_data_buffer", "acl.mdl.add_dataset_buffer",
    "acl.create_data_buffer", "acl.mdl.add_dataset_buffer",
]
TEARDOWN_SEQUENCE = [  # exact reverse of what LOAD_SEQUENCE created
    "acl.destroy_data_buffer", "acl.destroy_data_buffer", "acl.mdl.destroy_dataset", "acl.rt.free",
    "acl.rt.free", "acl.destroy_data_buffer", "acl.mdl.destroy_dataset", "acl.rt.free",
    "acl.mdl.destroy_desc", "acl.mdl.unload", "acl.rt.destroy_context", "acl.rt.reset_device",
]


def test_acl_fake_load_sequence_buffers_once_and_copy_kinds(fake_acl: FakeAcl, tmp_path) -> None:
    path = acl_toy(tmp_path)
    acl_mod.shutdown_acl()
    backend = create_backend("acl", path, acl_spec())
    backend.load()
    assert fake_acl.names() == LOAD_SEQUENCE
    mark = len(fake_acl.calls)
    batch = random_batch(ACL_INPUT, "uint8")
    for _ in range(100):
        outputs = backend.infer(batch)
    per_infer = fake_acl.names()[mark:]
    assert per_infer == ["acl.util.bytes_to_ptr", "acl.rt.memcpy", "acl.mdl.execute", "acl.rt.memcpy",
                         "acl.rt.memcpy"] * 100
    assert fake_acl.count("acl.rt.malloc") == 3 and fake_acl.executions == 100
    copies = fake_acl.calls_to("acl.rt.memcpy")[:3]
    in_size, sum_size, mean_size = batch.nbytes, 8 * 8 * 4, 1 * 4
    assert [(c.args[1], c.args[3], c.args[4]) for c in copies] == [
        (in_size, in_size, 1), (sum_size, sum_size, 2), (mean_size, mean_size, 2)]
    np.testing.assert_array_equal(outputs[0], batch.astype(np.float32).sum(axis=-1))
    np.testing.assert_allclose(outputs[1], [[batch.mean()]], rtol=1e-6)
    mark = len(fake_acl.calls)
    backend.close()
    assert fake_acl.names()[mark:] == TEARDOWN_SEQUENCE
    assert set(fake_acl.live().values()) == {0}
    assert fake_acl.violations == []
    acl_mod.shutdown_acl()
    acl_mod.shutdown_acl()
    assert fake_acl.count("acl.finalize") == 1  # at process end, not per model


def test_acl_fake_device_run_mode_copies_device_to_device(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    fake = FakeAcl(run_mode=ACL_DEVICE)
    monkeypatch.setitem(sys.modules, "acl", fake)
    batch = random_batch(ACL_INPUT, "uint8")
    with create_backend("acl", acl_toy(tmp_path), acl_spec()) as backend:
        out = backend.infer(batch)
    assert {c.args[4] for c in fake.calls_to("acl.rt.memcpy")} == {3}
    np.testing.assert_array_equal(out[0], batch.astype(np.float32).sum(axis=-1))


def test_acl_fake_old_cann_numpy_to_ptr_and_default_output_dtype(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path) -> None:
    fake = FakeAcl(legacy_pointers=True, output_data_type=False)
    monkeypatch.setitem(sys.modules, "acl", fake)
    batch = random_batch(ACL_INPUT, "uint8", seed=4)
    with create_backend("acl", acl_toy(tmp_path), acl_spec()) as backend:
        out = backend.infer(batch)
    assert "acl.util.numpy_to_ptr" in fake.names() and "acl.mdl.get_output_data_type" not in fake.names()
    assert out[0].dtype == np.float32
    np.testing.assert_array_equal(out[0], batch.astype(np.float32).sum(axis=-1))
    assert fake.violations == []


def test_acl_fake_float16_outputs_keep_the_models_dtype(fake_acl: FakeAcl, tmp_path) -> None:
    path = acl_toy(tmp_path, outputs=({"op": "sum_last", "dtype": "float16"},))
    batch = random_batch(ACL_INPUT, "uint8", seed=6)
    with create_backend("acl", path, acl_spec()) as backend:
        (out,) = backend.infer(batch)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, batch.astype(np.float32).sum(axis=-1).astype(np.float16))


def test_acl_fake_float_spec_against_a_uint8_aipp_model_is_refused_at_load(fake_acl: FakeAcl,
                                                                           tmp_path) -> None:
    backend = create_backend("acl", acl_toy(tmp_path), acl_spec(dtype="float32"))
    with pytest.raises(BackendError, match=r"toy.om: input size mismatch for 'images': expected 768 bytes "
                                           r"\(\(1, 8, 8, 3\) float32\), got 192 from the model"):
        backend.load()
    assert set(fake_acl.live().values()) == {0}


@pytest.mark.parametrize("code,meaning", sorted(acl_mod.ACL_ERRORS.items()))
def test_acl_fake_execute_error_codes_become_backend_errors(fake_acl: FakeAcl, tmp_path, code: int,
                                                            meaning: str) -> None:
    with create_backend("acl", acl_toy(tmp_path), acl_spec()) as backend:
        fake_acl.fail_on("acl.mdl.execute", code, call=fake_acl.count("acl.mdl.execute") + 1)
        with pytest.raises(BackendError) as err:
            backend.infer(random_batch(ACL_INPUT, "uint8"))
        expected = "%s: acl.mdl.execute failed: error %d: %s" % (backend.artifact_path, code, meaning)
        assert str(err.value) == expected
        assert backend.infer(random_batch(ACL_INPUT, "uint8"))  # a failed run leaves the model serving


@pytest.mark.parametrize("call,nth,code,text", [
    ("acl.rt.set_device", 1, 207004, "no device"),
    ("acl.mdl.load_from_file", 1, 100000, "invalid parameter"),
    ("acl.rt.malloc", 1, 207001, "device memory allocation failed"),
    ("acl.rt.malloc", 3, 207001, "device memory allocation failed"),
    ("acl.mdl.add_dataset_buffer", 2, 100000, "invalid parameter"),
])
def test_acl_fake_failed_load_releases_what_it_made_in_reverse(fake_acl: FakeAcl, tmp_path, call: str,
                                                               nth: int, code: int, text: str) -> None:
    fake_acl.fail_on(call, code, call=nth)
    backend = create_backend("acl", acl_toy(tmp_path), acl_spec())
    with pytest.raises(BackendError, match="toy.om: %s.* failed: error %d: %s" % (call, code, text)):
        backend.load()
    assert set(fake_acl.live().values()) == {0}, fake_acl.live()
    undo_of = {"acl.rt.set_device": "acl.rt.reset_device", "acl.rt.create_context": "acl.rt.destroy_context",
               "acl.mdl.load_from_file": "acl.mdl.unload", "acl.mdl.create_desc": "acl.mdl.destroy_desc",
               "acl.rt.malloc": "acl.rt.free", "acl.mdl.create_dataset": "acl.mdl.destroy_dataset",
               "acl.create_data_buffer": "acl.destroy_data_buffer"}
    names = fake_acl.names()
    failed_at = [i for i, n in enumerate(names) if n == call][nth - 1]
    made = [undo_of[n] for n in names[:failed_at] if n in undo_of]
    undone = [n for n in names[failed_at + 1:] if n in undo_of.values()]
    assert undone == made[::-1]
    assert not backend.loaded
    # the failure changed nothing: a retry with the fault gone loads and serves
    fake_acl.failures.clear()
    backend.load()
    assert len(backend.infer(random_batch(ACL_INPUT, "uint8"))) == 2
    backend.close()


def test_acl_fake_init_repeat_is_harmless_and_shared(fake_acl: FakeAcl, tmp_path) -> None:
    acl_mod.shutdown_acl()
    assert fake_acl.init() == 0  # someone else in the process initialised ACL first
    path = acl_toy(tmp_path)
    first = create_backend("acl", path, acl_spec())
    second = create_backend("acl", path, acl_spec())
    first.load()
    second.load()
    assert fake_acl.count("acl.init") == 2 and fake_acl.count("acl.rt.set_device") == 2
    first.close()
    assert len(second.infer(random_batch(ACL_INPUT, "uint8"))) == 2  # closing one model leaves the other
    second.close()
    assert set(fake_acl.live().values()) == {0}
    acl_mod.shutdown_acl()


def test_acl_fake_infer_on_another_thread_binds_the_context(fake_acl: FakeAcl, tmp_path) -> None:
    backend = create_backend("acl", acl_toy(tmp_path), acl_spec())
    backend.load()
    batch = random_batch(ACL_INPUT, "uint8", seed=8)
    results: List[object] = []
    worker = threading.Thread(target=lambda: results.extend(backend.infer(batch) for _ in range(3)))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(results) == 3
    assert fake_acl.count("acl.rt.set_context") == 1  # once for the worker thread, not per batch
    np.testing.assert_array_equal(results[0][0], batch.astype(np.float32).sum(axis=-1))
    backend.close()
    assert set(fake_acl.live().values()) == {0} and fake_acl.violations == []


@pytest.mark.skipif(importlib.util.find_spec("acl") is None,
                    reason="needs pyACL (acl module from the Ascend CANN toolkit) and an Ascend NPU")
def test_acl_real_runtime_runs_an_om(tmp_path) -> None:  # pragma: no cover - not run here
    om = os.environ.get("ATLAS_EDGE_TEST_OM")
    if not om:
        pytest.skip("set ATLAS_EDGE_TEST_OM=model.om and ATLAS_EDGE_TEST_OM_INPUT='1,640,640,3:uint8'")
    dims, dtype = os.environ.get("ATLAS_EDGE_TEST_OM_INPUT", "1,640,640,3:uint8").split(":")
    spec = TensorSpec("images", tuple(int(d) for d in dims.split(",")), dtype)
    with create_backend("acl", om, spec) as backend:
        first = backend.infer(random_batch(spec.shape, dtype))
        again = backend.infer(random_batch(spec.shape, dtype))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


# -- issue 12: the stand-ins are no kinder than the real modules ---------------------------------------------
def test_acl_fake_bytes_to_ptr_refuses_non_bytes_with_value_error_as_pyacl_does(fake_acl: FakeAcl) -> None:
    for wrong in (bytearray(8), np.zeros(8, np.uint8), memoryview(b"12345678")):
        with pytest.raises(ValueError, match="bytes_to_ptr needs bytes"):
            fake_acl.util.bytes_to_ptr(wrong)


def test_acl_fake_cann8_reserved_copy_kind_still_serves(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """CANN 8.x ignores memcpy's kind (the pointers say the direction): the backend must not depend on it."""
    fake = FakeAcl(kind_reserved=True)
    monkeypatch.setitem(sys.modules, "acl", fake)
    batch = random_batch(ACL_INPUT, "uint8")
    with create_backend("acl", acl_toy(tmp_path), acl_spec()) as backend:
        outputs = backend.infer(batch)
    np.testing.assert_array_equal(outputs[0], batch.astype(np.float32).sum(axis=-1))
    assert fake.violations == []


def test_acl_init_is_once_per_process_and_a_load_after_finalize_is_refused(fake_acl: FakeAcl, tmp_path) -> None:
    path = acl_toy(tmp_path)
    for _ in range(3):  # swaps: one acl.init for all of them, no finalize
        with create_backend("acl", path, acl_spec()) as backend:
            backend.infer(random_batch(ACL_INPUT, "uint8"))
    assert fake_acl.count("acl.init") == 1 and fake_acl.count("acl.finalize") == 0
    acl_mod.shutdown_acl()  # what atexit does
    late = create_backend("acl", path, acl_spec())
    with pytest.raises(BackendError, match="pyACL was finalized in this process.*restart the process"):
        late.load()
    assert fake_acl.count("acl.init") == 1 and fake_acl.violations == []


def test_closing_the_acl_model_leaves_an_mslite_fallback_on_the_npu_running(
        fake_acl: FakeAcl, fake_mslite: FakeMindSporeLite, tmp_path) -> None:
    acl_backend = create_backend("acl", acl_toy(tmp_path), acl_spec())
    acl_backend.load()
    lite_path = write_toy_model(str(tmp_path / "toy.mindir"), "mslite-toy", MSLITE_INPUT, outputs=MSLITE_OUTPUTS)
    lite = create_backend("mslite", lite_path, TensorSpec("images", MSLITE_INPUT, "float32"),
                          BackendOptions(target="ascend", precision_mode="force_fp16"))
    lite.load()
    acl_backend.close()
    assert fake_acl.count("acl.finalize") == 0 and fake_acl.initialized  # the device stays up for Lite
    batch = random_batch(MSLITE_INPUT)
    np.testing.assert_allclose(lite.infer(batch)[0], batch.sum(axis=1), rtol=1e-6)
    lite.close()


def test_mslite_fake_is_zero_copy_and_its_outputs_are_views_the_backend_copies(
        fake_mslite: FakeMindSporeLite, tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "toy.ms"), "mslite-toy", MSLITE_INPUT, outputs=MSLITE_OUTPUTS)
    with create_backend("mslite", path, TensorSpec("images", MSLITE_INPUT, "float32")) as backend:
        # a Fortran-ordered batch is made contiguous into a temporary that must live through predict
        first_batch = np.asfortranarray(random_batch(MSLITE_INPUT, seed=1))
        first = backend.infer(first_batch)[0]
        backend.infer(random_batch(MSLITE_INPUT, seed=2))
    np.testing.assert_allclose(first, first_batch.sum(axis=1), rtol=1e-6)  # not overwritten by predict 2
    model = fake_mslite.models[-1]
    tensor = model._output_tensors[0]
    view = tensor.get_data_to_numpy()
    assert not view.flags["OWNDATA"]  # as Lite 2.0.0: a view into the output buffer


def test_mslite_fake_refuses_a_predict_whose_input_array_was_freed(fake_mslite: FakeMindSporeLite,
                                                                   tmp_path) -> None:
    path = write_toy_model(str(tmp_path / "toy.ms"), "mslite-toy", MSLITE_INPUT, outputs=MSLITE_OUTPUTS)
    lite = fake_mslite
    model = lite.Model()
    model.build_from_file(path, lite.ModelType.MINDIR_LITE, lite.Context())
    inputs = model.get_inputs()
    inputs[0].set_data_from_numpy(random_batch(MSLITE_INPUT))  # nobody keeps this array
    gc.collect()
    with pytest.raises(RuntimeError, match="freed before predict"):
        model.predict(inputs)


def test_pick_backend_follows_the_device_order_against_what_the_bundle_serves() -> None:
    from agent.pipeline.backends import pick_backend

    everything = {"mslite": "ok", "mindspore": "ok", "opencv": "ok", "acl": "module 'acl' not found"}
    cpu = ("mslite", ["mindspore", "opencv"], "ms")
    assert pick_backend(*cpu, served={"ms", "mindir", "onnx"}, status=everything) == "mslite"
    # a MindSpore 2.7 MindIR is not a Lite artifact: without a .ms the preferred Lite is passed over
    assert pick_backend(*cpu, served={"mindir", "onnx"}, status=everything) == "mindspore"
    assert pick_backend(*cpu, served={"ms", "onnx"}, status=dict(everything, mslite="missing")) == "opencv"
    assert pick_backend(*cpu, served=None, status=everything) == "mslite"  # bundle unknown: runtimes alone
    # an Ascend box whose bundle holds only .om for another runtime: the preferred one, whose load names the gap
    assert pick_backend("acl", ["mslite"], "om", served={"om"}, status=everything) == "acl"


def test_cpu_dev_prefers_onnxruntime_and_keeps_lite_off_a_mindspore_mindir() -> None:
    from agent.pipeline.backends import backend_for, pick_backend

    device = load_device_config("cpu-dev")
    assert (device.backend, device.artifact_format) == ("onnxruntime", "onnx")
    cpu = (device.backend, device.fallback_backends, device.artifact_format)
    narrowed = {"serve_formats": device.serve_formats}
    everything = {"onnxruntime": "ok", "mslite": "ok", "mindspore": "ok", "opencv": "ok", "acl": "missing"}
    assert pick_backend(*cpu, served={"ms", "mindir", "onnx"}, status=everything, **narrowed) == "onnxruntime"
    no_ort = dict(everything, onnxruntime="module 'onnxruntime' not found")
    assert pick_backend(*cpu, served={"ms", "mindir", "onnx"}, status=no_ort, **narrowed) == "mslite"
    # Lite 2.0 cannot read MindSpore 2.7's MindIR: without a .ms the MindSpore runtime serves it, not Lite
    assert pick_backend(*cpu, served={"mindir", "onnx"}, status=no_ort, **narrowed) == "mindspore"
    assert pick_backend(*cpu, served={"mindir", "onnx"}, status=no_ort) == "mslite"  # what the narrowing stops
    assert pick_backend(*cpu, served={"onnx"}, status=dict(no_ort, mindspore="missing"), **narrowed) == "opencv"
    if importlib.util.find_spec("onnxruntime") is not None:  # both lanes install it: the demo serves on it
        from agent.bundle.manifest import load_manifest

        assert backend_for(device, load_manifest(DEMO_BUNDLE)) == "onnxruntime"


def test_serve_formats_and_onnxruntime_settings_are_checked_naming_the_field() -> None:
    from agent.config.device_config import DeviceConfig
    from agent.config.schema import ConfigError, parse

    base = {"name": "box", "target": "cpu", "backend": "onnxruntime", "artifact_format": "onnx",
            "memory_budget_mb": 512}
    for bad, field in (({"serve_formats": {"mslite": ["om"]}}, "serve_formats"),
                       ({"serve_formats": {"tflite": ["onnx"]}}, "serve_formats"),
                       ({"onnxruntime": {"execution_mode": "eager"}}, "onnxruntime.execution_mode"),
                       ({"onnxruntime": {"allow_spining": True}}, "onnxruntime.allow_spining")):
        with pytest.raises(ConfigError) as err:
            parse(DeviceConfig, dict(base, **bad))
        assert [e.path for e in err.value.errors] == [field], bad
    device = parse(DeviceConfig, dict(base, serve_formats={"mslite": ["ms"]}))
    assert device.backend_formats("mslite") == ("ms",) and device.backend_formats("opencv") == ("onnx",)
