"""Golden AIPP files, converter configs and ATC/converter_lite argument lists for every device config, all run
through the documented grammar (converters/grammar.py), and proof that the grammar rejects what it should.

The expected texts below were written by hand from the documented formulas (min_chn = mean,
var_reci = 1/std, BT.601 limited-range matrix), not produced by the code under test.
"""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.bundle.verify import write_manifest
from agent.config.device_config import known_devices, load_device_config
from converters import grammar
from converters.convert import ConvertError, ConvertRequest, plan_conversion

TIERS = [(64, 64), (48, 80)]
IMAGENET_RGB = {"color": "rgb", "mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375]}
IMAGENET_BGR = {"color": "bgr", "mean": [103.53, 116.28, 123.675], "std": [57.375, 57.12, 58.395]}
SCALE_RGB = {"color": "rgb", "mean": [0.0, 0.0, 0.0], "std": [255.0, 255.0, 255.0]}
CALIBRATION_COUNT = 4


def make_bundle(root, preprocessing, calibration=True):
    """A bundle with float ONNX and MindIR artifacts per tier (placeholder bytes: planning reads none)."""
    os.makedirs(root)
    artifacts = []
    for height, width in TIERS:
        for fmt in ("onnx", "mindir"):
            name = "golden_%dx%d.%s" % (height, width, fmt)
            with open(os.path.join(root, name), "wb") as handle:
                handle.write(b"placeholder " + name.encode())
            artifacts.append({"file": name, "format": fmt, "target": "cpu", "tier": [height, width],
                              "sha256": "", "size": 0})
    manifest = {
        "schema": 1, "name": "golden", "version": "1.0.0", "created": "2026-11-29T00:00:00Z",
        "task": "detect-yolov8", "labels": ["a", "b", "c"],
        "input": {"name": "images", "layout": "NCHW", "dtype": "float32", "tiers": [list(t) for t in TIERS]},
        "preprocessing": dict(preprocessing, letterbox={"pad_value": 114, "center": True, "scaleup": True}),
        "artifacts": artifacts,
    }
    if calibration:
        os.makedirs(os.path.join(root, "calibration"))
        for i in range(CALIBRATION_COUNT):
            with open(os.path.join(root, "calibration", "%03d.bin" % i), "wb") as handle:
                handle.write(bytes(64 * 64 * 3 * 4))
        manifest["calibration"] = {"dir": "calibration", "layout": "NHWC", "dtype": "float32",
                                   "tier": [64, 64], "count": CALIBRATION_COUNT}
    write_manifest(root, manifest)
    return root


@pytest.fixture
def bundles(tmp_path):
    return {
        "imagenet-rgb": make_bundle(str(tmp_path / "imagenet-rgb"), IMAGENET_RGB),
        "imagenet-bgr": make_bundle(str(tmp_path / "imagenet-bgr"), IMAGENET_BGR),
        "x255-rgb": make_bundle(str(tmp_path / "x255-rgb"), SCALE_RGB),
    }


def _plan(bundle, device, to, **options):
    return plan_conversion(ConvertRequest(bundle=bundle, device=device, to=to, **options))


def _file(job, suffix):
    (found,) = [f for f in job.files if f.path.endswith(suffix)]
    return found


def _body(text):
    """The text without its '#' header lines (those explain; the keys are what the tool reads)."""
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))


# --- golden outputs -----------------------------------------------------------------------------------------

GOLDEN_AIPP_IMAGENET_RGB_NET_BGR_IN_64 = """\
aipp_op {
  aipp_mode : static
  input_format : RGB888_U8
  src_image_size_w : 64
  src_image_size_h : 64
  csc_switch : false
  rbuv_swap_switch : true
  mean_chn_0 : 0
  min_chn_0 : 123.675
  var_reci_chn_0 : 0.0171247538
  mean_chn_1 : 0
  min_chn_1 : 116.28
  var_reci_chn_1 : 0.0175070028
  mean_chn_2 : 0
  min_chn_2 : 103.53
  var_reci_chn_2 : 0.0174291939
}
"""


