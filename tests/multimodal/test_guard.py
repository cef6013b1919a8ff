"""The fetch guard: the address decision for every blocked range (pure function on given addresses, no
connection), and real fetches from local servers on loopback only."""

from __future__ import annotations

import ipaddress
import threading

import pytest

from inference.media.guard import FetchError, FetchPolicy, address_decision, fetch_url, host_allowed
from tests.multimodal.servers import huge, redirect_to, send_bytes, serve, stall

BLOCKED = [
    "127.0.0.1", "127.255.255.254", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1",
    "169.254.169.254", "169.254.0.1", "100.64.0.1", "100.100.100.200", "224.0.0.1", "239.255.255.250",
    "0.0.0.0", "255.255.255.255", "240.0.0.1", "192.0.2.1", "198.18.0.1",
    "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254", "ff02::1", "2001:db8::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1", "::127.0.0.1",
    "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "2002:7f00:1::1",
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:808:808::1"]


@pytest.mark.parametrize("ip", BLOCKED)
def test_blocked_ranges(ip):
    assert address_decision(ip) is not None


@pytest.mark.parametrize("ip", ALLOWED)
def test_public_addresses_allowed(ip):
    assert address_decision(ip) is None


def test_operator_allowlist_overrides():
    nets = [ipaddress.ip_network("10.0.0.0/8")]
    assert address_decision("10.1.2.3", nets) is None
    assert address_decision("::ffff:10.1.2.3", nets) is None
    assert address_decision("192.168.1.1", nets) is not None


def test_domain_allowlist():
    assert host_allowed("img.example.com", [])
    assert host_allowed("example.com", ["example.com"])
    assert not host_allowed("evil.com", ["example.com"])
    assert host_allowed("a.cdn.example.com", ["*.cdn.example.com"])
    assert not host_allowed("cdn.example.com.evil.com", ["*.cdn.example.com"])


LOOP = [ipaddress.ip_network("127.0.0.1/32")]


@pytest.fixture
def servers():
    started = []

    def start(host, routes):
        srv, port = serve(host, routes)
        started.append(srv)
        return port

    yield start
    for s in started:
        s.shutdown()


def test_loopback_blocked_by_default_and_reachable_when_allowlisted(servers):
    port = servers("127.0.0.1", {"/a": send_bytes(b"IMG")})
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://127.0.0.1:{port}/a", "p", FetchPolicy(allow_nets=[]))
    assert "loopback" in exc.value.message and exc.value.param == "p"
    assert fetch_url(f"http://127.0.0.1:{port}/a", "p", FetchPolicy(allow_nets=LOOP)) == b"IMG"
    port6 = servers("::1", {"/a": send_bytes(b"V6")})
    with pytest.raises(FetchError):
        fetch_url(f"http://[::1]:{port6}/a", "p", FetchPolicy(allow_nets=LOOP))
    assert fetch_url(f"http://[::1]:{port6}/a", "p",
                     FetchPolicy(allow_nets=[ipaddress.ip_network("::1/128")])) == b"V6"


def test_redirect_hop_rechecked(servers):
    target = servers("127.0.0.2", {"/img": send_bytes(b"SECRET")})
    entry = servers("127.0.0.1", {"/r": redirect_to(f"http://127.0.0.2:{target}/img")})
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://127.0.0.1:{entry}/r", "p", FetchPolicy(allow_nets=LOOP))
    assert "127.0.0.2" in exc.value.message
    both = LOOP + [ipaddress.ip_network("127.0.0.2/32")]
    assert fetch_url(f"http://127.0.0.1:{entry}/r", "p", FetchPolicy(allow_nets=both)) == b"SECRET"
    # the per-model domain allowlist applies to every hop too
    entry2 = servers("127.0.0.1", {"/r": redirect_to(f"http://127.0.0.2:{target}/img")})
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://localhost:{entry2}/r", "p",
                  FetchPolicy(allow_nets=both + [ipaddress.ip_network("::1/128")], allowed_domains=["localhost"]))
    assert "allowed media domains" in exc.value.message


def test_redirect_cap(servers):
    port = servers("127.0.0.1", {"/loop": redirect_to("/loop")})  # redirects to itself forever
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://127.0.0.1:{port}/loop", "p", FetchPolicy(allow_nets=LOOP, max_redirects=3))
    assert "redirects" in exc.value.message


@pytest.mark.parametrize("with_length", [True, False])
def test_huge_body_capped(servers, with_length):
    progress: dict = {}
    port = servers("127.0.0.1", {"/big": huge(50 * 1024 * 1024, with_length, progress)})
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://127.0.0.1:{port}/big", "p", FetchPolicy(allow_nets=LOOP, max_bytes=1024 * 1024))
    assert exc.value.code == "image_too_large"
    # cut off before the server had sent it all (it blocks on the full socket once the reader stops)
    assert not progress["done"] and progress["sent"] < 50 * 1024 * 1024


def test_stalling_server_cut_off(servers):
    over = threading.Event()
    port = servers("127.0.0.1", {"/slow": stall(30, over)})
    with pytest.raises(FetchError) as exc:
        fetch_url(f"http://127.0.0.1:{port}/slow", "p", FetchPolicy(allow_nets=LOOP, timeout_s=1.0))
    assert exc.value.code == "image_fetch_timeout"
    assert not over.is_set()  # given up after its own timeout, while the server was still stalling


def test_bad_schemes_and_credentials():
    for url in ("file:///etc/passwd", "ftp://example.com/x", "gopher://x/"):
        with pytest.raises(FetchError):
            fetch_url(url, "p", FetchPolicy())
    with pytest.raises(FetchError):
        fetch_url("http://user:pw@127.0.0.1:1/x", "p", FetchPolicy(allow_nets=LOOP))
