"""The model manager's shadow runs (docs/shadow.md): a candidate fetched and verified as a deploy's, kept beside the
serving model, promoted by a deploy of the same bundle without a second download, or discarded; a bad request
changes nothing and leaves nothing in the store."""

import os
import shutil

import pytest

from agent.errors import CommandError
from agent.lifecycle.slots import PENDING
from agent.lifecycle.store import STAGING_DIR
from agent.pipeline.shadow import RUNNING, STOPPED
from agent.protocol.verbs import parse_request
from tests.support.lifecycle_support import TINY_BUNDLE, Harness, ServingLoop, deploy_request, no_progress
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


def test_a_classifier_cannot_be_shadowed(tmp_path):
    shutil.copytree(TINY_BUNDLE, str(tmp_path / "tiny"))
    h = Harness(tmp_path, str(tmp_path / "tiny"))
    h.manager.start()
    with pytest.raises(CommandError, match="classifier") as refused:
        h.manager.shadow(shadow_request(bundle="incoming/x", sha256="ab" * 32), no_progress)
    assert refused.value.code == "unsupported"
    h.manager.close()