def test_golden_atc_for_atlas_200dk_imagenet_bgr_input(bundles):
    plan = _plan(bundles["imagenet-rgb"], "atlas-200dk", "om", tiers=[(64, 64)])
    (job,) = plan.jobs
    aipp_file = _file(job, ".cfg")
    assert aipp_file.path == "convert/aipp_64x64_bgr.cfg"
    assert _body(aipp_file.text) == GOLDEN_AIPP_IMAGENET_RGB_NET_BGR_IN_64
    assert aipp_file.text.startswith("# static AIPP written by atlas-edge convert")
    assert job.cmd == [
        "atc", "--model=golden_64x64.onnx", "--framework=5", "--output=golden_64x64_Ascend310",
        "--input_shape=images:1,3,64,64", "--input_format=NCHW", "--soc_version=Ascend310",
        "--insert_op_conf=convert/aipp_64x64_bgr.cfg", "--precision_mode=force_fp16", "--output_type=FP32",
        "--log=error", "--host_env_os=linux", "--host_env_cpu=aarch64",  # the 200 DK's CPU, not the host's
    ]
    assert job.output == "golden_64x64_Ascend310.om" and job.toolchain == {"arch": "aarch64"}
    assert job.artifact["input_dtype"] == "uint8" and job.artifact["input_layout"] == "NHWC"
    assert job.artifact["normalize_on"] == "aipp" and job.artifact["input_color"] == "bgr"
    assert job.artifact["precision"] == "float16" and job.artifact["soc_version"] == "Ascend310"
    assert job.artifact["config_files"] == ["convert/aipp_64x64_bgr.cfg"]


def test_golden_bgr_network_with_bgr_input_needs_no_swap_on_atlas_300i_pro(bundles):
    (job, _second) = _plan(bundles["imagenet-bgr"], "atlas-300i-pro", "om").jobs
    body = _body(_file(job, ".cfg").text)
    assert "  rbuv_swap_switch : false\n" in body
    assert "  min_chn_0 : 103.53\n  var_reci_chn_0 : 0.0174291939\n" in body
    assert "  min_chn_2 : 123.675\n  var_reci_chn_2 : 0.0171247538\n" in body
    assert "--soc_version=Ascend310P3" in job.cmd


def test_golden_rgb_input_to_rgb_network_needs_no_swap(bundles):
    (job, _second) = _plan(bundles["imagenet-rgb"], "atlas-200dk", "om", input_format="rgb").jobs
    assert "  rbuv_swap_switch : false\n" in _file(job, "_rgb.cfg").text
    assert job.artifact["input_color"] == "rgb"


GOLDEN_AIPP_X255_RGB_NET_YUV_IN_48x80 = """\
aipp_op {
  aipp_mode : static
  input_format : YUV420SP_U8
  src_image_size_w : 80
  src_image_size_h : 48
  csc_switch : true
  rbuv_swap_switch : false
  matrix_r0c0 : 298
  matrix_r0c1 : 0
  matrix_r0c2 : 409
  matrix_r1c0 : 298
  matrix_r1c1 : -100
  matrix_r1c2 : -208
  matrix_r2c0 : 298
  matrix_r2c1 : 516
  matrix_r2c2 : 0
  input_bias_0 : 16
  input_bias_1 : 128
  input_bias_2 : 128
  mean_chn_0 : 0
  min_chn_0 : 0
  var_reci_chn_0 : 0.00392156863
  mean_chn_1 : 0
  min_chn_1 : 0
  var_reci_chn_1 : 0.00392156863
  mean_chn_2 : 0
  min_chn_2 : 0
  var_reci_chn_2 : 0.00392156863
}
"""

