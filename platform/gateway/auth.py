"""API-key authentication for the ASGI routes (the same selector the DRF class uses: one code path).

Verified keys (and refusals) are cached per process for at most ``AUTH_CACHE_TTL_S`` (1 s), so the hot path usually
costs one dictionary lookup; concurrent misses of one token share one lookup (``gateway.single_flight``). A change
to a key or tenant (revocation, rotation, edit, deactivation) is published on Redis Pub/Sub
(``tenancy.invalidation``); every api process listens on its event loop and drops the matching entries at once,
so a revoked key is refused everywhere within milliseconds (docs/ARCHITECTURE.md §7; measured in
tests/security/test_revocation_live.py). The 1 s lifetime stays as the fallback: a process clears its whole cache
whenever it (re)subscribes, since messages sent while it was not listening are lost. A lookup that was running when
an invalidation arrived is not cached (``_AuthCache.generation``). The ORM lookup runs off the event loop
(``channels.db.database_sync_to_async``: a connection broken by a PostgreSQL restart is dropped, the next lookup
connects again).

Refused keys are counted in Redis for ``/metrics`` (``gateway_auth_refusals_total{reason,key_prefix}``): the
prefix is a label only for an existing key presented with its own secret and refused as revoked, expired or of an
inactive tenant; malformed strings, unknown prefixes and wrong secrets all count under ``key_prefix="unknown"``;
past ``REFUSAL_PREFIX_LABELS_MAX`` distinct series, new prefixes count under ``key_prefix="other"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from channels.db import database_sync_to_async  # closes broken DB connections (a PostgreSQL restart)
from django.conf import settings
from django.db import DatabaseError

from gateway.errors import ApiError, database_unavailable, forbidden, unauthorized
from gateway.clients import redis
from gateway.single_flight import SingleFlight
from tenancy.invalidation import KEY_TOPIC, TENANT_TOPIC, auth_invalidation_channel, auth_invalidation_parse
from tenancy.selectors import AuthContext, AuthRefusal, api_key_check

log = logging.getLogger(__name__)

AUTH_CACHE_TTL_S = 1.0
_MAX_KEY_LEN = 256
_MAX_ENTRIES = 10_000

CachedAuth = AuthContext | AuthRefusal


def _token_prefix(token: str) -> str:
    return token.partition(".")[0]


class _AuthCache:
    """Token -> ``(deadline, AuthContext | AuthRefusal)``, indexed by key prefix and tenant for invalidation.

    ``generation`` grows with every invalidation; ``put`` ignores a result computed under an older generation
    (its lookup may have read the row before the change it would now hide for up to a second).
    """

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, CachedAuth]] = {}
        self.by_prefix: dict[str, set[str]] = {}
        self.by_tenant: dict[int, set[str]] = {}
        self.generation = 0

    def get(self, token: str, now: float) -> CachedAuth | None:
        hit = self.entries.get(token)
        return hit[1] if hit is not None and hit[0] > now else None

    def put(self, token: str, value: CachedAuth, deadline: float, generation: int) -> None:
        if generation != self.generation:
            return
        if len(self.entries) >= _MAX_ENTRIES:
            self.clear(bump=False)
        self.entries[token] = (deadline, value)
        self.by_prefix.setdefault(_token_prefix(token), set()).add(token)
        if isinstance(value, AuthContext):
            self.by_tenant.setdefault(value.tenant_id, set()).add(token)

    def _drop(self, tokens: set[str]) -> None:
        for token in tokens:
            hit = self.entries.pop(token, None)
            if hit is None:
                continue
            same_prefix = self.by_prefix.get(_token_prefix(token))
            if same_prefix is not None:
                same_prefix.discard(token)
            if isinstance(hit[1], AuthContext):
                same_tenant = self.by_tenant.get(hit[1].tenant_id)
                if same_tenant is not None:
                    same_tenant.discard(token)

    def drop_key(self, prefix: str) -> None:
        """Forget every token of the key ``prefix``."""
        self.generation += 1
        self._drop(self.by_prefix.pop(prefix, set()))

    def drop_tenant(self, tenant_id: int) -> None:
        """Forget every token of the tenant ``tenant_id``."""
        self.generation += 1
        self._drop(self.by_tenant.pop(tenant_id, set()))

    def clear(self, bump: bool = True) -> None:
        """Forget everything (``bump``: also refuse to cache lookups already running)."""
        if bump:
            self.generation += 1
        self.entries.clear()
        self.by_prefix.clear()
        self.by_tenant.clear()


_cache = _AuthCache()
# concurrent misses of one token share one lookup, and only within one cache generation (an invalidation since a
# lookup started makes the next miss look up again): gateway/single_flight.py
_lookups: SingleFlight[CachedAuth] = SingleFlight()
_listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]] = {}


def invalidation_apply(data: bytes | str) -> None:
    """Apply one invalidation message (``tenancy.invalidation``) to this process's cache."""
    parsed = auth_invalidation_parse(data)
    if parsed is None:
        return
    topic, value = parsed
    if topic == KEY_TOPIC:
        _cache.drop_key(value)
    elif topic == TENANT_TOPIC and value.isdigit():
        _cache.drop_tenant(int(value))


