"""The one client factory (agent/ops/mqtt_client.py): what every client is made with, and a TLS file that cannot be
read named as its owner calls it (the box's config, or ctl's option). The connections themselves are tested with
the transport (test_transport, test_failover), ctl (test_ctl) and the operator's link (test_link); TLS against a
real broker in test_broker_acl and test_broker_example."""

import argparse
import io
import ssl

import pytest

from agent.cli import ctl
from agent.config.mqtt_config import TlsConfig
from agent.config.schema import ConfigError
from agent.ops.mqtt_client import CONNECT_ATTEMPT_S, new_client, tls_context


def test_every_client_is_clean_version_311_without_reconnecting_of_its_own():
    client = new_client("box-1", "box-1", "secret", connect_timeout_s=2.5, userdata=7)
    assert client._client_id == b"box-1" and client._clean_session is True
    assert client._protocol == 4  # MQTT 3.1.1
    assert client._reconnect_on_failure is False
    assert client.connect_timeout == 2.5 and client._userdata == 7
    assert client._username == b"box-1" and client._password == b"secret"
    assert new_client("op").connect_timeout == CONNECT_ATTEMPT_S and new_client("op")._username is None


def test_a_tls_context_verifies_the_broker_unless_told_to_skip_only_the_hostname():
    assert tls_context(TlsConfig()).check_hostname is True
    insecure = tls_context(TlsConfig(insecure=True))
    assert insecure.check_hostname is False and insecure.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize("fields, named", [({}, "mqtt.tls.ca_file"), ({"ca_file": "--tls-ca"}, "--tls-ca")])
def test_a_missing_ca_file_is_named_as_its_caller_calls_it(tmp_path, fields, named):
    missing = str(tmp_path / "ca.pem")
    with pytest.raises(ConfigError) as failed:
        tls_context(TlsConfig(ca_file=missing), **({"fields": fields} if fields else {}))
    assert failed.value.errors[0].path == named and "file not found" in str(failed.value)


def test_a_key_without_its_certificate_is_refused(tmp_path):
    key = tmp_path / "key.pem"
    key.write_text("not a key")
    with pytest.raises(ConfigError, match="mqtt.tls.cert_file: required when key_file is set"):
        tls_context(TlsConfig(key_file=str(key)))


def test_ctl_with_an_unreadable_ca_exits_two_naming_the_option(tmp_path):
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    err = io.StringIO()
    args = parser.parse_args(["--broker", "mqtts://127.0.0.1:1", "--tls-ca", str(tmp_path / "none.pem"), "cam-01",
                              "status"])
    assert ctl.run(args, out=io.StringIO(), err=err) == ctl.EXIT_USAGE
    assert "--tls-ca: file not found" in err.getvalue()
