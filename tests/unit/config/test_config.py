"""Config schemas: every bad field is named, unknown keys fail, device configs load by stem."""

import json
import os
import random
import subprocess
import sys

import pytest
import yaml

from agent.config.daemon_config import load_daemon_config, merge_config, parse_daemon_config
from agent.config.device_config import known_devices, load_device_config
from agent.config.overrides import OVERRIDES_FILE, load_with_overrides
from agent.config.schema import ConfigError
from agent.config.secrets import credential_path, resolve_secret

GOOD = {"device_id": "cam-01", "model": {"bundle": "b"}}


def errors_of(data):
    with pytest.raises(ConfigError) as info:
        parse_daemon_config(data)
    return {e.path: e.message for e in info.value.errors}


def test_minimal_config_gets_defaults():
    config = parse_daemon_config(GOOD)
    assert config.mqtt.port == 1883 and config.mqtt.qos == 1
    assert config.batching.max_wait_ms == 10.0


def test_unknown_key_and_wrong_type_are_named_together():
    errors = errors_of({**GOOD, "mqtt": {"prot": 1883, "qos": "1"}, "batching": {"max_batch": 0}})
    assert "unknown key" in errors["mqtt.prot"]
    assert "expected an integer" in errors["mqtt.qos"]
    assert ">= 1" in errors["batching.max_batch"]


def test_missing_required_and_bool_is_not_int():
    errors = errors_of({"model": {"bundle": "b"}, "mqtt": {"port": True}})
    assert errors["device_id"] == "required"
    assert "expected an integer" in errors["mqtt.port"]


def test_cross_field_rules():
    errors = errors_of({**GOOD, "device_id": "a/b",
                        "sources": [{"name": "x", "uri": "u"}, {"name": "x", "uri": "v"}]})
    assert "device_id" in errors and "sources" in errors


def test_merge_config_validates_whole_and_rejects_non_live_sections():
    config = parse_daemon_config(GOOD)
    merged = merge_config(config, {"thresholds": {"conf": 0.5}})
    assert merged.thresholds.conf == 0.5 and config.thresholds.conf is None  # the original is untouched
    with pytest.raises(ConfigError) as info:
        merge_config(config, {"thresholds": {"conf": 2.0}})
    assert info.value.errors[0].path == "thresholds.conf"
    with pytest.raises(ConfigError) as info:
        merge_config(config, {"mqtt": {"port": 1}})
    assert info.value.errors[0].path == "mqtt"


@pytest.mark.parametrize("change, field", [
    ({"batching": {"queue_size": 1000000000}}, "batching.queue_size"),
    ({"publish": {"telemetry_interval_s": 1e-6}}, "publish.telemetry_interval_s"),
    ({"publish": {"max_rate_hz": 1e9}}, "publish.max_rate_hz"),
    ({"thresholds": {"max_det": 10 ** 9}}, "thresholds.max_det"),
    ({"sources": [{"name": "cam", "uri": "/frames", "max_fps": 1e9}]}, "sources[0].max_fps"),
    ({"sources": [{"name": "cam", "uri": "/frames", "reopen_min_s": 1e-9}]}, "sources[0].reopen_min_s"),
])
def test_every_live_number_has_bounds(change, field):
    config = parse_daemon_config({**GOOD, "sources": [{"name": "cam", "uri": "/frames"}]})
    with pytest.raises(ConfigError) as info:
        merge_config(config, change)
    assert [e.path for e in info.value.errors] == [field]


