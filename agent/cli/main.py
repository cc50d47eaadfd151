"""``atlas-edge``: one entry point for the box and the workstation.

Box commands (demo, run, ctl, validate, bundle, fleet) need only the edge dependencies. Host commands (qat, convert,
bench) import their modules when called, and say which extra to install when that fails.
"""

import argparse
import importlib
import json
import logging
import sys
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:
    from agent.config.daemon_config import DaemonConfig
    from agent.config.overrides import Overrides

EPILOG = """examples:
  atlas-edge demo --frames 24                       the whole pipeline on embedded defaults
  atlas-edge run --config /etc/atlas-edge/config.yaml
  atlas-edge ctl --broker mqtt://broker:1883 cam-01 status
  atlas-edge validate device_configs/atlas-200dk.yaml
  atlas-edge bundle verify examples/demo-bundle
  atlas-edge bundle create --model yolov8n.onnx --out out/yolov8n-bundle
  atlas-edge fleet rollout --group site-a --bundle m-1.2.tar.gz --sha256 HEX --max-failure-rate 0.05
  atlas-edge wheelhouse --python 3.9 --platform aarch64 --out wheels-a2
  atlas-edge qat --config quant/examples/shapes.yaml --out out/shapes-bundle
  atlas-edge convert --bundle out/shapes-bundle --device atlas-200dk --to om --dry-run
  atlas-edge bench --quick --json bench.json
"""

# subcommand -> (module, help, extra that provides its dependencies)
COMMANDS = {
    "demo": ("agent.cli.demo", "run the whole pipeline on the bundled model and sample frames", "edge"),
    "run": ("agent.cli.main", "run the daemon (under systemd: see systemd/atlas-edge.service)", "edge"),
    "ctl": ("agent.cli.ctl", "send one command to a box over MQTT and wait for its final ack", "edge"),
    "validate": ("agent.cli.main", "check a daemon config or device config; per-field errors", "edge"),
    "bundle": ("agent.cli.bundle", "create (from ONNX/MindIR), verify, sign, make keys: model bundles", "edge"),
    "fleet": ("agent.cli.fleet", "every box at a glance; staged rollouts with canary, waves and abort", "edge"),
    "console": ("agent.cli.console", "the operator's web console: the fleet, boxes, snapshots, live (roles)",
                "console"),
    "wheelhouse": ("agent.cli.wheelhouse", "download a box's pinned wheels for its Python and CPU (offline install)",
                   "edge"),
    "qat": ("quant.cli", "train / quantization-aware training / export to a bundle (workstation)", "host"),
    "convert": ("converters.cli", "convert a bundle's model with ATC or converter_lite (workstation)", "host"),
    "bench": ("benchmarks.cli", "measure preprocessing, decoding, batching, MQTT, memory, start-up", "dev"),
}


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="daemon config (YAML); see examples/daemon.yaml")


# sysexits.h EX_CONFIG (systemd shows "status=78/CONFIG"): a start-up failure that no restart can fix (a bad
# config, a missing or damaged bundle, a backend whose runtime is not installed). The unit lists it in
# RestartPreventExitStatus=, so systemd stops instead of retrying every RestartSec until StartLimitBurst.
EXIT_CANNOT_START = 78
# argparse's status for a bad command line (a typo in a drop-in's ExecStart=): also not fixed by a restart.
EXIT_USAGE = 2


def _run(args: argparse.Namespace) -> int:
    from agent.config.schema import ConfigError
    from agent.daemon import run_daemon
    from agent.pipeline.backends import BackendUnavailable

    try:
        return run_daemon(args.config)
    except (ConfigError, BackendUnavailable) as exc:
        _cannot_start(exc)
        return EXIT_CANNOT_START


def _cannot_start(exc: BaseException) -> None:
    """Say once, on stderr (the journal) and in ``systemctl status``, why the daemon will not be restarted."""
    from agent.health.sdnotify import SystemdNotifier

    print("atlas-edge cannot start, and a restart would fail the same way (exit %d, not restarted): %s\n"
          "Fix it, check with `atlas-edge validate`, then `systemctl restart atlas-edge`." % (
              EXIT_CANNOT_START, exc), file=sys.stderr)
    notifier = SystemdNotifier()
    notifier.status("cannot start: %s" % (exc or type(exc).__name__))  # flattened to one line by status()
    notifier.close()


def _add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a daemon config or a device config (YAML)")
    parser.add_argument("--probe", action="store_true",
                        help="also open each source once and read one picture; report the cause of any failure")


