"""``atlas-edge console``: the operator's web console over the fleet (docs/console.md), and its accounts.

``atlas-edge console --broker mqtt://broker:1883 --users console-users.json`` serves it on 127.0.0.1:8080;
``atlas-edge console adduser --users console-users.json NAME --role operator`` adds or replaces an account, the
password read from stdin. Needs the ``[console]`` extra: ``pip install 'atlas-edge[console]'``.
"""

import argparse
import getpass
import os
import sys
from typing import List, Optional, TextIO, Tuple

from agent.cli.ctl import add_broker_arguments, add_envelope_arguments, operator_link
from agent.config.schema import ConfigError
from agent.fleet.link import LinkError
from agent.fleet.rollout import default_state_dir

DEFAULT_LISTEN = "127.0.0.1:8080"
PASSWORD_ENV = "ATLAS_EDGE_CONSOLE_MQTT_PASSWORD"  # how the rollout commands it starts get its MQTT password
EXIT_USAGE, EXIT_BROKER = 2, 3
# What the [console] extra brings (pyproject.toml): module -> its distribution
CONSOLE_MODULES = (("starlette", "starlette"), ("uvicorn", "uvicorn"), ("jinja2", "jinja2"),
                   ("multipart", "python-multipart"), ("argon2", "argon2-cffi"))


