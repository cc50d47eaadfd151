"""The one redact (agent/_util/redact.py) on what both of its users hand it: camera URIs and the error texts
that repeat them (sources), and a deploy's bundle URLs, pre-signed or with credentials (lifecycle/fetch.py and
model_manager.py's acks and progress lines)."""

import pytest

from agent._util.redact import MASK, redact, redact_all


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
