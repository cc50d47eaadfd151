"""agent/bundle/ and `atlas-edge bundle`: every refusal names its field or file, and nothing bad passes.

The bundles here hold stand-in artifact bytes (the verifier hashes files, it does not run them); loading and
golden checks with real backends are covered in test_model_manager.py.
"""

import argparse
import io
import json
import os
import re
import shutil
import stat
import sys
import tarfile

import pytest

from agent.bundle.manifest import MANIFEST, SIGNATURE, BundleError
from agent.bundle.signing import load_public_key, sign_bundle
from agent.bundle.verify import sha256_file, verify_bundle, write_manifest
from agent.cli import bundle as bundle_cli
from agent.config.device_config import load_device_config
from agent.lifecycle.fetch import unpack_archive
from agent.pipeline.artifacts import pick_tier, select_artifacts
from tests.support.bundle_support import artifact, fields, make_bundle
from tests.support.needs import needs_cryptography


def messages(exc):
    return " | ".join(str(e) for e in exc.errors)


def key_pair(tmp_path):
    private_pem, public_pem, public_hex = bundle_cli.make_key_pair()
    (tmp_path / "k.key").write_bytes(private_pem)
    (tmp_path / "k.pub").write_bytes(public_pem)
    return private_pem, public_hex


# --- verify_bundle --------------------------------------------------------------------------------------

def test_a_good_bundle_verifies_and_pins_the_manifest_hash(tmp_path):
    make_bundle(tmp_path / "b")
    bundle = verify_bundle(str(tmp_path / "b"))
    assert bundle.manifest_sha256 == sha256_file(str(tmp_path / "b" / MANIFEST))
    assert bundle.signed is False
    assert bundle.label == "unit 1.0.0"
    assert sorted(bundle.manifest.files) == ["golden/case0.npy", "golden/case0.out.npy"]


def test_the_manifest_is_an_ordinary_readable_file_like_the_artifacts(tmp_path):
    """A bundle is copied and served by other users: the atomic write must not leave its manifest at 0600."""
    make_bundle(tmp_path / "b")
    assert stat.S_IMODE(os.stat(str(tmp_path / "b" / MANIFEST)).st_mode) == 0o644


