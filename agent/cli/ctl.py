"""``atlas-edge ctl``: send one command to a box over MQTT and wait for its final ack.

Subscribes to the ack topic *before* publishing (an ack cannot be missed), prints every ack as one JSON line
as it comes, and exits 0 only when the command succeeded. Exit codes: :data:`EXIT_OK`, :data:`EXIT_FAILED`
(the device answered ``failed``; its error is printed), :data:`EXIT_USAGE` (bad arguments),
:data:`EXIT_TIMEOUT` (no final ack in time), :data:`EXIT_BROKER` (cannot connect or subscribe).
Passing the same ``--request-id`` again is a safe retry: the device answers from its record.
"""

import argparse
import json
import logging
import queue
import ssl
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, TextIO, Tuple
from urllib.parse import urlsplit

from agent.config.mqtt_config import DEFAULT_PREFIX
from agent.config.schema import ConfigError
from agent.config.secrets import resolve_secret
from agent.protocol.envelope import DEFAULT_SIGNED_TTL_S, CommandEnvelope, group_target
from agent.protocol.messages import REQUEST_ID_RULE, SUCCEEDED, Ack, ProtocolError, is_request_id, parse_ack
from agent.protocol.topics import ack_topic as build_ack_topic
from agent.protocol.topics import check_topic_names, command_topic
from agent.protocol.verbs import verb_names, verbs_help

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_BROKER = 4

DEFAULT_BROKER = "mqtt://localhost:1883"
DEFAULT_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0
CONNECT_ATTEMPT_S = 5.0  # TCP (+TLS) bound per broker, so that a dead node of a cluster costs little
PORTS = {"mqtt": 1883, "mqtts": 8883}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = verbs_help()  # from the verb table: a verb added there is listed here
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("device", help="device id (as in <prefix>/<device>/...)")
    parser.add_argument("verb", choices=verb_names(), help="command to send (listed below)")
    parser.add_argument("--json", dest="payload", default="{}", metavar="PAYLOAD",
                        help="the verb's fields as a JSON object, e.g. '{\"bundle\": \"m-1.2\"}'")
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


def broker_label(args: argparse.Namespace) -> str:
    return ", ".join(args.broker or [DEFAULT_BROKER])


