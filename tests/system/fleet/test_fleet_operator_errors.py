"""Every operator error of ``fleet rollout`` is exit 2 with a message, never a traceback (issue 30, item 7):
an ``--archive-sha256`` that is not the archive's, for a URL and for a ``--bundle-file``; a ``--bundle-file``
that does not exist; a state file whose fields have the wrong types. Nothing is sent in any case. (Damaged
state files are unit-tested in tests/unit/fleet/test_fleet_rules.py; here the command's exit code.)"""

import json
import os
import shutil

import pytest

from agent.cli import fleet as fleet_cli
from agent.cli.ctl import EXIT_USAGE
from benchmarks.fleet_sim import build_bundles
from tests.conftest import REPO_ROOT
from tests.support.fleet_support import bundles  # noqa: F401 - a fixture

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)

WRONG = "0" * 64


def run(args, capsys):
    code = fleet_cli.main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.err


def test_an_archive_sha256_mismatch_is_exit_2_for_a_url_and_a_bundle_file(mosquitto, bundles, tmp_path,  # noqa: F811
                                                                          capsys):
    base = ["rollout", "--broker", mosquitto.url, "--prefix", "op-err", "--group", "g", "--sha256", bundles["sha"],
            "--archive-sha256", WRONG, "--state-dir", str(tmp_path / "s")]
    code, err = run(base + ["--bundle", bundles["url"]], capsys)
    assert code == EXIT_USAGE and "pre-flight" in err and "archive_sha256" in err and WRONG in err, err
    _v1, archive, _sha = build_bundles(str(tmp_path / "local"))
    code, err = run(base + ["--bundle", "incoming/fleet-2.0.0.tar.gz", "--bundle-file", archive], capsys)
    assert code == EXIT_USAGE and "pre-flight: %s" % archive in err and "archive_sha256" in err, err
    code, err = run(base + ["--bundle", "incoming/fleet-2.0.0.tar.gz", "--bundle-file", archive + ".gone"], capsys)
    assert code == EXIT_USAGE and "--bundle-file %s.gone does not exist" % archive in err, err
    assert not os.path.exists(str(tmp_path / "s"))  # refused before any state was written


def test_a_state_file_with_wrong_typed_fields_is_exit_2(mosquitto, tmp_path, capsys):
    fixture = os.path.join(REPO_ROOT, "tests", "fixtures", "fleet_journal", "in_progress", "ro-today.json")
    path = str(tmp_path / "ro-today.json")
    shutil.copy(fixture, path)
    data = json.load(open(path))
    data["runs"] = "twice"
    with open(path, "w") as handle:
        json.dump(data, handle)
    code, err = run(["resume", "--broker", mosquitto.url, "--prefix", "sim-fleet", "--rollout-id", "ro-today",
                     "--state-dir", str(tmp_path)], capsys)
    assert code == EXIT_USAGE and "is damaged (runs has the wrong type (str))" in err, err
