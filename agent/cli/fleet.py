"""``atlas-edge fleet status|rollout|pause|resume|cancel|revert|forget|metrics``: every box, staged rollouts.

``metrics`` is the fleet's MQTT-to-Prometheus bridge (agent/fleet/metrics_bridge.py, docs/metrics.md).

Exit codes of a rollout (``agent.fleet.report``): 0 completed, 1 aborted, 5 partial (ran to its end without
reaching every box), 6 paused (after its canary, or by ``fleet pause``), 7 cancelled; for every action
:data:`EXIT_USAGE` (2: bad arguments, a damaged state file, another process driving the rollout; nothing was
sent), :data:`EXIT_BROKER` (4: cannot connect or subscribe, or the connection dropped: re-run the same command to
continue) and :data:`EXIT_INTERRUPTED` (130: Ctrl-C; the state is saved, re-run the same command to continue).
See docs/fleet.md.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, TextIO

from agent._util.atomic import atomic_write
from agent.cli.ctl import (
    EXIT_BROKER,
    EXIT_OK,
    EXIT_USAGE,
    operator_link,
)
from agent.cli.fleet_options import (
    add_cancel,
    add_forget,
    add_metrics,
    add_pause,
    add_resume,
    add_revert,
    add_rollout,
    add_status,
    rollout_spec,
)
from agent.cli.fleet_preflight import Check
from agent.config.schema import ConfigError
from agent.fleet.inventory import Inventory, record_path
from agent.fleet.journal import RolloutLock, RolloutState
from agent.fleet.link import FleetLink, LinkError
from agent.fleet.plan import RolloutError, RolloutSpec, check_rollout_id, prefix_problems
from agent.fleet.records import FINISHED, Outcome, Phase, RevertWish, RolloutStatus
from agent.fleet.report import exit_code, report
from agent.fleet.rollout import Rollout, default_state_dir
from agent.fleet.status import BoxView, FleetView, collect, render_table
from agent.protocol.envelope import CommandEnvelope
from agent.protocol.topics import name_problem, status_topic

EXIT_INTERRUPTED = 130
ACTIONS = ("status", "rollout", "pause", "resume", "revert", "cancel", "forget", "metrics")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per action; their options are in :mod:`agent.cli.fleet_options`."""
    sub = parser.add_subparsers(dest="fleet_command", metavar="ACTION")
    for add in (add_status, add_rollout, add_pause, add_resume, add_revert, add_cancel, add_forget, add_metrics):
        add(sub)


def _link(args: argparse.Namespace, name: str) -> FleetLink:
    """A link to the first ``--broker`` that takes the connection (a cluster's nodes, in turn)."""
    return operator_link(args, name)


def _inventory(path: Optional[str]) -> Optional[List[str]]:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return sorted({line.strip() for line in handle if line.strip() and not line.startswith("#")})
    except (OSError, UnicodeDecodeError) as exc:
        raise RolloutError("--inventory %s: %s" % (path, exc)) from None


def _recorded_spec(args: argparse.Namespace) -> RolloutSpec:
    """The spec a paused rollout was started with (resume takes no rollout options of its own)."""
    state = RolloutState.load(os.path.join(_state_dir(args), "%s.json" % args.rollout_id))
    if state is None:
        raise RolloutError("no rollout %s in %s" % (args.rollout_id, _state_dir(args)))
    try:
        spec = RolloutSpec(**state.record.spec)
    except TypeError as exc:
        raise RolloutError("state file %s: its spec does not fit this version (%s)" % (state.path, exc)) from None
    if spec.prefix != args.prefix:
        raise RolloutError("rollout %s runs under --prefix %s" % (args.rollout_id, spec.prefix))
    return spec


def _state_dir(args: argparse.Namespace) -> str:
    return args.state_dir or default_state_dir()