GOLDEN_INI_ASCEND_YUV_48x80 = """\
[ascend_context]
precision_mode=enforce_fp16
output_type=FP32
insert_op_config_file_path=convert/aipp_48x80_yuv420sp.cfg
"""


def test_golden_converter_for_atlas_200i_dk_a2_x255_yuv420sp(bundles):
    plan = _plan(bundles["x255-rgb"], "atlas-200i-dk-a2", "ms", tiers=[(48, 80)], input_format="yuv420sp")
    (job,) = plan.jobs
    assert _body(_file(job, ".cfg").text) == GOLDEN_AIPP_X255_RGB_NET_YUV_IN_48x80
    ini = _file(job, ".ini")
    assert ini.path == "convert/converter_golden_48x80_Ascend310B4.ini"
    assert _body(ini.text) == GOLDEN_INI_ASCEND_YUV_48x80
    assert job.cmd == [
        "converter_lite", "--fmk=MINDIR", "--modelFile=golden_48x80.mindir",
        "--outputFile=golden_48x80_Ascend310B4",
        "--configFile=convert/converter_golden_48x80_Ascend310B4.ini",
        "--inputShape=images:1,3,48,80", "--optimize=ascend_oriented", "--saveType=MINDIR",
    ]
    assert job.output == "golden_48x80_Ascend310B4.mindir"
    assert job.artifact["format"] == "mindir" and job.artifact["target"] == "ascend"
    assert job.artifact["input_color"] == "yuv420sp"


def test_golden_yuv_rows_swap_for_a_bgr_network_on_atlas_500(bundles):
    (job, _second) = _plan(bundles["imagenet-bgr"], "atlas-500", "om", input_format="yuv420sp").jobs
    body = _body(_file(job, ".cfg").text)
    assert ("  matrix_r0c0 : 298\n  matrix_r0c1 : 516\n  matrix_r0c2 : 0\n"
            "  matrix_r1c0 : 298\n  matrix_r1c1 : -100\n  matrix_r1c2 : -208\n"
            "  matrix_r2c0 : 298\n  matrix_r2c1 : 0\n  matrix_r2c2 : 409\n") in body


def test_golden_cpu_dev_ms_is_float_without_config(bundles):
    (job, _second) = _plan(bundles["imagenet-rgb"], "cpu-dev", "ms").jobs
    assert job.files == []
    assert job.cmd == [
        "converter_lite", "--fmk=MINDIR", "--modelFile=golden_64x64.mindir", "--outputFile=golden_64x64_cpu",
        "--inputShape=images:1,3,64,64", "--optimize=general", "--saveType=MINDIR_LITE",
        "--inputDataFormat=NCHW",  # the device-side converter's default is NHWC; the agent feeds NCHW
    ]
    assert job.output == "golden_64x64_cpu.ms"
    keys = ("input_dtype", "input_layout", "normalize_on", "input_color", "precision")
    assert [job.artifact[k] for k in keys] == ["float32", "NCHW", "host", "rgb", "float32"]


GOLDEN_INI_CPU_PTQ = """\
[common_quant_param]
quant_type=FULL_QUANT
bit_num=8
[full_quant_param]
activation_quant_method=MAX_MIN
bias_correction=true
per_channel=true
[data_preprocess_param]
calibrate_path=images:calibration
calibrate_size=4
input_type=BIN
"""


def test_golden_ptq_on_cpu_omits_target_device(bundles):
    (job,) = _plan(bundles["imagenet-rgb"], "cpu-dev", "ms", tiers=[(64, 64)], ptq=True).jobs
    assert _body(_file(job, ".ini").text) == GOLDEN_INI_CPU_PTQ
    assert job.output == "golden_64x64_cpu_int8.ms" and job.artifact["precision"] == "int8"


