"""``atlas-edge ctl``: send one command to a box over MQTT and wait for its final ack.

Subscribes to the ack topic *before* publishing (an ack cannot be missed), prints every ack as one JSON line
as it comes, and exits 0 only when the command succeeded. Exit codes: :data:`EXIT_OK`, :data:`EXIT_FAILED`
(the device answered ``failed``; its error is printed), :data:`EXIT_USAGE` (bad arguments, ``--json`` fields
the verb's request type refuses, named: nothing is sent), :data:`EXIT_TIMEOUT` (no final ack in time),
:data:`EXIT_BROKER` (cannot connect or subscribe, or the connection dropped). Passing the same ``--request-id``
again is a safe retry: the device answers from its record.

It speaks through the operator's one link, :mod:`agent.fleet.link` (as ``fleet`` does); this module also holds
the connection options every operator command shares and :func:`operator_link`, which opens that link.
"""

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, TextIO, Tuple
from urllib.parse import urlsplit

from agent.config.mqtt_config import DEFAULT_PREFIX, TlsConfig
from agent.config.secrets import resolve_secret
from agent.fleet.link import FleetLink, LinkError, open_link
from agent.protocol.envelope import DEFAULT_SIGNED_TTL_S, CommandEnvelope, group_target
from agent.protocol.messages import REQUEST_ID_RULE, SUCCEEDED, Ack, ProtocolError, is_request_id, parse_ack
from agent.protocol.topics import ack_topic as build_ack_topic
from agent.protocol.topics import check_topic_names, command_topic
from agent.protocol.verbs import command_payload, parse_request, verb_names, verbs_help

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_BROKER = 4

DEFAULT_BROKER = "mqtt://localhost:1883"
DEFAULT_TIMEOUT_S = 30.0
PORTS = {"mqtt": 1883, "mqtts": 8883}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = verbs_help()  # from the verb table: a verb added there is listed here
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("device", help="device id (as in <prefix>/<device>/...)")
    parser.add_argument("verb", choices=verb_names(), help="command to send (listed below)")
    parser.add_argument("--json", dest="payload", default="{}", metavar="PAYLOAD",
                        help="the verb's fields as a JSON object, e.g. '{\"bundle\": \"m-1.2\"}'; read as the box "
                             "reads it, so a field it would refuse fails here (exit 2) and nothing is sent")
    add_broker_arguments(parser)
    parser.add_argument("--group", default=None, help="send to this group's topic; wait for DEVICE's acks")
    parser.add_argument("--request-id", default=None, help="reuse an id to retry safely (default: a new one)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds to wait for the "
                        "final ack")
    add_envelope_arguments(parser)


def add_envelope_arguments(parser: argparse.ArgumentParser) -> None:
    """How an operator command dates and signs what it sends (ctl, fleet): :mod:`agent.protocol.envelope`."""
    parser.add_argument("--ttl", type=float, default=None, metavar="S",
                        help="date each command (issued_at = when it is sent) and let it be valid S seconds: a box "
                             "refuses it later, and refuses a replay meanwhile (docs/mqtt.md, Freshness)")
    parser.add_argument("--command-key", default=None, metavar="PEM",
                        help="sign each command with this Ed25519 private key (boxes with commands.public_key "
                             "require it); implies --ttl %g unless given" % DEFAULT_SIGNED_TTL_S)


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection options every operator command shares (ctl, fleet)."""
    parser.add_argument("--broker", action="append", default=None, metavar="URL",
                        help="mqtt://HOST:PORT or mqtts://HOST:PORT (default %s); give it once per node of a "
                             "cluster and they are tried in turn" % DEFAULT_BROKER)
    parser.add_argument("--username", default=None, help="MQTT username (an operator account)")
    parser.add_argument("--password", default=None,
                        help="password, or env:VAR / cred:NAME to keep it off the command line")
    parser.add_argument("--tls-ca", default=None, metavar="FILE", help="CA file; implies TLS")
    parser.add_argument("--tls-insecure", action="store_true", help="skip hostname check (test brokers only)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="topic prefix")


def broker_address(url: str) -> Tuple[str, int, bool]:
    try:
        parts = urlsplit(url if "://" in url else "mqtt://" + url)
        port = parts.port
    except ValueError:  # a port out of range or not a number
        parts, port = None, None
    if parts is None or parts.scheme not in PORTS or not parts.hostname:
        raise ValueError("--broker must look like mqtt://HOST:PORT or mqtts://HOST:PORT (got %r)" % url)
    return parts.hostname, port or PORTS[parts.scheme], parts.scheme == "mqtts"


def broker_addresses(args: argparse.Namespace) -> List[Tuple[str, int, bool]]:
    """Every ``--broker`` given, in order (the default one when none is); ValueError names a bad one."""
    return [broker_address(url) for url in (args.broker or [DEFAULT_BROKER])]


def _command(args: argparse.Namespace) -> Tuple[str, str, str, Dict[str, Any]]:
    """(request_id, command topic, ack topic, body) from the arguments; ValueError (or ConfigError, naming every
    bad field of ``--json``) says what is wrong. The payload is read by the parse the box runs
    (:func:`agent.protocol.verbs.parse_request`), so a typo fails here and nothing is sent."""
    try:
        fields = json.loads(args.payload)
    except ValueError as exc:
        raise ValueError("--json is not valid JSON: %s" % exc) from None
    if not isinstance(fields, dict):
        raise ValueError("--json must be a JSON object, got %s" % type(fields).__name__)
    request = parse_request(args.verb, fields)
    request_id = args.request_id or "ctl-" + uuid.uuid4().hex[:16]
    if not is_request_id(request_id):
        raise ValueError("--request-id must be %s" % REQUEST_ID_RULE)
    check_topic_names((("DEVICE", args.device, False), ("--group", args.group, False),
                       ("--prefix", args.prefix, True)))
    if args.group:
        topic = command_topic(args.prefix, args.verb, group=args.group)
    else:
        topic = command_topic(args.prefix, args.verb, device=args.device)
    ack_topic = build_ack_topic(args.prefix, args.device, request_id)
    envelope = CommandEnvelope.from_file(getattr(args, "ttl", None), getattr(args, "command_key", None))
    body = envelope.wrap(group_target(args.group) if args.group else args.device, args.verb,
                         command_payload(args.verb, request, request_id))
    return request_id, topic, ack_topic, body


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Send the command in ``args`` and follow its acks; returns the exit code."""
    try:
        request_id, topic, ack_topic, body = _command(args)
        link = operator_link(args, "ctl")
    except ValueError as exc:  # also ConfigError: the --json fields, a secret or a TLS file, each bad one named
        print("atlas-edge ctl: %s" % exc, file=err)
        return EXIT_USAGE
    except LinkError as exc:
        print("atlas-edge ctl: %s" % exc, file=err)
        return EXIT_BROKER
    try:
        try:
            link.subscribe([ack_topic])  # before publishing: no ack can be missed
        except LinkError as exc:
            print("atlas-edge ctl: cannot subscribe to %s: %s" % (ack_topic, exc), file=err)
            return EXIT_BROKER
        return _follow(link, args, request_id, topic, link.publish(topic, body), out, err)
    except LinkError as exc:  # the connection dropped while waiting: the same request id again is a safe retry
        print("atlas-edge ctl: %s; re-run with --request-id %s to retry safely" % (exc, request_id), file=err)
        return EXIT_BROKER
    finally:
        link.close()


