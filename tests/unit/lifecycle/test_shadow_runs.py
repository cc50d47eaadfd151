"""The model manager's shadow runs (docs/shadow.md): a candidate fetched and verified as a deploy's, kept beside the
serving model, promoted by a deploy of the same bundle without a second download, or discarded; a bad request
changes nothing and leaves nothing in the store."""

import os
import shutil
import threading

import pytest

from agent.bundle.manifest import BundleError
from agent.bundle.signing import sign_bundle
from agent.cli.bundle import make_key_pair
from agent.errors import CommandError
from agent.lifecycle.slots import PENDING
from agent.lifecycle.store import STAGING_DIR
from agent.pipeline.shadow import RUNNING, STOPPED
from agent.protocol.verbs import parse_request
from tests.support.lifecycle_support import TINY_BUNDLE, Harness, ServingLoop, deploy_request, no_progress
from tests.support.needs import needs_cryptography
from tests.support.serving_support import needs_demo_bundle
from tests.support.shadow_support import candidate_bundle

pytestmark = needs_demo_bundle


def shadow_request(**payload):
    return parse_request("shadow", payload)


@pytest.fixture
def demo(tmp_path):
    """A manager serving the demo bundle's float model (on onnxruntime), and its int8 as a candidate in the store."""
    from agent.cli.demo import DEMO_BUNDLE

    base = str(tmp_path / "demo-1.0.0")
    candidate_bundle(DEMO_BUNDLE, base, "1.0.0", serve="float")
    h = Harness(tmp_path, base, backend="onnxruntime")
    h.manager.start()
    h.candidate_sha = candidate_bundle(DEMO_BUNDLE, h.incoming("int8-1.1.0"), "1.1.0")
    yield h
    h.manager.close()


def _entries(h):
    return sorted(os.listdir(os.path.join(h.store, "slots")))


def test_a_deploy_of_the_shadowed_candidate_switches_to_it_without_a_second_download(demo):
    h = demo
    before = _entries(h)
    answer = h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha, frames=5),
                              no_progress)
    assert answer["state"] == RUNNING and answer["candidate"]["version"] == "1.1.0"
    assert answer["reference"]["version"] == "1.0.0" and answer["low"] < answer["conf"]
    assert h.manager.shadow_tap() is not None and len(_entries(h)) == len(before) + 1
    assert h.manager.current.manifest.version == "1.0.0"  # nothing switched
    shutil.rmtree(h.incoming("int8-1.1.0"))  # the source is gone: only the candidate's own copy is left
    with ServingLoop(h.manager) as loop:
        result = h.manager.deploy(deploy_request({"bundle": "incoming/int8-1.1.0", "sha256": h.candidate_sha}),
                                  no_progress)
        loop.wait_batches(2)
    assert result["state"] == PENDING and result["model"]["version"] == "1.1.0"
    assert h.manager.current.precision == "int8" and h.manager.shadow_tap() is None
    assert h.manager.status()["slots"][result["slot"]]["state"] == PENDING
    assert os.listdir(os.path.join(h.store, STAGING_DIR)) == []


def test_a_bad_shadow_request_changes_nothing_and_leaves_nothing(demo):
    h = demo
    before = _entries(h)
    with pytest.raises(Exception, match="sha256"):
        h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256="0" * 64), no_progress)
    with pytest.raises(Exception, match="outside the bundle store"):
        h.manager.shadow(shadow_request(bundle=str(h.store + "/../elsewhere"), sha256=h.candidate_sha), no_progress)
    with pytest.raises(CommandError, match="serving model") as serving:
        h.manager.shadow(shadow_request(bundle="incoming/x", sha256=h.manager.current.bundle.manifest_sha256),
                         no_progress)
    assert serving.value.code == "already_serving"
    assert _entries(h) == before and h.manager.shadow_report() is None and h.manager.shadow_tap() is None
    assert os.listdir(os.path.join(h.store, STAGING_DIR)) == []


def test_a_shadow_is_refused_while_a_model_is_pending_and_a_deploy_of_another_while_one_runs(demo):
    h = demo
    from agent.cli.demo import DEMO_BUNDLE

    other_sha = candidate_bundle(DEMO_BUNDLE, h.incoming("float-1.2.0"), "1.2.0", serve="float")
    h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha), no_progress)
    with pytest.raises(CommandError, match="shadow-stop") as busy:
        h.manager.deploy(deploy_request({"bundle": "incoming/float-1.2.0", "sha256": other_sha}), no_progress)
    assert busy.value.code == "busy" and h.manager.shadow_tap() is not None
    stopped = h.manager.shadow_stop(discard=False)
    assert stopped["stopped"] and stopped["report"]["state"] == STOPPED
    with ServingLoop(h.manager):
        h.manager.deploy(deploy_request({"bundle": "incoming/float-1.2.0", "sha256": other_sha}), no_progress)
    assert h.manager.shadow_report() is None  # the kept candidate went with the deploy of another bundle
    with pytest.raises(CommandError, match="pending") as pending:
        h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha), no_progress)
    assert pending.value.code == "busy"


def test_shadow_stop_with_discard_deletes_the_candidate(demo):
    h = demo
    before = _entries(h)
    h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha), no_progress)
    assert len(_entries(h)) == len(before) + 1
    answer = h.manager.shadow_stop(discard=True)
    assert answer["discarded"] and answer["report"]["state"] == STOPPED
    assert _entries(h) == before and h.manager.shadow_report() is None
    with pytest.raises(CommandError) as nothing:
        h.manager.shadow_stop(discard=False)
    assert nothing.value.code == "no_shadow"


