"""A source URI's password as FFmpeg gets it (agent/config/source_uri.py): a raw one with characters a URL
cannot carry is percent-encoded; a URI that reads two ways is refused by validate, saying what to do and never
repeating the URI."""

import pytest

from agent.config.daemon_config import parse_daemon_config
from agent.config.schema import ConfigError
from agent.config.source_uri import resolve_source_uri, source_kind

GOOD = {"device_id": "cam-01", "model": {"bundle": "b"}}


@pytest.mark.parametrize("uri, resolved", [
    ("rtsp://viewer:Pa/ss@w0rd@10.0.0.5/cam", "rtsp://viewer:Pa%2Fss%40w0rd@10.0.0.5/cam"),
    ("rtsp://viewer:Pa ss%41@10.0.0.5:554/cam", "rtsp://viewer:Pa%20ss%41@10.0.0.5:554/cam"),  # %41 kept
    ("rtsp://viewer:a:b!$&@10.0.0.5/cam", "rtsp://viewer:a:b!$&@10.0.0.5/cam"),  # legal raw: unchanged
    ("rtsp://10.0.0.5/cam", "rtsp://10.0.0.5/cam"),
])
def test_a_raw_password_reaches_ffmpeg_percent_encoded(uri, resolved):
    assert source_kind(uri) == "stream"
    assert resolve_source_uri(uri) == resolved


def test_a_uri_that_reads_two_ways_is_refused_with_what_to_do():
    uri = "rtsp://viewer:s3cret@10.0.0.5/a@b"
    with pytest.raises(ConfigError) as info:
        parse_daemon_config({**GOOD, "sources": [{"name": "cam", "uri": uri}]})
    (error,) = info.value.errors
    assert error.path == "sources[0].uri"
    assert "percent-encode" in error.message and "cred:NAME" in error.message and "s3cret" not in str(info.value)
