"""The options of ``atlas-edge fleet``: one function per action adds its sub-command, and ``rollout_spec``
turns ``fleet rollout``'s options into the rollout they describe (``agent.fleet.plan.spec_arguments`` the other way).

Separate from :mod:`agent.cli.fleet`, which runs the actions: what an operator may type (names, types, defaults,
help) is read and changed on its own, and the running code only reads the parsed namespace.
"""

import argparse
import math
from typing import Any, Dict

from agent.cli.ctl import add_broker_arguments, add_envelope_arguments
from agent.fleet.plan import (
    DEFAULT_CONFIRM_TIMEOUT_S,
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_RETRIES,
    DEFAULT_REVERT_TIMEOUT_S,
    RolloutSpec,
)
from agent.fleet.rollout import default_state_dir
from agent.fleet.status import DEFAULT_LISTEN_S, SETTLE_S


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


def add_status(sub: Any) -> None:
    """``fleet status``: listen for the boxes' answers, print them."""
    status = sub.add_parser("status", help="every box that announced itself: online, model, slots, fps, alerts")
    add_broker_arguments(status)
    status.add_argument("--group", default=None, help="only boxes of this group")
    status.add_argument("--json", action="store_true", help="JSON for scripts instead of a table")
    status.add_argument("--listen", type=finite, default=DEFAULT_LISTEN_S, metavar="S",
                        help="seconds to listen for the boxes' answers, telemetry (fps) and alerts")
    status.add_argument("--state-dir", default=None, help="where the record of every box seen is kept "
                        "(default %s)" % default_state_dir())


def add_rollout(sub: Any) -> None:
    """``fleet rollout``: the bundle, the waves, the abort rules, the timeouts."""
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
                         help="abort once failures / boxes sent a deploy (in flight counted as not failed) "
                              "exceeds R; see --min-executed")
    rollout.add_argument("--min-executed", type=int, default=1, metavar="N",
                         help="outcomes needed before the rate is judged (default 1; never fewer than --canary)")
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
    gate = rollout.add_argument_group(
        "gate on measured agreement (docs/shadow.md)",
        "With --shadow-frames each box of a wave first runs the candidate in shadow beside its serving model on its "
        "own live frames; it is deployed only if the candidate's score-aware F1 against the serving model reaches "
        "--min-agreement, else it ends 'disagreement' (a failure for the abort rules: a bad candidate stops the "
        "rollout in its canary, before any box serves it). A box whose agent does not know shadow runs ends "
        "'no_shadow', never deployed.")
    gate.add_argument("--shadow-frames", type=int, default=None, metavar="N",
                      help="frames each box compares before it is judged (turns the gate on)")
    gate.add_argument("--min-agreement", type=finite, default=None, metavar="F1",
                      help="score-aware F1 a box must measure to be deployed (default %.2f)" % DEFAULT_MIN_AGREEMENT)
    gate.add_argument("--shadow-sample", type=finite, default=None, metavar="R",
                      help="share of each box's served frames offered to the candidate, 0 < R <= 1 (default 1)")
    gate.add_argument("--shadow-timeout", type=finite, default=None, metavar="S",
                      help="a box without a final shadow report this long after its shadow command ends timed_out "
                           "(default: --confirm-timeout; also the run's max_s on the box)")
    rollout.add_argument("--wait-offline", type=finite, default=None, metavar="S",
                         help="boxes offline at the start make a last wave, sent to each that is back within S s")
    rollout.add_argument("--expect", type=int, default=None, metavar="N",
                         help="the group has N boxes: listen longer for missing ones; fewer heard ends 'partial'")
    rollout.add_argument("--bundle-file", default=None, metavar="PATH",
                         help="a local copy of the bundle for the pre-flight, when --bundle is a path in the "
                              "boxes' store")
    rollout.add_argument("--no-preflight", action="store_true",
                         help="skip fetching and checking the bundle (digest, device kinds) before sending")
    rollout.add_argument("--allow-duplicate-ids", action="store_true",
                         help="go on although two boxes answer as one device id (in different groups or of "
                              "different kinds); default: refused, naming them (exit 2)")
    rollout.add_argument("--inventory", default=None, metavar="FILE",
                         help="device ids that must be reached, one per line; those never heard are 'unseen'")
    _state_args(rollout, False)
    _run_args(rollout)


