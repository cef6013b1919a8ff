"""Issue 14: the fetch guard turns every malformed URL into a ``FetchError`` (400) and a port of 0 is refused, not
replaced by 80; ``fetch_urls`` reports each URL's own error. (That the fetches overlap is shown on the live
platform: test_gateway_images_live.py.) Loopback servers only."""

from __future__ import annotations

import ipaddress

import pytest

from inference.media.guard import FetchError, FetchPolicy, fetch_url, fetch_urls
from tests.multimodal.servers import serve, stall

LOOPBACK = [ipaddress.ip_network("127.0.0.1/32")]


@pytest.mark.parametrize("url", ["http://127.0.0.1:0/", "http://[::1", "http://[::ffff:999.1.1.1]/",
                                 "http://a:99999/", "https://127.0.0.1:-1/"])
def test_malformed_urls_are_fetch_errors(url):
    with pytest.raises(FetchError) as info:
        fetch_url(url, "messages[0].content[1]", FetchPolicy(allow_nets=LOOPBACK, timeout_s=2))
    assert info.value.param == "messages[0].content[1]"
    assert info.value.code in ("image_url_blocked", "invalid_image_url")  # refused, never connected


def test_fetches_share_one_deadline():
    servers = [serve("127.0.0.1", {"/s": stall(6)}) for _ in range(3)]
    try:
        items = [(f"http://127.0.0.1:{port}/s", f"p{i}") for i, (_s, port) in enumerate(servers)]
        out = fetch_urls(items, FetchPolicy(allow_nets=LOOPBACK, timeout_s=1.5))
    finally:
        for srv, _port in servers:
            srv.shutdown()
    assert [o.code for o in out] == ["image_fetch_timeout"] * 3
    assert [o.param for o in out] == ["p0", "p1", "p2"]
