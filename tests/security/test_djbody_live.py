"""Issue 14 follow-up, against uvicorn started the way ``manage.py serve`` starts the front api
(``serve.api_command``): login lockout not bypassed with ``X-Forwarded-For``; gateway requests refused from
their headers (unknown routes, ``/health`` with a body, declared bodies over the cap); Django routes under the
body deadlines (408).

No engine or Celery worker: everything under test is answered by the api process itself. Small body deadlines
(``REQUEST_BODY_IDLE_TIMEOUT_S`` 2 s, ``REQUEST_BODY_TIMEOUT_S`` 6 s) keep the slow-body tests short.
"""

from __future__ import annotations

import json
import re
import socket
import sys

import httpx
import pytest

from ops.management.commands.serve import api_command
from ops.supervisor import Supervisor, wait_until, http_ok as _http_ok
from harness.live_platform import child_env, free_port, redis_for, run_manage, stop_children

PASSWORD = "pw-alice-right-1"
IDLE_S, TOTAL_S = 2, 6
_SETUP = f"""
from django.contrib.auth import get_user_model
U = get_user_model()
U.objects.create_superuser("alice", password={PASSWORD!r})
U.objects.create_superuser("bob", password={PASSWORD!r})
print("ok")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    var_dir, prefix, env, scratch = child_env(tmp_path_factory.mktemp("djbody"), "djb")
    env.pop("FORWARDED_ALLOW_IPS", None)  # the default: no proxy is trusted
    env.update({"REQUEST_BODY_IDLE_TIMEOUT_S": str(IDLE_S), "REQUEST_BODY_TIMEOUT_S": str(TOTAL_S)})
    sup = Supervisor(env=env, log_dir=var_dir / "log")
    try:
        redis_for(sup, env, var_dir)
        run_manage(env, "migrate", "--no-input", timeout=300)
        run_manage(env, "shell", "-c", _SETUP)
        port = free_port()
        sup.start("api", api_command(sys.executable, "127.0.0.1", port, 1))
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_ok(base + "/accounts/login/"), 90, "uvicorn /accounts/login/", sup)
        yield {"base": base, "port": port}
    finally:
        stop_children(sup, scratch, env.get("REDIS_URL", ""), prefix)


def _login(base: str, path: str, username: str, password: str, xff: str) -> int:
    """One login through the form (CSRF token from a GET), claiming ``xff`` as the client address; the status."""
    with httpx.Client(base_url=base, timeout=60) as client:
        page = client.get(path)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        r = client.post(path, data={"username": username, "password": password, "csrfmiddlewaretoken": token},
                        headers={"X-Forwarded-For": xff, "Referer": base + path})
        return r.status_code


@pytest.mark.parametrize("path, user", [("/admin/login/", "alice"), ("/accounts/login/", "bob")])
def test_login_lockout_is_not_bypassed_with_x_forwarded_for(site, path, user):
    # a different claimed address per try: uvicorn must not believe any of them (no proxy is trusted)
    statuses = [_login(site["base"], path, user, "wrong", f"9.9.9.{i}") for i in range(6)]
    assert statuses[-1] == 429, statuses
    assert _login(site["base"], path, user, PASSWORD, "9.9.9.99") == 429  # locked: the right password is refused


def test_serve_trusts_proxy_headers_only_when_configured(settings):
    settings.FORWARDED_ALLOW_IPS = ""
    assert "--no-proxy-headers" in api_command("python", "127.0.0.1", 8000, 1)
    settings.FORWARDED_ALLOW_IPS = "10.0.0.5"
    cmd = api_command("python", "127.0.0.1", 8000, 1)
    assert "--no-proxy-headers" not in cmd and cmd[cmd.index("--forwarded-allow-ips") + 1] == "10.0.0.5"


def _raw(port: int, head: str, body: bytes = b"", timeout: float = 60) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case names) and JSON body of the response on ``sock`` (its socket timeout bounds
    every read)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(lines[0].split()[1]), headers, json.loads(rest[:length] or b"{}")


def _closed(sock: socket.socket) -> bool:
    """True when the server closes the connection (reads until EOF; bounded by the socket timeout)."""
    try:
        for _ in range(1000):
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, TimeoutError):
        return False
    return False


_16MB = 16 * 1024 * 1024


@pytest.mark.parametrize("method, path, length, status, code", [
    ("POST", "/v1/nonexistent", _16MB, 404, "unknown_route"),
    ("POST", "/v1/chat/completions/", _16MB, 404, "unknown_route"),
    ("GET", "/health", _16MB, 413, "request_too_large"),
    ("GET", "/health", 10, 413, "request_too_large"),
    ("POST", "/v1/chat/completions", _16MB + 1, 413, "request_too_large"),
    ("POST", "/v1/chat/completions", 17_000_000, 413, "request_too_large"),
    ("POST", "/tokenize", 17_000_000, 413, "request_too_large"),
])
def test_gateway_refuses_from_the_headers(site, method, path, length, status, code):
    # a few bytes of a huge declared body: the answer comes from the headers (before the fix the api waited for
    # the body, answering 408 only at the idle deadline)
    sock = _raw(site["port"], f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {length}\r\n", b"{\"a")
    with sock:
        got, headers, body = _response(sock)
        assert (got, body["error"]["code"]) == (status, code), body
        assert headers.get("connection") == "close"
        assert _closed(sock)


def test_health_without_a_body_and_known_routes_still_served(site):
    assert httpx.get(site["base"] + "/health", timeout=30).status_code == 200
    r = httpx.post(site["base"] + "/v1/chat/completions", json={"model": "m", "messages": []}, timeout=30)
    assert r.status_code == 401  # a known route goes on to authentication
    r = httpx.get(site["base"] + "/v1/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"


@pytest.mark.parametrize("path", ["/admin/login/", "/accounts/login/", "/api/v1/keys"])
def test_django_routes_time_out_a_stalled_body(site, path):
    sock = _raw(site["port"], f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n", b"u")
    with sock:
        status, headers, body = _response(sock)  # before the fix: no answer (the socket timeout, 60 s, fails it)
        assert status == 408 and body["error"]["code"] == "request_timeout", body
        assert headers.get("connection") == "close" and _closed(sock)


def test_django_routes_time_out_a_trickled_body(site):
    # one byte per second never trips the idle deadline (2 s), but the whole body is due within 6 s
    sock = _raw(site["port"], "POST /admin/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n")
    with sock:
        sock.settimeout(1)
        answer = b""
        for _ in range(60):  # at most 60 bytes, one a second; the server answers long before
            try:
                sock.sendall(b"u")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                answer = sock.recv(65536)
                if answer:
                    break
            except TimeoutError:
                continue
        assert answer.startswith(b"HTTP/1.1 408"), answer


def test_a_client_sending_an_oversized_body_gets_the_413(site):
    # the answer comes before the body is read; a real client still sending it gets that answer
    r = httpx.post(site["base"] + "/v1/chat/completions", content=b"x" * (17 * 1024 * 1024),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_every_gateway_route_passes_the_header_check():
    # ingress.ROUTE_PATHS must follow gateway/routing.py, or a new route would be answered 404 from the headers
    from django.urls.resolvers import RoutePattern

    from gateway import ingress
    from gateway.routing import http_urlpatterns

    for pattern in http_urlpatterns[:-1]:  # the last one is the catch-all 404
        p = pattern.pattern
        path = "/" + str(p) if isinstance(p, RoutePattern) else "/v1/models/some-model"
        assert ingress.is_route(path), path
    assert not ingress.is_route("/v1/models/a/b") and not ingress.is_route("/v1/chat/completions/")
