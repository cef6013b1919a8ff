"""Issue 14 follow-up: every echoed request id keeps printable ASCII only (one helper), so a body
``request_id`` with non-ASCII characters is never echoed raw in the ``X-Request-Id`` header."""

from gateway.pipeline.preamble import clean_request_id, client_request_id


def test_clean_request_id_keeps_printable_ascii_only():
    assert clean_request_id("chatcmpl-é中\u2028 x\x7f") == "chatcmpl-x"
    assert clean_request_id("é") == ""


def test_body_request_id_is_cleaned_like_the_header():
    assert client_request_id(None, "abc-é-1") == "abc--1"
