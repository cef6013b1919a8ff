"""API-key authentication for the ASGI routes (the same selector the DRF class uses: one code path).

Verified keys are cached per process for at most ``AUTH_CACHE_TTL_S`` (1 s), so a revoked or expired key
stops working in every api process within a second (DESIGN.md §7) while the hot path usually costs one
dictionary lookup. The ORM lookup runs off the event loop (``sync_to_async``).
"""

from __future__ import annotations

import time

from asgiref.sync import sync_to_async

from gateway.errors import ApiError, forbidden, unauthorized
from tenancy.selectors import AuthContext, api_key_authenticate

AUTH_CACHE_TTL_S = 1.0
_MAX_KEY_LEN = 256
_cache: dict[str, tuple[float, AuthContext | None]] = {}


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
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


async def authenticate(headers: list[tuple[bytes, bytes]]) -> AuthContext:
    """Return the ``AuthContext`` of the request's key; raise ``ApiError`` 401 when missing or invalid."""
    token = bearer_token(headers)
    if token is None:
        raise unauthorized()
    now = time.monotonic()
    hit = _cache.get(token)
    if hit is not None and hit[0] > now:
        ctx = hit[1]
    else:
        ctx = await sync_to_async(api_key_authenticate, thread_sensitive=False)(token)
        if len(_cache) > 10_000:
            _cache.clear()
        _cache[token] = (now + AUTH_CACHE_TTL_S, ctx)
    if ctx is None:
        raise unauthorized()
    return ctx


def require_scope(ctx: AuthContext, scope: str) -> None:
    """Raise 403 when the key lacks ``scope``."""
    if scope not in ctx.scopes:
        raise forbidden(f"This API key does not have the '{scope}' scope")


def require_model(ctx: AuthContext, model: str) -> None:
    """Raise 403 when the key is restricted to other models."""
    if ctx.allowed_models and model not in ctx.allowed_models:
        raise ApiError(403, f"This API key is not allowed to use model '{model}'", "permission_error",
                       "model", "model_not_allowed")
