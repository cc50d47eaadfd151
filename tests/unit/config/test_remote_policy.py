"""A remote set-config hands the box data, never a capability (agent/config/remote_policy.py): source URIs
matched per part, no userinfo or secret reference from the payload, no loopback, link-local or own address,
FFmpeg options from an allow-list; credentials only from the local ``remote_config.credentials``."""

import json
import socket

import pytest
import yaml

from agent.config.daemon_config import merge_config, parse_daemon_config
from agent.config.overrides import OVERRIDES_FILE, load_with_overrides
from agent.config.remote_policy import REMOTE_INPUT_OPTIONS, address_problem
from agent.config.schema import ConfigError

GOOD = {"device_id": "cam-01", "model": {"bundle": "b"}}
CAM = {"name": "cam", "uri": "rtsp://10.1.2.3/stream1"}


def box(**remote_config):
    return parse_daemon_config({**GOOD, "sources": [CAM], "remote_config": remote_config})


def refusal(config, sources):
    """The one error of a refused change: (field, message)."""
    with pytest.raises(ConfigError) as info:
        merge_config(config, {"sources": sources})
    assert len(info.value.errors) == 1, info.value
    return info.value.errors[0].path, info.value.errors[0].message


def own_address():
    """A non-loopback address of this machine (None when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 9))  # no packet is sent: only the route is looked up
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.parametrize("uri", [
    "rtsp://10.1.2.9:cred:mqtt-password@127.0.0.1:18905/stream1",  # '*' once matched across the userinfo
    "rtsp://10.1.2.9:env:MQTT_PASSWORD@127.0.0.1:18905/stream1",
    "rtsp://10.1.2.9@127.0.0.1:18902/stream1",
    "rtsp://viewer:pw@10.1.2.9/stream1",  # a password from the payload: never
    "rtsp://10.1.2.9/stream1?u=cred:mqtt-password",
])
def test_userinfo_and_secret_references_in_a_remote_uri_are_refused(uri):
    field, message = refusal(box(source_uris=["rtsp://10.1.2.*/stream1", "rtsp://10.1.2.*/stream1?*"]),
                             [{"name": "cam", "uri": uri}])
    assert field == "sources[0].uri" and "remote_config.credentials" in message
    assert "cred:" not in message.replace("cred:/env:", "") and "127.0.0.1" not in message  # never the URI


def test_patterns_match_scheme_host_port_path_and_query_part_by_part():
    config = box(source_uris=["rtsp://10.1.2.*/stream1", "http://10.1.5.7:8080/snap/*?channel=*"])
    for uri in ("rtsp://10.1.2.9/stream1", "rtsp://10.1.2.9:554/stream1", "RTSP://10.1.2.9/stream1",
                "http://10.1.5.7:8080/snap/a.mjpg?channel=2"):
        assert merge_config(config, {"sources": [{"name": "cam", "uri": uri}]}).sources[0].uri == uri
    for uri in ("rtsp://10.1.2.9:8554/stream1",  # another port than the pattern's (its default)
                "rtsp://10.1.3.9/stream1", "rtsps://10.1.2.9/stream1", "rtsp://10.1.2.9/stream1?x=1",
                "rtsp://10.1.2.9/stream1/../etc", "rtsp://10.1.2.9.evil.example/stream1",
                "http://10.1.5.7/snap/a.mjpg?channel=2", "camera:0", "/etc", "rtsp://10.1.2.9/stream1#f"):
        field, message = refusal(config, [{"name": "cam", "uri": uri}])
        assert field == "sources[0].uri" and "remote_config.source_uris" in message, uri


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "localhost", "[::1]", "169.254.169.254", "0.0.0.0",
                                  "[::ffff:127.0.0.1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::1]", "[fe80::1]",
                                  "224.0.0.1"])
def test_a_remote_uri_never_reaches_loopback_link_local_or_unspecified(host):
    field, message = refusal(box(source_uris=["rtsp://*/stream1"]),
                             [{"name": "cam", "uri": "rtsp://%s/stream1" % host}])
    assert field == "sources[0].uri" and "non-routable" in message


def test_a_remote_uri_never_reaches_the_box_itself_nor_an_unresolvable_name():
    address = own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert address_problem(address, 554) == "its host resolves to one of this box's own addresses"
    assert address_problem("10.1.2.9", 554) is None  # not ours (the machine running this has no 10.1.2.9)
    assert address_problem("nothing.invalid", 554) == "its host does not resolve"


def test_credentials_of_a_remote_source_come_only_from_the_local_allow_list():
    config = box(source_uris=["rtsp://10.1.2.*/stream1", "rtsp://10.9.9.*/s"],
                 credentials={"rtsp://10.1.2.*/stream1": "viewer:cred:cam-viewer"})
    merged = merge_config(config, {"sources": [{"name": "cam", "uri": "rtsp://10.1.2.9/stream1"},
                                               {"name": "b", "uri": "rtsp://10.9.9.1/s"}]})
    assert [s.uri for s in merged.sources] == ["rtsp://viewer:cred:cam-viewer@10.1.2.9/stream1",
                                               "rtsp://10.9.9.1/s"]
    again = merge_config(merged, {"sources": [{"name": "cam", "uri": "rtsp://10.1.2.9/stream1"}]})
    assert again.sources[0].uri == merged.sources[0].uri  # the same change twice means the same


@pytest.mark.parametrize("remote_config, field", [
    ({"source_uris": ["rtsp://u:p@10.1.2.*/s"]}, "remote_config.source_uris[0]"),
    ({"source_uris": ["10.1.2.*"]}, "remote_config.source_uris[0]"),
    ({"source_uris": ["rtsp://10.1.2.*/s"], "credentials": {"rtsp://10.1.2.*/s": "viewer:plain-password"}},
     "remote_config.credentials"),
    ({"source_uris": [], "credentials": {"rtsp://10.1.2.*/s": "viewer:cred:x"}}, "remote_config.credentials"),
])
def test_the_local_policy_itself_is_checked(remote_config, field):
    with pytest.raises(ConfigError) as info:
        parse_daemon_config({**GOOD, "remote_config": remote_config})
    assert field in [e.path for e in info.value.errors]


@pytest.mark.parametrize("key, value", [
    ("http_proxy", "http://127.0.0.1:18902/"), ("protocol_whitelist", "file,http,tcp"), ("rtsp_flags", "listen"),
    ("input_format", "image2"), ("timeout", "-1"), ("listen", "1"), ("rtsp_transport", "udp_multicast"),
    ("rtsp_transport", "http"), ("stimeout", "5|http_proxy;http://127.0.0.1:1/"), ("buffer_size", "1e9"),
])
def test_input_options_set_remotely_are_an_allow_list(key, value):
    """With the default policy (no URI may change), options alone once sent the box through a proxy."""
    field, message = refusal(box(), [dict(CAM, input_options={key: value})])
    assert field == "sources[0].input_options.%s" % key


def test_harmless_options_and_the_local_files_own_options_pass():
    assert set(REMOTE_INPUT_OPTIONS) >= {"stimeout", "rw_timeout", "rtsp_transport", "buffer_size"}
    tuned = merge_config(box(), {"sources": [dict(CAM, input_options={"stimeout": "5000000",
                                                                      "rtsp_transport": "udp"})]})
    assert tuned.sources[0].input_options == {"stimeout": "5000000", "rtsp_transport": "udp"}
    local = parse_daemon_config({**GOOD, "sources": [dict(CAM, input_options={"http_proxy": "http://p:3128/"})]})
    kept = merge_config(local, {"sources": [dict(CAM, input_options={"http_proxy": "http://p:3128/"}, max_fps=2)]})
    assert kept.sources[0].max_fps == 2  # the local file's own option, re-sent unchanged


def test_an_attack_already_saved_in_overrides_is_ignored_at_the_next_start(tmp_path):
    """Before this policy the change survived restarts in overrides.json; now the file's section no longer
    validates, so the box starts on its config file alone and says so (without repeating the URI)."""
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "daemon.yaml"
    config.write_text(yaml.safe_dump({**GOOD, "state_dir": str(state), "sources": [CAM],
                                      "remote_config": {"source_uris": ["rtsp://10.1.2.*/stream1"]}}))
    attack = "rtsp://10.1.2.9:cred:mqtt-password@127.0.0.1:18905/stream1"
    (state / OVERRIDES_FILE).write_text(json.dumps({"version": 1, "changes": {
        "sources": [CAM, {"name": "gate", "uri": attack}]}}))
    loaded, overrides = load_with_overrides(str(config), quarantine=False)
    assert [s.name for s in loaded.sources] == ["cam"]
    (ignored,) = overrides.alerts()
    assert ignored["kind"] == "override_ignored" and "127.0.0.1" not in json.dumps(ignored)
