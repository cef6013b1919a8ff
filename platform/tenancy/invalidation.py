"""Auth-cache invalidation over Redis Pub/Sub: a change to a key or a tenant reaches every api process at once.

Each api process caches verified keys for at most ``gateway.auth.AUTH_CACHE_TTL_S`` (1 s) and subscribes to
``auth_invalidation_channel(LINK_PREFIX)``; when a key or tenant row is saved or deleted (REST API, admin,
``manage.py``, a shell: ``post_save``/``post_delete``), this module publishes, once the transaction commits,

* ``key:<prefix>`` for an API key (revocation, rotation, any edit), and
* ``tenant:<id>`` for a tenant (deactivation, limits, cache group),

and every subscribed process drops the matching cache entries (``gateway.auth``). A message lost while a process
is reconnecting is covered by the process clearing its cache on every (re)subscription, and by the 1 s lifetime.
A failed publish (Redis down) is logged and never fails the change itself.
"""

from __future__ import annotations

import functools
import logging

import redis
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

KEY_TOPIC = "key"
TENANT_TOPIC = "tenant"


def auth_invalidation_channel(prefix: str) -> str:
    """The Pub/Sub channel of auth-cache invalidations under the platform's Redis ``prefix``."""
    return f"{prefix}:auth:invalidate"


def auth_invalidation_parse(data: bytes | str) -> tuple[str, str] | None:
    """``(topic, value)`` of a message (``("key", "sk-AbCd1234")``, ``("tenant", "7")``), or None if malformed."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    topic, sep, value = text.partition(":")
    if not sep or not value or topic not in (KEY_TOPIC, TENANT_TOPIC):
        return None
    return topic, value


@functools.lru_cache(maxsize=4)
def _client(url: str) -> redis.Redis:
    # short timeouts: an admin save must not hang on a dead Redis (the 1 s cache lifetime still holds)
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def auth_invalidation_publish(message: str) -> None:
    """Publish ``message`` now (``key:<prefix>`` or ``tenant:<id>``); a Redis error is logged, not raised."""
    try:
        _client(settings.REDIS_URL).publish(auth_invalidation_channel(settings.LINK_PREFIX), message)
    except redis.RedisError:
        log.warning("auth invalidation %s not published (Redis unreachable); in force within 1 s anyway", message)


def _after_commit(message: str) -> None:
    transaction.on_commit(functools.partial(auth_invalidation_publish, message))


def on_api_key_changed(sender, instance, created: bool = False, **kwargs) -> None:
    """``post_save``/``post_delete`` receiver of ``ApiKey``: publish ``key:<prefix>`` after commit (a new key has
    nothing cached)."""
    if not created and instance.prefix:
        _after_commit(f"{KEY_TOPIC}:{instance.prefix}")


def on_tenant_changed(sender, instance, created: bool = False, **kwargs) -> None:
    """``post_save``/``post_delete`` receiver of ``Tenant``: publish ``tenant:<id>`` after commit."""
    if not created and instance.pk is not None:
        _after_commit(f"{TENANT_TOPIC}:{instance.pk}")