def test_schema_errors_name_every_bad_field(tmp_path):
    root = tmp_path / "b"
    data = make_bundle(root)
    del data["version"]
    data["artifacts"][0]["format"] = "tflite"
    data["preprocessing"] = {"colour": "rgb"}
    data["input"]["tiers"] = [[0, 32]]
    (root / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert set(fields(info.value)) >= {"version", "artifacts[0].format", "preprocessing.colour",
                                       "input.tiers[0]"}
    assert "unknown key" in messages(info.value)


def test_an_artifact_tier_outside_input_tiers_is_named(tmp_path):
    root = tmp_path / "b"
    data = make_bundle(root)
    data["artifacts"][0]["tier"] = [64, 64]
    (root / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert fields(info.value) == ["artifacts[0].tier"]
    assert "[64, 64] is not one of input.tiers [[32, 32]]" in messages(info.value)


def test_broken_json_names_the_manifest(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    (root / MANIFEST).write_text("{")
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert fields(info.value) == ["manifest.json"]


def test_hash_mismatch_names_the_file(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    body = bytearray((root / "model.onnx").read_bytes())
    body[0] ^= 0xFF  # same size, different bytes
    (root / "model.onnx").write_bytes(bytes(body))
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert fields(info.value) == ["artifacts[0].sha256"]
    assert "hash mismatch for model.onnx" in messages(info.value)


def test_size_mismatch_and_missing_file_are_named(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    with open(str(root / "golden" / "case0.npy"), "ab") as handle:
        handle.write(b"x")
    os.remove(str(root / "golden" / "case0.out.npy"))
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert sorted(fields(info.value)) == ["files[golden/case0.npy].size", "files[golden/case0.out.npy]"]
    assert "file missing: golden/case0.out.npy" in messages(info.value)


def test_an_unlisted_file_makes_the_bundle_invalid(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    (root / "notes.txt").write_text("not in the manifest")
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root))
    assert fields(info.value) == ["files"]
    assert "unlisted file in bundle: notes.txt" in messages(info.value)


def test_write_manifest_refuses_an_invalid_manifest_and_leaves_the_old_one(tmp_path):
    root = tmp_path / "b"
    data = make_bundle(root)
    before = (root / MANIFEST).read_bytes()
    data["task"] = "segment"
    with pytest.raises(BundleError) as info:
        write_manifest(str(root), data)
    assert fields(info.value) == ["task"]
    assert (root / MANIFEST).read_bytes() == before
    assert sorted(os.listdir(str(root))) == ["golden", MANIFEST, "model.onnx"]


# --- compatibility and tiers -------------------------------------------------------------------------------

def test_wrong_soc_version_names_both_values(tmp_path):
    root = tmp_path / "b"
    make_bundle(root, [artifact("model.om", format="om", target="ascend", soc_version="Ascend310P3",
                                input_dtype="uint8", normalize_on="aipp")])
    bundle = verify_bundle(str(root))
    with pytest.raises(BundleError) as info:
        select_artifacts(bundle, load_device_config("atlas-200dk"), "acl")
    assert fields(info.value) == ["artifacts[0].soc_version"]
    text = messages(info.value)
    assert "model.om was built for Ascend310P3, device atlas-200dk is Ascend310" in text
    # the same bundle on the box it was built for
    chosen = select_artifacts(bundle, load_device_config("atlas-300i-pro"), "acl")
    assert [a.file for a in chosen.values()] == ["model.om"]


def test_an_ascend_only_bundle_on_a_cpu_box_names_the_target(tmp_path):
    root = tmp_path / "b"
    make_bundle(root, [artifact("model.mindir", format="mindir", target="ascend", soc_version="Ascend310B4")])
    bundle = verify_bundle(str(root))
    with pytest.raises(BundleError) as info:
        select_artifacts(bundle, load_device_config("cpu-dev"), "mindspore")
    assert fields(info.value) == ["artifacts[0].target"]
    assert "model.mindir is for ascend, device cpu-dev is cpu" in messages(info.value)


def test_no_artifact_for_the_backend_names_the_formats(tmp_path):
    make_bundle(tmp_path / "b")
    bundle = verify_bundle(str(tmp_path / "b"))
    with pytest.raises(BundleError, match="no serve artifact for backend mindspore"):
        select_artifacts(bundle, load_device_config("cpu-dev"), "mindspore")
    with pytest.raises(BundleError, match="unknown backend 'tensorrt'"):
        select_artifacts(bundle, load_device_config("cpu-dev"), "tensorrt")


def test_select_prefers_the_artifact_whose_batch_matches(tmp_path):
    root = tmp_path / "b"
    make_bundle(root, [artifact("m1.onnx", batch=1), artifact("m4.onnx", batch=4),
                       artifact("convert.onnx", role="convert")])
    bundle = verify_bundle(str(root))
    device = load_device_config("cpu-dev")
    assert select_artifacts(bundle, device, "opencv", batch=4)[(32, 32)].file == "m4.onnx"
    assert select_artifacts(bundle, device, "opencv", batch=2)[(32, 32)].file == "m1.onnx"  # smallest


@pytest.mark.parametrize("src_hw, expected", [
    ((1080, 1920), (192, 320)),  # 16:9 is nearest to 5:3
    ((480, 480), (256, 256)),
    ((1920, 1080), (256, 256)),  # portrait: the square pads less than the landscape tier
    ((600, 1000), (192, 320)),  # exactly 5:3
])
def test_pick_tier_golden_values(src_hw, expected):
    assert pick_tier([(256, 256), (192, 320)], src_hw) == expected


def test_pick_tier_ties_go_to_the_larger_tier():
    assert pick_tier([(128, 128), (256, 256)], (100, 100)) == (256, 256)
    with pytest.raises(ValueError):
        pick_tier([(128, 128)], (0, 10))


# --- signatures ------------------------------------------------------------------------------------------

@needs_cryptography
def test_signature_good_bad_and_missing_with_a_configured_key(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    private_pem, public_hex = key_pair(tmp_path)
    with pytest.raises(BundleError) as info:  # key configured, bundle unsigned
        verify_bundle(str(root), bytes.fromhex(public_hex))
    assert fields(info.value) == ["manifest.sig"]
    assert "missing: this box requires signed bundles" in messages(info.value)

    assert sign_bundle(str(root), private_pem) == public_hex
    bundle = verify_bundle(str(root), load_public_key(public_hex))
    assert bundle.signed is True
    assert verify_bundle(str(root), load_public_key(str(tmp_path / "k.pub"))).signed  # PEM form of the key

    other_hex = bundle_cli.make_key_pair()[2]
    with pytest.raises(BundleError, match="signature does not match the manifest and key"):
        verify_bundle(str(root), bytes.fromhex(other_hex))


def test_without_cryptography_a_signed_bundle_is_refused_naming_the_package(tmp_path, monkeypatch):
    """A box-only install without the ``edge`` extra: a configured key cannot be checked, so nothing serves."""
    root = tmp_path / "b"
    make_bundle(root)
    (root / SIGNATURE).write_bytes(b"\0" * 64)
    for name in ["cryptography"] + [m for m in sys.modules if m.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it (or a loaded submodule) raises ImportError
    with pytest.raises(BundleError) as info:
        verify_bundle(str(root), b"\1" * 32)
    assert fields(info.value) == ["manifest.sig"]
    assert "signature checks need the 'cryptography' package" in messages(info.value)


@needs_cryptography
def test_editing_a_signed_manifest_breaks_the_signature(tmp_path):
    root = tmp_path / "b"
    make_bundle(root)
    private_pem, public_hex = key_pair(tmp_path)
    sign_bundle(str(root), private_pem)
    data = json.loads((root / MANIFEST).read_text())
    data["postprocessing"] = {"conf": 0.01}
    (root / MANIFEST).write_text(json.dumps(data))  # by hand: the signature file stays
    with pytest.raises(BundleError, match="signature does not match"):
        verify_bundle(str(root), bytes.fromhex(public_hex))


@needs_cryptography
def test_rewriting_the_manifest_removes_the_stale_signature(tmp_path):
    root = tmp_path / "b"
    data = make_bundle(root)
    private_pem, _hex = key_pair(tmp_path)
    sign_bundle(str(root), private_pem)
    write_manifest(str(root), dict(data, version="1.0.1"))
    assert not (root / SIGNATURE).exists()


def test_a_bad_public_key_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        load_public_key("abcd")


# --- archives --------------------------------------------------------------------------------------------

def _tar_with(path, members):
    with tarfile.open(str(path), "w:gz") as tar:
        for name, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = b"x"
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            elif kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = "/etc/passwd"
                tar.addfile(info)
            elif kind == "device":
                info.type = tarfile.CHRTYPE
                tar.addfile(info)


@pytest.mark.parametrize("name, kind, reason", [
    ("../evil.txt", "file", "archive member escapes the bundle: ../evil.txt"),
    ("bundle/../../evil.txt", "file", "escapes the bundle"),
    ("/tmp/abs.txt", "file", "archive member escapes the bundle: /tmp/abs.txt"),
    ("link", "symlink", "archive member is not a plain file: link"),
    ("dev", "device", "archive member is not a plain file: dev"),
])
def test_unsafe_tar_members_are_refused_before_anything_is_written(tmp_path, name, kind, reason):
    archive = tmp_path / "bad.tar.gz"
    _tar_with(archive, [("manifest.json", "file"), (name, kind)])
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(BundleError) as info:
        unpack_archive(str(archive), str(dest))
    assert reason in messages(info.value)
    assert os.listdir(str(dest)) == []
    assert not (tmp_path / "evil.txt").exists()


def test_a_tar_with_one_top_directory_unpacks_to_a_verifiable_bundle(tmp_path):
    make_bundle(tmp_path / "shapes-1")
    archive = tmp_path / "shapes-1.tar.gz"
    with tarfile.open(str(archive), "w:gz") as tar:
        tar.add(str(tmp_path / "shapes-1"), arcname="shapes-1")
    dest = tmp_path / "out"
    dest.mkdir()
    root = unpack_archive(str(archive), str(dest))
    assert root == str(dest / "shapes-1")
    assert verify_bundle(root).manifest.name == "unit"


def test_a_tar_without_a_manifest_is_refused(tmp_path):
    archive = tmp_path / "empty.tar.gz"
    _tar_with(archive, [("readme.txt", "file")])
    (tmp_path / "out").mkdir()
    with pytest.raises(BundleError, match="missing at the archive's root"):
        unpack_archive(str(archive), str(tmp_path / "out"))


# --- atlas-edge bundle verify | sign | keygen ------------------------------------------------------------

def cli(*argv):
    parser = argparse.ArgumentParser()
    bundle_cli.add_arguments(parser)
    return bundle_cli.run(parser.parse_args(list(argv)))


@needs_cryptography
def test_cli_keygen_sign_verify(tmp_path, capsys):
    root = tmp_path / "b"
    make_bundle(root)
    prefix = str(tmp_path / "fleet")
    assert cli("keygen", prefix) == 0
    public_hex = capsys.readouterr().out.split("public hex")[1].strip()
    assert len(public_hex) == 64
    assert stat.S_IMODE(os.stat(prefix + ".key").st_mode) == 0o600
    assert cli("keygen", prefix) == 2  # never overwrites a key
    assert "refusing to overwrite" in capsys.readouterr().err

    assert cli("verify", str(root), "--public-key", public_hex) == 1
    assert "manifest.sig: missing" in capsys.readouterr().err
    assert cli("sign", str(root), "--key", prefix + ".key") == 0
    assert public_hex in capsys.readouterr().out
    assert cli("verify", str(root), "--public-key", prefix + ".pub") == 0
    out = capsys.readouterr().out
    assert "signature        present" in out and out.rstrip().endswith("OK")


def test_cli_verify_refuses_a_tampered_bundle_naming_the_file(tmp_path, capsys):
    root = tmp_path / "b"
    make_bundle(root)
    (root / "model.onnx").write_bytes(b"stand-in model bytes for model.onnX")
    assert cli("verify", str(root)) == 1
    assert "artifacts[0].sha256: hash mismatch for model.onnx" in capsys.readouterr().err


@needs_cryptography
def test_cli_sign_refuses_a_broken_bundle_and_writes_no_signature(tmp_path, capsys):
    root = tmp_path / "b"
    make_bundle(root)
    assert cli("keygen", str(tmp_path / "k")) == 0
    (root / "extra.bin").write_bytes(b"?")
    assert cli("sign", str(root), "--key", str(tmp_path / "k.key")) == 1
    assert "unlisted file in bundle: extra.bin" in capsys.readouterr().err
    assert not (root / SIGNATURE).exists()


def test_cli_verify_checks_the_device_and_reads_archives(tmp_path, capsys):
    root = tmp_path / "b"
    make_bundle(root)
    assert cli("verify", str(root), "--device", "atlas-200dk") == 1
    assert "no serve artifact for backend acl" in capsys.readouterr().err
    assert cli("verify", str(root), "--device", "cpu-dev", "--backend", "opencv") == 0
    assert "cpu-dev/opencv serves      tier 32x32 with model.onnx" in capsys.readouterr().out
    archive = tmp_path / "b.tar.gz"
    with tarfile.open(str(archive), "w:gz") as tar:
        tar.add(str(root), arcname="b")
    assert cli("verify", str(archive)) == 0
    assert cli("verify", str(root), "--run-golden") == 2  # needs --device
    shutil.rmtree(str(root))
    assert cli("verify", str(root)) == 1


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEMO_BUNDLE = os.path.join(REPO, "examples", "demo-bundle")


@pytest.mark.skipif(not os.path.isdir(DEMO_BUNDLE), reason="examples/demo-bundle is not in this checkout")
def test_cli_verify_runs_the_demo_bundles_golden_set_with_opencv(capsys):
    assert cli("verify", DEMO_BUNDLE, "--device", "cpu-dev", "--backend", "opencv", "--run-golden") == 0
    out = capsys.readouterr().out
    assert "shapes-det" in out
    assert re.search(r"golden set       passed: [1-9]\d* case\(s\), max abs diff", out)
