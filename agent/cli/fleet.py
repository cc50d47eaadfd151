"""``atlas-edge fleet status|rollout|resume|cancel|forget``: every box at a glance, and staged rollouts.

Exit codes of a rollout (``agent.fleet.report``): 0 completed, 1 aborted, 5 partial (ran to its end without
reaching every box), 6 paused after its canary, 7 cancelled; for every action :data:`EXIT_USAGE` (2: bad
arguments, a damaged state file, another process driving the rollout; nothing was sent), :data:`EXIT_BROKER`
(4: cannot connect or subscribe, or the connection dropped: re-run the same command to continue) and
:data:`EXIT_INTERRUPTED` (130: Ctrl-C; the state is saved, re-run the same command to continue).
See docs/fleet.md.
"""

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, TextIO

from agent._util.atomic import atomic_write
from agent.cli.ctl import (
    EXIT_BROKER,
    EXIT_OK,
    EXIT_USAGE,
    add_broker_arguments,
    add_envelope_arguments,
    broker_addresses,
    make_client,
)
from agent.config.schema import ConfigError
from agent.config.secrets import resolve_secret
from agent.fleet.inventory import Inventory, record_path
from agent.fleet.journal import RolloutLock, RolloutState
from agent.fleet.link import FleetLink, LinkError
from agent.fleet.plan import (
    CANCELLED_ROLLOUT,
    DEFAULT_CONFIRM_TIMEOUT_S,
    DEFAULT_RETRIES,
    DEFAULT_REVERT_TIMEOUT_S,
    FINISHED,
    RolloutError,
    RolloutSpec,
    check_rollout_id,
    prefix_problems,
)
from agent.fleet.report import exit_code, report
from agent.fleet.rollout import Rollout, default_state_dir
from agent.fleet.status import DEFAULT_LISTEN_S, SETTLE_S, FleetView, collect, render_table
from agent.protocol.envelope import CommandEnvelope
from agent.protocol.topics import name_problem, status_topic

EXIT_INTERRUPTED = 130
ACTIONS = ("status", "rollout", "resume", "cancel", "forget")


