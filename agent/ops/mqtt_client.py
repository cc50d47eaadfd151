"""The one place that makes a paho MQTT client and its TLS context: for the box's connection supervisor
(:mod:`agent.ops.connection`) and for the operator's link (``atlas-edge ctl``, ``fleet``, ``demo``'s console view,
through :func:`agent.cli.ctl.operator_link`, which opens :func:`agent.fleet.link.open_link`).

Every client is built the same way: paho's version-2 callbacks, MQTT 3.1.1, a clean session and no reconnecting
of paho's own (``reconnect_on_failure=False``: exactly one layer reconnects, the box's supervisor; the operator's
link never does), the TCP (+TLS) connect bounded by ``connect_timeout_s``, and the credentials and TLS context
given. What differs between the box and the operator (the client id, the box's last will and in-flight window,
the callbacks) is set by the caller on the client returned.
"""

import ssl
from typing import Any, Mapping, Optional

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from agent.config.mqtt_config import TlsConfig
from agent.config.schema import ConfigError, FieldError
from agent.config.secrets import credential_path

CONNECT_ATTEMPT_S = 5.0  # TCP (+TLS) bound per broker, so that a dead node of a cluster costs little
# How the box's config names the TLS files; the operator's command line names them after its options instead.
CONFIG_TLS_FIELDS = {"ca_file": "mqtt.tls.ca_file", "cert_file": "mqtt.tls.cert_file",
                     "key_file": "mqtt.tls.key_file"}


def tls_context(tls: TlsConfig, fields: Mapping[str, str] = CONFIG_TLS_FIELDS) -> ssl.SSLContext:
    """A TLS client context (the broker's certificate verified against ``ca_file``, else the system's CAs; a
    client certificate when ``cert_file`` is set); a bad or missing file fails here, a ConfigError naming it as
    ``fields`` says (``mqtt.tls.ca_file`` in the box's config, ``--tls-ca`` on the command line)."""
    ca_file = credential_path(tls.ca_file, fields.get("ca_file", "ca_file"))
    cert_file = credential_path(tls.cert_file, fields.get("cert_file", "cert_file"))
    key_file = credential_path(tls.key_file, fields.get("key_file", "key_file"))
    if key_file and not cert_file:
        raise ConfigError([FieldError(fields.get("cert_file", "cert_file"), "required when key_file is set")])
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([FieldError(fields.get("ca_file", "ca_file"), "cannot load %s: %s"
                                      % (ca_file, exc))]) from exc
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([FieldError(fields.get("cert_file", "cert_file"), "cannot load %s / %s: %s"
                                          % (cert_file, key_file, exc))]) from exc
    if tls.insecure:
        context.check_hostname = False  # the certificate chain is still verified
    return context


def new_client(client_id: str, username: Optional[str] = None, password: Optional[str] = None,
               tls: Optional[ssl.SSLContext] = None, connect_timeout_s: float = CONNECT_ATTEMPT_S,
               userdata: Any = None) -> mqtt.Client:
    """A clean-session paho client for one connection (see the module docstring); ``password`` is already
    resolved (:func:`agent.config.secrets.resolve_secret`), ``tls`` made by :func:`tls_context` (None: plain)."""
    client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id,
                         clean_session=True, userdata=userdata, protocol=mqtt.MQTTv311,
                         reconnect_on_failure=False)
    client.connect_timeout = connect_timeout_s
    if username is not None:
        client.username_pw_set(username, password)
    if tls is not None:
        client.tls_set_context(tls)
    return client