def _command(args: argparse.Namespace) -> Tuple[str, str, str, bytes]:
    """(request_id, command topic, ack topic, payload) from the arguments; ValueError says what is wrong."""
    try:
        fields = json.loads(args.payload)
    except ValueError as exc:
        raise ValueError("--json is not valid JSON: %s" % exc) from None
    if not isinstance(fields, dict):
        raise ValueError("--json must be a JSON object, got %s" % type(fields).__name__)
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
    fields["request_id"] = request_id
    envelope = CommandEnvelope.from_file(getattr(args, "ttl", None), getattr(args, "command_key", None))
    fields = envelope.wrap(group_target(args.group) if args.group else args.device, args.verb, fields)
    return request_id, topic, ack_topic, json.dumps(fields).encode("utf-8")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Send the command in ``args`` and follow its acks; returns the exit code."""
    try:
        addresses = broker_addresses(args)
        request_id, topic, ack_topic, payload = _command(args)
        password = resolve_secret(args.password)
    except (ValueError, ConfigError) as exc:
        print("atlas-edge ctl: %s" % exc, file=err)
        return EXIT_USAGE
    events: "queue.Queue[Tuple[str, Any]]" = queue.Queue()
    failures = []
    for host, port, use_tls in addresses:  # in turn: the first broker that takes the connection
        try:
            client = make_client(args, "ctl", use_tls, password)
        except ValueError as exc:
            print("atlas-edge ctl: %s" % exc, file=err)
            return EXIT_USAGE
        # Callbacks only enqueue; this thread does the rest.
        client.on_connect = lambda c, u, flags, rc, props: events.put(("connect", rc))
        client.on_subscribe = lambda c, u, mid, codes, props: events.put(("subscribe", list(codes)))
        client.on_message = lambda c, u, message: events.put(("ack", message.payload))
        client.on_disconnect = lambda c, u, flags, rc, props: events.put(("disconnect", rc))
        try:
            client.connect(host, port, keepalive=30)
            break
        except (OSError, ValueError) as exc:
            failures.append("%s:%d: %s" % (host, port, exc))
    else:
        print("atlas-edge ctl: cannot connect to %s" % "; ".join(failures), file=err)
        return EXIT_BROKER
    client.loop_start()
    try:
        return _converse(client, events, args, request_id, topic, ack_topic, payload, out, err)
    finally:
        client.disconnect()
        client.loop_stop()


def run_client_id(username: Optional[str], tool: str) -> str:
    """This run's own client id, ``<username>-<tool>-<random>``, never the bare account name: a broker drops the
    older of two connections with one client id, so a ``fleet status`` must not share one with a running
    ``fleet rollout`` (the operators' listener in systemd/mosquitto.conf.example keeps the ids clients choose)."""
    return "%s-%s-%s" % (username or "atlas-edge", tool, uuid.uuid4().hex[:12])


def make_client(args: argparse.Namespace, name: str, use_tls: bool, password: Optional[str]) -> Any:
    """A clean-session paho client (no own reconnecting) with the credentials and TLS options of ``args``, and a
    client id of this run's own (:func:`run_client_id`; ``name`` is the tool: ``ctl``, ``fleet``).

    ``password`` is already resolved (:func:`resolve_secret`); ValueError names a CA file that cannot be loaded.
    """
    import paho.mqtt.client as mqtt  # the box's dependency; imported here so --help works without it
    from paho.mqtt.enums import CallbackAPIVersion

    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2,
                         client_id=run_client_id(args.username, name), clean_session=True,
                         reconnect_on_failure=False)
    client.connect_timeout = CONNECT_ATTEMPT_S
    if args.username is not None:
        client.username_pw_set(args.username, password)
    if use_tls or args.tls_ca:
        try:
            context = ssl.create_default_context(cafile=args.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError("--tls-ca %s: %s" % (args.tls_ca, exc)) from None
        context.check_hostname = not args.tls_insecure
        client.tls_set_context(context)
    return client


def _expect(events: "queue.Queue[Tuple[str, Any]]", kind: str, deadline: float) -> Optional[Any]:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            got, value = events.get(timeout=remaining)
        except queue.Empty:
            return None
        if got == kind:
            return value
        if got == "disconnect":
            return None


def _converse(client: Any, events: "queue.Queue[Tuple[str, Any]]", args: argparse.Namespace,
              request_id: str, topic: str, ack_topic: str, payload: bytes, out: TextIO, err: TextIO) -> int:
    setup_deadline = time.monotonic() + CONNECT_TIMEOUT_S
    reason = _expect(events, "connect", setup_deadline)
    if reason is None or reason.is_failure:
        print("atlas-edge ctl: broker %s refused or dropped the connection: %s" % (broker_label(args), reason),
              file=err)
        return EXIT_BROKER
    client.subscribe(ack_topic, qos=1)
    granted = _expect(events, "subscribe", setup_deadline)
    if not granted or granted[0].is_failure:
        print("atlas-edge ctl: cannot subscribe to %s (%s): check the broker ACL for this user"
              % (ack_topic, granted), file=err)
        return EXIT_BROKER
    info = client.publish(topic, payload, qos=1)
    deadline = time.monotonic() + args.timeout
    last_state = None
    while True:
        raw = _expect(events, "ack", deadline)
        if raw is None:
            break
        try:
            body: Dict[str, Any] = json.loads(raw)
            ack = parse_ack(body)
        except ValueError as exc:  # not JSON, or a ProtocolError naming the field
            what = exc if isinstance(exc, ProtocolError) else "not JSON"
            print("atlas-edge ctl: ignoring a message on %s: %s" % (ack_topic, what), file=err)
            continue
        print(json.dumps(body, sort_keys=True), file=out, flush=True)
        last_state = ack.state
        if ack.final:
            if last_state == SUCCEEDED:
                return EXIT_OK
            _print_error(ack, err)
            return EXIT_FAILED
    if not info.is_published():
        print("atlas-edge ctl: the broker did not acknowledge the command on %s" % topic, file=err)
    print("atlas-edge ctl: no final ack from %s for %s within %.0f s (last state: %s)"
          % (args.device, request_id, args.timeout, last_state or "none; is the device online?"), file=err)
    return EXIT_TIMEOUT


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
