"""ModelManager: hot swap between batches, refusals that change nothing, automatic rollback, crash recovery.

Real inference throughout: a tiny network that MindSpore exported to ONNX and MindIR, committed in
``tests/data/tiny-classify`` (rebuilt by ``tests/data/build_tiny_bundle.py``), served by OpenCV's DNN (fast
loads; all a box-only install needs) and, in one test, by MindSpore itself. MindSpore also computed the golden
outputs, so the golden self-test compares OpenCV against an independent reference. A small loop in the tests
plays the daemon's serving thread: ``handover.run_pending(); between_batches(); current.infer_frames(...);
record_batch(...)``.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from agent.bundle.manifest import MANIFEST, BundleError
from agent.bundle.signing import sign_bundle
from agent.bundle.verify import sha256_file
from agent.cli.bundle import make_key_pair
from agent.config.schema import ConfigError, parse
from agent.errors import CommandError
from agent.lifecycle.fetch import FetchError
from agent.lifecycle.model_manager import release_key
from agent.lifecycle.probation import CONFIRM, ROLLBACK, Window
from agent.lifecycle.slots import CONFIRMED, EMPTY, PENDING, STANDBY, load_slots
from agent.lifecycle.store import STAGING_DIR
from agent.pipeline import backends
from agent.pipeline.backends.opencv_backend import OpenCvBackend
from tests.conftest import wait_for
from tests.support import lifecycle_support as lifecycle
from tests.support.clock_support import ManualClock
from tests.support.lifecycle_support import (
    BATCH,
    LONG_WINDOW_S,
    NOISE_PROOF_FACTOR,
    REPO,
    WAIT_S,
    Harness,
    ServingLoop,
    assert_unchanged,
    deploy_request,
    new_version,
    no_progress,
    snapshot,
)
from tests.support.needs import needs_cryptography, needs_mindspore

base_bundle = lifecycle.base_bundle  # fixtures: the committed tiny bundle, and a model manager on it
harness = lifecycle.harness

RSS_MARGIN_MB = 60.0  # 50 deploy/rollback cycles must not grow the process by more than this


# --- start ------------------------------------------------------------------------------------------------

def test_the_manifest_the_daemon_read_is_the_one_a_first_start_installs(harness, base_bundle):
    """The daemon reads model.bundle's manifest once (the backend is chosen by it) and hands it in: a first start
    installs the bundle only if the copy it verifies still has that manifest."""
    from agent.bundle.manifest import load_manifest
    from agent.lifecycle.model_manager import ModelManager

    h = harness()
    read = load_manifest(base_bundle)

    def manager(manifest):
        return ModelManager(lambda: h.config, h.device, "opencv", on_event=h.events.append, handover=h.handover,
                            manifest=manifest)

    changed = manager(replace(read, version="9.9.9"))  # the file changed between the daemon's read and the copy
    with pytest.raises(BundleError, match="model.bundle changed while the daemon started"):
        changed.start()
    changed.close()
    assert not os.path.exists(h.state_file) and not os.listdir(os.path.join(h.store, "slots"))  # nothing installed
    same = manager(read)
    assert same.start().label == "tiny 1.0.0" and same.manifest is read
    same.close()


def test_first_start_imports_the_bundle_into_slot_a_and_a_restart_keeps_it(harness, base_bundle):
    h = harness()
    model = h.manager.start()
    assert model.label == "tiny 1.0.0" and model.backend_name == "opencv"
    status = h.manager.status()
    assert status["serving"] == "a"
    assert status["slots"]["a"]["state"] == CONFIRMED
    assert status["slots"]["a"]["manifest_sha256"] == sha256_file(os.path.join(base_bundle, MANIFEST))
    assert status["slots"]["b"]["state"] == EMPTY
    [slot_dir] = h.slot_dirs()
    assert slot_dir.startswith("a-")
    h.manager.close()

    again = harness()
    assert again.manager.start().label == "tiny 1.0.0"
    assert again.slot_dirs() == [slot_dir]
    assert again.events == []


def _truncated(path):
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(data[:len(data) // 2])  # a write cut short by a power loss


def _random_bytes(path):
    with open(path, "wb") as handle:
        handle.write(np.random.default_rng(5).integers(0, 256, size=200, dtype=np.uint8).tobytes())


def _wrong_schema(path):
    with open(path, "w") as handle:
        json.dump({"schema": 1, "serving": "c", "name": ["not", "a", "string"], "slots": []}, handle)


DAMAGE = {"truncated": _truncated, "random-bytes": _random_bytes, "wrong-schema": _wrong_schema}


def _serves(manager, batches=3):
    """The manager serves: a few batches through its current model with no error."""
    with ServingLoop(manager) as loop:
        loop.wait_batches(batches)
    assert loop.errors == 0 and all(fed == got for _l, fed, got in loop.log)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_slot_table_is_set_aside_and_the_configured_bundle_serves(harness, damage):
    h = harness()
    h.manager.start()
    h.manager.close()
    DAMAGE[damage](h.state_file)
    again = harness()
    assert again.manager.start().label == "tiny 1.0.0"
    [event] = again.events_named("slots_reset")
    assert os.path.exists(event["moved_to"]) and event["moved_to"].startswith(again.state_file + ".corrupt-")
    assert event["reason"]
    assert load_slots(again.state_file).serving == "a"
    _serves(again.manager)


def _damage_bundle(h, slot_dir, damage):
    """Truncate the artifact, or replace the manifest with random bytes or with JSON of another schema."""
    target = "model_32x32.onnx" if damage == "truncated" else MANIFEST
    DAMAGE[damage](os.path.join(h.store, slot_dir, target))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_confirmed_bundle_at_start_is_set_aside_and_the_standby_serves(harness, base_bundle, damage):
    h = harness(observation_s=0.2)
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    with ServingLoop(h.manager):
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        h.wait_for_event("confirmed")
    h.manager.close()
    confirmed_dir = load_slots(h.state_file).slots["b"].bundle
    _damage_bundle(h, confirmed_dir, damage)

    again = harness()
    assert again.manager.start().label == "tiny 1.0.0"
    [moved] = again.events_named("bundle_moved_aside")
    assert moved["slot"] == "b" and moved["model"]["version"] == "2.0.0"
    assert moved["moved_to"].startswith(os.path.join(again.store, confirmed_dir) + ".corrupt-")
    assert os.path.isdir(moved["moved_to"]) and not os.path.exists(os.path.join(again.store, confirmed_dir))
    [event] = again.events_named("rollback")
    assert event["trigger"] == "restart" and "slot b (tiny 2.0.0) failed verification" in event["reason"]
    assert event["to"]["version"] == "1.0.0"
    status = again.manager.status()
    assert status["serving"] == "a"
    assert (status["slots"]["a"]["state"], status["slots"]["b"]["state"]) == (CONFIRMED, EMPTY)
    assert status["last_rollback"]["version"] == "2.0.0"
    _serves(again.manager)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_only_bundle_at_start_is_set_aside_and_the_configured_one_imported(harness, damage):
    h = harness()
    h.manager.start()
    h.manager.close()
    [slot_dir] = h.slot_dirs()
    _damage_bundle(h, "slots/" + slot_dir, damage)

    again = harness()
    assert again.manager.start().label == "tiny 1.0.0"
    [moved] = again.events_named("bundle_moved_aside")
    assert moved["slot"] == "a" and os.path.isdir(moved["moved_to"])
    table = load_slots(again.state_file)
    assert table.serving == "a" and table.slots["b"].state == EMPTY
    assert sorted(again.slot_dirs()) == sorted([slot_dir, os.path.basename(moved["moved_to"])])
    _serves(again.manager)


# --- deploy: the switch ------------------------------------------------------------------------------------

def test_deploy_switches_between_batches_without_losing_a_frame(harness, base_bundle):
    h = harness()
    old = h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    messages = []
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(10)
        result = h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), messages.append)
        assert h.manager.current.label == "tiny 2.0.0"  # switched before deploy returned
        loop.wait_batches(10)
    assert result == {"slot": "b", "state": "pending",
                      "model": {"name": "tiny", "version": "2.0.0", "manifest_sha256": sha},
                      "previous": {"name": "tiny", "version": "1.0.0",
                                   "manifest_sha256": old.bundle.manifest_sha256},
                      "observation_s": LONG_WINDOW_S}
    assert loop.errors == 0
    assert all(fed == got for _label, fed, got in loop.log)  # every frame fed got a result
    labels = [label for label, _fed, _got in loop.log]
    assert set(labels) == {"tiny 1.0.0", "tiny 2.0.0"}
    first_new = labels.index("tiny 2.0.0")
    assert labels[:first_new] == ["tiny 1.0.0"] * first_new  # old, then new: exactly one change
    assert labels[first_new:] == ["tiny 2.0.0"] * (len(labels) - first_new)
    assert first_new >= 10
    assert [m.split(" ")[0] for m in messages] == ["fetching", "verifying", "loading", "switching"]
    table = load_slots(h.state_file)
    assert (table.serving, table.slots["b"].state, table.slots["a"].state) == ("b", PENDING, CONFIRMED)
    [switched] = h.events_named("switched")
    assert switched["slot"] == "b" and switched["state"] == "pending"
    assert h.manager.status()["pending"]["frames"] > 0
    assert len(h.slot_dirs()) == 2


def test_a_healthy_window_confirms_and_the_store_keeps_two_bundles(harness, base_bundle):
    h = harness(observation_s=0.3)
    h.manager.start()
    v1_dir = h.slot_dirs()
    sha2 = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    sha3 = new_version(base_bundle, h.incoming("tiny-3"), "3.0.0")
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(6)
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha2}), no_progress)
        confirmed = h.wait_for_event("confirmed")
        assert confirmed["slot"] == "b" and confirmed["model"]["version"] == "2.0.0"
        assert confirmed["figures"]["frames"] >= 1 and confirmed["figures"]["observed_s"] >= 0.3
        status = h.manager.status()
        assert (status["slots"]["a"]["state"], status["slots"]["b"]["state"]) == (STANDBY, CONFIRMED)

        h.events.clear()
        deployed = h.manager.deploy(deploy_request({"bundle": "incoming/tiny-3", "sha256": sha3}), no_progress)
        assert deployed["slot"] == "a"
        h.wait_for_event("confirmed")
        assert len(h.slot_dirs()) == 2 and not set(v1_dir) & set(h.slot_dirs())  # 1.0.0 removed

        h.events.clear()
        result = h.manager.rollback()  # nothing pending: back to the previous confirmed model
        assert result["model"]["version"] == "2.0.0" and result["rolled_back"]["version"] == "3.0.0"
        loop.wait_batches(3)
        assert loop.log[-1][0] == "tiny 2.0.0"
    [event] = h.events_named("rollback")
    assert event["trigger"] == "operator" and event["to"]["version"] == "2.0.0"
    status = h.manager.status()
    assert status["serving"] == "b"
    assert (status["slots"]["a"]["state"], status["slots"]["b"]["state"]) == (STANDBY, CONFIRMED)
    assert loop.errors == 0 and all(fed == got for _l, fed, got in loop.log)


DEMO_BUNDLE = os.path.join(REPO, "examples", "demo-bundle")


@pytest.mark.skipif(not os.path.isdir(DEMO_BUNDLE), reason="examples/demo-bundle is not in this checkout")
def test_the_demo_detector_swaps_on_both_tiers_without_losing_a_frame(tmp_path):
    """The committed shapes detector (two tiers, YOLOv8 decode) through a deploy and an operator rollback."""
    from agent.devtools.scenes import generate_scene

    h = Harness(tmp_path, DEMO_BUNDLE)
    try:
        old = h.manager.start()
        assert sorted(old.tiers) == [(192, 320), (256, 256)]
        sha = new_version(DEMO_BUNDLE, h.incoming("demo-1.0.1"), "1.0.1")
        with ServingLoop(h.manager) as loop:
            rng = np.random.default_rng(5)
            loop.frames = [generate_scene(rng, (360, 640))[0], generate_scene(rng, (300, 300))[0]]
            assert [old.tier_for(f.shape[:2]) for f in loop.frames] == [(192, 320), (256, 256)]
            loop.wait_batches(5)
            h.manager.deploy(deploy_request({"bundle": "incoming/demo-1.0.1", "sha256": sha}), no_progress)
            loop.wait_batches(5)
            h.manager.rollback()
            loop.wait_batches(5)
        labels = [label for label, _fed, _got in loop.log]
        changes = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
        assert len(changes) == 2 and labels[changes[0]] == "shapes-det 1.0.1"
        assert labels[-1] == "shapes-det 1.0.0"
        assert loop.errors == 0 and all(fed == got for _l, fed, got in loop.log)
        assert h.manager.current is old
    finally:
        h.manager.close()


# MindSpore 2.7 cannot compile or run one GraphCell while another thread runs one ("Nested execution during
# JIT execution", or a deadlock): the backend holds one process-wide lock around every MindSpore call, so a
# deploy's compile waits for the batch in flight and serving waits (once) for the compile.


@needs_mindspore
def test_deploy_and_rollback_with_the_mindspore_backend_while_serving(harness, base_bundle):
    h = harness(backend="mindspore")
    old = h.manager.start()
    assert old.backend_name == "mindspore"
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(3)
        # compiles while serving
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        loop.wait_batches(3)
        assert h.manager.current.describe()["artifacts"] == {"32x32": "model_32x32.mindir"}
        h.manager.rollback()
        loop.wait_batches(3)
    labels = [label for label, _fed, _got in loop.log]
    changes = [labels[i] for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    assert changes == ["tiny 2.0.0", "tiny 1.0.0"]
    assert loop.errors == 0 and all(fed == got for _l, fed, got in loop.log)
    assert h.manager.current is old


# --- deploy: refusals change nothing -----------------------------------------------------------------------

def _tamper_file(data, root):
    pass  # the manifest is rewritten first; the file is changed after (see _bad_bundle)


def _fail_golden(data, root):
    path = os.path.join(root, "golden", "case0.model_32x32.onnx.npy")
    np.save(path, np.load(path) + 1.0)  # write_manifest then re-hashes it: a consistent bundle that is wrong


def _ascend_only(data, root):
    for art in data["artifacts"]:
        art.update(target="ascend", soc_version="Ascend310B4")


def _bad_bundle(h, base_bundle, kind):
    """(payload, expected exception type, text the reason must contain, field it must name)."""
    name = "tiny-" + kind
    path = h.incoming(name)
    if kind == "wrong-sha":
        new_version(base_bundle, path, "2.0.0")
        payload = {"bundle": "incoming/" + name, "sha256": "ab" * 32}
        return payload, CommandError, "the command pinned", "sha256"
    if kind == "tampered":
        sha = new_version(base_bundle, path, "2.0.0")
        with open(os.path.join(path, "model_32x32.onnx"), "r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 0xFF]))
        return ({"bundle": "incoming/" + name, "sha256": sha}, BundleError,
                "hash mismatch for model_32x32.onnx", "artifacts[0].sha256")
    if kind == "golden":
        sha = new_version(base_bundle, path, "2.0.0", _fail_golden)
        return {"bundle": "incoming/" + name, "sha256": sha}, BundleError, "case 0: max abs diff 1", "golden"
    if kind == "ascend-only":
        sha = new_version(base_bundle, path, "2.0.0", _ascend_only)
        return ({"bundle": "incoming/" + name, "sha256": sha}, BundleError,
                "model_32x32.onnx is for ascend, device cpu-dev is cpu", "artifacts[0].target")
    if kind == "outside":
        sha = new_version(base_bundle, path + "-elsewhere", "2.0.0")
        outside = os.path.join(os.path.dirname(h.store), "outside")
        shutil.move(path + "-elsewhere", outside)
        return {"bundle": outside, "sha256": sha}, FetchError, "is outside the bundle store", "bundle"
    if kind == "dotdot":
        sha = new_version(base_bundle, path, "2.0.0")
        return {"bundle": "incoming/../../" + os.path.basename(base_bundle.rstrip("/")) + "/../x",
                "sha256": sha}, FetchError, "outside the bundle store", "bundle"
    if kind == "symlink-out":
        outside = os.path.join(os.path.dirname(h.store), "outside-2")
        sha = new_version(base_bundle, outside, "2.0.0")
        os.symlink(outside, path)  # a link inside the store to a bundle outside it
        return {"bundle": "incoming/" + name, "sha256": sha}, FetchError, "outside the bundle store", "bundle"
    if kind == "tar-dotdot":
        archive = path + ".tar.gz"
        sha = new_version(base_bundle, path, "2.0.0")
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(path, arcname="tiny")
            tar.add(os.path.join(path, MANIFEST), arcname="../escaped.json")
        return ({"bundle": "incoming/%s.tar.gz" % name, "sha256": sha}, BundleError,
                "archive member escapes the bundle: ../escaped.json", "bundle")
    if kind == "missing-sha":
        return {"bundle": "incoming/x"}, ConfigError, "required", "sha256"
    if kind == "bad-sha":
        return {"bundle": "incoming/x", "sha256": "xyz"}, ConfigError, "64 hex digits", "sha256"
    if kind == "unknown-key":
        payload = {"bundle": "incoming/x", "sha256": "ab" * 32, "force": True}
        return payload, ConfigError, "unknown key", "force"
    if kind == "already-serving":
        sha = sha256_file(os.path.join(base_bundle, MANIFEST))
        return {"bundle": "incoming/x", "sha256": sha}, CommandError, "already serving", "sha256"
    raise AssertionError(kind)


BAD_KINDS = ["wrong-sha", "tampered", "golden", "ascend-only", "outside", "dotdot", "symlink-out",
             "tar-dotdot", "missing-sha", "bad-sha", "unknown-key", "already-serving"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_deploy_raises_with_its_reason_and_changes_nothing(harness, base_bundle, kind):
    h = harness()
    h.manager.start()
    payload, error_type, reason, field_name = _bad_bundle(h, base_bundle, kind)
    before = snapshot(h)
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(2)
        with pytest.raises(error_type) as info:
            h.manager.deploy(deploy_request(payload), no_progress)
        loop.wait_batches(2)
    error = info.value
    if isinstance(error, CommandError):
        assert reason in error.message and error.field == field_name
    else:
        assert reason in str(error)
        assert field_name in [e.path for e in error.errors]
    assert_unchanged(h, before)
    assert {label for label, _f, _g in loop.log} == {"tiny 1.0.0"}
    assert h.events == []


def test_a_bundle_for_another_soc_is_refused_naming_both_on_a_stand_in_ascend_box(base_bundle, tmp_path):
    """A stand-in Ascend310B4 box runs the ONNX artifact with OpenCV (no NPU here); the SoC check is real."""
    from agent.config.device_config import DeviceConfig

    stand_in_box = parse(DeviceConfig, {
        "name": "stand-in-310b4", "target": "ascend", "soc_version": "Ascend310B4", "backend": "opencv",
        "artifact_format": "onnx", "memory_budget_mb": 512})
    first = str(tmp_path / "tiny-310b4")
    new_version(base_bundle, first, "1.0.0", _ascend_only)
    h = Harness(tmp_path, first, device=stand_in_box)
    try:
        assert h.manager.start().label == "tiny 1.0.0"

        def for_310p3(data, root):
            for art in data["artifacts"]:
                art.update(target="ascend", soc_version="Ascend310P3")

        sha = new_version(first, h.incoming("tiny-310p3"), "2.0.0", for_310p3)
        before = snapshot(h)
        with pytest.raises(BundleError) as info:
            h.manager.deploy(deploy_request({"bundle": "incoming/tiny-310p3", "sha256": sha}), no_progress)
        expected = "model_32x32.onnx was built for Ascend310P3, device stand-in-310b4 is Ascend310B4"
        assert expected in str(info.value)
        assert [e.path for e in info.value.errors] == ["artifacts[0].soc_version"]
        assert_unchanged(h, before)
    finally:
        h.manager.close()


@needs_cryptography
def test_signatures_are_required_when_a_key_is_configured(harness, base_bundle, tmp_path):
    private_pem, _public_pem, public_hex = make_key_pair()
    other_private = make_key_pair()[0]
    signed_first = str(tmp_path / "tiny-signed")
    new_version(base_bundle, signed_first, "1.0.0")
    sign_bundle(signed_first, private_pem)
    h = Harness(tmp_path, signed_first, public_key=public_hex)
    try:
        h.manager.start()
        unsigned_sha = new_version(signed_first, h.incoming("unsigned"), "2.0.0")
        wrong_sha = new_version(signed_first, h.incoming("wrong-key"), "2.0.1")
        sign_bundle(h.incoming("wrong-key"), other_private)
        good_sha = new_version(signed_first, h.incoming("good"), "2.0.2")
        sign_bundle(h.incoming("good"), private_pem)
        before = snapshot(h)
        with pytest.raises(BundleError, match="manifest.sig: missing: this box requires signed bundles"):
            h.manager.deploy(deploy_request({"bundle": "incoming/unsigned", "sha256": unsigned_sha}), no_progress)
        with pytest.raises(BundleError, match="signature does not match the manifest and key"):
            h.manager.deploy(deploy_request({"bundle": "incoming/wrong-key", "sha256": wrong_sha}), no_progress)
        assert_unchanged(h, before)
        with ServingLoop(h.manager):
            h.manager.deploy(deploy_request({"bundle": "incoming/good", "sha256": good_sha}), no_progress)
        assert h.manager.current.label == "tiny 2.0.2" and h.manager.current.bundle.signed
    finally:
        h.manager.close()


@needs_cryptography
def test_a_signed_older_release_or_another_model_is_refused_unless_the_command_allows_it(harness, base_bundle,
                                                                                        tmp_path):
    """A validly signed bundle is not enough: replacing 2.0.0 by 1.0.0, or the model by another, must be asked."""
    private_pem, _public_pem, public_hex = make_key_pair()
    serving = str(tmp_path / "tiny-2.0.0")
    new_version(base_bundle, serving, "2.0.0")
    sign_bundle(serving, private_pem)
    h = Harness(tmp_path, serving, public_key=public_hex)
    try:
        h.manager.start()
        older = new_version(serving, h.incoming("older"), "1.9.9")
        sign_bundle(h.incoming("older"), private_pem)
        other = new_version(serving, h.incoming("other"), "3.0.0",
                            mutate=lambda data, _dst: data.update(name="another-model"))
        sign_bundle(h.incoming("other"), private_pem)
        before = snapshot(h)
        for source, sha, code, field in [("incoming/older", older, "downgrade", "allow_downgrade"),
                                         ("incoming/other", other, "model_change", "allow_model_change")]:
            with pytest.raises(CommandError) as info:
                h.manager.deploy(deploy_request({"bundle": source, "sha256": sha}), no_progress)
            assert (info.value.code, info.value.field) == (code, field)
            model, state, dirs = before
            assert h.manager.current is model and open(h.state_file, "rb").read() == state
            assert h.slot_dirs() == dirs and os.listdir(os.path.join(h.store, STAGING_DIR)) == []
        with ServingLoop(h.manager):
            older_request = deploy_request({"bundle": "incoming/older", "sha256": older, "allow_downgrade": True})
            result = h.manager.deploy(older_request, no_progress)
        assert result["model"]["version"] == "1.9.9" and h.manager.current.label == "tiny 1.9.9"
    finally:
        h.manager.close()
    h = Harness(tmp_path / "second", serving, public_key=public_hex)
    try:
        h.manager.start()
        other = new_version(serving, h.incoming("other"), "3.0.0",
                            mutate=lambda data, _dst: data.update(name="another-model"))
        sign_bundle(h.incoming("other"), private_pem)
        with ServingLoop(h.manager):
            h.manager.deploy(deploy_request({"bundle": "incoming/other", "sha256": other, "allow_model_change": True}),
                             no_progress)
        assert h.manager.current.label == "another-model 3.0.0"
    finally:
        h.manager.close()


@pytest.mark.parametrize("version, key", [("2.10.0", (2, 10, 0)), ("1", (1,)), ("2.0.0-rc1", (2, 0, 0)),
                                          ("v2", None), ("2026-01-01", (2026,))])
def test_release_order_is_by_leading_dotted_numbers(version, key):
    assert release_key(version) == key


def test_a_deploy_the_serving_loop_never_takes_is_withdrawn(harness, base_bundle):
    h = harness(switch_timeout_s=0.5)
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    before = snapshot(h)
    with pytest.raises(CommandError) as info:  # no serving loop runs
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
    assert info.value.code == "switch_timeout"
    assert_unchanged(h, before)


def _recording_backends(monkeypatch):
    """Every backend created from here on, so a test can check each staged model was closed."""
    import agent.pipeline.model as model_module

    created = []
    real_create = model_module.create_backend

    def recording_create(*args, **kwargs):
        backend = real_create(*args, **kwargs)
        created.append(backend)
        return backend

    monkeypatch.setattr(model_module, "create_backend", recording_create)
    return created


def _disk_full_for(monkeypatch, path):
    """Make the atomic write of ``path`` fail with ENOSPC until the returned ``free()`` is called."""
    import errno

    import agent._util.atomic as atomic_module
    import agent.lifecycle.slots as slots_module

    real_write = atomic_module.atomic_write
    full = [True]

    def failing_write(target, data, durable=True):
        if full[0] and os.path.abspath(target) == os.path.abspath(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target)
        return real_write(target, data, durable)

    monkeypatch.setattr(atomic_module, "atomic_write", failing_write)
    monkeypatch.setattr(slots_module, "atomic_write", failing_write)  # slots bound the name at import
    return lambda: full.__setitem__(0, False)


def test_a_full_disk_at_the_slot_table_fails_the_deploy_closes_the_staged_model_and_changes_nothing(
        harness, base_bundle, monkeypatch):
    h = harness()
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    before = snapshot(h)
    status_before = h.manager.status()
    created = _recording_backends(monkeypatch)
    free = _disk_full_for(monkeypatch, h.state_file)
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(2)
        with pytest.raises(CommandError) as info:
            h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        assert info.value.code == "storage"
        assert h.state_file in info.value.message and "No space left on device" in info.value.message
        assert created and all(backend.closed for backend in created)  # the staged model was released
        assert_unchanged(h, before)
        assert h.manager.status() == status_before and h.events == []
        assert h.handover.pending() == 0
        free()  # the disk is back: the next deploy is not refused as busy
        result = h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        loop.wait_batches(2)
    assert result["state"] == "pending" and h.manager.current.manifest.version == "2.0.0"
    assert load_slots(h.state_file).pending == "b"


def test_a_full_disk_at_the_slot_table_fails_a_standby_restore_and_closes_the_reloaded_model(
        harness, base_bundle, monkeypatch):
    h = harness(observation_s=0.0)
    old = h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    with ServingLoop(h.manager) as loop:
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        h.wait_for_event("confirmed")  # 1.0.0 is the standby now
        serving = h.manager.current
        assert serving is not old and h.manager.status()["slots"]["a"]["state"] == STANDBY
        state, status_before = open(h.state_file, "rb").read(), h.manager.status()
        created = _recording_backends(monkeypatch)
        free = _disk_full_for(monkeypatch, h.state_file)
        with pytest.raises(CommandError) as info:
            h.manager.rollback()
        assert info.value.code == "storage" and h.state_file in info.value.message
        assert created and all(backend.closed for backend in created)
        assert h.manager.current is serving and h.manager.status() == status_before
        assert open(h.state_file, "rb").read() == state
        free()
        result = h.manager.rollback()
        loop.wait_batches(2)
    assert result["model"]["version"] == "1.0.0" and h.manager.current.manifest.version == "1.0.0"


def test_a_withdrawn_switch_whose_table_cannot_be_written_back_reports_the_timeout_and_serves_the_old(
        harness, base_bundle, monkeypatch):
    """The table naming the new slot pending reached the disk, the swap timed out, and writing the old table
    back fails: memory follows what serves, the timeout stays the reported error, and it names the table."""
    import agent.lifecycle.swap as swap_module

    h = harness()
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    status_before = h.manager.status()
    created = _recording_backends(monkeypatch)
    real_save = swap_module.save_slots
    writes = []

    def save_then_fill_the_disk(path, table):  # the first write (pending) succeeds, the write-back does not
        writes.append(table.pending)
        if len(writes) > 1:
            import errno
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real_save(path, table)

    monkeypatch.setattr(swap_module, "save_slots", save_then_fill_the_disk)
    with pytest.raises(CommandError) as info:  # no serving loop runs the queue
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress, timeout_s=0.3)
    assert info.value.code == "switch_timeout" and "still serving the old one" in info.value.message
    assert h.state_file in info.value.message and "No space left on device" in info.value.message
    assert writes == ["b", None]
    assert created and all(backend.closed for backend in created)
    assert h.manager.current.manifest.version == "1.0.0" and h.manager.status() == status_before
    # the disk still says 'b pending': a restart treats it as a crash while pending and serves 1.0.0
    assert load_slots(h.state_file).pending == "b"
    monkeypatch.setattr(swap_module, "save_slots", real_save)
    with ServingLoop(h.manager) as loop:  # not refused as busy: memory holds no pending slot
        result = h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        loop.wait_batches(2)
    assert result["state"] == "pending" and load_slots(h.state_file).pending == "b"


# --- the one handover queue: everything that changes the serving model happens between batches, in order ----

def _in_thread(out, key, fn, *args, **kwargs):
    def call():
        try:
            out[key] = fn(*args, **kwargs)
        except BaseException as exc:  # recorded for the assertions
            out[key] = exc

    thread = threading.Thread(target=call, name="test-" + key)
    thread.start()
    return thread


def _wait_queued(handover, count):
    assert wait_for(lambda: handover.pending() >= count, WAIT_S, interval=0.005), \
        "only %d of %d items reached the queue" % (handover.pending(), count)


def test_a_config_change_a_swap_and_a_rollback_at_once_apply_in_order_between_batches(harness, base_bundle):
    """The test is the serving loop: it runs a batch, lets three callers queue their changes, then runs the
    queue once and the next batch. Nothing is applied outside the loop, all three are applied, in order."""
    h = harness()
    old = h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    frames = [np.zeros((32, 32, 3), np.uint8)] * BATCH
    served = []

    def batch():
        model = h.manager.current
        results = model.infer_frames(frames)
        h.manager.record_batch(BATCH, results[0].timings_ms["infer"], failed=False)
        served.append((model.label, len(results)))

    def config_change():  # what the daemon's set-config hands over: its new config, then the models in memory
        h.events.append({"event": "config", "serving": h.manager.current.label})
        h.config = replace(h.config, thresholds=replace(h.config.thresholds, top_k=2))
        h.manager.apply_thresholds()

    batch()
    out = {}
    threads = [_in_thread(out, "config", h.handover.submit, config_change, WAIT_S, what="config change")]
    _wait_queued(h.handover, 1)
    request = deploy_request({"bundle": "incoming/tiny-2", "sha256": sha})
    threads.append(_in_thread(out, "deploy", h.manager.deploy, request, no_progress))
    _wait_queued(h.handover, 2)  # the deploy loaded and self-tested v2 off the serving thread
    threads.append(_in_thread(out, "rollback", h.manager.rollback, "changed my mind"))
    _wait_queued(h.handover, 3)
    assert h.manager.current is old and h.events == []  # nothing happened outside the serving loop

    assert h.handover.run_pending() == 3
    h.manager.between_batches()
    batch()
    for thread in threads:
        thread.join(WAIT_S)
    assert [e["event"] for e in h.events] == ["config", "switched", "rollback"]
    assert h.events[0]["serving"] == "tiny 1.0.0"
    assert out["config"] is None
    assert out["deploy"]["state"] == "pending" and out["deploy"]["model"]["version"] == "2.0.0"
    assert out["rollback"]["reason"] == "operator: changed my mind"
    assert out["rollback"]["model"]["version"] == "1.0.0" and out["rollback"]["rolled_back"]["version"] == "2.0.0"
    assert served == [("tiny 1.0.0", BATCH), ("tiny 1.0.0", BATCH)]  # v2 came and went between two batches
    assert h.manager.current is old and old.thresholds.top_k == 2
    table = load_slots(h.state_file)
    assert table.serving == "a" and table.slots["b"].state == EMPTY
    assert table.last_rollback.version == "2.0.0"
    assert len(h.slot_dirs()) == 1


def test_a_callers_timeout_withdraws_the_swap_and_releases_the_staged_model(harness, base_bundle, monkeypatch):
    h = harness()
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    before = snapshot(h)
    created = _recording_backends(monkeypatch)
    with pytest.raises(CommandError) as info:  # no serving loop runs the queue
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress, timeout_s=0.3)
    assert info.value.code == "switch_timeout" and "within 0.3 s; still serving" in info.value.message
    assert h.handover.run_pending() == 0  # withdrawn: the loop passes it without running it
    assert created and all(backend.closed for backend in created)  # the staged model was released
    assert_unchanged(h, before)
    assert h.events == []
    with pytest.raises(CommandError) as info:
        h.manager.rollback(timeout_s=0.3)  # nothing pending and nothing kept: refused at once, not queued
    assert info.value.code == "nothing_to_roll_back" and h.handover.pending() == 0


# --- the observation window ------------------------------------------------------------------------------

class SlowBackendForTests(OpenCvBackend):
    """Test-only: the real OpenCV backend plus a fixed sleep per inference, to make a latency regression."""

    DELAY_S = 0.03

    def _infer(self, batch):
        time.sleep(self.DELAY_S)
        return super()._infer(batch)


class FailingBackendForTests(OpenCvBackend):
    """Test-only: the real OpenCV backend that raises on every inference once ``failing`` is set."""

    failing = False

    def _infer(self, batch):
        if FailingBackendForTests.failing:
            raise RuntimeError("stand-in runtime failure")
        return super()._infer(batch)


def test_a_slower_pending_model_is_rolled_back_within_the_window(harness, base_bundle, monkeypatch):
    h = harness(latency_regression=2.0)
    old = h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(20)  # the confirmed model's baseline
        # only models loaded from now on get the slow class: the serving one keeps its real backend
        monkeypatch.setitem(backends.BACKENDS, "opencv", SlowBackendForTests)
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        event = h.wait_for_event("rollback")
        loop.wait_batches(3)
    assert event["trigger"] == "latency"
    assert "median inference" in event["reason"] and "exceeds 2.0 x baseline" in event["reason"]
    figures = event["figures"]
    assert figures["p50_ms"] > 2.0 * figures["baseline_ms"]
    assert figures["p50_ms"] >= SlowBackendForTests.DELAY_S * 1e3  # the sleep alone, per chunk of one frame
    assert figures["batches"] >= 10 and figures["observed_s"] < LONG_WINDOW_S
    assert event["from"]["version"] == "2.0.0" and event["to"]["version"] == "1.0.0"
    assert h.manager.current is old  # kept loaded during the window: the rollback is a reference swap
    assert loop.log[-1][0] == "tiny 1.0.0" and loop.errors == 0
    status = h.manager.status()
    assert status["serving"] == "a" and status["slots"]["b"]["state"] == EMPTY
    assert status["last_rollback"]["reason"] == event["reason"]
    assert len(h.slot_dirs()) == 1  # the rejected bundle left the store


def test_a_failing_pending_model_is_rolled_back_on_its_error_rate(harness, base_bundle, monkeypatch):
    h = harness()
    old = h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    monkeypatch.setattr(FailingBackendForTests, "failing", False)
    with ServingLoop(h.manager) as loop:
        loop.wait_batches(5)
        monkeypatch.setitem(backends.BACKENDS, "opencv", FailingBackendForTests)
        loop.inference.clear()  # so that every batch the new model serves fails
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)  # self-test passes
        FailingBackendForTests.failing = True
        loop.inference.set()
        event = h.wait_for_event("rollback")
        loop.wait_batches(3)
    assert event["trigger"] == "errors"
    assert "above max_error_rate 0.050" in event["reason"]
    assert event["figures"]["failed_frames"] == event["figures"]["frames"] >= 10
    assert h.manager.current is old and loop.log[-1] == ("tiny 1.0.0", BATCH, BATCH)


def test_operator_rollback_while_pending_and_no_second_deploy_meanwhile(harness, base_bundle):
    h = harness()
    old = h.manager.start()
    sha2 = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    sha3 = new_version(base_bundle, h.incoming("tiny-3"), "3.0.0")
    with ServingLoop(h.manager) as loop:
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha2}), no_progress)
        with pytest.raises(CommandError) as info:
            h.manager.deploy(deploy_request({"bundle": "incoming/tiny-3", "sha256": sha3}), no_progress)
        assert info.value.code == "busy" and "tiny 2.0.0 is pending in slot b" in info.value.message
        result = h.manager.rollback("operator saw false positives")
        loop.wait_batches(2)
    assert result["model"]["version"] == "1.0.0" and result["rolled_back"]["version"] == "2.0.0"
    assert result["reason"] == "operator: operator saw false positives"
    assert h.manager.current is old
    [event] = h.events_named("rollback")
    assert event["trigger"] == "operator"
    with pytest.raises(CommandError) as info:  # slot b was emptied: there is nothing further back
        h.manager.rollback()
    assert info.value.code == "nothing_to_roll_back"


def test_the_window_runs_on_the_injected_monotonic_clock_not_the_wall_clock(harness, base_bundle, monkeypatch):
    clock = ManualClock()
    h = harness(clock=clock, observation_s=60.0)
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    real_time = time.time
    with ServingLoop(h.manager) as loop:
        h.manager.deploy(deploy_request({"bundle": "incoming/tiny-2", "sha256": sha}), no_progress)
        monkeypatch.setattr(time, "time", lambda: real_time() + 86400.0)  # NTP steps the wall clock a day ahead
        loop.wait_batches(15)
        assert h.events_named("confirmed") == [] and h.manager.status()["pending"]["observed_s"] == 0.0
        clock.now += 59.0
        loop.wait_batches(3)
        assert h.events_named("confirmed") == []
        clock.now += 1.0
        confirmed = h.wait_for_event("confirmed")
    assert confirmed["figures"]["observed_s"] == 60.0


@pytest.mark.parametrize("latencies, failed, elapsed, expected", [
    ([4.1] * 10, 0, 1.0, ROLLBACK),  # p50 4.1 > 2.0 x 2.0
    ([3.9] * 10, 0, 1.0, None),  # within the factor, window not over
    ([3.9] * 10, 0, 60.0, CONFIRM),
    ([9.0] * 9, 0, 1.0, None),  # too few batches to judge latency yet
    ([9.0] * 9, 0, 60.0, None),  # ... even at the window's end: it stays pending until it has enough
    ([9.0] * 10, 0, 60.0, ROLLBACK),
    ([2.0] * 9, 0, 60.0, None),  # healthy but too little evidence to confirm
    ([2.0] * 10, 0, 60.0, CONFIRM),
    ([2.0] * 9, 1, 1.0, ROLLBACK),  # 2 failed frames of 20: 0.10 > 0.05
    ([], 0, 60.0, None),  # served nothing: not shown healthy, stays pending
])
def test_window_verdicts_golden_values(latencies, failed, elapsed, expected):
    window = Window(slot="b", started=100.0, baseline_ms=2.0, baseline_samples=[2.0] * 10)
    for value in latencies:
        window.add(2, value, False)
    for _ in range(failed):
        window.add(2, 0.0, True)
    decision, reason, figures = window.verdict(100.0 + elapsed, 60.0, 2.0, 0.05)
    assert decision == expected, reason
    assert figures["frames"] == 2 * (len(latencies) + failed)


def test_without_a_baseline_latency_is_not_judged():
    window = Window(slot="b", started=0.0, baseline_ms=None, baseline_samples=[])
    for _ in range(20):
        window.add(1, 1000.0, False)
    assert window.verdict(1.0, 60.0, 2.0, 0.05)[0] is None
    assert window.verdict(61.0, 60.0, 2.0, 0.05)[0] == CONFIRM


# --- crash while pending ----------------------------------------------------------------------------------

CRASH_CHILD = r"""
import functools, json, sys, threading
import numpy as np
from agent.config.daemon_config import parse_daemon_config
from agent.config.device_config import load_device_config
from agent.lifecycle.model_manager import ModelManager
from agent.pipeline.handover import BetweenBatches
from agent.protocol.verbs import parse_request