def test_a_remote_change_keeps_sources_inside_their_lane():
    """A remote set-config may tune a source, not point it (or a new one) at a file or an internal URL."""
    config = parse_daemon_config({**GOOD, "sources": [{"name": "cam", "uri": "rtsp://10.1.2.3/s1"}]})
    tuned = merge_config(config, {"sources": [{"name": "cam", "uri": "rtsp://10.1.2.3/s1", "max_fps": 5}]})
    assert tuned.sources[0].max_fps == 5
    for sources in ([{"name": "cam", "uri": "/etc"}],
                    [{"name": "cam", "uri": "rtsp://10.1.2.3/s1"}, {"name": "spy", "uri": "http://127.0.0.1:8080/"}]):
        with pytest.raises(ConfigError) as info:
            merge_config(config, {"sources": sources})
        assert "remote_config.source_uris in the local config allows it (allowed: none)" in str(info.value)
    allowed = parse_daemon_config({**GOOD, "sources": [{"name": "cam", "uri": "rtsp://10.1.2.3/s1"}],
                                   "remote_config": {"source_uris": ["rtsp://10.1.2.*/s1"]}})
    assert merge_config(allowed, {"sources": [{"name": "cam", "uri": "rtsp://10.1.2.9/s1"}]}).sources[0].uri \
        == "rtsp://10.1.2.9/s1"
    with pytest.raises(ConfigError, match="sources\\[0\\].uri"):
        merge_config(allowed, {"sources": [{"name": "cam", "uri": "rtsp://10.1.3.9/s1"}]})
    with pytest.raises(ConfigError, match="cannot change while running"):
        merge_config(allowed, {"remote_config": {"source_uris": ["*"]}})


def test_the_number_of_sources_is_bounded():
    many = [{"name": "c%d" % i, "uri": "rtsp://10.0.0.%d/s" % i} for i in range(17)]
    assert "at most 16 sources" in errors_of({**GOOD, "sources": many})["sources"]


@pytest.mark.parametrize("device_id", ["operator", "operator-alice", "group", "$SYS", "cam:01", "cam 01"])
def test_broker_reserved_and_topic_special_device_ids_are_refused(device_id):
    assert "device_id" in errors_of({**GOOD, "device_id": device_id})


def test_a_password_is_not_sent_over_plain_tcp_beyond_loopback_unless_allowed():
    remote = {"host": "broker.example", "password": "env:PW"}
    assert "sent in clear over plain TCP to broker.example" in errors_of({**GOOD, "mqtt": remote})["mqtt.password"]
    for mqtt in ({**remote, "tls": {}}, {**remote, "allow_plain_password": True},
                 {"host": "127.0.0.1", "password": "env:PW"}, {"host": "localhost", "password": "env:PW"}):
        assert parse_daemon_config({**GOOD, "mqtt": mqtt}).mqtt.password == "env:PW"