def run(args: argparse.Namespace, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests and callers may have replaced them
    command = getattr(args, "fleet_command", None)
    if command not in ACTIONS:
        print("atlas-edge fleet: choose an action: %s (see --help)" % ", ".join(ACTIONS), file=err)
        return EXIT_USAGE
    link = None
    try:
        if command == "cancel":
            return _cancel(args, out) or EXIT_OK
        if command == "pause":
            return _pause(args, out)
        problems = prefix_problems(args.prefix)
        if problems:
            raise RolloutError(problems[0])
        spec = rollout_id = envelope = None
        if command in ("rollout", "resume", "revert"):
            envelope = CommandEnvelope.from_file(args.ttl, args.command_key)  # a bad key: exit 2, nothing sent
            spec = rollout_spec(args) if command == "rollout" else _recorded_spec(args)
            spec.check()
            rollout_id = check_rollout_id(args.rollout_id or spec.default_id())
            if command == "rollout" and args.expect is not None and args.expect < 1:
                raise RolloutError("--expect must be >= 1")
        if command == "metrics":
            return _metrics(args, err)
        link = _link(args, "fleet")
        if command == "status":
            return _status(args, link, out)
        if command == "forget":
            return _forget(args, link, out)
        if command == "revert" and _cancel(args, out, revert=True) is not None:
            return EXIT_OK  # another process drives it: that process reverts
        return _rollout(args, spec, rollout_id, envelope, link, out, err, resume=command in ("resume", "revert"))
    except (ValueError, ConfigError, RolloutError) as exc:
        print("atlas-edge fleet: %s" % exc, file=err)
        return EXIT_USAGE
    except OSError as exc:  # the state directory or a file in it (a read-only or missing place)
        print("atlas-edge fleet: %s: %s" % (exc.filename or "", exc.strerror or exc), file=err)
        return EXIT_USAGE
    except LinkError as exc:
        print("atlas-edge fleet: %s%s" % (exc, "; re-run the same command to continue" if command in (
            "rollout", "resume") else ""), file=err)
        return EXIT_BROKER
    except KeyboardInterrupt:
        print("atlas-edge fleet: interrupted%s" % ("; the state is saved: re-run the same command to continue"
                                                   if command in ("rollout", "resume") else ""), file=err)
        return EXIT_INTERRUPTED
    finally:
        if link is not None:
            link.close()


def _record(args: argparse.Namespace) -> Inventory:
    """The operator's record of every box seen under ``--prefix`` (agent/fleet/inventory.py)."""
    return Inventory(record_path(_state_dir(args), args.prefix), args.prefix)


def _status(args: argparse.Namespace, link: FleetLink, out: TextIO) -> int:
    record = _record(args)
    view = FleetView(args.prefix)
    view.known_groups.update(record.known_groups())  # a recorded box whose status turns unreadable stays listed
    collect(link, view, args.listen, group=args.group)
    view.judge_stale()
    record.fold(view)
    record.fill(view)  # boxes seen before and not heard now: listed as unknown, with their last sighting
    record.save()
    boxes = view.rows(args.group)  # a device id two boxes answer as: one row each
    if args.json:
        print(json.dumps({"group": args.group, "boxes": [b.as_dict() for b in boxes]}, indent=1, sort_keys=True),
              file=out)
    else:
        print(render_table(boxes), file=out)
    return EXIT_OK


def _metrics(args: argparse.Namespace, err: TextIO) -> int:
    """``fleet metrics``: bind, connect (a broker refusing the first connection is exit 4), then serve until
    SIGTERM or Ctrl-C; later losses of the broker are the bridge's to retry (agent/fleet/metrics_bridge.py)."""
    import signal
    import threading

    from agent.config.daemon_config import parse_listen
    from agent.fleet.metrics_bridge import BridgeState, MetricsServer, registry_for, run_bridge

    if args.forget_after <= 0:
        raise RolloutError("--forget-after must be > 0")
    host, port = parse_listen(args.listen)
    try:
        import prometheus_client  # noqa: F401 - the 'metrics' extra
    except ImportError:
        raise RolloutError("fleet metrics needs prometheus_client: pip install 'atlas-edge[metrics]'") from None
    bridge = BridgeState(args.prefix, args.group, _state_dir(args), args.forget_after)
    try:
        server = MetricsServer(host, port, registry_for(bridge))
    except OSError as exc:
        raise RolloutError("--listen %s: %s" % (args.listen, exc.strerror or exc)) from None
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        links = [_link(args, "fleet-metrics")]  # the first connection: a wrong --broker ends the command here

        def connect() -> FleetLink:
            return links.pop() if links else _link(args, "fleet-metrics")

        print("fleet metrics: serving http://%s:%d/metrics" % server.address, file=err, flush=True)
        run_bridge(bridge, connect, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
    return EXIT_OK


def _forget(args: argparse.Namespace, link: FleetLink, out: TextIO) -> int:
    problem = name_problem(args.device)
    if problem is not None:
        raise RolloutError("%r is not a device id: it %s" % (args.device, problem))
    link.clear_retained(status_topic(args.prefix, args.device))
    record = _record(args)
    if record.boxes.pop(args.device, None) is not None:
        record.save()
    print("forgot %s: its retained status is cleared (it reappears if the box connects again)" % args.device,
          file=out)
    return EXIT_OK


def _cancel(args: argparse.Namespace, out: TextIO, revert: bool = False) -> Optional[int]:
    """Stop a rollout (``fleet cancel``), or mark it to be reverted (``--revert``, ``fleet revert``).

    A finished rollout can still be reverted: it is then ``cancelled`` (its boxes no longer serve what a
    ``completed`` would say), ``cancel.after`` keeps how it had ended. For ``fleet revert`` (``revert``) the
    return is None when no process drives the rollout: the caller runs the reverts itself.
    """
    rollout_id = check_rollout_id(args.rollout_id)
    revert = revert or args.revert
    base = os.path.join(_state_dir(args), rollout_id)
    with RolloutLock.probe(base + ".lock") as running:
        state = None if running else RolloutState.load(base + ".json")
        if not running and state is None:
            raise RolloutError("no rollout %s in %s" % (rollout_id, _state_dir(args)))
        if state is not None and state.status in FINISHED and not revert:
            raise RolloutError("rollout %s already %s ('fleet revert' or 'cancel --revert' rolls back the boxes it "
                               "moved)" % (rollout_id, state.status))
        atomic_write(base + ".cancel", json.dumps({"revert": revert}) + "\n")
        if state is not None:  # no process drives it: cancelled here, reverts by the next run of the command
            state.top(status=RolloutStatus.CANCELLED, revert=RevertWish.WANTED if revert else None,
                      cancel={"revert": revert, "after": str(state.status)})
            for device, box in state.boxes.items():
                if box.phase == Phase.PLANNED:  # never sent anything: it ends as the end of a run leaves it
                    state.set(device, outcome=Outcome.NOT_STARTED, phase=Phase.DONE)
            state.save()
    if getattr(args, "fleet_command", None) == "revert" and not running:
        return None
    print("rollout %s: cancel %s%s" % (rollout_id, "sent to the running process" if running else "recorded",
                                       "; re-run the rollout command (or 'fleet revert') to revert moved boxes"
                                       if revert and not running else ""), file=out)
    return EXIT_OK


def _pause(args: argparse.Namespace, out: TextIO) -> int:
    """Pause a rollout before its next wave: the running process is handed ``<id>.pause``; a rollout no process
    drives is marked paused in its state file at once."""
    rollout_id = check_rollout_id(args.rollout_id)
    base = os.path.join(_state_dir(args), rollout_id)
    with RolloutLock.probe(base + ".lock") as running:
        state = None if running else RolloutState.load(base + ".json")
        if not running and state is None:
            raise RolloutError("no rollout %s in %s" % (rollout_id, _state_dir(args)))
        if state is not None and state.status != RolloutStatus.RUNNING:
            raise RolloutError("rollout %s is %s: only a running rollout can be paused" % (rollout_id, state.status))
        if running:
            atomic_write(base + ".pause", "{}\n")
        else:
            state.top(status=RolloutStatus.PAUSED)
            state.save()
    print("rollout %s: %s; 'fleet resume' goes on" % (rollout_id, "pause sent to the running process (it pauses "
                                                      "before its next wave)" if running else "paused"), file=out)
    return EXIT_OK


def _rollout(args: argparse.Namespace, spec: Any, rollout_id: Any, envelope: Any, link: FleetLink, out: TextIO,
             err: TextIO, resume: bool) -> int:
    state_dir = _state_dir(args)

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    check = None
    if not resume and not args.no_preflight:
        from agent.cli.fleet_preflight import preflight

        check = preflight(spec.bundle, spec.sha256, args.bundle_file, progress, spec.archive_sha256)
    # Boxes that must be reached: --inventory's, and the group's boxes in the operator's record (unseen if silent).
    record = _record(args)
    listed = _inventory(getattr(args, "inventory", None))
    recorded = record.devices(spec.group)
    engine = Rollout(spec, rollout_id, state_dir, link, progress=progress, listen_s=args.listen,
                     settle_s=args.settle, expect=getattr(args, "expect", None),
                     inventory=sorted(set(listed or []) | set(recorded)) if listed or recorded else None,
                     resume=resume, envelope=envelope)
    # A box the record or --inventory lists in the group whose status is too malformed to name its groups is
    # still the group's: reported malformed (counted in the exit code), never not_targeted.
    engine.view.known_groups.update(record.known_groups())
    engine.view.known_groups.update({device: sorted(set(engine.view.known_groups.get(device, [])) | {spec.group})
                                     for device in listed or []})
    engine.preflight = _gate(engine.view, spec.group, getattr(args, "allow_duplicate_ids", False), check)
    state = engine.run()
    record.fold(engine.view)
    record.save()
    result = report(state)
    result["broker_messages"] = {"sent": link.sent, "received": link.received}
    path = args.report or os.path.join(state_dir, "%s.report.json" % rollout_id)
    atomic_write(path, json.dumps(result, indent=1, sort_keys=True) + "\n", durable=False)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True), file=out)
    else:
        print(_summary(result, path), file=out)
    return exit_code(result["status"])