async def _listen() -> None:
    """Subscribe to the invalidation channel and apply its messages until cancelled; on any error, clear the cache
    and subscribe again (0.1 s, doubling to 2 s between tries)."""
    channel = auth_invalidation_channel(settings.LINK_PREFIX)
    backoff = 0.1
    while True:
        pubsub = redis().pubsub()
        try:
            await pubsub.subscribe(channel)
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=False, timeout=5.0)
                if msg is None:
                    continue
                if msg["type"] == "subscribe":  # (re)subscribed: what was sent meanwhile is lost
                    _cache.clear()
                    backoff = 0.1
                elif msg["type"] == "message":
                    invalidation_apply(msg["data"])
        except asyncio.CancelledError:
            raise
        except Exception:  # any Redis or parse failure (logged): fall back to the TTL, retry
            _cache.clear()
            log.warning("auth invalidation listener lost Redis; retrying in %.1f s", backoff, exc_info=True)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        finally:
            try:
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped in older redis-py releases
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                pass


def listener_ensure() -> None:
    """Start this event loop's invalidation listener if it is not running (called on every authentication)."""
    loop = asyncio.get_running_loop()
    entry = _listeners.get(id(loop))
    if entry is not None and entry[0] is loop and not entry[1].done():
        return
    _listeners[id(loop)] = (loop, loop.create_task(_listen(), name="auth-invalidations"))


# ------------------------------------------------------------------------------------------- refusal counts
REFUSAL_PREFIX_LABELS_MAX = 1000
_REFUSAL_SEP = "|"
# KEYS[1] the hash; ARGV[1] the series' field, ARGV[2] the overflow field, ARGV[3] the cap on fields.
_COUNT_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 or redis.call('HLEN', KEYS[1]) < tonumber(ARGV[3]) then
  return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