def test_golden_ptq_on_ascend_targets_the_npu(bundles):
    (job,) = _plan(bundles["imagenet-rgb"], "atlas-200i-dk-a2", "ms", tiers=[(64, 64)], ptq=True).jobs
    sections = grammar.check_lite_config(_file(job, ".ini").text)
    assert sections["full_quant_param"]["target_device"] == "ASCEND"
    assert sections["ascend_context"]["insert_op_config_file_path"] == "convert/aipp_64x64_bgr.cfg"
    assert "--optimize=ascend_oriented" in job.cmd


# --- every device config x preprocessing x input format through the grammar ---------------------------------

@pytest.mark.parametrize("device_name", known_devices())
@pytest.mark.parametrize("spec", ["imagenet-rgb", "imagenet-bgr", "x255-rgb"])
def test_every_device_config_generates_grammatical_output(bundles, device_name, spec):
    device = load_device_config(device_name)
    checked = 0
    formats = ["bgr", "rgb", "yuv420sp"] if device.target == "ascend" else [None]
    for to in ("om", "ms"):
        for input_format in formats:
            for ptq in (False, True):
                if to == "om" and (ptq or device.target != "ascend"):
                    with pytest.raises(ConvertError):
                        _plan(bundles[spec], device_name, to, ptq=ptq, input_format=input_format)
                    continue
                plan = _plan(bundles[spec], device_name, to, ptq=ptq, input_format=input_format,
                             tiers=[(64, 64)] if ptq else None)
                assert len(plan.jobs) == (1 if ptq else len(TIERS))
                for job in plan.jobs:
                    for generated in job.files:
                        if generated.path.endswith(".cfg"):
                            grammar.check_aipp(generated.text)
                        else:
                            grammar.check_lite_config(generated.text)
                    if to == "om":
                        flags = grammar.check_atc_args(job.cmd[1:])
                        assert flags["soc_version"] == device.soc_version
                        assert flags["precision_mode"] == device.precision_mode
                    else:
                        flags = grammar.check_converter_args(job.cmd[1:])
                        expected = "ascend_oriented" if device.target == "ascend" else "general"
                        assert flags["optimize"] == expected
                    checked += 1
    # ascend: 3 input formats x (om: 2 tiers, ms: 2 tiers, ms --ptq: 1 tier); cpu: ms 2 tiers + ms --ptq 1
    assert checked == (3 * (2 + 2 + 1) if device.target == "ascend" else 2 + 1)


def test_om_on_a_cpu_box_is_refused_with_a_reason(bundles):
    with pytest.raises(ConvertError) as info:
        _plan(bundles["imagenet-rgb"], "cpu-dev", "om")
    assert "--to om" in str(info.value) and "cpu" in str(info.value)


def test_bad_requests_name_the_option(bundles):
    cases = [
        ({"device": "atlas-200dk", "to": "om", "tiers": [(320, 320)]}, "--tiers: 320x320"),
        ({"device": "atlas-200dk", "to": "om", "ptq": True}, "--ptq"),
        ({"device": "no-such-box", "to": "om"}, "no-such-box"),
        ({"device": "cpu-dev", "to": "ms", "input_format": "yuv420sp"}, "--input-format"),
        ({"device": "cpu-dev", "to": "ms", "ptq": True, "tiers": [(48, 80)]}, "calibration.tier"),
        ({"device": "atlas-200dk", "to": "om", "timeout_s": 0}, "--timeout"),
    ]
    for options, expected in cases:
        with pytest.raises(ConvertError) as info:
            plan_conversion(ConvertRequest(bundle=bundles["imagenet-rgb"], **options))
        assert expected in str(info.value), (options, str(info.value))


# --- the validator rejects what is not documented -----------------------------------------------------------

