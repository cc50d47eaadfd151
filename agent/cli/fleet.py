"""``atlas-edge fleet status|rollout``: every box at a glance, and staged rollouts with automatic abort.

Exit codes: :data:`EXIT_OK`; :data:`EXIT_FAILED` (a rollout aborted or some box failed); :data:`EXIT_USAGE` (bad
arguments, or a state file from a different command); :data:`EXIT_BROKER` (cannot connect or subscribe, or the
connection dropped: re-run the same command to continue). See docs/fleet.md.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, TextIO

from agent.cli.ctl import (
    EXIT_BROKER,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    add_broker_arguments,
    broker_addresses,
    make_client,
)
from agent.config.schema import ConfigError
from agent.config.secrets import resolve_secret
from agent.fleet.link import FleetLink, LinkError
from agent.fleet.rollout import (
    COMPLETED,
    DEFAULT_CONFIRM_TIMEOUT_S,
    FAILURES,
    Rollout,
    RolloutError,
    RolloutSpec,
    check_rollout_id,
    default_state_dir,
    report,
)
from agent.fleet.status import DEFAULT_LISTEN_S, FleetView, collect, render_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", metavar="ACTION")
    status = sub.add_parser("status", help="every box that announced itself: online, model, slots, fps, alerts")
    add_broker_arguments(status)
    status.add_argument("--group", default=None, help="only boxes of this group")
    status.add_argument("--json", action="store_true", help="JSON for scripts instead of a table")
    status.add_argument("--listen", type=float, default=DEFAULT_LISTEN_S, metavar="S",
                        help="seconds to listen for telemetry (fps) and alerts after the retained status")
    rollout = sub.add_parser("rollout", help="deploy a bundle to a group: canary, waves, abort, resume")
    add_broker_arguments(rollout)
    rollout.add_argument("--group", required=True, help="the boxes whose status names this group")
    rollout.add_argument("--bundle", required=True, metavar="URL_OR_PATH",
                         help="what each box fetches: a path in its bundle store or an http(s) URL")
    rollout.add_argument("--sha256", required=True, metavar="HEX", help="the bundle's manifest sha256")
    rollout.add_argument("--canary", type=int, default=1, metavar="N", help="boxes in the first wave (default 1)")
    size = rollout.add_mutually_exclusive_group()
    size.add_argument("--waves", type=int, default=3, metavar="N", help="waves after the canary (default 3)")
    size.add_argument("--wave-size", type=int, default=None, metavar="N", help="boxes per wave instead")
    rollout.add_argument("--max-failures", type=int, default=None, metavar="N",
                         help="abort once more than N boxes failed")
    rollout.add_argument("--max-failure-rate", type=float, default=None, metavar="R",
                         help="abort once failures / executed boxes exceeds R (after --min-executed boxes)")
    rollout.add_argument("--min-executed", type=int, default=1, metavar="N",
                         help="boxes that must have an outcome before the rate is judged (default 1)")
    rollout.add_argument("--confirm-timeout", type=float, default=DEFAULT_CONFIRM_TIMEOUT_S, metavar="S",
                         help="a box not confirmed this long after its deploy was sent is timed_out (default "
                              "%.0f; more than the boxes' observation_s)" % DEFAULT_CONFIRM_TIMEOUT_S)
    rollout.add_argument("--rollback-on-abort", action="store_true",
                         help="on abort, roll every moved box back to its previous model")
    rollout.add_argument("--wait-offline", type=float, default=None, metavar="S",
                         help="boxes offline at the start make a last wave, sent to each that is back within S s")
    rollout.add_argument("--rollout-id", default=None,
                         help="default: derived from prefix, group, bundle and sha256 (a re-run resumes)")
    rollout.add_argument("--state-dir", default=None,
                         help="where progress is kept (default %s)" % default_state_dir())
    rollout.add_argument("--report", default=None, metavar="FILE",
                         help="write the final JSON report here (default: beside the state file)")
    rollout.add_argument("--json", action="store_true", help="print the final JSON report on stdout")
    rollout.add_argument("--listen", type=float, default=0.0, metavar="S",
                         help="seconds to listen before planning (default: until the retained burst ends)")


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


def run(args: argparse.Namespace, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests and callers may have replaced them
    command = getattr(args, "fleet_command", None)
    if command not in ("status", "rollout"):
        print("atlas-edge fleet: choose an action: status or rollout (see --help)", file=err)
        return EXIT_USAGE
    try:
        if command == "rollout":
            spec = RolloutSpec(group=args.group, bundle=args.bundle, sha256=args.sha256.lower(),
                               prefix=args.prefix, canary=args.canary, waves=args.waves,
                               wave_size=args.wave_size, max_failures=args.max_failures,
                               max_failure_rate=args.max_failure_rate, min_executed=args.min_executed,
                               confirm_timeout_s=args.confirm_timeout, rollback_on_abort=args.rollback_on_abort,
                               wait_offline_s=args.wait_offline)
            spec.check()
            rollout_id = check_rollout_id(args.rollout_id or spec.default_id())
        link = _link(args, "atlas-edge-fleet")
    except (ValueError, ConfigError, RolloutError) as exc:
        print("atlas-edge fleet: %s" % exc, file=err)
        return EXIT_USAGE
    except LinkError as exc:
        print("atlas-edge fleet: %s" % exc, file=err)
        return EXIT_BROKER
    try:
        if command == "status":
            return _status(args, link, out)
        return _rollout(args, spec, rollout_id, link, out, err)
    except LinkError as exc:
        print("atlas-edge fleet: %s%s" % (exc, "; re-run the same command to continue" if command == "rollout"
                                          else ""), file=err)
        return EXIT_BROKER
    except RolloutError as exc:
        print("atlas-edge fleet: %s" % exc, file=err)
        return EXIT_USAGE
    finally:
        link.close()


def _status(args: argparse.Namespace, link: FleetLink, out: TextIO) -> int:
    view = collect(link, FleetView(args.prefix), args.listen)
    boxes = view.in_group(args.group)
    if args.json:
        print(json.dumps({"group": args.group, "boxes": [b.as_dict() for b in boxes]}, indent=1, sort_keys=True),
              file=out)
    else:
        print(render_table(boxes), file=out)
    return EXIT_OK


def _rollout(args: argparse.Namespace, spec: RolloutSpec, rollout_id: str, link: FleetLink, out: TextIO,
             err: TextIO) -> int:
    state_dir = args.state_dir or default_state_dir()

    def progress(line: str) -> None:
        print(line, file=err, flush=True)

    state = Rollout(spec, rollout_id, state_dir, link, progress=progress, listen_s=args.listen).run()
    result = report(state)
    result["broker_messages"] = {"sent": link.sent, "received": link.received}
    path = args.report or os.path.join(state_dir, "%s.report.json" % rollout_id)
    from agent._util.atomic import atomic_write

    atomic_write(path, json.dumps(result, indent=1, sort_keys=True) + "\n", durable=False)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True), file=out)
    else:
        print(_summary(result, path), file=out)
    failed = any(b["outcome"] in FAILURES for b in result["boxes"])
    return EXIT_OK if result["status"] == COMPLETED and not failed else EXIT_FAILED


def _summary(result: Dict[str, Any], path: str) -> str:
    counts = ", ".join("%s %d" % kv for kv in sorted(result["counts"].items()))
    lines: List[str] = ["rollout %s %s in %.1f s: %s" % (result["rollout_id"], result["status"],
                                                         result["wall_s"] or 0.0, counts)]
    if result["abort"]:
        lines.append("aborted in wave %d: %s" % (result["abort"]["wave"] + 1, result["abort"]["reason"]))
    reverted = [b["device"] for b in result["boxes"] if b["reverted"]]
    if reverted:
        lines.append("rolled back on abort: %d box(es)" % len(reverted))
    lines.append("report: %s" % path)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge fleet", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