end
return redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
"""
_pending: set[asyncio.Task[None]] = set()
_PENDING_MAX = 1000


def refusals_key(prefix: str) -> str:
    """Redis hash of refusal counts: field ``<reason>|<key_prefix label>`` -> count."""
    return f"{prefix}:auth:refusals"


def refusal_labels(field: str) -> tuple[str, str]:
    """``(reason, key_prefix)`` of a ``refusals_key`` field."""
    reason, _, key_prefix = field.partition(_REFUSAL_SEP)
    return reason, key_prefix


async def _count(refusal: AuthRefusal) -> None:
    label = refusal.key_prefix or "unknown"
    try:
        await redis().eval(_COUNT_LUA, 1, refusals_key(settings.LINK_PREFIX),
                           f"{refusal.reason}{_REFUSAL_SEP}{label}", f"{refusal.reason}{_REFUSAL_SEP}other",
                           REFUSAL_PREFIX_LABELS_MAX)
    except Exception:  # a count lost to a Redis hiccup (logged) never fails the 401 itself
        log.debug("refusal count lost", exc_info=True)


def refusal_count(refusal: AuthRefusal) -> None:
    """Count ``refusal`` in Redis in the background (the 401 does not wait; at most ``_PENDING_MAX`` in flight)."""
    if len(_pending) >= _PENDING_MAX:
        return
    task = asyncio.get_running_loop().create_task(_count(refusal))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


# ------------------------------------------------------------------------------------------------ authenticate
Headers = list[tuple[bytes, bytes]]
"""Request headers as ASGI gives them."""


def bearer_token(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or ``None`` (any other scheme too)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            try:
                text = value.decode("latin-1").strip()
            except UnicodeDecodeError:
                return None
            scheme, _, token = text.partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token or len(token) > _MAX_KEY_LEN:
                return None
            return token
    return None


@dataclass(frozen=True)
class Credentials:
    """Where a route reads the caller's API key: ``read(headers)`` gives the presented token, or ``None`` when there
    is none (it may raise ``ApiError`` 401 itself, e.g. for two headers that disagree); ``missing`` is the 401's
    message without a valid key (``None``: ``errors.unauthorized``'s, which names ``Authorization: Bearer``)."""

    read: Callable[[Headers], str | None]
    missing: str | None = None

    def refusal(self) -> ApiError:
        """The 401 of a request without a valid key."""
        return unauthorized() if self.missing is None else unauthorized(self.missing)


BEARER = Credentials(bearer_token)
"""``Authorization: Bearer <key>``: every OpenAI route."""


def api_key_or_bearer(headers: Headers) -> str | None:
    """The key of an ``x-api-key`` header or of ``Authorization: Bearer`` (the ``anthropic`` SDK sends one or the
    other, by version); ``None`` without either. Both present and naming different keys: ``ApiError`` 401 (which
    one the caller meant cannot be told)."""
    api_key: str | None = None
    for name, value in headers:
        if name.lower() == b"x-api-key":
            api_key = value.decode("latin-1").strip() or None
            break
    bearer = bearer_token(headers)
    if api_key is not None and bearer is not None and api_key != bearer:
        raise unauthorized("x-api-key and Authorization: Bearer carry different API keys; send one of them")
    token = api_key or bearer
    return token if token is not None and len(token) <= _MAX_KEY_LEN else None


API_KEY_OR_BEARER = Credentials(api_key_or_bearer, "Invalid or missing API key. Send 'x-api-key: <key>' (or "
                                                    "'Authorization: Bearer <key>').")
"""``x-api-key`` or ``Authorization: Bearer``: the Messages API."""


async def _lookup(token: str, now: float, generation: int) -> CachedAuth:
    """The ORM's verdict on ``token``, cached until ``now + AUTH_CACHE_TTL_S`` unless an invalidation came since
    ``generation``; 503 ``database_unavailable`` when the database cannot be reached."""
    try:
        result: CachedAuth = await database_sync_to_async(api_key_check, thread_sensitive=False)(token)
    except DatabaseError:
        raise database_unavailable() from None
    _cache.put(token, result, now + AUTH_CACHE_TTL_S, generation)
    return result


async def authenticate(headers: Headers, credentials: Credentials = BEARER) -> AuthContext:
    """Return the ``AuthContext`` of the request's key, read where ``credentials`` says (a bearer token by default);
    raise ``ApiError`` 401 when missing or invalid (a presented key's refusal is counted for ``/metrics``)."""
    token = credentials.read(headers)
    if token is None:
        raise credentials.refusal()
    listener_ensure()
    now = time.monotonic()
    result = _cache.get(token, now)
    if result is None:
        generation = _cache.generation
        result = await _lookups.run(token, lambda: _lookup(token, now, generation), tag=generation,
                                    max_age_s=AUTH_CACHE_TTL_S)
    if isinstance(result, AuthRefusal):
        refusal_count(result)
        raise credentials.refusal()
    return result


def require_scope(ctx: AuthContext, scope: str) -> None:
    """Raise 403 when the key lacks ``scope``."""
    if scope not in ctx.scopes:
        raise forbidden(f"This API key does not have the '{scope}' scope")


def require_model(ctx: AuthContext, model: str) -> None:
    """Raise 403 when the key is restricted to other models."""
    if ctx.allowed_models and model not in ctx.allowed_models:
        raise ApiError(403, f"This API key is not allowed to use model '{model}'", "permission_error",
                       "model", "model_not_allowed")