def missing_extra() -> Optional[str]:
    """The [console] extra's distributions that cannot be imported, named; None when all can."""
    import importlib.util

    missing = [dist for module, dist in CONSOLE_MODULES if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return "needs %s, not installed: pip install 'atlas-edge[console]'" % ", ".join(missing)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("The operator's web console over the fleet (docs/console.md): it reads the boxes over\n"
                          "MQTT as `fleet status` does and serves pages on --listen. Needs the [console] extra.")
    parser.epilog = ("examples:\n  atlas-edge console adduser --users users.json olga --role operator < password.txt\n"
                     "  atlas-edge console --users users.json --broker mqtt://broker:1883 --listen 127.0.0.1:8080")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--users", metavar="FILE",
                        help="the users file (JSON, Argon2 hashes; required): `console adduser` writes it")
    add_broker_arguments(parser)
    add_envelope_arguments(parser)
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help="where the web server listens (default %s: this machine only; give 0.0.0.0:PORT "
                             "to serve the network, and then --tls-cert)" % DEFAULT_LISTEN)
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate chain "
                        "(cookies then marked Secure)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    parser.add_argument("--audit", default=None, metavar="FILE",
                        help="the audit log, one JSON line per action (default: console-audit.jsonl beside --users)")
    parser.add_argument("--listen-s", type=float, default=2.0, metavar="S",
                        help="seconds to gather the retained statuses before serving (default 2)")
    parser.add_argument("--state-dir", default=None, metavar="DIR",
                        help="where rollouts are kept, as for `atlas-edge fleet rollout` (default %s): the "
                             "rollouts page lists them and starts new ones there" % default_state_dir())
    sub = parser.add_subparsers(dest="console_command", metavar="[adduser]",
                                title="without an action it serves the console; with one")
    adduser = sub.add_parser("adduser", help="add or replace an account (password from stdin)",
                             description="Add or replace an account of the users file; the password is read "
                                         "from stdin (a terminal asks twice).")
    adduser.add_argument("--users", required=True, metavar="FILE", help="the users file (made if missing, 0600)")
    adduser.add_argument("name", help="the user name")
    adduser.add_argument("--role", required=True, choices=("viewer", "operator"),
                         help="viewer: sees everything, changes nothing; operator: runs commands and rollouts")
    adduser.add_argument("--groups", default="", metavar="G1,G2",
                         help="an operator limited to these groups (default: every group)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    problem = missing_extra()
    if problem:
        print("atlas-edge console %s" % problem, file=err)
        return EXIT_USAGE
    from agent.console.accounts import Accounts, AccountsError

    if args.console_command == "adduser":
        try:
            return _adduser(args, out)
        except AccountsError as exc:
            print("atlas-edge console adduser: %s" % exc, file=err)
            return EXIT_USAGE
    try:
        if not args.users:
            raise ValueError("--users FILE is required (make one: atlas-edge console adduser --users FILE NAME "
                             "--role operator)")
        accounts = Accounts.load(args.users)
        host, port = _listen(args.listen)
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if not accounts.accounts:
            raise ValueError("%s has no account: add one with atlas-edge console adduser" % args.users)
    except (AccountsError, ValueError) as exc:
        print("atlas-edge console: %s" % exc, file=err)
        return EXIT_USAGE
    try:
        link = operator_link(args, "console")
    except (ValueError, ConfigError) as exc:
        print("atlas-edge console: %s" % exc, file=err)
        return EXIT_USAGE
    except LinkError as exc:
        print("atlas-edge console: %s" % exc, file=err)
        return EXIT_BROKER
    return _serve(args, accounts, link, host, port, err)


def _serve(args: argparse.Namespace, accounts, link, host: str, port: int, err: TextIO) -> int:
    import uvicorn

    from agent.console.app import make_app
    from agent.console.audit import AuditLog
    from agent.console.watch import FleetWatch
    from agent.console.web import Console
    from agent.protocol.envelope import CommandEnvelope

    envelope = CommandEnvelope.from_file(args.ttl, args.command_key)
    watch = FleetWatch(link, args.prefix, envelope)
    desk = rollout_desk(args)
    audit = AuditLog(args.audit or os.path.join(os.path.dirname(os.path.abspath(args.users)),
                                                "console-audit.jsonl"))
    try:
        watch.start(listen_s=args.listen_s)
        app = make_app(Console(watch, accounts, audit, secure_cookie=bool(args.tls_cert), rollouts=desk))
        print("atlas-edge console: %d boxes; serving http%s://%s:%d/ (audit log %s, rollouts in %s)" % (
            len(watch.view.boxes), "s" if args.tls_cert else "", host, port, audit.path, desk.state_dir), file=err,
            flush=True)
        uvicorn.run(app, host=host, port=port, log_level="warning", ssl_certfile=args.tls_cert,
                    ssl_keyfile=args.tls_key, timeout_graceful_shutdown=2)
    finally:
        watch.stop()
        audit.close()
    return 0


def rollout_desk(args: argparse.Namespace):
    """The console's rollouts (agent/console/rollouts.py): in ``--state-dir``, each started as the rollout command
    with the console's own broker and signing options; the password goes to it in its environment, never on its
    command line."""
    from agent.config.secrets import resolve_secret
    from agent.console.rollouts import RolloutDesk

    link_args, env = [], {}
    for url in args.broker or []:
        link_args += ["--broker", url]
    if args.username:
        link_args += ["--username", args.username]
    if args.password is not None:
        env[PASSWORD_ENV] = resolve_secret(args.password) or ""
        link_args += ["--password", "env:" + PASSWORD_ENV]
    if args.tls_ca:
        link_args += ["--tls-ca", os.path.abspath(args.tls_ca)]
    if args.tls_insecure:
        link_args.append("--tls-insecure")
    if args.ttl is not None:
        link_args += ["--ttl", repr(args.ttl)]
    if args.command_key:
        link_args += ["--command-key", os.path.abspath(args.command_key)]
    return RolloutDesk(os.path.abspath(args.state_dir or default_state_dir()), args.prefix, link_args, env)


def _adduser(args: argparse.Namespace, out: TextIO) -> int:
    from agent.console.accounts import Accounts, AccountsError

    if sys.stdin.isatty():
        password = getpass.getpass("password for %s: " % args.name)
        if getpass.getpass("again: ") != password:
            raise AccountsError("the two passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    accounts = Accounts.load(args.users, missing_ok=True)
    groups = [g for g in args.groups.split(",") if g]
    account = accounts.add(args.name, args.role, password, groups)
    accounts.save()
    print("%s: %s is %s%s" % (args.users, account.name, account.role.value,
                              " of %s" % ", ".join(account.groups) if account.groups else ""), file=out)
    return 0


def _listen(value: str) -> Tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("--listen must be HOST:PORT (got %r)" % value)
    return host.strip("[]"), int(port)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-edge console")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
