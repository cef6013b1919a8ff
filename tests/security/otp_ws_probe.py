"""Run in a fresh process with ``DJANGO_ADMIN_OTP=1`` (the admin site and django-otp's middleware are chosen at
start-up) and ``REDIS_URL`` (the channel layer): migrate a scratch SQLite database, make a superuser with a TOTP
device and a tenant owner, record another tenant's usage; then log in at ``/accounts/login/`` with the password
only and at ``/admin/login/`` with the password and a TOTP code, and with each session ask the usage WebSocket
(``usage.routing.websocket_application``, driven through asgiref's ``ApplicationCommunicator``) for the
all-tenant view. Prints the outcomes as JSON.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys

import django

PASSWORD = "pw-root-12345"


async def _feed(app, cookie: str, ask: dict) -> dict:
    """Connect to ``/ws/usage/`` with the session ``cookie``, send ``ask``; what came back."""
    from asgiref.testing import ApplicationCommunicator

    ws = ApplicationCommunicator(app, {
        "type": "websocket", "path": "/ws/usage/", "raw_path": b"/ws/usage/", "query_string": b"",
        "headers": [(b"cookie", cookie.encode()), (b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")],
        "subprotocols": [], "scheme": "ws", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80)})
    await ws.send_input({"type": "websocket.connect"})
    result: dict = {"connect": (await ws.receive_output(10))["type"]}
    if result["connect"] == "websocket.accept":
        await ws.send_input({"type": "websocket.receive", "text": json.dumps(ask)})
        first = await ws.receive_output(10)
        result["first"] = json.loads(first["text"]) if first["type"] == "websocket.send" else first
        result["then"] = None if await ws.receive_nothing(timeout=1) else await ws.receive_output(5)
        await ws.send_input({"type": "websocket.disconnect", "code": 1000})
    await ws.wait(2)
    return result


def main() -> None:
    assert os.environ.get("DJANGO_ADMIN_OTP") == "1" and os.environ.get("REDIS_URL")
    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.utils import timezone
    from django_otp.oath import totp
    from django_otp.plugins.otp_totp.models import TOTPDevice

    from tenancy.models import Tenant
    from tenancy.services import api_key_create
    from usage.models import UsageRecord
    from usage.rollups import usage_rollup_all
    from usage.routing import websocket_application

    setup_test_environment()  # the test client's host "testserver" is allowed
    call_command("migrate", verbosity=0)
    User = get_user_model()
    User.objects.create_superuser("root", "root@example.com", PASSWORD)
    owner = User.objects.create_user("owner", password=PASSWORD)
    call_command("enrol_totp", "root", stdout=io.StringIO(), stderr=io.StringIO())
    device = TOTPDevice.objects.get(user__username="root")
    for name, who in (("other", None), ("owned", owner)):  # one request each
        tenant = Tenant.objects.create(name=name, owner=who)
        key, _ = api_key_create(tenant=tenant, name="k")
        now = timezone.now()
        UsageRecord.objects.create(request_id=f"otp-ws-{name}", tenant=tenant, api_key=key, served_model_name="m",
                                   endpoint="chat", prompt_tokens=7, completion_tokens=3, created_at=now,
                                   finished_at=now, e2e_latency_ms=5.0)
    usage_rollup_all()

    def login(path: str, username: str, data: dict) -> tuple[Client, dict]:
        client = Client()
        response = client.post(path, {"username": username, "password": PASSWORD, **data})
        http = client.get("/admin/usage-data?range=hour")
        return client, {"login": response.status_code, "usage_data": http.status_code}

    def cookie(client: Client) -> str:
        return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"

    operator = {"range": "hour", "api_key_id": None, "operator": True}
    result = {}
    client, result["password_only"] = login("/accounts/login/", "root", {"next": "/usage/"})
    result["password_only"]["ws"] = asyncio.run(_feed(websocket_application, cookie(client), operator))
    good = totp(device.bin_key, device.step, device.t0, device.digits)
    client, result["with_token"] = login("/admin/login/", "root", {"next": "/admin/", "otp_device": device.persistent_id,
                                                                   "otp_token": f"{good:0{device.digits}d}"})
    result["with_token"]["ws"] = asyncio.run(_feed(websocket_application, cookie(client), operator))
    client, result["tenant_owner"] = login("/accounts/login/", "owner", {"next": "/usage/"})
    result["tenant_owner"]["ws"] = asyncio.run(_feed(websocket_application, cookie(client),
                                                     {"range": "hour", "api_key_id": None}))
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
