"""The request head the front api sends along with a passed connection (gateway/connection_pass.py)."""

from gateway.connection_pass import request_head


def test_request_head_rebuilds_the_request_line_and_headers_without_expect():
    scope = {"method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"a=1&b=%20", "http_version": "1.1",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", b"12"), (b"expect", b"100-continue"),
                         (b"authorization", b"Bearer sk-x")]}
    assert request_head(scope) == (b"POST /v1/chat/completions?a=1&b=%20 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"
                                   b"content-length: 12\r\nauthorization: Bearer sk-x\r\n\r\n")


def test_request_head_keeps_the_raw_path_and_http_version():
    scope = {"method": "POST", "path": "/tokenize", "raw_path": b"/tok%65nize", "query_string": b"",
             "http_version": "1.0", "headers": [(b"content-length", b"0")]}
    assert request_head(scope) == b"POST /tok%65nize HTTP/1.0\r\ncontent-length: 0\r\n\r\n"