def _gate(view: FleetView, group: str, allow_duplicates: bool, check: Optional[Check]) -> Check:
    """What a new rollout checks once its boxes are gathered, before anything is sent: duplicate device ids
    (refused unless ``--allow-duplicate-ids``), then the pre-flight's artifact check; RolloutError refuses."""
    def gate(boxes: List[BoxView]) -> None:
        problem = view.duplicate_problem(group)
        if problem is not None and not allow_duplicates:
            raise RolloutError(problem)
        if check is not None:
            check(boxes)
    return gate


def _summary(result: Dict[str, Any], path: str) -> str:
    counts = ", ".join("%s %d" % kv for kv in sorted(result["counts"].items()))
    lines: List[str] = ["rollout %s %s in %.1f s: %s" % (result["rollout_id"], result["status"],
                                                         result["wall_s"] or 0.0, counts)]
    if result["abort"]:
        lines.append("aborted in wave %d: %s" % (result["abort"]["wave"] + 1, result["abort"]["reason"]))
    if result["shortfall"]:
        lines.append(result["shortfall"])
    if result["not_reached"]:
        lines.append("not reached: %s" % ", ".join(result["not_reached"][:50]))
    reverted = [b["device"] for b in result["boxes"] if b["reverted"]]
    if reverted:
        lines.append("rolled back: %d box(es)" % len(reverted))
    anomalies = ["%s: %s" % (b["device"], a) for b in result["boxes"] for a in b["anomalies"]]
    lines += ["anomaly %s" % a for a in anomalies[:20]]
    lines.append("report: %s" % path)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge fleet", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
