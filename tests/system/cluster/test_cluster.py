"""The fleet on a clustered broker: a real 3-node RabbitMQ cluster (MQTT plugin, Debian's package) on loopback.

RabbitMQ sends no retained message to a wildcard subscription and keeps retained messages per node; a node
that stops fires no will. So here ``fleet status`` and ``rollout`` find boxes by their answers to an announce
request, a box moves to another node through ``mqtt.hosts`` when its node stops, and the operator never shows a
box ``online`` on a dead node. Boxes are real daemons (benchmarks/fleet_sim.py: real transport, dispatcher,
model manager; a stand-in backend). A standalone node serves the first test and is stopped after it; the
cluster is formed once for the rest of this module (about 20-30 s; 125-135 MiB per node) and stopped at its end
with every process it started (agent/devtools/rabbitmq.py).

Nodes are stopped (a clean stop) or killed (SIGKILL of the node's VM: a crash) under boxes and under an operator;
each test that uses the cluster starts with its three nodes running (the ``whole`` fixture starts again any that an
earlier test stopped or killed). Besides real daemons, the rollout test uses protocol-only simulated boxes
(tests/support/fleet_boxes.py), which follow the box's session policy and move through the fleet's brokers.
"""

import json
import os
import threading
import time

import pytest
from conftest import wait_for

from agent.cli import ctl
from agent.cli import fleet as fleet_cli
from agent.cli.ctl import EXIT_BROKER, EXIT_OK
from agent.devtools.broker import BrokerError
from agent.devtools.rabbitmq import RabbitCluster, describe, find_rabbitmq
from agent.fleet.report import EXIT_COMPLETED
from tests.conftest import MqttProbe
from tests.support.fleet_boxes import BoxFleet, model, random_prefix
from tests.support.fleet_support import bundles, make_fleet, rollout_args, run_cli, truth  # noqa: F401 - fixtures

pytestmark = pytest.mark.fleet_rig  # operator-side rig: run once, in the host lane (Makefile)

FAILOVER_BOUND_S = 15.0  # the bound on a box publishing again through another node
# Issue 30's bound for a node killed with SIGKILL; measured 1-4 s here (printed): the bound leaves room for load.
KILL_FAILOVER_BOUND_S = 20.0


def _rabbitmq(size):
    try:
        find_rabbitmq()
    except BrokerError as exc:
        pytest.skip("needs RabbitMQ for the cluster lane: %s" % exc)
    formed = RabbitCluster(size)
    with formed:
        yield formed
    left = [describe(pid) for pid in formed.leftovers()]
    assert left == []  # no beam, epmd, erl_child_setup or inet_gethost of ours still runs


@pytest.fixture
def single():
    """One standalone node (a cluster of one), stopped before the 3-node cluster starts."""
    yield from _rabbitmq(1)


@pytest.fixture(scope="module")
def cluster():
    yield from _rabbitmq(3)


@pytest.fixture
def whole(cluster):
    """The module's cluster with every node running: a node an earlier test killed or stopped is started again
    (it rejoins the others, which still run), so each test begins with three nodes whatever ran before."""
    for node in cluster.nodes:
        if not node.running:
            node.start()
    running = cluster.running_nodes()
    assert sorted(running) == sorted(n.name for n in cluster.nodes), running
    return cluster


def status(node_urls, prefix, tmp_path, capsys, *extra):
    argv = ["status", "--prefix", prefix, "--json", "--listen", "1", "--state-dir", str(tmp_path / "op")]
    for url in node_urls:
        argv += ["--broker", url]
    code, shown = run_cli(argv + list(extra), capsys)
    assert code == EXIT_OK, shown
    return {b["device"]: b for b in shown["boxes"]}


