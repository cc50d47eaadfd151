"""atlas-edge qat: bad input fails fast with an error naming the file or field, and changes nothing."""

import os
import subprocess
import sys

import cv2
import numpy as np
import pytest
import yaml

from quant import cli
from quant.datasets import DatasetError, load_image_folder, load_yolo, parse_yolo_labels

pytest.importorskip("mindspore")
pytest.importorskip("mindspore_gs")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def write_config(directory, **overrides):
    config = {
        "name": "bad-input",
        "task": "classify",
        "data": {"kind": "digits"},
        "network": {"kind": "classifier", "options": {"width": 8}},
        "export": {"tiers": [[32, 32]]},
        "train": {"epochs": 1},
        "qat": {"epochs": 1},
    }
    for key, value in overrides.items():
        config[key] = value
    path = os.path.join(str(directory), "qat.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config, handle)
    return path


def run_cli(config_path, out_dir, *extra):
    return cli.main(
        ["--config", config_path, "--out", str(out_dir), "--work-dir", str(out_dir) + ".work"] + list(extra)
    )


def image_folder(root, broken=None):
    rng = np.random.default_rng(0)
    for label in ("cat", "dog"):
        os.makedirs(os.path.join(root, label))
        for i in range(3):
            cv2.imwrite(os.path.join(root, label, "%d.png" % i), rng.integers(0, 255, (20, 24, 3), np.uint8))
    if broken:
        with open(os.path.join(root, "dog", broken), "wb") as handle:
            handle.write(b"this is not a png")


def test_help_lists_the_options():
    result = subprocess.run(
        [sys.executable, "-m", "quant.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for option in ("--config", "--out", "--epochs", "--device", "--resume", "cpu,gpu,ascend"):
        assert option in result.stdout.replace("{", "").replace("}", "")


def test_missing_data_directory_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-images"
    config = write_config(tmp_path, data={"kind": "imagefolder", "root": str(missing)})
    assert run_cli(config, tmp_path / "bundle") == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such directory" in err
    assert not (tmp_path / "bundle").exists()


def test_unknown_config_key_is_named(tmp_path, capsys):
    config = write_config(tmp_path, train={"epochs": 1, "learning_rat": 0.1})
    assert run_cli(config, tmp_path / "bundle") == 2
    assert "train.learning_rat: unknown key" in capsys.readouterr().err


def test_undecodable_image_is_named(tmp_path):
    image_folder(str(tmp_path / "data"), broken="broken.png")
    with pytest.raises(DatasetError, match="broken.png: not a decodable image"):
        load_image_folder(str(tmp_path / "data"), (32, 32), _spec(), 0.3, 0)


def test_yolo_label_out_of_range_names_file_and_line(tmp_path):
    os.makedirs(tmp_path / "images")
    os.makedirs(tmp_path / "labels")
    cv2.imwrite(str(tmp_path / "images" / "a.jpg"), np.zeros((40, 60, 3), np.uint8))
    (tmp_path / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n2 0.5 0.5 0.1 0.1\n")
    with pytest.raises(DatasetError, match=r"a\.txt:2: class 2 out of range 0\.\.1"):
        load_yolo(str(tmp_path), ["circle", "square"], (32, 32), _spec(), 0.5, 0)
    (tmp_path / "labels" / "a.txt").write_text("0 0.5 0.5 1.2 0.2\n")
    with pytest.raises(DatasetError, match=r"a\.txt:1: coordinates must be normalised"):
        parse_yolo_labels(str(tmp_path / "labels" / "a.txt"), 2, (40, 60))


def test_yolo_labels_map_to_pixels(tmp_path):
    label = tmp_path / "a.txt"
    label.write_text("1 0.5 0.25 0.2 0.5\n\n")
    boxes, classes = parse_yolo_labels(str(label), 2, (40, 100))
    np.testing.assert_allclose(boxes, [[40, 0, 60, 20]])
    assert classes.tolist() == [1]


def test_tier_not_divisible_by_stride_fails_before_training(tmp_path, capsys):
    config = write_config(
        tmp_path,
        task="detect-yolov8",
        data={"kind": "shapes", "train_count": 4},
        network={"kind": "detector"},
        export={"tiers": [[256, 256], [200, 320]]},
    )
    assert run_cli(config, tmp_path / "bundle") == 2
    err = capsys.readouterr().err
    assert "export.tiers[1]: [200, 320] is not divisible by the network stride 16" in err
    assert not (tmp_path / "bundle").exists() and not (tmp_path / "bundle.work").exists()


def test_checkpoint_that_does_not_match_the_network_is_named(tmp_path, capsys):
    import mindspore as ms

    from quant.networks import SmallClassifier

    checkpoint = str(tmp_path / "wide.ckpt")
    ms.save_checkpoint(SmallClassifier(10, width=16), checkpoint)
    config = write_config(
        tmp_path, network={"kind": "classifier", "options": {"width": 8}, "checkpoint": checkpoint}
    )
    assert run_cli(config, tmp_path / "bundle") == 2
    err = capsys.readouterr().err
    assert "wide.ckpt does not match the network" in err and "shape mismatch" in err


def test_existing_directory_that_is_not_a_bundle_is_left_alone(tmp_path, capsys):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert run_cli(write_config(tmp_path), out) == 2
    assert "is not a bundle; refusing to replace it" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def test_negative_epochs_rejected(tmp_path, capsys):
    assert run_cli(write_config(tmp_path), tmp_path / "bundle", "--epochs", "-1") == 2
    assert "--epochs must be >= 0" in capsys.readouterr().err


def _spec():
    from agent.pipeline.preprocess import PreprocessSpec

    return PreprocessSpec()


def test_user_network_by_import_path():
    from quant.networks import SmallClassifier, build_network

    network = build_network("quant.networks:SmallClassifier", 4, {"width": 8})
    assert isinstance(network, SmallClassifier) and network.num_classes == 4
    with pytest.raises(ValueError, match="no_such_module"):
        build_network("no_such_module:Net", 4)
    with pytest.raises(ValueError, match="expected classifier, detector or package.module:Class"):
        build_network("resnet", 4)
