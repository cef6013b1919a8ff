"""Issue 14: the all-tenant usage (admin "Usage dashboard", its JSON, the WebSocket's operator mode) needs the
``usage.view_usagerollup`` permission, not only ``is_staff``; the WebSocket re-reads the user before every push.

The WebSocket tests drive ``usage.routing.websocket_application`` (session auth, origin check, the consumer)
through asgiref's ``ApplicationCommunicator`` (channels' ``WebsocketCommunicator`` is the same thing, but
``channels.testing`` imports daphne, which is not installed) and a real Redis channel layer (``REDIS_URL``
or db 4 of the local Redis, under a random prefix); the pushes read a real (transactional) test database.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest
import redis
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from channels.layers import get_channel_layer
from django.conf import settings as django_settings
from django.contrib.auth.models import Permission
from django.test import Client
from django.utils import timezone

from tenancy.models import Tenant
from tenancy.services import api_key_create
from usage.live import LIVE_GROUP
from usage.models import UsageRecord
from usage.rollups import usage_rollup_all

PERM = ("usage", "view_usagerollup")


def _perm():
    return Permission.objects.get(content_type__app_label=PERM[0], codename=PERM[1])


def _usage_of_another_tenant() -> None:
    """One rolled-up request of a tenant the operator does not own (all-tenant data to look for)."""
    tenant = Tenant.objects.create(name=f"other-{uuid.uuid4().hex[:6]}")
    api_key, _ = api_key_create(tenant=tenant, name="k")
    now = timezone.now()
    UsageRecord.objects.create(request_id=f"perm-{uuid.uuid4().hex}", tenant=tenant, api_key=api_key,
                               served_model_name="m", endpoint="chat", prompt_tokens=7, completion_tokens=3,
                               created_at=now, finished_at=now, e2e_latency_ms=5.0)
    usage_rollup_all()


@pytest.fixture
def staff(django_user_model):
    """``make(perm: bool)``: an active staff user (not superuser), with or without the permission, and a
    test client logged in as it."""

    def make(perm: bool):
        user = django_user_model.objects.create_user(f"staff-{uuid.uuid4().hex[:6]}", password="pw-staff-123",
                                                     is_staff=True)
        if perm:
            user.user_permissions.add(_perm())
        client = Client(raise_request_exception=False)
        client.force_login(user)
        return user, client

    return make


@pytest.mark.django_db
def test_staff_without_the_permission_gets_403_on_page_and_json(staff):
    _, client = staff(perm=False)
    assert client.get("/admin/usage/usagerollup/").status_code == 403
    r = client.get("/admin/usage-data?range=hour")
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error"


@pytest.mark.django_db
def test_staff_with_the_permission_and_superusers_see_all_tenants(staff, django_user_model):
    _usage_of_another_tenant()
    _, client = staff(perm=True)
    root = django_user_model.objects.create_superuser("root", "r@example.com", "pw-root-123")
    su = Client()
    su.force_login(root)
    for c in (client, su):
        assert c.get("/admin/usage/usagerollup/").status_code == 200
        r = c.get("/admin/usage-data?range=hour")
        assert r.status_code == 200 and r.json()["totals"]["requests"] == 1


# --- WebSocket ----------------------------------------------------------------------------------------

@pytest.fixture
def channel_layer_redis(settings):
    """The Redis channel layer on ``REDIS_URL`` (or the local Redis, db 4) under a random prefix."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/4"
    prefix = f"llmptest-{uuid.uuid4().hex[:10]}"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                                           "CONFIG": {"hosts": [url], "prefix": f"{prefix}:asgi"}}}
    yield
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


class WebSocket(ApplicationCommunicator):
    """A WebSocket client of an ASGI app: the ASGI WebSocket messages, with JSON helpers."""

    def __init__(self, app, path: str, headers: list[tuple[bytes, bytes]]):
        super().__init__(app, {"type": "websocket", "path": path, "raw_path": path.encode(), "query_string": b"",
                               "headers": headers, "subprotocols": [], "scheme": "ws",
                               "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)})

    async def connect(self, timeout: float = 10) -> dict:
        await self.send_input({"type": "websocket.connect"})
        return await self.receive_output(timeout)

    async def send_json_to(self, data) -> None:
        await self.send_input({"type": "websocket.receive", "text": json.dumps(data)})

    async def receive_json_from(self, timeout: float = 10):
        message = await self.receive_output(timeout)
        assert message["type"] == "websocket.send", message
        return json.loads(message["text"])

    async def disconnect(self) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": 1000})
        await self.wait(1)


def _communicator(client: Client) -> WebSocket:
    from usage.routing import websocket_application

    cookie = f"{django_settings.SESSION_COOKIE_NAME}={client.cookies[django_settings.SESSION_COOKIE_NAME].value}"
    return WebSocket(websocket_application, "/ws/usage/",
                     headers=[(b"cookie", cookie.encode()), (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")])


async def _push_from_server() -> None:
    """What the usage flush does after new rollups: ``usage.updated`` to the dashboards' group."""
    await get_channel_layer().group_send(LIVE_GROUP, {"type": "usage.updated"})


def _revoke(user, how: str) -> None:
    if how == "staff flag":
        type(user).objects.filter(pk=user.pk).update(is_staff=False)
    elif how == "permission":
        user.user_permissions.remove(_perm())
    elif how == "deactivated":
        type(user).objects.filter(pk=user.pk).update(is_active=False)


async def _operator_feed(staff, perm: bool):
    """Another tenant's usage recorded, a staff user (``perm``: with the all-tenant permission) connected to the
    usage WebSocket and asking for the operator view; ``(user, communicator, first message)``. The caller
    disconnects the communicator."""
    await sync_to_async(_usage_of_another_tenant)()
    user, client = await sync_to_async(staff)(perm=perm)
    ws = _communicator(client)
    assert (await ws.connect())["type"] == "websocket.accept"
    try:
        await ws.send_json_to({"range": "hour", "api_key_id": None, "operator": True})
        first = await ws.receive_json_from(timeout=10)
    except BaseException:
        await ws.disconnect()
        raise
    return user, ws, first


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("db_connections_closed_in_their_threads")
@pytest.mark.parametrize("how", ["staff flag", "permission", "deactivated"])
async def test_ws_operator_feed_stops_at_the_next_push_after_revocation(staff, channel_layer_redis, how):
    user, ws, first = await _operator_feed(staff, perm=True)
    try:
        assert first["totals"]["requests"] == 1  # another tenant's usage: the all-tenant view
        await _push_from_server()
        again = await ws.receive_json_from(timeout=10)  # keeps streaming
        assert again["totals"]["requests"] == 1

        await sync_to_async(_revoke)(user, how)
        await asyncio.sleep(0.6)  # past the consumer's MIN_INTERVAL_S, so the next push is immediate
        await _push_from_server()
        refused = await ws.receive_json_from(timeout=10)
        assert "points" not in refused and refused["error"]["code"] == "forbidden", refused
        closed = await ws.receive_output(timeout=10)
        assert closed == {"type": "websocket.close", "code": 4403}
        assert await ws.receive_nothing(timeout=0.5)  # nothing more, not even on a later push
    finally:
        await ws.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("db_connections_closed_in_their_threads")
async def test_ws_staff_without_the_permission_never_gets_all_tenants(staff, channel_layer_redis):
    _, ws, refused = await _operator_feed(staff, perm=False)
    try:
        assert "points" not in refused and refused["error"]["code"] == "forbidden", refused
        assert await ws.receive_output(timeout=10) == {"type": "websocket.close", "code": 4403}
    finally:
        await ws.disconnect()
