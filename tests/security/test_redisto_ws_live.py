"""The usage WebSocket stays open while idle and still gets pushes (live platform, real Redis and uvicorn).

Before the fix the channel layer's BZPOPMIN (5 s) hit redis-py 8's default 5 s socket timeout: the consumer
died with ``redis.exceptions.TimeoutError`` and uvicorn closed ``/ws/usage/`` after exactly 5 s, every time.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect


@pytest.fixture(scope="module")
def live(shared_live):
    """The shared live platform (tests/conftest.py)."""
    return shared_live

IDLE_S = 12.0  # > 2 × the channel layer's 5 s BZPOPMIN


@pytest.fixture(scope="module")
def owner(live):
    """A dashboard user owning a tenant: ``(username, password)``."""
    tenant = f"ws-{uuid.uuid4().hex[:6]}"
    live.new_key(tenant=tenant)
    user = f"owner-{tenant}"
    live.manage("shell", "-c", (
        "from django.contrib.auth import get_user_model; from tenancy.models import Tenant; "
        f"u = get_user_model().objects.create_user('{user}', password='pw-owner-123'); "
        f"t = Tenant.objects.get(name='{tenant}'); t.owner = u; t.save()"))
    return user, "pw-owner-123"


def _session_cookie(base: str, user: str, password: str) -> str:
    with httpx.Client(base_url=base, timeout=30) as http:
        http.get("/accounts/login/").raise_for_status()
        r = http.post("/accounts/login/", data={"username": user, "password": password,
                                                "csrfmiddlewaretoken": http.cookies["csrftoken"]},
                      headers={"Referer": base + "/accounts/login/"})
        assert r.status_code == 302, (r.status_code, r.text[:300])
        return f"sessionid={http.cookies['sessionid']}"


def _log_tail(live, name: str) -> str:
    logs = sorted((live.var_dir / "log").glob(f"{name}*"))
    return "".join(p.read_text(errors="replace")[-1500:] for p in logs)


def test_usage_websocket_survives_idle_and_pushes_after(live, owner):
    base = live.base_url
    cookie = _session_cookie(base, *owner)
    ws_url = base.replace("http://", "ws://") + "/ws/usage/"
    opened = time.monotonic()
    try:
        with connect(ws_url, additional_headers={"Cookie": cookie}, origin=base, open_timeout=30) as ws:
            first = json.loads(ws.recv(timeout=30))  # the push on connect
            assert "totals" in first, first
            while (left := IDLE_S - (time.monotonic() - opened)) > 0:  # idle: only the server's own refreshes
                try:
                    ws.recv(timeout=left)  # the consumer's fallback refresh (every 10 s), if it comes
                except TimeoutError:
                    pass
            # a usage update published by another process (the usage workers' path) reaches the open socket
            live.manage("shell", "-c", "from usage.live import usage_live_notify; usage_live_notify()")
            pushed = json.loads(ws.recv(timeout=30))
            assert "totals" in pushed, pushed
            # and the client can still change its view
            ws.send(json.dumps({"range": "day"}))
            assert "totals" in json.loads(ws.recv(timeout=30))
    except ConnectionClosed as exc:  # before the fix: after ~5 s, "Timeout reading from 127.0.0.1:PORT"
        pytest.fail(f"/ws/usage/ closed {time.monotonic() - opened:.1f} s after connecting: {exc!r}; api log: "
                    f"{_log_tail(live, 'api')}")