def finite(text: str) -> float:
    """An argparse type: a finite number (NaN never times out, infinity never ends)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a number" % text) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError("%r is not a finite number" % text)
    return value


def _per_type(text: str) -> Dict[str, int]:
    name, _, limit = text.partition("=")
    try:
        return {name.strip(): int(limit)}
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not TYPE=N (e.g. timed_out=2)" % text) from None


def _state_args(parser: argparse.ArgumentParser, rollout_id_required: bool) -> None:
    parser.add_argument("--rollout-id", default=None, required=rollout_id_required,
                        help="the rollout (its first progress line names it)" if rollout_id_required else
                        "default: derived from prefix, group, bundle and sha256 (a re-run resumes)")
    parser.add_argument("--state-dir", default=None, help="where progress is kept (default %s)" %
                        default_state_dir())


def _run_args(parser: argparse.ArgumentParser) -> None:
    """The options of the actions that send commands (rollout, resume): deploys and rollbacks are dated and
    signed with ``--ttl`` / ``--command-key`` as ctl's are. Each send is dated afresh (also a deploy sent again
    to a box that came back), so ``--ttl`` bounds one delivery, not the rollout (docs/fleet.md)."""
    add_envelope_arguments(parser)
    parser.add_argument("--report", default=None, metavar="FILE",
                        help="write the final JSON report here (default: beside the state file)")
    parser.add_argument("--json", action="store_true", help="print the final JSON report on stdout")
    parser.add_argument("--listen", type=finite, default=0.0, metavar="S",
                        help="listen at least S seconds before planning (default: until the set of boxes settles)")
    parser.add_argument("--settle", type=finite, default=SETTLE_S, metavar="S",
                        help="the set of boxes has settled once none appeared for S seconds (default %.1f)" %
                        SETTLE_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", metavar="ACTION")
    status = sub.add_parser("status", help="every box that announced itself: online, model, slots, fps, alerts")
    add_broker_arguments(status)
    status.add_argument("--group", default=None, help="only boxes of this group")
    status.add_argument("--json", action="store_true", help="JSON for scripts instead of a table")
    status.add_argument("--listen", type=finite, default=DEFAULT_LISTEN_S, metavar="S",
                        help="seconds to listen for the boxes' answers, telemetry (fps) and alerts")
    status.add_argument("--state-dir", default=None, help="where the record of every box seen is kept "
                        "(default %s)" % default_state_dir())
    rollout = sub.add_parser("rollout", help="deploy a bundle to a group: canary, waves, abort, resume")
    add_broker_arguments(rollout)
    rollout.add_argument("--group", required=True, help="the boxes whose status names this group")
    rollout.add_argument("--bundle", required=True, metavar="URL_OR_PATH",
                         help="what each box fetches: a path in its bundle store or an http(s) URL")
    rollout.add_argument("--sha256", required=True, metavar="HEX", help="the bundle's manifest sha256")
    rollout.add_argument("--archive-sha256", default=None, metavar="HEX",
                         help="sha256sum of the archive file; required when --bundle is a URL")
    rollout.add_argument("--canary", type=int, default=1, metavar="N", help="boxes in the first wave (default 1)")
    size = rollout.add_mutually_exclusive_group()
    size.add_argument("--waves", type=int, default=3, metavar="N", help="waves after the canary (default 3)")
    size.add_argument("--wave-size", type=int, default=None, metavar="N", help="boxes per wave instead")
    rollout.add_argument("--max-failures", type=int, default=None, metavar="N",
                         help="abort once more than N boxes failed")
    rollout.add_argument("--max-failure-rate", type=finite, default=None, metavar="R",
                         help="abort once failures / executed boxes exceeds R (after --min-executed boxes)")
    rollout.add_argument("--min-executed", type=int, default=1, metavar="N",
                         help="boxes that must have an outcome before the rate is judged (default 1)")
    rollout.add_argument("--max-per-type", type=_per_type, action="append", default=[], metavar="TYPE=N",
                         help="abort once more than N boxes ended as TYPE (failed, timed_out, rolled_back, "
                              "malformed, duplicate); repeatable")
    rollout.add_argument("--continue-after-canary-failure", action="store_true",
                         help="go on to the waves although a canary box failed (default: abort)")
    rollout.add_argument("--pause-after-canary", action="store_true",
                         help="stop after the canary (exit 6) until 'fleet resume'")
    rollout.add_argument("--confirm-timeout", type=finite, default=DEFAULT_CONFIRM_TIMEOUT_S, metavar="S",
                         help="a box not confirmed this long after its deploy ended is timed_out (default "
                              "%.0f; more than the boxes' observation_s)" % DEFAULT_CONFIRM_TIMEOUT_S)
    rollout.add_argument("--step-timeout", type=finite, default=None, metavar="S",
                         help="a deploy silent this long is timed_out; each progress ack restarts it (default: "
                              "--confirm-timeout)")
    rollout.add_argument("--retries", type=int, default=DEFAULT_RETRIES, metavar="N",
                         help="times a 'busy' or 'interrupted' deploy is sent again, with backoff (default %d)" %
                         DEFAULT_RETRIES)
    rollout.add_argument("--max-per-minute", type=int, default=None, metavar="N",
                         help="send at most N deploys in any minute")
    rollout.add_argument("--rollback-on-abort", action="store_true",
                         help="on abort, roll every box seen on the new bundle back to its previous model")
    rollout.add_argument("--revert-timeout", type=finite, default=DEFAULT_REVERT_TIMEOUT_S, metavar="S",
                         help="how long moved boxes are followed after an abort (default %.0f)" %
                         DEFAULT_REVERT_TIMEOUT_S)
    rollout.add_argument("--wait-offline", type=finite, default=None, metavar="S",
                         help="boxes offline at the start make a last wave, sent to each that is back within S s")
    rollout.add_argument("--expect", type=int, default=None, metavar="N",
                         help="the group has N boxes: listen longer for missing ones; fewer heard ends 'partial'")
    rollout.add_argument("--bundle-file", default=None, metavar="PATH",
                         help="a local copy of the bundle for the pre-flight, when --bundle is a path in the "
                              "boxes' store")
    rollout.add_argument("--no-preflight", action="store_true",
                         help="skip fetching and checking the bundle (digest, device kinds) before sending")
    rollout.add_argument("--inventory", default=None, metavar="FILE",
                         help="device ids that must be reached, one per line; those never heard are 'unseen'")
    _state_args(rollout, False)
    _run_args(rollout)
    resume = sub.add_parser("resume", help="go on with a rollout paused after its canary")
    add_broker_arguments(resume)
    _state_args(resume, True)
    _run_args(resume)
    cancel = sub.add_parser("cancel", help="stop a rollout: nothing more is sent; --revert rolls moved boxes back")
    cancel.add_argument("--revert", action="store_true", help="roll every moved box back (by the running "
                        "rollout, or by the next run of the rollout command)")
    _state_args(cancel, True)
    forget = sub.add_parser("forget", help="clear a decommissioned box's retained status and its record")
    add_broker_arguments(forget)
    forget.add_argument("device", help="the device id")
    forget.add_argument("--state-dir", default=None, help="the operator's record to remove it from too (default "
                        "%s)" % default_state_dir())


def _link(args: argparse.Namespace, name: str) -> FleetLink:
    """A link to the first ``--broker`` that takes the connection (a cluster's nodes, in turn)."""
    addresses, password = broker_addresses(args), resolve_secret(args.password)
    failures = []
    for host, port, use_tls in addresses:
        client = make_client(args, name, use_tls, password)
        try:
            return FleetLink(client, host, port, "%s:%d" % (host, port)).connect()
        except LinkError as exc:
            failures.append(str(exc))
    raise LinkError("; ".join(failures))


def _inventory(path: Optional[str]) -> Optional[List[str]]:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return sorted({line.strip() for line in handle if line.strip() and not line.startswith("#")})
    except (OSError, UnicodeDecodeError) as exc:
        raise RolloutError("--inventory %s: %s" % (path, exc)) from None


def _spec(args: argparse.Namespace) -> RolloutSpec:
    per_type: Dict[str, int] = {}
    for item in args.max_per_type:
        per_type.update(item)
    return RolloutSpec(group=args.group, bundle=args.bundle, sha256=args.sha256.lower(), prefix=args.prefix,
                       archive_sha256=args.archive_sha256 and args.archive_sha256.lower(),
                       canary=args.canary, waves=args.waves, wave_size=args.wave_size,
                       max_failures=args.max_failures, max_failure_rate=args.max_failure_rate,
                       min_executed=args.min_executed, confirm_timeout_s=args.confirm_timeout,
                       rollback_on_abort=args.rollback_on_abort, wait_offline_s=args.wait_offline,
                       step_timeout_s=args.step_timeout, retries=args.retries, max_per_minute=args.max_per_minute,
                       max_per_type=per_type, continue_after_canary_failure=args.continue_after_canary_failure,
                       pause_after_canary=args.pause_after_canary, revert_timeout_s=args.revert_timeout)


def _recorded_spec(args: argparse.Namespace) -> RolloutSpec:
    """The spec a paused rollout was started with (resume takes no rollout options of its own)."""
    state = RolloutState.load(os.path.join(_state_dir(args), "%s.json" % args.rollout_id))
    if state is None:
        raise RolloutError("no rollout %s in %s" % (args.rollout_id, _state_dir(args)))
    try:
        spec = RolloutSpec(**state.data["spec"])
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
            return _cancel(args, out)
        problems = prefix_problems(args.prefix)
        if problems:
            raise RolloutError(problems[0])
        spec = rollout_id = envelope = None
        if command in ("rollout", "resume"):
            envelope = CommandEnvelope.from_file(args.ttl, args.command_key)  # a bad key: exit 2, nothing sent
            spec = _spec(args) if command == "rollout" else _recorded_spec(args)
            spec.check()
            rollout_id = check_rollout_id(args.rollout_id or spec.default_id())
            if command == "rollout" and args.expect is not None and args.expect < 1:
                raise RolloutError("--expect must be >= 1")
        link = _link(args, "atlas-edge-fleet")
        if command == "status":
            return _status(args, link, out)
        if command == "forget":
            return _forget(args, link, out)
        return _rollout(args, spec, rollout_id, envelope, link, out, err, resume=command == "resume")
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
    view = collect(link, FleetView(args.prefix), args.listen, group=args.group)
    view.judge_stale()
    record.fold(view)
    record.fill(view)  # boxes seen before and not heard now: listed as unknown, with their last sighting
    record.save()
    boxes = view.in_group(args.group)
    if args.json:
        print(json.dumps({"group": args.group, "boxes": [b.as_dict() for b in boxes]}, indent=1, sort_keys=True),
              file=out)
    else:
        print(render_table(boxes), file=out)
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


def _cancel(args: argparse.Namespace, out: TextIO) -> int:
    rollout_id = check_rollout_id(args.rollout_id)
    base = os.path.join(_state_dir(args), rollout_id)
    with RolloutLock.probe(base + ".lock") as running:
        state = None if running else RolloutState.load(base + ".json")
        if not running and state is None:
            raise RolloutError("no rollout %s in %s" % (rollout_id, _state_dir(args)))
        if state is not None and state.status in FINISHED:
            raise RolloutError("rollout %s already %s" % (rollout_id, state.status))
        atomic_write(base + ".cancel", json.dumps({"revert": args.revert}) + "\n")
        if state is not None:  # no process drives it: cancelled here, reverts by the next run of the command
            state.top(status=CANCELLED_ROLLOUT, revert="wanted" if args.revert else None,
                      cancel={"revert": args.revert})
            state.save()
    print("rollout %s: cancel %s%s" % (rollout_id, "sent to the running process" if running else "recorded",
                                       "; re-run the rollout command to revert moved boxes" if args.revert and
                                       not running else ""), file=out)
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
                     resume=resume, preflight=check, envelope=envelope)
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