def test_one_node_status_lists_every_box_and_a_rollout_confirms_them(
        single, make_fleet, bundles, tmp_path, capsys):  # noqa: F811 - fixtures imported from fleet_support
    node = single.nodes[0]
    prefix = "one-%s" % os.urandom(3).hex()
    fleet = make_fleet(5, broker=node, prefix=prefix)
    seen = status([node.url], prefix, tmp_path, capsys)
    assert sorted(seen) == sorted(box.device_id for box in fleet.boxes)
    assert all(b["state"] == "online" and b["serving"]["version"] == "1.0.0" and b["broker"] == node.address
               for b in seen.values()), seen

    code, report = run_cli(rollout_args(node, fleet, bundles, tmp_path, "--canary", "1", "--waves", "1"), capsys)
    assert code == EXIT_OK, report
    assert report["counts"] == {"confirmed": 5}
    assert fleet.deploys() == {box.device_id: 1 for box in fleet.boxes}
    assert all(s == {"version": "2.0.0", "state": "confirmed"} for s in truth(fleet).values())


def test_boxes_on_two_nodes_an_operator_on_the_third_and_a_node_that_stops(
        whole, make_fleet, bundles, tmp_path, capsys):  # noqa: F811 - fixtures imported from fleet_support
    n1, n2, n3 = whole.nodes
    prefix = "trio-%s" % os.urandom(3).hex()
    probe = MqttProbe(n3, ["%s/+/results/#" % prefix, "%s/+/status" % prefix])  # a subscriber on node 3
    try:
        # a-000 on node 1; b-000 on node 2, moving to node 1 then 3; c-000 knows only node 2.
        a = make_fleet(1, broker=n1, prefix=prefix, name="a", hosts=[n1.address, n2.address, n3.address],
                       result_hz=0)
        b = make_fleet(1, broker=n2, prefix=prefix, name="b", hosts=[n2.address, n1.address, n3.address],
                       result_hz=0)
        c = make_fleet(1, broker=n2, prefix=prefix, name="c", hosts=[n2.address])
        box_a, box_b, box_c = a.boxes[0], b.boxes[0], c.boxes[0]
        seen = status([n3.url], prefix, tmp_path, capsys)
        assert {d: (s["state"], s["broker"], s["serving"]["version"]) for d, s in seen.items()} == {
            box_a.device_id: ("online", n1.address, "1.0.0"), box_b.device_id: ("online", n2.address, "1.0.0"),
            box_c.device_id: ("online", n2.address, "1.0.0")}

        code, report = run_cli(rollout_args(n3, a, bundles, tmp_path, "--canary", "1", "--waves", "1"), capsys)
        assert code == EXIT_OK, report
        assert report["counts"] == {"confirmed": 3}
        assert all(truth(f)[f.boxes[0].device_id] == {"version": "2.0.0", "state": "confirmed"} for f in (a, b, c))

        results_b = "%s/%s/results/sim" % (prefix, box_b.device_id)
        assert wait_for(lambda: len(probe.on(results_b)) >= 10)
        stopped_at = time.monotonic()
        n2.stop()
        moved = [n1.address, n3.address]

        def b_back():
            return any(m["state"] == "online" and m.get("broker") in moved
                       for m in probe.on("%s/%s/status" % (prefix, box_b.device_id)))

        assert wait_for(b_back, timeout=FAILOVER_BOUND_S), box_b.daemon.transport.stats()
        back_after = time.monotonic() - stopped_at
        count = len(probe.on(results_b))
        assert wait_for(lambda: len(probe.on(results_b)) >= count + 10)  # and it goes on publishing

        # The operator: b on the node it moved to; c, whose only node is gone, not online; --broker in turn.
        seen = status([n2.url, n3.url], prefix, tmp_path, capsys)
        assert seen[box_b.device_id]["state"] == "online" and seen[box_b.device_id]["broker"] == n1.address
        assert seen[box_a.device_id]["state"] == "online" and seen[box_a.device_id]["broker"] == n1.address
        assert seen[box_c.device_id]["state"] in ("stale", "unknown"), seen[box_c.device_id]
        assert seen[box_c.device_id]["broker"] == n2.address  # where it was last seen
        assert all(s["broker"] != n2.address for s in seen.values() if s["state"] == "online"), seen

        # No result of b lost: its sequence numbers arrive without a gap across the move.
        box_b.stop()
        stats = box_b.daemon.transport.stats()
        assert wait_for(lambda: probe.on("%s/%s/status" % (prefix, box_b.device_id))[-1]["state"] == "offline")
        seqs = [m["seq"] for m in probe.on(results_b)]
        missing = sorted(set(range(min(seqs), max(seqs) + 1)) - set(seqs))
        assert not missing, "b lost %s; its transport: %s" % (missing, stats)
        assert stats["dropped"] == 0 and stats["lost"] == 0
        print("b published again through %s %.1f s after node 2 stopped; %d results, seq %d-%d, no gap; "
              "requeued %d, replayed %d; c: %s" % (stats["broker"], back_after, len(seqs), min(seqs), max(seqs),
                                                   stats["requeued"], stats["replayed"],
                                                   seen[box_c.device_id]["state"]))
    finally:
        probe.close()