def add_resume(sub: Any) -> None:
    """``fleet resume``: a paused rollout, with the options it was started with."""
    resume = sub.add_parser("resume", help="go on with a paused rollout (after its canary, or by 'fleet pause')")
    add_broker_arguments(resume)
    _state_args(resume, True)
    _run_args(resume)


def add_cancel(sub: Any) -> None:
    """``fleet cancel``: stop a rollout; no broker needed, it writes beside the state file."""
    cancel = sub.add_parser("cancel", help="stop a rollout: nothing more is sent; --revert rolls moved boxes back")
    cancel.add_argument("--revert", action="store_true", help="roll every moved box back (by the running "
                        "rollout, or by the next run of the rollout command)")
    _state_args(cancel, True)


def add_pause(sub: Any) -> None:
    """``fleet pause``: no broker needed, it writes beside the state file."""
    pause = sub.add_parser("pause", help="pause a rollout before its next wave ('fleet resume' goes on)",
                           description="Pause a rollout: the running process finishes the wave in flight (its boxes "
                           "are judged as usual) and sends the next wave nothing; it then ends 'paused' (exit 6). A "
                           "rollout no process drives is marked paused at once. 'fleet resume' goes on, 'fleet "
                           "cancel' stops it there.")
    _state_args(pause, True)


def add_revert(sub: Any) -> None:
    """``fleet revert``: roll back every box a rollout may have moved, finished or not (docs/fleet.md)."""
    revert = sub.add_parser("revert", help="roll back every box a rollout may have moved (also a finished "
                            "rollout: it then reports cancelled)")
    add_broker_arguments(revert)
    _state_args(revert, True)
    _run_args(revert)


def add_forget(sub: Any) -> None:
    """``fleet forget``: a decommissioned box."""
    forget = sub.add_parser("forget", help="clear a decommissioned box's retained status and its record")
    add_broker_arguments(forget)
    forget.add_argument("device", help="the device id")
    forget.add_argument("--state-dir", default=None, help="the operator's record to remove it from too (default "
                        "%s)" % default_state_dir())


def add_metrics(sub: Any) -> None:
    """``fleet metrics``: the MQTT-to-Prometheus bridge (agent/fleet/metrics_bridge.py, docs/metrics.md)."""
    from agent.fleet.metrics_bridge import DEFAULT_FORGET_AFTER_S, DEFAULT_PORT

    metrics = sub.add_parser(
        "metrics", help="serve every box's status and telemetry (and the rollouts in --state-dir) to Prometheus",
        description="An MQTT-to-Prometheus bridge for boxes Prometheus cannot reach: it listens to every box's "
        "retained status and its telemetry and serves them as atlas_edge_fleet_* series on GET /metrics "
        "(docs/metrics.md). Runs until stopped (SIGTERM, Ctrl-C); a lost broker is retried every few seconds.")
    add_broker_arguments(metrics)
    metrics.add_argument("--listen", default="127.0.0.1:%d" % DEFAULT_PORT, metavar="HOST:PORT",
                         help="where Prometheus scrapes (default 127.0.0.1:%d; a bare PORT is loopback too: "
                         "give 0.0.0.0:PORT or an address to be reached from elsewhere)" % DEFAULT_PORT)
    metrics.add_argument("--group", action="append", default=[], metavar="G",
                         help="only boxes of this group (repeat for several; default every box)")
    metrics.add_argument("--state-dir", default=None, help="rollouts whose progress is served (read only; "
                         "default %s)" % default_state_dir())
    metrics.add_argument("--forget-after", type=finite, default=DEFAULT_FORGET_AFTER_S, metavar="S",
                         help="drop a box from the series after S seconds without a word from it (default "
                         "%.0f: a day)" % DEFAULT_FORGET_AFTER_S)


def rollout_spec(args: argparse.Namespace) -> RolloutSpec:
    """The rollout the options of ``fleet rollout`` describe (checked by :meth:`RolloutSpec.check`)."""
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
                       pause_after_canary=args.pause_after_canary, revert_timeout_s=args.revert_timeout,
                       shadow_frames=args.shadow_frames, min_agreement=args.min_agreement,
                       shadow_sample=args.shadow_sample, shadow_timeout_s=args.shadow_timeout)