def _follow(link: FleetLink, args: argparse.Namespace, request_id: str, topic: str, sent: Any, out: TextIO,
            err: TextIO) -> int:
    """Print each ack until the final one (its exit code) or ``--timeout``."""
    deadline = time.monotonic() + args.timeout
    last_state = None
    while True:
        message = link.get(deadline - time.monotonic())
        if message is None:
            break
        body = message.json()
        try:
            ack = parse_ack(body)
        except ProtocolError as exc:
            what = exc if body is not None else "not JSON"
            print("atlas-edge ctl: ignoring a message on %s: %s" % (message.topic, what), file=err)
            continue
        print(json.dumps(body, sort_keys=True), file=out, flush=True)
        last_state = ack.state
        if ack.final:
            if last_state == SUCCEEDED:
                return EXIT_OK
            _print_error(ack, err)
            return EXIT_FAILED
    if not sent.is_published():
        print("atlas-edge ctl: the broker did not acknowledge the command on %s" % topic, file=err)
    print("atlas-edge ctl: no final ack from %s for %s within %.0f s (last state: %s)"
          % (args.device, request_id, args.timeout, last_state or "none; is the device online?"), file=err)
    return EXIT_TIMEOUT


def run_client_id(username: Optional[str], tool: str) -> str:
    """This run's own client id, ``<username>-<tool>-<random>``, never the bare account name: a broker drops the
    older of two connections with one client id, so a ``fleet status`` must not share one with a running
    ``fleet rollout`` (the operators' listener in systemd/mosquitto.conf.example keeps the ids clients choose)."""
    return "%s-%s-%s" % (username or "atlas-edge", tool, uuid.uuid4().hex[:12])


def operator_link(args: argparse.Namespace, tool: str) -> FleetLink:
    """The operator's link (:func:`agent.fleet.link.open_link`) to the first ``--broker`` that takes the
    connection, its clients made by :func:`make_client` (``tool``: ``ctl``, ``fleet``, ``fleet-metrics``).

    ValueError names a bad ``--broker``, ConfigError a secret or CA file that cannot be read (both before anything
    is sent); LinkError says what each broker did.
    """
    addresses = broker_addresses(args)
    password = resolve_secret(args.password)
    return open_link(addresses, lambda use_tls: make_client(args, tool, use_tls, password))


def make_client(args: argparse.Namespace, name: str, use_tls: bool, password: Optional[str]) -> Any:
    """A paho client (:func:`agent.ops.mqtt_client.new_client`) with the credentials and TLS options of
    ``args``, and a client id of this run's own (:func:`run_client_id`; ``name`` is the tool).

    ``password`` is already resolved (:func:`resolve_secret`); ConfigError names a CA file that cannot be loaded.
    """
    from agent.ops.mqtt_client import new_client, tls_context  # paho's: imported here so --help works without it

    tls = None
    if use_tls or args.tls_ca:
        tls = tls_context(TlsConfig(ca_file=args.tls_ca, insecure=args.tls_insecure), {"ca_file": "--tls-ca"})
    return new_client(run_client_id(args.username, name), args.username, password, tls)


def _print_error(ack: Ack, err: TextIO) -> None:
    error = ack.error
    assert error is not None  # parse_ack requires it in a failed ack
    where = " (field %s)" % error.field if error.field else ""
    print("atlas-edge ctl: failed: %s%s: %s" % (error.code, where, error.message), file=err)
    for item in error.errors or ():
        print("  %s: %s" % (item.field or "<root>", item.message), file=err)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge ctl", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    threading.current_thread().name = "ctl"
    sys.exit(main())