def test_a_box_whose_node_is_killed_publishes_through_another_and_answers_commands(
        whole, make_fleet, tmp_path, capsys):  # noqa: F811 - fixtures imported from fleet_support
    """SIGKILL of the node a real daemon is on: its session dies with the node (nothing the survivors hold for it
    can refuse it), it is back through the next of ``mqtt.hosts`` within the issue's bound, and a command sent
    through a third node is answered."""
    n1, n2, n3 = whole.nodes
    prefix = "kill-%s" % os.urandom(3).hex()
    fleet = make_fleet(1, broker=n2, prefix=prefix, name="k", hosts=[n2.address, n1.address, n3.address],
                       result_hz=5)
    box = fleet.boxes[0]
    status_topic = "%s/%s/status" % (prefix, box.device_id)
    results = "%s/%s/results/sim" % (prefix, box.device_id)
    probe = MqttProbe(n3, [results, status_topic])  # the operator's view, on a node that stays up
    try:
        assert wait_for(lambda: len(probe.on(results)) >= 5)
        killed_at = time.monotonic()
        n2.kill()

        def back():
            return any(m["state"] == "online" and m.get("broker") in (n1.address, n3.address)
                       for m in probe.on(status_topic))

        assert wait_for(back, timeout=KILL_FAILOVER_BOUND_S), (box.daemon.transport.stats(), n1.log_tail())
        back_after = time.monotonic() - killed_at
        count = len(probe.on(results))
        assert wait_for(lambda: len(probe.on(results)) >= count + 5)  # and it goes on publishing there

        code = ctl.main([box.device_id, "status", "--broker", n3.url, "--prefix", prefix, "--timeout", "30"])
        shown = capsys.readouterr()
        assert code == EXIT_OK, shown
        stats = box.daemon.transport.stats()
        print("killed node 2: the daemon published through %s %.1f s later; status answered; reconnects %d, "
              "requeued %d, dropped %d" % (stats["broker"], back_after, stats["reconnects"], stats["requeued"],
                                          stats["dropped"]))
    finally:
        probe.close()


SIM_BUNDLE, SIM_SHA = "shapes-2.0.0.tar.gz", "2" * 64
ROLLOUT_JOIN_S = 300.0  # a bound for a loaded machine: the rollout's own timeouts (60 s) end it well before


@pytest.fixture
def sim_fleets():
    made = []

    def make(node, order, name, count, deploy_s, reconnect_s):
        """``count`` simulated boxes starting on ``node``, then trying ``order``'s nodes in turn."""
        fleet = BoxFleet(node.host, node.port, prefix, {SIM_BUNDLE: model("2.0.0", SIM_SHA)}, deploy_s=deploy_s,
                         hosts=[(n.host, n.port) for n in order], reconnect_s=reconnect_s)
        for index in range(count):
            fleet.add("%s-%d" % (name, index))
        made.append(fleet)
        return fleet.start()

    prefix = random_prefix("killrollout")
    make.prefix = prefix
    yield make
    for fleet in made:
        fleet.close()


