"""Who makes a control-plane change, for the audit log (django-auditlog's ``LogEntry``).

django-auditlog writes one ``LogEntry`` per saved or deleted row of the tracked models (``AUDITLOG_INCLUDE_TRACKING_
MODELS`` in settings: tenants, API keys, served models, admission policies) with the per-field changes
(``{"field": [before, after]}``). This module adds who made the change, from where and as which operation:

* Django's routes (the admin, the REST API with a session, the dashboards): ``AuditContextMiddleware`` names the
  logged-in user, the client address (``REMOTE_ADDR``: uvicorn's client, proxy headers believed only from
  ``FORWARDED_ALLOW_IPS``, so unlike django-auditlog's own middleware a client cannot pick it with
  ``X-Forwarded-For``) and the surface from the path (``admin`` under ``/admin/``, ``rest`` under ``/api/``, else
  ``web``).
* The REST API with an API key: ``tenancy.api.base.TenantAPIView`` names the key once DRF has authenticated it
  (``actor_set``/``actor_reset``).
* Management commands: ``audit.commands.AuditedCommand`` (``source="command"``, ``command`` = its name).
* Anything else (a shell, a script, a Celery task): ``source="system"``.

Services name the operation (``audit_operation("revoke")``: ``create``, ``update``, ``revoke``, ``rotate``) so a
reader sees what happened and not only which fields changed; the outermost one wins (the successor a rotation
creates is logged as part of the ``rotate``).

What lands in ``LogEntry``: ``actor`` (the user, when there is one), ``remote_addr``, and ``additional_data`` =
``{"source": ..., "operation": ..., "api_key": {"id": ..., "prefix": ...}, "command": ...}`` (keys present
when known).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass
from functools import partial

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.contrib.auth import get_user_model

SOURCES = ("admin", "rest", "web", "command", "system")


@dataclass(frozen=True)
class AuditActor:
    """Who acts: ``source`` (one of ``SOURCES``), the Django user (``user_id``) or API key (``api_key_id``,
    ``api_key_prefix``) when known, the client address, and the management command's name."""

    source: str = "system"
    user_id: int | None = None
    api_key_id: int | None = None
    api_key_prefix: str = ""
    remote_addr: str | None = None
    command: str = ""

    def as_data(self) -> dict:
        """The ``additional_data`` part of this actor (no user: that is ``LogEntry.actor``)."""
        data: dict = {"source": self.source}
        if self.api_key_id is not None:
            data["api_key"] = {"id": self.api_key_id, "prefix": self.api_key_prefix}
        if self.command:
            data["command"] = self.command
        return data


_SYSTEM = AuditActor()
_actor: ContextVar[Callable[[], AuditActor] | None] = ContextVar("audit_actor", default=None)
_operation: ContextVar[str | None] = ContextVar("audit_operation", default=None)


def current_actor() -> AuditActor:
    """The actor of the running request, command or block (``source="system"`` when none was named)."""
    resolve = _actor.get()
    return resolve() if resolve is not None else _SYSTEM


def actor_set(actor: AuditActor | Callable[[], AuditActor]) -> Token:
    """Name the actor of what follows in this context (an ``AuditActor`` or a function resolving one when an entry
    is written); give the token to ``actor_reset``."""
    return _actor.set(actor if callable(actor) else (lambda: actor))


def actor_reset(token: Token) -> None:
    """Undo ``actor_set``."""
    _actor.reset(token)


@contextlib.contextmanager
def audit_actor(actor: AuditActor) -> Iterator[None]:
    """Entries written inside the block name ``actor``."""
    token = actor_set(actor)
    try:
        yield
    finally:
        actor_reset(token)


@contextlib.contextmanager
def audit_operation(name: str) -> Iterator[None]:
    """Entries written inside the block carry ``operation=name``, unless an enclosing block named one."""
    if _operation.get() is not None:
        yield
        return
    token = _operation.set(name)
    try:
        yield
    finally:
        _operation.reset(token)


def request_actor(request) -> AuditActor:
    """The actor of a Django request: its authenticated user (if any), client address and surface."""
    path = request.path or ""
    source = "admin" if path.startswith("/admin/") else "rest" if path.startswith("/api/") else "web"
    user = getattr(request, "user", None)
    user_id = user.pk if isinstance(user, get_user_model()) and user.is_authenticated else None
    return AuditActor(source=source, user_id=user_id, remote_addr=request.META.get("REMOTE_ADDR") or None)


class AuditContextMiddleware:
    """Names each Django request's actor for the audit log (resolved lazily, when an entry is written, so the
    user is the one the view ends up with); sync and async capable."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        token = actor_set(partial(request_actor, request))
        try:
            return self.get_response(request)
        finally:
            actor_reset(token)

    async def _acall(self, request):
        token = actor_set(partial(request_actor, request))
        try:
            return await self.get_response(request)
        finally:
            actor_reset(token)


def on_log_entry_pre_save(sender, instance, raw: bool = False, **kwargs) -> None:
    """``pre_save`` receiver of ``LogEntry``: a new entry gets the current actor, client address and operation."""
    if raw or instance.pk is not None:
        return
    actor = current_actor()
    data = dict(instance.additional_data or {})
    data.update(actor.as_data())
    operation = _operation.get()
    if operation is not None:
        data["operation"] = operation
    instance.additional_data = data
    if actor.user_id is not None and instance.actor_id is None:
        instance.actor_id = actor.user_id
    if actor.remote_addr and not instance.remote_addr:
        instance.remote_addr = actor.remote_addr
