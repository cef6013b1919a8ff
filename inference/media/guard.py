"""Fetching image URLs that cannot be turned against the platform (SSRF-safe by construction).

vLLM checks an allowlist on the first URL only and follows redirects unchecked, with no address blocking
(vLLM's ``vllm/multimodal/media/connector.py``). Here:

* ``address_decision(ip, allow_nets)`` is the one rule: an address is refused when it is loopback,
  private (RFC 1918, ULA ``fc00::/7``), link-local (incl. ``169.254.169.254`` and other cloud metadata
  addresses), carrier-grade NAT (``100.64.0.0/10``), multicast, unspecified, reserved, documentation or
  otherwise not globally routable; IPv4-mapped (``::ffff:a.b.c.d``), IPv4-compatible, NAT64
  (``64:ff9b::/96``) and 6to4 (``2002::/16``) IPv6 forms are judged by the IPv4 address they embed. An
  operator allowlist of networks (``MM_FETCH_ALLOW_NETS``, comma-separated CIDRs) overrides the refusal.
* ``fetch_url`` resolves the host once per hop, refuses the hop when ANY resolved address is refused,
  then connects to a checked address itself (no second DNS lookup; TLS still verifies the hostname via
  SNI), and never uses proxy environment variables. Redirects (301/302/303/307/308) are followed by hand,
  at most ``max_redirects``, each hop re-checked (scheme, per-model domain allowlist, every address).
* Caps: total time ``timeout_s`` across all hops (each socket operation gets the remaining time, and
  the body is read with a deadline, so a stalling server is cut off), ``max_bytes`` of body (checked
  against ``Content-Length`` and while reading).

* ``fetch_urls`` fetches a request's URLs concurrently (one thread each) under ONE deadline, so a request with
  several slow images holds an ``mm`` worker for at most ``timeout_s``, not ``timeout_s`` per image.

Every refusal or failure is a ``FetchError`` (an ``ImageError``: HTTP 400 naming the message part), malformed
URLs included (an unclosed ``[``, a bad or zero port, a host that is no valid address or name): a URL the client
sent is never a server error. A fetch that runs past the deadline is a 400 too (code ``image_fetch_timeout``):
the slow server is the one the client chose, and retrying the same request cannot help.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urljoin, urlsplit

from inference.shared.config import SETTINGS

from .image import ImageError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_EXTRA_BLOCKED = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4",
    "::/96", "100::/64", "2001::/32", "fec0::/10", "ff00::/8",
)]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.ip_network("2002::/16")


class FetchError(ImageError):
    """A URL that may not or could not be fetched (HTTP 400)."""


def parse_allow_nets(value: str | None) -> list[IPNetwork]:
    """Networks from a comma-separated CIDR list (``MM_FETCH_ALLOW_NETS``); bad entries raise ``ValueError``."""
    return [ipaddress.ip_network(v.strip(), strict=False) for v in (value or "").split(",") if v.strip()]


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _SIXTOFOUR:
        return ip.sixtofour
    return None


def address_decision(ip: str | IPAddress, allow_nets: list[IPNetwork] | None = None) -> str | None:
    """``None`` when ``ip`` may be connected to, else the reason it is refused (see module docstring).

    ``allow_nets``: operator-allowlisted networks; an address inside one is allowed whatever its range.
    """
    addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
        return "IPv6 address with a zone index"
    for net in allow_nets or ():
        if addr.version == net.version and addr in net:
            return None
    if isinstance(addr, ipaddress.IPv6Address):
        v4 = _embedded_v4(addr)
        if v4 is not None:
            reason = address_decision(v4, allow_nets)
            return None if reason is None else f"embeds {v4}: {reason}"
    if addr.is_loopback:
        return "loopback address"
    if addr.is_link_local:
        return "link-local address (includes cloud metadata endpoints)"
    if addr.is_multicast:
        return "multicast address"
    if addr.is_unspecified:
        return "unspecified address"
    if addr.version == 4 and addr in ipaddress.ip_network("100.64.0.0/10"):
        return "carrier-grade NAT address"
    if addr.is_private:
        return "private address"
    for net in _EXTRA_BLOCKED:
        if addr.version == net.version and addr in net:
            return "reserved address"
    if addr.is_reserved or not addr.is_global:
        return "address that is not globally routable"
    return None


def host_allowed(host: str, allowed_domains: list[str] | None) -> bool:
    """Per-model domain allowlist: exact hostname, or ``*.suffix`` for subdomains; empty = any host."""
    if not allowed_domains:
        return True
    host = host.lower().rstrip(".")
    for d in allowed_domains:
        d = d.lower().rstrip(".")
        if host == d or (d.startswith("*.") and host.endswith(d[1:])):
            return True
    return False


@dataclass
class FetchPolicy:
    """Fetch limits. ``allow_nets``: operator network allowlist; ``allowed_domains``: per-model hostname
    allowlist applied to every hop (empty = any)."""

    timeout_s: float = SETTINGS.mm_fetch_timeout_s
    max_bytes: int = SETTINGS.mm_fetch_max_bytes
    max_redirects: int = SETTINGS.mm_fetch_max_redirects
    allow_nets: list[IPNetwork] = field(default_factory=lambda: parse_allow_nets(SETTINGS.mm_fetch_allow_nets))
    allowed_domains: list[str] = field(default_factory=list)
    user_agent: str = "llmp-media-fetch/1"


def _resolve(host: str, port: int) -> list[str]:
    try:
        return [ipaddress.ip_address(host).compressed]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def fetch_urls(items: list[tuple[str, str]], policy: FetchPolicy) -> list[bytes | FetchError]:
    """Fetch ``items`` (``(url, part)`` each) concurrently, one thread per URL, all under one deadline
    (``policy.timeout_s`` from now). Returns, in the same order, each body or the ``FetchError`` it ended with
    (the caller decides which error to report). Blocks at most about ``policy.timeout_s``: every socket operation
    of every fetch gets only the time left to the shared deadline."""
    if not items:
        return []
    deadline = time.monotonic() + policy.timeout_s

    def one(item: tuple[str, str]) -> bytes | FetchError:
        try:
            return fetch_url(item[0], item[1], policy, deadline=deadline)
        except FetchError as exc:
            return exc

    if len(items) == 1:
        return [one(items[0])]
    with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="mm-fetch") as pool:
        return list(pool.map(one, items))


def fetch_url(url: str, part: str, policy: FetchPolicy, *, deadline: float | None = None) -> bytes:
    """GET ``url`` under ``policy`` and return the body. ``deadline`` (``time.monotonic()``): when the fetch must
    be over, default ``policy.timeout_s`` from now. Raises ``FetchError`` naming ``part``."""
    try:
        return _fetch_url(url, part, policy, time.monotonic() + policy.timeout_s if deadline is None else deadline)
    except FetchError:
        raise
    except (ValueError, UnicodeError) as exc:  # urlsplit/urljoin/ipaddress on a malformed URL or Location
        raise FetchError(f"{part}: malformed image URL ({exc})", part, "invalid_image_url") from None


def _fetch_url(url: str, part: str, policy: FetchPolicy, deadline: float) -> bytes:
    for _hop in range(policy.max_redirects + 1):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise FetchError(f"{part}: URL scheme {scheme!r} is not allowed (http, https or data only)", part,
                             "image_url_blocked")
        host = parts.hostname
        if not host:
            raise FetchError(f"{part}: URL has no host", part, "image_url_blocked")
        if parts.username or parts.password:
            raise FetchError(f"{part}: URLs with credentials are not allowed", part, "image_url_blocked")
        if not host_allowed(host, policy.allowed_domains):
            raise FetchError(f"{part}: host {host!r} is not in this model's allowed media domains", part,
                             "image_url_blocked")
        try:
            port = parts.port
        except ValueError:
            raise FetchError(f"{part}: bad port in URL", part, "image_url_blocked") from None
        if port is None:
            port = 443 if scheme == "https" else 80
        elif not 0 < port < 65536:  # port 0 is no port (and once fell back to 80)
            raise FetchError(f"{part}: bad port in URL", part, "image_url_blocked")
        try:
            addrs = _resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise FetchError(f"{part}: cannot resolve {host!r} ({exc})", part, "image_fetch_failed") from None
        if not addrs:
            raise FetchError(f"{part}: {host!r} has no address", part, "image_fetch_failed")
        for a in addrs:
            reason = address_decision(a, policy.allow_nets)
            if reason is not None:
                raise FetchError(f"{part}: refusing to fetch from {host!r}: it resolves to a {reason}", part,
                                 "image_url_blocked")
        status, location, body = _get_once(addrs[0], port, scheme, host, parts, deadline, policy, part)
        if status in (301, 302, 303, 307, 308):
            if not location:
                raise FetchError(f"{part}: redirect without Location", part, "image_fetch_failed")
            url = urljoin(url, location)
            continue
        if status != 200:
            raise FetchError(f"{part}: fetching the image returned HTTP {status}", part, "image_fetch_failed")
        return body
    raise FetchError(f"{part}: more than {policy.max_redirects} redirects", part, "image_fetch_failed")


def _remaining(deadline: float, part: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError(f"{part}: fetching the image took too long", part, "image_fetch_timeout")
    return left


def _get_once(ip: str, port: int, scheme: str, host: str, parts: SplitResult, deadline: float, policy: FetchPolicy,
              part: str) -> tuple[int, str | None, bytes]:
    """One GET to the checked address ``ip``; returns (status, Location, body or b"" for redirects)."""
    sock = None
    try:
        sock = socket.create_connection((ip, port), timeout=_remaining(deadline, part))
        if scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        conn = http.client.HTTPConnection(host, port, timeout=_remaining(deadline, part))
        conn.sock = sock  # connect() is never called: the socket goes to the address that was checked
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        default_port = 443 if scheme == "https" else 80
        host_hdr = host if ":" not in host else f"[{host}]"
        conn.putheader("Host", host_hdr if port == default_port else f"{host_hdr}:{port}")
        conn.putheader("User-Agent", policy.user_agent)
        conn.putheader("Accept", "image/*")
        conn.putheader("Connection", "close")
        conn.endheaders()
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308):
            return resp.status, resp.getheader("Location"), b""
        if resp.status != 200:
            return resp.status, None, b""
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise FetchError(f"{part}: image is larger than {policy.max_bytes} bytes", part, "image_too_large")
        chunks, total = [], 0
        while True:
            sock.settimeout(_remaining(deadline, part))
            chunk = resp.read1(65536)
            if not chunk:
                break
            total += len(chunk)
            if total > policy.max_bytes:
                raise FetchError(f"{part}: image is larger than {policy.max_bytes} bytes", part,
                                 "image_too_large")
            chunks.append(chunk)
        return 200, None, b"".join(chunks)
    except FetchError:
        raise
    except TimeoutError:
        raise FetchError(f"{part}: fetching the image took too long", part, "image_fetch_timeout") from None
    except (OSError, http.client.HTTPException, ssl.SSLError, ValueError) as exc:  # ValueError: e.g. a Host
        # header that is not latin-1
        raise FetchError(f"{part}: fetching the image failed ({type(exc).__name__}: {exc})", part,
                         "image_fetch_failed") from None
    finally:
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