def _rollout_in_background(argv):
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(code=fleet_cli.main(argv)), name="rollout")
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("victim", ["box", "box_away_at_send", "operator"])
def test_a_rollout_survives_a_sigkill_of_a_boxs_node_or_of_the_operators(whole, sim_fleets, victim, tmp_path,
                                                                           capsys):
    """Issue 30: boxes on nodes 1 and 2, the operator on node 3 (then node 1); one node is killed mid-rollout.
    The boxes of a killed node come back through another; an operator whose node died stops with its state saved
    and the same command, re-run, continues through the next ``--broker``. Every box ends confirmed, deployed once.

    ``box``: node 2 dies while its boxes deploy. ``box_away_at_send``: it dies in the canary's deploy and its boxes
    stay away 6 s, so the wave's deploys to them are published while they have no subscription anywhere (lost:
    clean sessions); the operator sends them again when they are heard from.
    """
    n1, n2, n3 = whole.nodes
    deploy_s = 3.0  # long enough for the kill to land while deploys run
    away_s = 6.0 if victim == "box_away_at_send" else None  # past the canary's deploy and window: the wave goes out
    fleets = [sim_fleets(n1, [n1, n2, n3], "a", 3, deploy_s, 0.5),
              sim_fleets(n2, [n2, n1, n3], "b", 3, deploy_s, away_s or 0.5)]
    boxes = [box for fleet in fleets for box in fleet.boxes]
    killed = n3 if victim == "operator" else n2
    argv = ["rollout", "--broker", n3.url, "--broker", n1.url, "--prefix", sim_fleets.prefix, "--group", "sim",
            "--bundle", SIM_BUNDLE, "--sha256", SIM_SHA, "--state-dir", str(tmp_path / "rollouts"),
            "--confirm-timeout", "60", "--canary", "1", "--waves", "1", "--json"]
    deploys = MqttProbe(n1, ["%s/+/cmd/deploy" % sim_fleets.prefix])  # what the operator sent, seen on node 1
    thread, outcome = _rollout_in_background(argv)
    try:
        # box: node 2 dies once its boxes are deploying; the others: in the canary's deploy
        moving = fleets[1].boxes if victim == "box" else boxes
        assert wait_for(lambda: any(box.commands for box in moving), timeout=120.0)
        killed.kill()
        early = {box.device for box in boxes if box.commands}  # the canary (and the wave's first, for "box")
    finally:
        thread.join(ROLLOUT_JOIN_S)
        deploys.close()
    assert not thread.is_alive(), "the rollout did not end within %.0f s" % ROLLOUT_JOIN_S
    runs = [outcome["code"]]
    if victim == "operator":  # its link died with node 3: state saved, exit 4; the same command continues
        assert runs[0] == EXIT_BROKER, capsys.readouterr()
        capsys.readouterr()
        runs.append(fleet_cli.main(argv))
    shown = capsys.readouterr()
    report = json.loads(shown.out)
    states = {b["device"]: b["outcome"] for b in report["boxes"]}
    truths = {box.device: box.serving() for box in boxes}
    print("killed %s's node %s mid-rollout: exits %s, report %s, boxes on %s" % (
        victim, killed.name, runs, report["counts"], {b.device: b.broker for b in boxes}))
    assert runs[-1] == EXIT_COMPLETED, (report["counts"], states, truths)
    assert states == {box.device: "confirmed" for box in boxes}, (states, truths)
    assert all(t == {"version": "2.0.0", "state": "confirmed"} for t in truths.values()), truths
    assert {box.device: box.deploys for box in boxes} == {box.device: 1 for box in boxes}  # none ran twice
    if victim == "box_away_at_send":  # the premise: the wave reached b's boxes only by a re-send after their return
        sent = {box.device: [m["request_id"] for m in deploys.on("%s/%s/cmd/deploy" % (sim_fleets.prefix, box.device))]
                for box in fleets[1].boxes if box.device not in early}
        assert sent and all(len(ids) >= 2 and len(set(ids)) == 1 for ids in sent.values()), sent