def test_a_restart_forgets_the_candidate_and_its_start_deletes_the_entry(demo, tmp_path):
    """A daemon stopped during a shadow run: the next start serves what the slot table says, and the candidate's
    store entry (named by no slot) is gone, not left to fill the disk."""
    h = demo
    before = _entries(h)
    h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha), no_progress)
    assert len(_entries(h)) == len(before) + 1
    h.manager.close()
    again = Harness(tmp_path, h.config.model.bundle, backend="onnxruntime")
    again.manager.start()
    try:
        assert _entries(again) == before and again.manager.shadow_report() is None
        assert again.manager.current.manifest.version == "1.0.0"
    finally:
        again.manager.close()


def test_a_classifier_cannot_be_shadowed(tmp_path):
    shutil.copytree(TINY_BUNDLE, str(tmp_path / "tiny"))
    h = Harness(tmp_path, str(tmp_path / "tiny"))
    h.manager.start()
    with pytest.raises(CommandError, match="classifier") as refused:
        h.manager.shadow(shadow_request(bundle="incoming/x", sha256="ab" * 32), no_progress)
    assert refused.value.code == "unsupported"
    h.manager.close()


@needs_cryptography
def test_a_box_that_requires_signatures_shadows_only_a_candidate_signed_by_its_key(tmp_path):
    """The candidate goes the deploy's way: unsigned or signed by another key, it is refused naming the signature,
    and nothing is loaded or left in the store; signed by the box's key, it runs."""
    from agent.cli.demo import DEMO_BUNDLE

    private_pem, _public_pem, public_hex = make_key_pair()
    base = str(tmp_path / "demo-1.0.0")
    candidate_bundle(DEMO_BUNDLE, base, "1.0.0", serve="float")
    sign_bundle(base, private_pem)
    h = Harness(tmp_path, base, backend="onnxruntime", public_key=public_hex)
    try:
        h.manager.start()
        unsigned = candidate_bundle(DEMO_BUNDLE, h.incoming("unsigned"), "1.1.0")
        wrong = candidate_bundle(DEMO_BUNDLE, h.incoming("wrong-key"), "1.1.1")
        sign_bundle(h.incoming("wrong-key"), make_key_pair()[0])
        good = candidate_bundle(DEMO_BUNDLE, h.incoming("good"), "1.1.2")
        sign_bundle(h.incoming("good"), private_pem)
        before = _entries(h)
        with pytest.raises(BundleError, match="manifest.sig: missing"):
            h.manager.shadow(shadow_request(bundle="incoming/unsigned", sha256=unsigned), no_progress)
        with pytest.raises(BundleError, match="signature does not match"):
            h.manager.shadow(shadow_request(bundle="incoming/wrong-key", sha256=wrong), no_progress)
        assert _entries(h) == before and h.manager.shadow_report() is None
        assert h.manager.shadow(shadow_request(bundle="incoming/good", sha256=good), no_progress)["state"] == RUNNING
    finally:
        h.manager.close()


def test_a_shadow_while_a_deploy_runs_is_refused_busy_and_changes_nothing(demo):
    """The deploy holds the manager's operation (here: stuck in its fetch); a shadow then fails busy at once."""
    h = demo
    entered, release = threading.Event(), threading.Event()
    real_fetch = h.manager._fetch_install

    def slow_fetch(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real_fetch(*args, **kwargs)

    h.manager._fetch_install = slow_fetch
    from agent.cli.demo import DEMO_BUNDLE

    other = candidate_bundle(DEMO_BUNDLE, h.incoming("float-1.2.0"), "1.2.0", serve="float")
    deploy = threading.Thread(target=lambda: h.manager.deploy(
        deploy_request({"bundle": "incoming/float-1.2.0", "sha256": other}), no_progress))
    with ServingLoop(h.manager):
        deploy.start()
        try:
            assert entered.wait(30)
            before = _entries(h)
            with pytest.raises(CommandError, match="deploy or rollback is running") as busy:
                h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=h.candidate_sha), no_progress)
            assert busy.value.code == "busy" and _entries(h) == before and h.manager.shadow_report() is None
        finally:
            release.set()
            deploy.join(60)


def test_the_candidates_priority_is_the_configured_one(tmp_path):
    """model.shadow_nice reaches the run (its thread lowers itself to it); the default is the lowest, 19."""
    from agent.cli.demo import DEMO_BUNDLE
    from agent.config.daemon_config import SHADOW_NICE

    base = str(tmp_path / "demo-1.0.0")
    candidate_bundle(DEMO_BUNDLE, base, "1.0.0", serve="float")
    for settings, expected in (({}, SHADOW_NICE), ({"shadow_nice": 7}, 7)):
        h = Harness(tmp_path / str(expected), base, backend="onnxruntime", **settings)
        h.manager.start()
        try:
            sha = candidate_bundle(DEMO_BUNDLE, h.incoming("int8-1.1.0"), "1.1.0")
            h.manager.shadow(shadow_request(bundle="incoming/int8-1.1.0", sha256=sha, frames=5), no_progress)
            run = h.manager.shadow_tap()
            assert run is not None and run.nice == expected and run.priority_problem is None  # lowered so
        finally:
            h.manager.close()
    assert SHADOW_NICE == 19
