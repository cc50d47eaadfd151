"""The one redact (agent/_util/redact.py) on what both of its users hand it: camera URIs and the error texts
that repeat them (sources), and a deploy's bundle URLs, pre-signed or with credentials (lifecycle/fetch.py and
model_manager.py's acks and progress lines)."""

import re

import pytest

from agent._util.redact import MASK, redact, redact_all, split_userinfo


def test_camera_passwords_are_masked_in_every_uri_of_a_text_and_user_names_stay():
    text = "cannot open rtsp://admin:s3cr@t@10.0.0.5:554/s (then http://u:p@h/x); rtsp://h/open rtsp://user@h/x"
    assert redact(text) == ("cannot open rtsp://admin:***@10.0.0.5:554/s (then http://u:***@h/x); rtsp://h/open "
                            "rtsp://user@h/x")
    assert redact_all({"a": ["rtsp://u:pw@h/s", 3]}) == {"a": ["rtsp://u:***@h/s", 3]}


def test_a_careless_password_with_query_or_fragment_characters_is_hidden_whole():
    assert redact("rtsp://admin:pa?ss#w=rd@cam:554/live") == "rtsp://admin:***@cam:554/live"


def test_query_parameters_that_tell_streams_apart_stay():
    uri = "rtsp://viewer:pw@nvr/cam/realmonitor?channel=2&subtype=0"
    assert redact(uri) == "rtsp://viewer:***@nvr/cam/realmonitor?channel=2&subtype=0"


@pytest.mark.parametrize("url, shown", [
    ("https://b.example/tiny-2.tar.gz?token=s3cr3t", "https://b.example/tiny-2.tar.gz?token=***"),
    ("https://s3.example/b/m.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20261202"
     "&X-Amz-Date=20261202T000000Z&X-Amz-Expires=900&X-Amz-Security-Token=FwoG&X-Amz-Signature=ab12",
     "https://s3.example/b/m.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20261202T000000Z&X-Amz-Expires=900&X-Amz-Security-Token=***&X-Amz-Signature=***"),
    ("https://acct.blob.example/c/m.tar?sv=2021-08-06&se=2026-12-03&sr=b&sp=r&sig=Zm9v%3D#part",
     "https://acct.blob.example/c/m.tar?sv=2021-08-06&se=2026-12-03&sr=b&sp=r&sig=***#part"),
    ("https://obs.example/m.tar?AccessKeyId=K1&Expires=1&Signature=x&api_key=y&password=z",
     "https://obs.example/m.tar?AccessKeyId=***&Expires=1&Signature=***&api_key=***&password=***"),
    ("https://deploy:hunter2@b.example:8443/m.tar", "https://deploy:***@b.example:8443/m.tar"),
    ("/var/lib/atlas-edge/incoming/m.tar", "/var/lib/atlas-edge/incoming/m.tar"),
])
def test_bundle_urls_lose_their_credentials_and_keep_what_locates_them(url, shown):
    assert redact(url) == shown
    assert redact("fetching %s: refused" % url) == "fetching %s: refused" % shown


def test_the_mask_is_the_only_trace_of_a_secret():
    text = "download of https://u:pw1@h/x.tar?token=tok2&sig=sig3 failed; rtsp://a:pw4@c/s"
    shown = redact(text)
    assert not any(secret in shown for secret in ("pw1", "tok2", "sig3", "pw4"))
    assert shown.count(MASK) == 4
    assert redact(shown) == shown  # idempotent: a redacted text passes through a second redact unchanged


def test_the_box_has_one_redact():
    import agent.lifecycle.fetch as fetch
    import agent.lifecycle.model_manager as model_manager

    assert fetch.redact is redact and model_manager.redact is redact


@pytest.mark.parametrize("uri, password", [
    ("rtsp://viewer:Pa/ss@w0rd@10.0.0.5/cam", "Pa/ss@w0rd"),  # raw '/' and '@' (issue 31)
    ("rtsp://viewer:Pa ss@10.0.0.5:554/cam", "Pa ss"),  # raw space
    ("rtsp://viewer:a@b:c/d?e#f g@cam-1.site:8554/live?x=1", "a@b:c/d?e#f g"),
    ("rtsp://viewer:cred:cam1@10.0.0.5/cam", "cred:cam1"),
])
def test_a_raw_password_is_masked_whole_wherever_the_uri_stands(uri, password):
    """The userinfo runs to the last '@' after which the rest reads as host[:port]: in the URI alone, in prose,
    in JSON text, before other URIs on the same line, and after a second redact."""
    user_host = "rtsp://viewer:***@" + uri.rsplit("@", 1)[1]
    assert redact(uri) == user_host
    for text in ("cannot open %s: Connection refused" % uri, '{"uri": "%s", "n": 1}' % uri,
                 "[%s] then http://u:pw@h/x" % uri, "a\n%s\nb" % uri):
        shown = redact(text)
        assert not [piece for piece in re.split(r"[@/ ]", password) if len(piece) > 2 and piece in shown]
        assert "viewer:***@" in shown and redact(shown) == shown
    assert split_userinfo(uri).password == password and not split_userinfo(uri).ambiguous


def test_a_uri_that_reads_two_ways_is_flagged_and_masked_the_longer_way():
    """``u:p@h/a@b`` is user u at h, or password ``p@h/a`` at b: configs refuse it, the mask covers both."""
    for uri in ("rtsp://u:p@h/a@b", "http://host:80/a@b.example"):
        assert split_userinfo(uri).ambiguous, uri
    assert redact("rtsp://u:p@h/a@b") == "rtsp://u:***@b"
    for uri in ("http://host/a@b", "rtsp://u@h/x", "rtsp://h:554/x", "rtsp://u:p@ss@h/x"):
        assert not split_userinfo(uri).ambiguous, uri
    assert redact("http://host/a@b") == "http://host/a@b"  # no password anywhere: nothing masked
    assert split_userinfo("rtsp://u:p@ss@h/x").rest == "h/x"
