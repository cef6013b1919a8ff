"""WebSocket ``/ws/usage/``: pushes dashboard figures on connect and whenever new rollups exist.

Auth: the Django session (``AuthMiddlewareStack``). A user for whom ``usage.web.can_view_all_tenants`` holds
(active staff with ``usage.view_usagerollup``) may ask for ``"operator": true`` (all tenants); anyone else gets
only the tenant they own; with ``DJANGO_ADMIN_OTP`` the all-tenant view also needs the session's second factor,
verified at the admin's login (``second_factor_verified``), as the admin does. The user is read afresh from the
database (in a worker thread) before every push: one deactivated, or asking for all tenants after losing the staff
flag or the permission (or without a verified second factor), gets an error
(``{"error": {"message", "type": "permission_error", "param": null, "code": "forbidden"}}``) and the socket
is closed with code 4403. Client → server JSON: ``{"range": "hour"|"day"|"30d",
"api_key_id": int|null, "operator": bool}``, an operator view also ``"tenant": int|null, "q": str, "page": int``
(the key table's filter, search and page); any time, answered at once. Server → client: the same payload as
the page's JSON (``usage.web.dashboard_payload``, for operators ``usage.web.operator_payload``), at most once
per ``MIN_INTERVAL_S`` after a ``usage.updated`` group message, and every ``REFRESH_S`` seconds as a fallback.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from channels.db import database_sync_to_async  # closes broken DB connections (a PostgreSQL restart)
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import get_user_model

from tenancy.models import ApiKey, Tenant

from .live import LIVE_GROUP
from .web import can_view_all_tenants, dashboard_payload, operator_payload

MIN_INTERVAL_S = 0.5
REFRESH_S = 10.0


CLOSE_FORBIDDEN = 4403  # WebSocket close code: the user may no longer watch what it asked for
_REFUSED = "refused"  # _resolve: send the error and close


def _id_or_none(value) -> int | None:
    """``value`` when it is a positive 64-bit database id (an int, not a bool), else None."""
    return value if type(value) is int and 0 < value < 2**63 else None


def second_factor_verified(user, session) -> bool:
    """Whether the Django ``session`` (a WebSocket scope's ``session``) carries a second factor verified for
    ``user`` when the admin demands one (``DJANGO_ADMIN_OTP``; always True when it does not).

    The admin's own rule (django-otp's ``OTPAdminSite``: ``user.is_verified()``, which django-otp's
    ``OTPMiddleware`` installs from the session's device: confirmed, the user's own). Django's middleware does not
    run on a Channels WebSocket scope, so that middleware is run here on the scope's session. Blocking (it reads
    the session and the device from the database): call it off the event loop."""
    if not settings.ADMIN_OTP:
        return True
    from django_otp.middleware import OTPMiddleware

    request = SimpleNamespace(user=user, session=session)
    OTPMiddleware(lambda req: req)(request)  # replaces request.user with the user django-otp verified
    return bool(request.user.is_verified())


def _resolve(user_pk, want_operator: bool, key_id, session=None):
    """``(tenant_id, key_id)`` the user ``user_pk`` (read now from the database) may watch (``tenant_id``
    None = all tenants); False when it owns no such tenant/key; ``_REFUSED`` when the user is gone or
    inactive, or asks for all tenants without ``usage.web.can_view_all_tenants`` or, when the admin demands a
    second factor, without one verified in ``session`` (``second_factor_verified``). Blocking: call it off the
    event loop."""
    user = get_user_model().objects.filter(pk=user_pk).first()
    if user is None or not user.is_active:
        return _REFUSED
    if want_operator:
        allowed = can_view_all_tenants(user) and second_factor_verified(user, session)
        return (None, key_id) if allowed else _REFUSED
    tenant = Tenant.objects.filter(owner=user, is_active=True).order_by("pk").first()
    if tenant is None:
        return False
    if key_id is not None and not ApiKey.objects.filter(pk=key_id, tenant=tenant).exists():
        return False
    return tenant.pk, key_id


class UsageLiveConsumer(AsyncJsonWebsocketConsumer):
    """One dashboard's live feed."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        self.view = {"range": "hour", "api_key_id": None, "operator": False, "tenant": None, "q": "", "page": 1}
        self.refused = False
        self.last_sent = 0.0
        self.pending: asyncio.Task | None = None
        await self.channel_layer.group_add(LIVE_GROUP, self.channel_name)
        await self.accept()
        self.ticker = asyncio.get_running_loop().create_task(self._tick())

    async def disconnect(self, code):
        for task in (getattr(self, "ticker", None), getattr(self, "pending", None)):
            if task is not None:
                task.cancel()
        if self.channel_layer is not None:
            await self.channel_layer.group_discard(LIVE_GROUP, self.channel_name)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            return
        rng = content.get("range", self.view["range"])
        key, tenant, q, page = (content.get(f) for f in ("api_key_id", "tenant", "q", "page"))
        self.view = {"range": rng if rng in ("hour", "day", "30d") else "hour",
                     "api_key_id": _id_or_none(key), "operator": bool(content.get("operator")),
                     "tenant": _id_or_none(tenant),
                     "q": q if isinstance(q, str) and len(q) <= 128 and "\x00" not in q else "",
                     "page": page if type(page) is int and 0 < page < 2**31 else 1}
        await self._push()

    async def usage_updated(self, event):
        wait = self.last_sent + MIN_INTERVAL_S - time.monotonic()
        if wait <= 0:
            await self._push()
        elif self.pending is None or self.pending.done():
            self.pending = asyncio.get_running_loop().create_task(self._push_later(wait))

    async def _push_later(self, wait: float):
        await asyncio.sleep(wait)
        await self._push()

    async def _tick(self):
        while True:
            await asyncio.sleep(REFRESH_S)
            await self._push()

    async def _push(self):
        if self.refused:
            return
        user_pk = self.scope["user"].pk
        view = dict(self.view)
        resolved = await database_sync_to_async(_resolve, thread_sensitive=False)(
            user_pk, view["operator"], view["api_key_id"], self.scope.get("session"))
        if resolved is _REFUSED:
            await self._refuse()
            return
        if resolved is False:
            await self.send_json({"error": "forbidden"})
            return
        tenant_id, key_id = resolved
        if view["operator"]:
            data = await database_sync_to_async(operator_payload, thread_sensitive=False)(
                range_name=view["range"], tenant_id=view["tenant"], api_key_id=key_id, q=view["q"] or None,
                page=view["page"])
        else:
            data = await database_sync_to_async(dashboard_payload, thread_sensitive=False)(
                range_name=view["range"], tenant_id=tenant_id, api_key_id=key_id)
        if self.refused:  # refused by a push that overtook this one
            return
        self.last_sent = time.monotonic()
        await self.send_json(data)

    async def _refuse(self):
        """Send the permission error once, stop the timers and close with ``CLOSE_FORBIDDEN``."""
        if self.refused:
            return
        self.refused = True
        current = asyncio.current_task()
        for task in (getattr(self, "ticker", None), getattr(self, "pending", None)):
            if task is not None and task is not current:
                task.cancel()
        await self.send_json({"error": {"message": "This user may no longer watch this usage.",
                                        "type": "permission_error", "param": None, "code": "forbidden"}})
        await self.close(code=CLOSE_FORBIDDEN)