def _validate(args: argparse.Namespace) -> int:
    """Decide the file's kind by its keys, validate it whole, print every error or the parsed result.

    For a daemon config, the state directory's overrides (remote ``set-config`` changes) are merged as ``run``
    would, and the values they set are marked; the files are only read.
    """
    import yaml

    from agent._util.redact import redact_all
    from agent.config.daemon_config import DaemonConfig
    from agent.config.device_config import DeviceConfig, load_device_config
    from agent.config.overrides import load_with_overrides
    from agent.config.schema import ConfigError, describe, to_dict
    from agent.protocol.verbs import check_group_verbs

    try:
        with open(args.file, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        print("%s: %s" % (args.file, exc), file=sys.stderr)
        return EXIT_USAGE
    is_device = isinstance(data, dict) and ("soc_version" in data or "target" in data)
    overrides = None
    try:
        if is_device:
            config = load_device_config(args.file)
        else:
            config, overrides = load_with_overrides(args.file, quarantine=False)
            check_group_verbs(config.commands.group_verbs)  # the protocol's verbs: a layer above the config's
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    kind = DeviceConfig if is_device else DaemonConfig
    print("%s: valid %s" % (args.file, "device config" if is_device else "daemon config"))
    values = redact_all(to_dict(config))
    from_overrides = overrides.values() if overrides is not None else {}
    for path, _default, doc in describe(kind):
        value = values
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        marked = any(path == key or path.startswith(key + ".") for key in from_overrides)
        # JSON, not yaml.safe_dump: that ends a lone scalar with a document-end line ("...")
        print("%s %-34s %-28s %s" % ("*" if marked else " ", path, json.dumps(value)[:28], doc))
    if overrides is not None:
        _print_overrides(overrides)
    if args.probe and not is_device:
        return _probe_sources(config)
    return 0


def _probe_sources(config: "DaemonConfig") -> int:
    """``validate --probe``: each source opened once; 0 only when every one gave a picture. The cause's detail
    is printed (the operator's own terminal), redacted."""
    from agent._util.redact import redact
    from agent.pipeline.sources import probe

    failed = 0
    for source in config.sources:
        found = probe(source)
        if found["ok"]:
            print("probe %s: ok, %dx%d picture in %.2f s (time from %s)" % (
                source.name, found["image_hw"][1], found["image_hw"][0], found["seconds"], found["ts_source"]))
        else:
            failed += 1
            print("probe %s: FAILED [%s] %s" % (source.name, found["cause"], redact(found["message"])))
    return 1 if failed else 0


def _print_overrides(overrides: "Overrides") -> None:
    """What the state directory's overrides file contributes, or why it would be ignored by ``run``."""
    from agent._util.redact import redact

    report = overrides.report()
    if report["unreadable"]:
        print("overrides %s could not be read (%s); run validate as the daemon's user (sudo -u atlas-edge) to "
              "see what they set" % (report["file"], report["unreadable"]))
    elif report["damaged"]:
        print("overrides %s are damaged and would be moved aside at start: %s" % (report["file"],
                                                                                  report["damaged"]))
    elif report["values"] or report["ignored"]:
        print("* from overrides %s (remote set-config; the file above is unchanged):" % report["file"])
        for key, value in report["values"].items():
            print("    %s = %s" % (key, redact(json.dumps(value))))
        for item in report["ignored"]:
            print("  ignored (no longer valid against this file): %s: %s" % (
                item["section"], "; ".join("%s: %s" % (e["field"], e["message"]) for e in item["errors"])))


LOCAL = {"run": (_add_run_arguments, _run), "validate": (_add_validate_arguments, _validate)}


def _load(name: str):
    """(add_arguments, run) of a subcommand, or a stand-in that explains which extra is missing."""
    if name in LOCAL:
        return LOCAL[name]
    module_name, _help, extra = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        reason = str(exc)

        def explain(args: argparse.Namespace) -> int:
            if missing == module_name.split(".")[0] == "benchmarks":  # not in the wheel (pyproject.toml)
                print("atlas-edge %s runs from a source checkout: the benchmarks package is not installed with "
                      "atlas-edge. In the checkout's root: python -m agent %s (or make bench)." % (name, name),
                      file=sys.stderr)
                return 2
            print("atlas-edge %s needs %s, which is not installed (%s).\n"
                  "Install the '%s' extra: pip install 'atlas-edge[%s]'%s" % (
                      name, missing, reason, extra, extra,
                      "  (and: pip install --no-deps mindspore-gs==1.3.0)" if extra == "host" else ""),
                  file=sys.stderr)
            return 2

        explain.accepts_unknown = True  # its options are unknown without the module: explain, don't fail
        return (lambda parser: None), explain
    return module.add_arguments, module.run


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atlas-edge", description="Deploy vision models to Huawei Atlas edge boxes and keep them running.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text, _extra) in COMMANDS.items():
        child = sub.add_parser(name, help=help_text, description=help_text)
        # Import a subcommand's module only when it is the one being run (host modules import MindSpore).
        if only == name:
            add_arguments, run = _load(name)
            add_arguments(child)
            child.set_defaults(handler=run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(getattr(args, "handler", None), "accepts_unknown", False):
        parser.error("unrecognized arguments: %s" % " ".join(unknown))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    handler: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