deploy_request = functools.partial(parse_request, "deploy")
config = parse_daemon_config(json.loads(sys.argv[1]))
manager = ModelManager(lambda: config, load_device_config("cpu-dev"), "opencv", on_event=lambda event: None,
                       handover=BetweenBatches())
manager.start()
frame = np.zeros((32, 32, 3), np.uint8)

def serve():
    while True:
        manager.handover.run_pending()
        manager.between_batches()
        results = manager.current.infer_frames([frame])
        manager.record_batch(1, results[0].timings_ms["infer"], False)

threading.Thread(target=serve, daemon=True).start()
manager.deploy(deploy_request({"bundle": sys.argv[2], "sha256": sys.argv[3]}), lambda message: None)
print("PENDING", manager.current.manifest.version, flush=True)
threading.Event().wait(120)
"""


def test_a_crash_while_pending_comes_back_on_the_confirmed_model(harness, base_bundle, tmp_path):
    h = harness()
    h.manager.start()
    h.manager.close()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    config = {"device_id": "t1", "state_dir": str(tmp_path / "state"),
              "model": {"bundle": base_bundle, "backend": "opencv", "observation_s": LONG_WINDOW_S,
                        "latency_regression": NOISE_PROOF_FACTOR}}
    env = dict(os.environ, PYTHONPATH=REPO)
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, json.dumps(config), "incoming/tiny-2", sha],
                             stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready, "the child never reported its deploy"
        assert child.stdout.readline().decode().split() == ["PENDING", "2.0.0"]
    finally:
        os.kill(child.pid, signal.SIGKILL)  # no shutdown code runs: as if the box lost power
        child.wait(timeout=WAIT_S)
        child.stdout.close()
    assert load_slots(h.state_file).pending == "b"

    again = harness()
    model = again.manager.start()
    assert model.label == "tiny 1.0.0"
    [event] = again.events_named("rollback")
    assert event["trigger"] == "restart" and event["from"]["version"] == "2.0.0"
    assert "restarted while tiny 2.0.0 was pending" in event["reason"]
    status = again.manager.status()
    assert status["serving"] == "a" and status["slots"]["b"]["state"] == EMPTY
    assert len(again.slot_dirs()) == 1


# --- resources -------------------------------------------------------------------------------------------

def _rss_mb():
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_fifty_deploy_rollback_cycles_do_not_leak(harness, base_bundle):
    h = harness()
    h.manager.start()
    sha = new_version(base_bundle, h.incoming("tiny-2"), "2.0.0")
    payload = {"bundle": "incoming/tiny-2", "sha256": sha}
    with ServingLoop(h.manager) as loop:
        for _ in range(3):  # allocator and import warm-up, not counted
            h.manager.deploy(deploy_request(payload), no_progress)
            h.manager.rollback()
        before = _rss_mb()
        started = time.monotonic()
        for _ in range(50):
            h.manager.deploy(deploy_request(payload), no_progress)
            h.manager.rollback()
        after = _rss_mb()
        elapsed = time.monotonic() - started
    print("\n50 deploy/rollback cycles: RSS %.1f MB -> %.1f MB (%+.1f MB), %.1f s, %d batches served" % (
        before, after, after - before, elapsed, len(loop.log)))
    assert after - before < RSS_MARGIN_MB
    assert len(h.events_named("rollback")) == 53 and len(h.events_named("switched")) == 53
    assert loop.errors == 0 and all(fed == got for _l, fed, got in loop.log)
    assert h.manager.current.label == "tiny 1.0.0" and len(h.slot_dirs()) == 1