def test_documented_aipp_sample_is_accepted():
    """An AIPP file in the style of the Ascend samples (crop keys, fractional min_chn, 1/0 booleans)."""
    sample = """
    aipp_op{
        aipp_mode:static
        input_format : YUV420SP_U8
        src_image_size_w : 224
        src_image_size_h : 224
        crop: false
        load_start_pos_h : 0
        crop_size_w : 224
        csc_switch : 1
        rbuv_swap_switch : 0
        mean_chn_0 : 123
        min_chn_0 : 0.675
        var_reci_chn_0: 0.0171
        matrix_r0c0: 256
        matrix_r0c1: 0
        matrix_r0c2: 359
        matrix_r1c0: 256
        matrix_r1c1: -88
        matrix_r1c2: -183
        matrix_r2c0: 256
        matrix_r2c1: 454
        matrix_r2c2: 0
        input_bias_0: 16
        input_bias_1: 128
        input_bias_2: 128}
    """
    (block,) = grammar.check_aipp(sample)
    assert block["matrix_r1c1"] == "-88" and block["crop"] == "false"


GOOD_AIPP = GOLDEN_AIPP_IMAGENET_RGB_NET_BGR_IN_64


@pytest.mark.parametrize("broken, expected", [
    (GOOD_AIPP.replace("mean_chn_1", "mean_chn_l"), "mean_chn_l: unknown key"),
    (GOOD_AIPP.replace("RGB888_U8", "RGB888"), "input_format: 'RGB888' is not one of"),
    (GOOD_AIPP.replace("csc_switch : false", "csc_switch : yes"), "csc_switch: 'yes'"),
    (GOOD_AIPP.replace("mean_chn_0 : 0", "mean_chn_0 : 123.675"), "mean_chn_0: '123.675' is not an integer"),
    (GOOD_AIPP.replace("min_chn_0 : 123.675", "min_chn_0 : 300"), "min_chn_0: '300'"),
    (GOOD_AIPP.replace("  src_image_size_w : 64\n", ""), "src_image_size_w: required"),
    (GOOD_AIPP.replace("aipp_mode : static", "aipp_mode : static\n  aipp_mode : static"), "given twice"),
    (GOOD_AIPP.replace("csc_switch : false", "csc_switch : true"), "matrix_r0c0: required"),
    (GOOD_AIPP.replace("RGB888_U8", "YUV420SP_U8").replace("_w : 64", "_w : 63"), "must be even"),
    (GOOD_AIPP.replace("}", ""), "missing '}'"),
    (GOOD_AIPP.replace("aipp_op {", "aipp {"), "expected 'aipp_op {'"),
])
def test_aipp_validator_rejects(broken, expected):
    with pytest.raises(grammar.GrammarError) as info:
        grammar.check_aipp(broken)
    assert expected in str(info.value)


GOOD_INI = GOLDEN_INI_ASCEND_YUV_48x80 + GOLDEN_INI_CPU_PTQ


@pytest.mark.parametrize("broken, expected", [
    (GOOD_INI.replace("[ascend_context]", "[ascend_contxt]"), "[ascend_contxt]: unknown section"),
    (GOOD_INI.replace("output_type=FP32", "output_dtype=FP32"), "output_dtype: unknown key"),
    (GOOD_INI.replace("enforce_fp16", "force_fp16"), "precision_mode: 'force_fp16' is not one of"),
    (GOOD_INI.replace("bit_num=8", "bit_num=4"), "bit_num: must be 8 for FULL_QUANT"),
    (GOOD_INI.replace("input_type=BIN\n", ""), "input_type: required for FULL_QUANT"),
    (GOOD_INI.replace("per_channel=true", "per_channel=yes"), "per_channel: 'yes'"),
    (GOOD_INI.replace("calibrate_size=4", "calibrate_size=0"), "calibrate_size: '0'"),
    ("precision_mode=enforce_fp16\n" + GOOD_INI, "outside any [section]"),
    (GOOD_INI + "[ascend_context]\nprovider=ge\n", "section [ascend_context] given twice"),
    (GOOD_INI.replace("quant_type=FULL_QUANT", "quant_type=WEIGHT_QUANT"), "[full_quant_param]: only valid"),
])
def test_converter_config_validator_rejects(broken, expected):
    grammar.check_lite_config(GOOD_INI)
    with pytest.raises(grammar.GrammarError) as info:
        grammar.check_lite_config(broken)
    assert expected in str(info.value)


