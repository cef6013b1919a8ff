"""Tenancy reads: API key authentication (the one code path used by the gateway and DRF)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from .limits import UNLIMITED, Limits
from .models import ApiKey
from .services import API_KEY_PREFIX_CHARS, API_KEY_PREFIX_LEAD, api_key_hash

API_KEY_MAX_LEN = 256
_DUMMY_HASH = "0" * 64


@dataclass(frozen=True, slots=True)
class AuthContext:
    """Who is calling: the authenticated key and its tenant. Immutable, safe to cache (<= 1 s).

    ``key_limits``/``tenant_limits`` carry the limits so ``tenancy.limits.limits_acquire`` needs no DB hit;
    ``priority_tier`` (the key's effective tier) and ``fair_share_weight`` (the tenant's) go to admission and
    the engine (``inference.api.admission``), never taken from the request.
    """

    key_id: int
    key_prefix: str
    tenant_id: int
    tenant_name: str
    allowed_models: tuple[str, ...]
    scopes: tuple[str, ...]
    expires_at: datetime | None
    key_limits: Limits = UNLIMITED
    tenant_limits: Limits = UNLIMITED
    cache_group: str = ""
    priority_tier: int = 1
    fair_share_weight: int = 1

    @property
    def cache_scope(self) -> str:
        """Who shares this caller's prompt-prefix and image-feature caches: ``group:<name>`` for a
        tenant in a non-blank ``Tenant.cache_group``, else ``tenant:<id>`` (the tenant alone)."""
        return f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.tenant_id}"

    def allows_model(self, served_model_name: str) -> bool:
        """True when the key may use ``served_model_name`` (empty ``allowed_models`` = every model)."""
        return not self.allowed_models or served_model_name in self.allowed_models

    def has_scope(self, scope: str) -> bool:
        """True when ``scope`` is among the key's scopes."""
        return scope in self.scopes

    def is_expired(self, now: datetime | None = None) -> bool:
        """True once ``expires_at`` has passed (check this on a cached context)."""
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


def api_key_split(secret: str) -> str | None:
    """Lookup prefix of a presented key (``sk-XXXXXXXX`` of ``sk-XXXXXXXX.<secret>``), or None if malformed."""
    if not isinstance(secret, str) or len(secret) > API_KEY_MAX_LEN or not secret.startswith(API_KEY_PREFIX_LEAD):
        return None
    prefix, dot, rest = secret.partition(".")
    if not dot or not rest or len(prefix) != len(API_KEY_PREFIX_LEAD) + API_KEY_PREFIX_CHARS:
        return None
    return prefix


@dataclass(frozen=True, slots=True)
class AuthRefusal:
    """Why a presented key was refused: ``reason`` (``malformed``, ``unknown_key``, ``wrong_secret``, ``revoked``,
    ``expired`` or ``tenant_inactive``) and, only when the secret was the key's own (``revoked``, ``expired``,
    ``tenant_inactive``), the key's ``key_prefix`` (else None: a malformed string, an unknown prefix or a wrong
    secret names no key). Immutable, cached like an ``AuthContext``."""

    reason: str
    key_prefix: str | None = None


def api_key_check(secret: str) -> AuthContext | AuthRefusal:
    """Authenticate a presented API key (sync ORM: call it off the event loop): its ``AuthContext``, or the
    ``AuthRefusal`` saying why not (malformed, unknown, wrong secret, revoked, expired, inactive tenant).

    The hash comparison is constant-time (``hmac.compare_digest``), and unknown prefixes still pay for one HMAC
    so timing does not reveal which prefixes exist.
    """
    prefix = api_key_split(secret)
    if prefix is None:
        return AuthRefusal("malformed")
    api_key = ApiKey.objects.select_related("tenant").filter(prefix=prefix).first()
    presented = api_key_hash(secret)
    if api_key is None:
        hmac.compare_digest(presented, _DUMMY_HASH)
        return AuthRefusal("unknown_key")
    if not hmac.compare_digest(presented, api_key.secret_hash):
        return AuthRefusal("wrong_secret")
    now = timezone.now()
    if api_key.revoked_at is not None:
        return AuthRefusal("revoked", api_key.prefix)
    if api_key.expires_at is not None and api_key.expires_at <= now:
        return AuthRefusal("expired", api_key.prefix)
    if not api_key.tenant.is_active:
        return AuthRefusal("tenant_inactive", api_key.prefix)
    return AuthContext(
        key_id=api_key.pk,
        key_prefix=api_key.prefix,
        tenant_id=api_key.tenant_id,
        tenant_name=api_key.tenant.name,
        allowed_models=tuple(api_key.allowed_models or ()),
        scopes=tuple(api_key.scopes or ()),
        expires_at=api_key.expires_at,
        key_limits=api_key.limits(),
        tenant_limits=api_key.tenant.limits(),
        cache_group=api_key.tenant.cache_group or "",
        priority_tier=api_key.effective_priority_tier,
        fair_share_weight=api_key.tenant.fair_share_weight,
    )


def api_key_authenticate(secret: str) -> AuthContext | None:
    """``api_key_check``'s ``AuthContext``, or ``None`` for a malformed, unknown, wrong, revoked or expired key, or a
    key whose tenant is inactive (sync ORM: call it off the event loop)."""
    result = api_key_check(secret)
    return result if isinstance(result, AuthContext) else None
