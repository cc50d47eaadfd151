"""Simulated fleets for the operator-tool tests (a helper module, not a test module): the bundles they deploy,
a fleet factory, and running ``atlas-edge fleet`` in-process. test_fleet, test_cluster and test_inventory
import these instead of importing each other."""

import json
import os

import pytest

from agent.bundle.verify import sha256_file
from agent.cli import fleet as fleet_cli
from benchmarks.fleet_sim import BundleServer, SimulatedFleet, build_bundles, slot_summary

WINDOW_S = 1.0  # observation window of the simulated boxes: short, but judged on >= 10 batches
CONFIRM_TIMEOUT_S = 60.0  # a bound for a loaded CI machine; tests never assert durations


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fleet-bundles"))
    v1, archive, sha = build_bundles(root)
    server = BundleServer(root)
    yield {"v1": v1, "url": server.url(os.path.basename(archive)), "sha": sha, "archive_sha": sha256_file(archive)}
    server.close()


@pytest.fixture
def make_fleet(tmp_path, mosquitto, bundles):
    fleets = []

    def make(count, broker=None, prefix=None, **kwargs):
        broker = broker or mosquitto
        prefix = prefix or "fleet-%s" % os.urandom(3).hex()  # earlier tests' retained status stays out of view
        fleet = SimulatedFleet(str(tmp_path / ("boxes%d" % len(fleets))), broker.host, broker.port, bundles["v1"],
                               count, observation_s=WINDOW_S, prefix=prefix, **kwargs)
        fleet.prefix = prefix
        fleets.append(fleet)
        return fleet.start()

    yield make
    for fleet in fleets:
        fleet.close()


# The protocol-only boxes (tests/support/fleet_boxes.py): what they are sent and what they go to.
SIM_BUNDLE = "shapes-2.0.0.tar.gz"
SIM_NEW_SHA = "2" * 64


@pytest.fixture
def box_fleet(mosquitto):
    """``make(count, faults={index: (fault, params)}, **BoxFleet options)``: protocol-only boxes box-00...,
    not started (``.start()`` them); closed after the test."""
    from tests.support.fleet_boxes import BoxFleet, model, random_prefix

    fleets = []

    def make(count, faults=None, **kwargs):
        fleet = BoxFleet(mosquitto.host, mosquitto.port, random_prefix(), {SIM_BUNDLE: model("2.0.0", SIM_NEW_SHA)},
                         **kwargs)
        for index in range(count):
            fault, params = (faults or {}).get(index, (None, None))
            fleet.add("box-%02d" % index if count <= 100 else "box-%04d" % index, fault=fault, params=params)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.close()


def sim_rollout_args(url, prefix, state_dir, *extra):
    """``fleet rollout`` of :data:`SIM_BUNDLE` to group ``sim`` of the protocol-only boxes, JSON report."""
    return ["rollout", "--broker", url, "--prefix", prefix, "--group", "sim", "--bundle", SIM_BUNDLE,
            "--sha256", SIM_NEW_SHA, "--state-dir", str(state_dir), "--confirm-timeout", "60", "--json"] + list(extra)


def rollout_args(broker, fleet, bundles, tmp_path, *extra):
    return ["rollout", "--broker", broker.url, "--prefix", fleet.prefix, "--group", "sim",
            "--bundle", bundles["url"], "--sha256", bundles["sha"], "--archive-sha256", bundles["archive_sha"],
            "--state-dir", str(tmp_path / "rollouts"),
            "--confirm-timeout", str(CONFIRM_TIMEOUT_S), "--json"] + list(extra)


def run_cli(args, capsys):
    code = fleet_cli.main(args)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip().startswith("{") else out)


def truth(fleet):
    return {box.device_id: slot_summary(box.serving()) for box in fleet.boxes}