GOOD_CONVERTER = ["--fmk=ONNX", "--modelFile=m.onnx", "--outputFile=m", "--inputShape=images:1,3,64,64",
                  "--optimize=general", "--saveType=MINDIR_LITE"]
GOOD_ATC = ["--model=m.onnx", "--framework=5", "--output=m", "--input_shape=images:1,3,64,64",
            "--soc_version=Ascend310B4", "--precision_mode=force_fp16", "--log=error"]


def _swap(args, old, new):
    return [new if a == old else a for a in args]


@pytest.mark.parametrize("args, expected", [
    (GOOD_CONVERTER + ["--output_file=x"], "--output_file: unknown flag"),
    (_swap(GOOD_CONVERTER, "--optimize=general", "--optimize=ascend"), "--optimize: 'ascend'"),
    (GOOD_CONVERTER[1:], "--fmk: required"),
    (_swap(GOOD_CONVERTER, "--outputFile=m", "--outputFile=m.ms"), "without the .ms/.mindir suffix"),
    (_swap(GOOD_CONVERTER, "--inputShape=images:1,3,64,64", "--inputShape=images:-1,3,64,64"), "fixed dims"),
    (GOOD_CONVERTER + ["model.onnx"], "expected --name=value"),
    (GOOD_CONVERTER + ["--fmk=MINDIR"], "--fmk: given twice"),
])
def test_converter_flag_validator_rejects(args, expected):
    grammar.check_converter_args(GOOD_CONVERTER)
    with pytest.raises(grammar.GrammarError) as info:
        grammar.check_converter_args(args)
    assert expected in str(info.value)


@pytest.mark.parametrize("args, expected", [
    (GOOD_ATC + ["--soc=Ascend310"], "--soc: unknown flag"),
    (_swap(GOOD_ATC, "--soc_version=Ascend310B4", "--soc_version=Ascend311"), "--soc_version: 'Ascend311'"),
    (_swap(GOOD_ATC, "--framework=5", "--framework=2"), "--framework: '2'"),
    (_swap(GOOD_ATC, "--output=m", "--output=m.om"), "without the .om suffix"),
    (_swap(GOOD_ATC, "--input_shape=images:1,3,64,64", "--input_shape=images:-1,3,64,64"), "-1 needs"),
    (_swap(GOOD_ATC, "--precision_mode=force_fp16", "--precision_mode=enforce_fp16"), "--precision_mode"),
    ([a for a in GOOD_ATC if not a.startswith("--soc_version")], "--soc_version: required"),
    (GOOD_ATC + ["--dynamic_batch_size=1,2,4"], "needs -1 in --input_shape"),
])
def test_atc_flag_validator_rejects(args, expected):
    grammar.check_atc_args(GOOD_ATC)
    with pytest.raises(grammar.GrammarError) as info:
        grammar.check_atc_args(args)
    assert expected in str(info.value)


def test_atc_accepts_documented_dynamic_batch():
    args = _swap(GOOD_ATC, "--input_shape=images:1,3,64,64", "--input_shape=images:-1,3,64,64")
    assert grammar.check_atc_args(args + ["--dynamic_batch_size=1,2,4,8"])["dynamic_batch_size"] == "1,2,4,8"


