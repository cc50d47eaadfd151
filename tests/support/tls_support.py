"""A throwaway certificate authority for tests that run MQTT over TLS (a helper module, not a test module)."""

import os
import shutil
import subprocess
from typing import NamedTuple

import pytest

from tests.conftest import WAIT_S


class Pki(NamedTuple):
    ca: str  # the CA certificate clients trust
    cert: str  # the broker's certificate for 127.0.0.1, signed by ``ca``
    key: str
    other_ca: str  # a second CA that signed nothing here: trusting it must not be enough


def make_test_pki(out: str) -> Pki:
    """Made with the openssl CLI in ``out`` (skips the test when there is none); EC keys, fast to generate."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command line tool to make a test CA")
    os.makedirs(out, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=out, timeout=WAIT_S)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=atlas-edge test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(out, "san.cnf"), "w") as handle:
        handle.write("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")
    run("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.crt", "-days", "2", "-subj", "/CN=other CA")
    return Pki(*(os.path.join(out, name) for name in ("ca.crt", "server.crt", "server.key", "other.crt")))