def test_secrets_from_env_and_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("MQTT_PW", "s3cret")
    assert resolve_secret("env:MQTT_PW") == "s3cret"
    (tmp_path / "mqtt-password").write_text("from-systemd\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert resolve_secret("cred:mqtt-password") == "from-systemd"
    monkeypatch.delenv("MQTT_PW")
    with pytest.raises(ConfigError, match="MQTT_PW"):
        resolve_secret("env:MQTT_PW")


def test_one_resolver_names_the_field_for_files_and_values(tmp_path, monkeypatch):
    """Config, transport (TLS files) and ctl share these; each failure names the field that asked."""
    (tmp_path / "tls-key").write_text("KEY")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    assert credential_path("cred:tls-key", "mqtt.tls.key_file") == str(tmp_path / "tls-key")
    assert credential_path(str(tmp_path / "tls-key"), "mqtt.tls.key_file") == str(tmp_path / "tls-key")
    with pytest.raises(ConfigError, match="mqtt.tls.key_file: file not found"):
        credential_path("cred:absent", "mqtt.tls.key_file")
    with pytest.raises(ConfigError, match="mqtt.password: cannot read credential"):
        resolve_secret("cred:absent")
    with pytest.raises(ConfigError, match="bad credential name"):
        resolve_secret("cred:../etc/passwd")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(ConfigError, match=r"mqtt.tls.ca_file: cred: needs systemd LoadCredential"):
        credential_path("cred:ca", "mqtt.tls.ca_file")
    assert resolve_secret("plain") == "plain" and resolve_secret(None) is None


@pytest.mark.parametrize("name", ["atlas-200dk", "atlas-200i-dk-a2", "atlas-300i-pro", "atlas-500", "cpu-dev"])
def test_every_device_config_loads_by_stem(name):
    device = load_device_config(name)
    assert device.name == name
    expected_soc = {"atlas-200dk": "Ascend310", "atlas-200i-dk-a2": "Ascend310B4", "atlas-300i-pro": "Ascend310P3",
                    "atlas-500": "Ascend310", "cpu-dev": None}[name]
    assert device.soc_version == expected_soc


def test_known_devices_lists_the_card():
    assert set(known_devices()) >= {"atlas-200dk", "atlas-200i-dk-a2", "atlas-300i-pro", "atlas-500", "cpu-dev"}


def test_device_config_cross_rules(tmp_path):
    bad = yaml.safe_load(open(load_device_config.__globals__["device_config_path"]("atlas-200dk")))
    bad.update({"soc_version": None, "artifact_format": "onnx", "name": "wrong"})
    path = tmp_path / "atlas-200dk.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as info:
        load_device_config(str(path))
    paths = {e.path for e in info.value.errors}
    assert {"soc_version", "artifact_format"} <= paths


def test_example_daemon_config_is_valid():
    config = load_daemon_config("examples/daemon.yaml")
    assert config.device == "cpu-dev" and config.batching.max_batch == 4


def test_relative_source_paths_are_relative_to_the_config_file(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    uris = {"folder": "frames", "video": "../clips/gate.mp4", "absolute": "/srv/frames", "usb": "camera:0",
            "stream": "rtsp://10.0.0.5/live"}
    path = site / "daemon.yaml"
    path.write_text(yaml.safe_dump({"device_id": "cam-01", "model": {"bundle": "b"},
                                    "sources": [{"name": k, "uri": v} for k, v in uris.items()]}))
    resolved = {s.name: s.uri for s in load_daemon_config(str(path)).sources}
    assert resolved == {"folder": str(site / "frames"), "video": str(site / "../clips/gate.mp4"),
                        "absolute": "/srv/frames", "usb": "camera:0", "stream": "rtsp://10.0.0.5/live"}


def test_public_key_files_are_relative_to_the_config_file_and_hex_keys_stay(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from agent.commands.freshness import freshness_of

    site = tmp_path / "site"
    site.mkdir()
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    (site / "operators.pem").write_bytes(public.public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    path = site / "daemon.yaml"
    path.write_text(yaml.safe_dump({"device_id": "cam-01", "model": {"bundle": "b", "public_key": raw.hex()},
                                    "commands": {"public_key": "operators.pem"}}))
    monkeypatch.chdir(tmp_path)  # not the config's folder: "operators.pem" is not found from here
    config = load_daemon_config(str(path))
    assert config.commands.public_key == str(site / "operators.pem")
    assert config.model.public_key == raw.hex()
    assert freshness_of(config.commands).public_key == raw


def test_an_unknown_device_name_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as info:
        parse_daemon_config({"device_id": "cam-01", "model": {"bundle": "b"}, "device": "no-such-box"})
    [error] = info.value.errors
    assert error.path == "device" and "'no-such-box'" in error.message
    assert all(name in error.message for name in known_devices())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=60)


def test_validate_cli_prints_fields_and_exit_codes(tmp_path):
    ok = _cli("validate", "device_configs/atlas-200i-dk-a2.yaml")
    assert ok.returncode == 0 and "Ascend310B4" in ok.stdout
    bad = tmp_path / "daemon.yaml"
    bad.write_text("device_id: x\nmodel: {bundle: b}\nmqtt: {port: 70000, hots: a}\n")
    result = _cli("validate", str(bad))
    assert result.returncode == 1
    assert "mqtt.port: must be <= 65535" in result.stderr and "mqtt.hots: unknown key" in result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("device_id: [unclosed\n")
    assert _cli("validate", str(broken)).returncode != 0


def test_validate_refuses_names_some_broker_reads_as_separators_or_wildcards(tmp_path):
    """RabbitMQ turns '.' into a topic level: cam.04 would publish on atlas-edge/cam/04/... and miss its commands."""
    config = tmp_path / "daemon.yaml"
    config.write_text("device_id: cam.04\nmodel: {bundle: b}\n")
    result = _cli("validate", str(config))
    assert result.returncode == 1
    assert "device_id: must not contain '.': RabbitMQ's topic-level separator" in result.stderr, result.stderr
    assert errors_of(dict(GOOD, device_id="cam*1")) == {
        "device_id": "must not contain '*': RabbitMQ's one-word wildcard (AMQP topic bindings) (got 'cam*1')"}
    found = errors_of({"device_id": "cam-1", "model": {"bundle": "b"}, "sources": [{"name": "a.b", "uri": "x"}],
                       "mqtt": {"prefix": "site/a.b", "groups": ["ok", "site.b", "x+y"]}})
    assert found == {
        "sources[0].name": "must not contain '.': RabbitMQ's topic-level separator (AMQP routing keys) (got 'a.b')",
        "mqtt.prefix": "must not contain '.': RabbitMQ's topic-level separator (AMQP routing keys) (got 'site/a.b')",
        "mqtt.groups[1]": "must not contain '.': RabbitMQ's topic-level separator (AMQP routing keys) (got 'site.b')",
        "mqtt.groups[2]": "must not contain '+': an MQTT wildcard (got 'x+y')"}
    assert parse_daemon_config(dict(GOOD, mqtt={"prefix": "plant/atlas-edge", "groups": ["line-1"]}))
    assert "'$'" in errors_of(dict(GOOD, mqtt={"prefix": "$SYS/x"}))["mqtt.prefix"]


def test_validate_prints_each_value_on_its_own_line():
    result = _cli("validate", "examples/daemon.yaml")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.strip() in ("...", "---")]
    [conf] = [line.split() for line in lines if line.split()[:1] == ["thresholds.conf"]]
    assert conf[1] == "0.3"
    [device_id] = [line.split() for line in lines if line.split()[:1] == ["device_id"]]
    assert device_id[1] == '"cam-01"'


# --- overrides: remote set-config changes in the state directory --------------------------------------------

def write_config(tmp_path, **extra):
    data = {"device_id": "cam-01", "model": {"bundle": "b"}, "state_dir": "state", **extra}
    path = tmp_path / "config.yaml"
    path.write_text("# the operator's comment\n" + yaml.safe_dump(data))
    return path


def test_overrides_merge_over_the_file_survive_a_reload_and_never_touch_it(tmp_path):
    path = write_config(tmp_path, thresholds={"iou": 0.6})
    before = path.read_bytes()
    config, overrides = load_with_overrides(str(path))
    assert overrides.values() == {} and config.thresholds.conf is None
    overrides.record({"thresholds": {"conf": 0.4}})
    overrides.record({"batching": {"max_batch": 4}})
    stored = json.loads((tmp_path / "state" / OVERRIDES_FILE).read_text())
    assert stored == {"version": 1, "changes": {"thresholds": {"conf": 0.4}, "batching": {"max_batch": 4}}}
    again, reread = load_with_overrides(str(path))  # what a restart does
    assert again.thresholds.conf == 0.4 and again.thresholds.iou == 0.6 and again.batching.max_batch == 4
    assert reread.values() == {"batching.max_batch": 4, "thresholds.conf": 0.4}
    assert path.read_bytes() == before  # the operator's file, comment included, is never rewritten
    previous = reread.record({"thresholds": {"conf": 0.2}})
    reread.restore(previous)  # the change could not be applied: the file says what is in effect again
    assert load_with_overrides(str(path))[0].thresholds.conf == 0.4


def test_an_override_that_no_longer_validates_is_reported_and_ignored(tmp_path):
    path = write_config(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    # A section that is not live (any more) and a value out of bounds, next to one that still applies.
    (state / OVERRIDES_FILE).write_text(json.dumps({"version": 1, "changes": {
        "mqtt": {"port": 1884}, "batching": {"max_batch": 999}, "thresholds": {"conf": 0.3}}}))
    config, overrides = load_with_overrides(str(path))
    assert config.thresholds.conf == 0.3 and config.batching.max_batch == 1 and config.mqtt.port == 1883
    ignored = {item["section"]: item["errors"][0]["field"] for item in overrides.ignored}
    assert ignored == {"mqtt": "mqtt", "batching": "batching.max_batch"}
    assert overrides.damaged is None and (state / OVERRIDES_FILE).exists()  # not damaged: kept for a person
    assert sorted(a["figures"]["section"] for a in overrides.alerts()) == ["batching", "mqtt"]
    assert {a["kind"] for a in overrides.alerts()} == {"override_ignored"}


@pytest.mark.parametrize("damage", [
    pytest.param(lambda good: good[: len(good) // 2], id="truncated"),
    pytest.param(lambda good: bytes(random.Random(7).getrandbits(8) for _ in range(100)), id="random-bytes"),
    pytest.param(lambda good: b'{"thresholds": {"conf": 0.4}}', id="json-of-the-wrong-schema"),
    pytest.param(lambda good: b'[1, 2, 3]', id="json-not-a-mapping"),
])
def test_a_damaged_overrides_file_is_moved_aside_and_the_file_config_serves(tmp_path, damage):
    path = write_config(tmp_path)
    config, overrides = load_with_overrides(str(path))
    overrides.record({"thresholds": {"conf": 0.4}})
    target = tmp_path / "state" / OVERRIDES_FILE
    target.write_bytes(damage(target.read_bytes()))
    config, overrides = load_with_overrides(str(path))
    assert config.thresholds.conf is None  # the config file alone
    assert overrides.damaged and overrides.moved_to and os.path.exists(overrides.moved_to)
    assert not target.exists() and overrides.moved_to.startswith(str(target) + ".corrupt-")
    assert overrides.report()["moved_to"] == overrides.moved_to
    overrides.record({"thresholds": {"conf": 0.5}})  # and set-config works again on a fresh file
    assert load_with_overrides(str(path))[0].thresholds.conf == 0.5


def test_validate_marks_values_from_overrides_and_changes_nothing(tmp_path):
    path = write_config(tmp_path)
    _config, overrides = load_with_overrides(str(path))
    overrides.record({"thresholds": {"conf": 0.4}, "mqtt": {"port": 1}})  # as if written by an older version
    result = _cli("validate", str(path))
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if "thresholds.conf" in ln and "0.4" in ln)
    assert line.startswith("*")
    assert not any(ln.startswith("*") and "thresholds.iou" in ln for ln in result.stdout.splitlines())
    assert "ignored (no longer valid against this file): mqtt" in result.stdout
    # a damaged file is reported by validate but left where it is (validate only reads)
    target = tmp_path / "state" / OVERRIDES_FILE
    target.write_bytes(b"\x00garbage")
    result = _cli("validate", str(path))
    assert result.returncode == 0 and "damaged and would be moved aside" in result.stdout
    assert target.read_bytes() == b"\x00garbage" and os.listdir(tmp_path / "state") == [OVERRIDES_FILE]


def test_overrides_that_cannot_be_read_are_reported_not_moved(tmp_path):
    """A person running validate without the daemon's permissions, or a path that is not a file."""
    path = write_config(tmp_path)
    (tmp_path / "state" / OVERRIDES_FILE).mkdir(parents=True)  # open() fails with an OSError, as on EACCES
    config, overrides = load_with_overrides(str(path))
    assert config.thresholds.conf is None and overrides.unreadable and overrides.moved_to is None
    assert [a["kind"] for a in overrides.alerts()] == ["state_file_unreadable"]
    assert (tmp_path / "state" / OVERRIDES_FILE).is_dir()
    result = _cli("validate", str(path))
    assert result.returncode == 0 and "could not be read" in result.stdout