IDENTIFIER = st.from_regex(r"[a-z][a-z0-9_]{0,24}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(IDENTIFIER)
def test_any_undocumented_aipp_key_is_rejected(key):
    documented = set(grammar.AIPP_STATIC_KEYS) | set(grammar.AIPP_COMMON_KEYS) | {"aipp_op"}
    text = GOOD_AIPP.replace("}", "  %s : 1\n}" % key)
    if key in documented:
        return
    with pytest.raises(grammar.GrammarError) as info:
        grammar.check_aipp(text)
    assert "%s: unknown key" % key in str(info.value)


@settings(max_examples=60, deadline=None)
@given(IDENTIFIER)
def test_any_undocumented_flag_is_rejected(name):
    for check, good, documented in ((grammar.check_atc_args, GOOD_ATC, grammar.ATC_FLAGS),
                                    (grammar.check_converter_args, GOOD_CONVERTER, grammar.CONVERTER_FLAGS)):
        if name in documented:
            continue
        with pytest.raises(grammar.GrammarError) as info:
            check(good + ["--%s=1" % name])
        assert "--%s: unknown flag" % name in str(info.value)


# --- issue 12: what the published ATC / converter_lite pages say, each checked -----------------------------

def test_atc_refuses_nhwc_for_an_onnx_model_and_takes_the_documented_formats():
    base = ["--model=m.onnx", "--framework=5", "--output=m", "--soc_version=Ascend310"]
    for fmt in ("NCHW", "NCDHW", "ND"):
        grammar.check_atc_args(base + ["--input_format=%s" % fmt])
    with pytest.raises(grammar.GrammarError, match="for an ONNX model .* ATC takes NCHW, NCDHW, ND"):
        grammar.check_atc_args(base + ["--input_format=NHWC"])
    grammar.check_atc_args(["--model=m.pb", "--framework=3", "--output=m", "--soc_version=Ascend310",
                            "--input_format=NHWC"])  # TensorFlow may say NHWC


def test_an_nhwc_bundle_is_refused_for_atc_not_relabelled(tmp_path):
    root = make_bundle(str(tmp_path / "nhwc"), IMAGENET_RGB, calibration=False)
    import json

    path = os.path.join(root, "manifest.json")
    with open(path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    manifest["input"]["layout"] = "NHWC"
    write_manifest(root, manifest)
    with pytest.raises(ConvertError, match="input.layout is NHWC, but ATC reads an ONNX model's input as "
                                           "NCHW/NCDHW/ND only"):
        _plan(root, "atlas-200dk", "om")


def test_host_env_comes_from_the_device_arch_and_is_absent_when_unknown(bundles):
    a2 = _plan(bundles["imagenet-rgb"], "atlas-200i-dk-a2", "om").jobs[0]
    assert a2.cmd[-2:] == ["--host_env_os=linux", "--host_env_cpu=aarch64"] and a2.toolchain == {"arch": "aarch64"}
    card = _plan(bundles["imagenet-rgb"], "atlas-300i-pro", "om").jobs[0]  # a PCIe card: the host's CPU
    assert not any(c.startswith("--host_env") for c in card.cmd) and card.toolchain == {}
    with pytest.raises(grammar.GrammarError, match="--host_env_os and --host_env_cpu go together"):
        grammar.check_atc_args(["--model=m.onnx", "--framework=5", "--output=m", "--soc_version=Ascend310",
                                "--host_env_cpu=aarch64"])


def test_calibrate_path_joins_inputs_with_a_comma():
    from converters import lite_config

    assert lite_config.calibrate_path([("a", "d1"), ("b", "d2")]) == "a:d1,b:d2"
    ok = "[common_quant_param]\nquant_type=FULL_QUANT\nbit_num=8\n[data_preprocess_param]\n" \
         "calibrate_path=a:d1,b:d2\ncalibrate_size=4\ninput_type=BIN\n"
    grammar.check_lite_config(ok)
    with pytest.raises(grammar.GrammarError, match="calibrate_path"):
        grammar.check_lite_config(ok.replace("a:d1,b:d2", "a:d1;b:d2"))


def test_the_200i_dk_a2_serves_pyacl_first_and_lite_as_the_fallback():
    device = load_device_config("atlas-200i-dk-a2")
    assert (device.backend, device.fallback_backends, device.artifact_format) == ("acl", ["mslite"], "om")
    assert device.arch == "aarch64" and device.soc_version == "Ascend310B4"
